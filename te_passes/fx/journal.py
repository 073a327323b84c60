"""A journal of FX graph edits that can be undone exactly (same node names, order, arguments,
meta), so a pass hands the pass manager an undo instead of a copy of its graph
(``ctx.checkpoint(undo)``, docs/design.md "The manager"). Generic FX: no TE knowledge.
"""

from __future__ import annotations

from typing import Any

import torch.fx


def replace_uses_with_constant(node: torch.fx.Node, value: Any, log: "GraphJournal | None" = None) -> list[str]:
    """Replace every use of ``node`` by the literal ``value``; return the users' names."""
    users = list(node.users)
    for user in users:
        args = torch.fx.node.map_arg(user.args, lambda a: value if a is node else a)
        kwargs = torch.fx.node.map_arg(user.kwargs, lambda a: value if a is node else a)
        if log is not None:
            log.set_args(user, args, kwargs)
        else:
            user.args, user.kwargs = args, kwargs
    return [u.name for u in users]


class GraphJournal:
    """A pass's mutations (argument replacements, erasures of user-less nodes), recorded so
    that :meth:`undo` restores the graph exactly (same node names, order, arguments, meta);
    handed to the pass manager as ``ctx.checkpoint(undo)`` (``ctx``: a
    ``te_passes.pipeline.base.PassContext``, or ``None``) on the first mutation, instead of a
    copy of the graph (a copy costs ~20-30 us per node on every graph with residue to fold)."""

    def __init__(self, graph: torch.fx.Graph, ctx: Any | None) -> None:
        self.graph, self.ctx = graph, ctx
        self.ops: list[tuple] = []

    def _first(self) -> None:
        if not self.ops and self.ctx is not None:
            self.ctx.checkpoint(self.undo)

    def set_args(self, node: torch.fx.Node, args: tuple, kwargs: dict) -> None:
        self._first()
        self.ops.append(("args", node, node.args, node.kwargs))
        node.args, node.kwargs = args, kwargs

    def erase(self, node: torch.fx.Node) -> None:
        """``graph.erase_node(node)`` (``node`` has no users), remembering where it was."""
        self._first()
        info = ("erase", node, node.next, node.op, node.target, node.args, node.kwargs, node.name,
                node.type, node.meta)
        self.graph.erase_node(node)
        self.ops.append(info)

    def undo(self) -> None:
        """Revert every recorded mutation, newest first; erased nodes are re-created in place."""
        graph = self.graph
        new_of: dict[torch.fx.Node, torch.fx.Node] = {}

        def m(a: Any) -> Any:
            return torch.fx.node.map_arg(a, lambda n: new_of.get(n, n))

        for op in reversed(self.ops):
            if op[0] == "args":
                _, node, args, kwargs = op
                node = new_of.get(node, node)
                node.args, node.kwargs = m(args), m(kwargs)
                continue
            _, node, nxt, opcode, target, args, kwargs, name, type_expr, meta = op
            with graph.inserting_before(new_of.get(nxt, nxt)):
                new = graph.create_node(opcode, target, m(args), m(kwargs), name=name, type_expr=type_expr)
            if new.name != name:  # the erased node still holds the name in the graph's namespace
                new.name = name
            new.meta = meta
            new_of[node] = new
        self.ops.clear()
