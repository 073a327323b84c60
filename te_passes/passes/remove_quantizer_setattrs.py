"""Pass ``remove_quantizer_setattrs``: side-effect-only quantizer ``__setattr__`` residue is removed.

See docs/passes/remove_quantizer_setattrs.md."""

from __future__ import annotations

import torch
import torch.fx

from te_passes.analyses.liveness import gc_paused
from te_passes.fx.graph import PLAIN_TYPES as _PLAIN_TYPES
from te_passes.fx.journal import GraphJournal
from te_passes.pipeline.base import PassContext, PassRecord, Stage, TEPass, TEPassResult
from te_passes.te.graph_constants import TEConstKind
from te_passes.te.graph_scan import bundle_quantizers, const_kind, users_of_objects, leaf_values  # shared scans


class RemoveQuantizerSetattrs(TEPass):
    """Remove side-effect-only ``__setattr__`` nodes on quantizer constants.

    Records: ``"folded_setattr"`` (``receiver``, ``field``, ``value``, ``reason``), ``"kept"``
    (``receiver``, ``reason``; ``field``, ``value`` when a write would change the receiver).

    Raises (caught by the manager, which undoes the rewrite):
        RuntimeError: the op bundles' quantizers changed (identity or value) during the rewrite.
    """

    name = "remove_quantizer_setattrs"
    stages = frozenset({Stage.DYNAMO})
    description = "remove side-effect-only quantizer __setattr__ residue from Dynamo graphs"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> TEPassResult:
        with gc_paused():  # no automatic collections rescanning a large graph's heap
            records: list[PassRecord] = []
            changed = self._fold_setattrs(gm, records, ctx.journal)
            return TEPassResult(gm, changed, records)

    def _fold_setattrs(self, gm: torch.fx.GraphModule, records: list[PassRecord],
                       log: GraphJournal) -> bool:
        graph = gm.graph
        groups: dict[int, list[torch.fx.Node]] = {}
        for node in graph.nodes:
            if (node.op == "call_method" and node.target == "__setattr__" and len(node.args) == 3
                    and const_kind(node.args[0]) is TEConstKind.QUANTIZER):
                groups.setdefault(id(node.args[0]), []).append(node)
        if not groups:
            return False
        before = bundle_quantizers(graph)
        users = users_of_objects(graph, set(groups))
        to_erase: list[torch.fx.Node] = []
        for rid, nodes in groups.items():
            recv = nodes[0].args[0]
            cls = type(recv).__name__
            own = set(nodes)
            observers = sorted({n.name for n in users.get(rid, ()) if n not in own})
            bad = [n for n in nodes if n.users or n.kwargs or not isinstance(n.args[1], str)
                   or (not isinstance(n.args[2], _PLAIN_TYPES)  # a plain value holds no node
                       and any(isinstance(x, torch.fx.Node) for x in leaf_values(n.args[2])))]
            if bad:
                for n in nodes:
                    records.append(PassRecord("kept", n.name, {
                        "receiver": cls, "reason": f"{bad[0].name} is used, takes kwargs or writes a "
                                                   "non-constant value: not side-effect-only"}))
                continue
            changing = next((n for n in nodes if not _writes_held_value(recv, n.args[1], n.args[2])), None)
            if observers and changing is not None:
                field, new = changing.args[1:]
                old = getattr(recv, field, "<unset>")
                retyped = f", equal but of type {type(new).__name__}" if old == new else ""
                for n in nodes:
                    records.append(PassRecord("kept", n.name, {
                        "receiver": cls, "field": n.args[1], "value": n.args[2],
                        "reason": f"receiver is also used by {', '.join(observers)} and {changing.name} changes "
                                  f"{field} from {old!r} to {new!r}{retyped}"}))
                continue
            reason = ("no-op: writes the value the constant already holds (receiver also used by "
                      + ", ".join(observers) + ")") if observers else "receiver is not observed by any other node"
            for n in nodes:
                records.append(PassRecord("folded_setattr", n.name, {
                    "receiver": cls, "field": n.args[1], "value": n.args[2], "reason": reason}))
                to_erase.append(n)
        for n in to_erase:
            log.erase(n)
        after = bundle_quantizers(graph)
        if [(a[0], a[1], id(a[2]), a[3]) for a in before] != [(a[0], a[1], id(a[2]), a[3]) for a in after]:
            raise RuntimeError("remove_quantizer_setattrs: op bundle quantizers changed while folding __setattr__ "
                               "residue (identity or value); refusing the rewrite")
        return bool(to_erase)


def _writes_held_value(recv: object, field: str, value: object) -> bool:
    """Whether ``setattr(recv, field, value)`` is a no-op: ``recv`` already holds an equal value of the same type."""
    return hasattr(recv, field) and type(getattr(recv, field)) is type(value) and getattr(recv, field) == value
