"""The edit journal: every FX graph edit a pass makes, recorded so that :meth:`GraphJournal.undo`
restores the graph exactly (same node names, order, arguments, targets, meta). Generic FX: no TE
knowledge. The pass manager opens one per pass run (``ctx.journal``); docs/design.md "The manager".
"""

from __future__ import annotations

from typing import Any, Callable

import torch.fx
from torch.fx.node import map_arg

#: ``set_meta`` value / recorded old value meaning "key absent".
ABSENT: Any = object()


class GraphJournal:
    """A pass's edits of FX graphs, newest last; :meth:`undo` reverts them newest first.

    Edits: :meth:`set_args`, :meth:`set_target`, :meth:`set_meta`, :meth:`replace_uses`,
    :meth:`erase` (a user-less node), :meth:`call_function` (a new node). ``bool(journal)``:
    whether anything was edited (the manager's "changed?")."""

    def __init__(self) -> None:
        self.ops: list[tuple] = []

    def __bool__(self) -> bool:
        return bool(self.ops)

    def set_args(self, node: torch.fx.Node, args: tuple, kwargs: dict | None = None) -> None:
        """``node.args, node.kwargs = args, kwargs`` (``kwargs=None``: unchanged)."""
        self.ops.append(("args", node, node.args, node.kwargs))
        node.args = args
        if kwargs is not None:
            node.kwargs = kwargs

    def set_target(self, node: torch.fx.Node, target: Any) -> None:
        """``node.target = target``."""
        self.ops.append(("target", node, node.target))
        node.target = target

    def set_meta(self, node: torch.fx.Node, key: str, value: Any) -> None:
        """``node.meta[key] = value`` (:data:`ABSENT`: delete the key)."""
        self.ops.append(("meta", node, key, node.meta.get(key, ABSENT)))
        if value is ABSENT:
            node.meta.pop(key, None)
        else:
            node.meta[key] = value

    def replace_uses(self, node: torch.fx.Node, value: Any) -> list[torch.fx.Node]:
        """Replace every use of ``node`` by ``value`` (a node: ``Node.replace_all_uses_with``, so
        provenance observers see it; or a literal); return the users."""
        users = list(node.users)
        for user in users:
            self.ops.append(("args", user, user.args, user.kwargs))
        if isinstance(value, torch.fx.Node):
            node.replace_all_uses_with(value)
        else:
            for user in users:
                user.args = map_arg(user.args, lambda a: value if a is node else a)
                user.kwargs = map_arg(user.kwargs, lambda a: value if a is node else a)
        return users

    def erase(self, node: torch.fx.Node) -> None:
        """``graph.erase_node(node)`` (``node`` has no users), remembering where it was."""
        info = ("erase", node, node.graph, node.next, node.op, node.target, node.args, node.kwargs, node.name,
                node.type, node.meta)
        node.graph.erase_node(node)
        self.ops.append(info)

    def call_function(self, target: Callable, args: tuple, kwargs: dict | None = None, *,
                      after: torch.fx.Node | None = None, before: torch.fx.Node | None = None,
                      meta: dict | None = None) -> torch.fx.Node:
        """A new ``call_function`` node right after ``after`` or before ``before`` (``meta`` copied
        onto it). Raises ``ValueError`` unless exactly one of them is given."""
        if (after is None) == (before is None):
            raise ValueError("GraphJournal.call_function: give after= or before=, not both or neither")
        anchor = after if after is not None else before
        where = anchor.graph.inserting_after(after) if after is not None else anchor.graph.inserting_before(before)
        with where:
            node = anchor.graph.call_function(target, args, kwargs)
        node.meta.update(meta or {})
        self.ops.append(("create", node))
        return node

    def undo(self) -> None:
        """Revert every recorded edit, newest first; erased nodes are re-created in place."""
        new_of: dict[torch.fx.Node, torch.fx.Node] = {}

        def m(a: Any) -> Any:
            return map_arg(a, lambda n: new_of.get(n, n))

        for op in reversed(self.ops):
            kind, node = op[0], new_of.get(op[1], op[1])
            if kind == "args":
                node.args, node.kwargs = m(op[2]), m(op[3])
            elif kind == "target":
                node.target = op[2]
            elif kind == "meta":
                node.meta.pop(op[2], None) if op[3] is ABSENT else node.meta.__setitem__(op[2], op[3])
            elif kind == "create":
                node.graph.erase_node(node)
            else:
                _, old, graph, nxt, opcode, target, args, kwargs, name, type_expr, meta = op
                with graph.inserting_before(new_of.get(nxt, nxt)):
                    new = graph.create_node(opcode, target, m(args), m(kwargs), name=name, type_expr=type_expr)
                if new.name != name:  # the erased node still holds the name in the graph's namespace
                    new.name = name
                new.meta = meta
                new_of[old] = new
        self.ops.clear()
