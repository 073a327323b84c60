"""Pass ``call_te_impl_directly``: each compiled TE op call costs what calling TE's impl costs.

See docs/passes/call_te_impl_directly.md."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.fx

from te_passes.fx.graph import op_qualname, same_objects
from te_passes.pipeline.base import PassConfig, PassContext, PassRecord, PassSkipped, Stage, TEPass, TEPassResult
from te_passes.ops import direct_call as dc, direct_lowering, te_base as te_base_op
from te_passes.ops.te_base import DirectCallUnavailable, op_family, overload
from te_passes.ops.constants import hoisted_name


def _tensor_slot_nodes(node: torch.fx.Node) -> list[tuple[str, torch.fx.Node]] | str:
    """``[(slot, node)]`` for the FX nodes in ``node``'s tensor slots, or why the args miss the schema."""
    schema = node.target._schema
    if node.kwargs:
        return f"keyword arguments {sorted(node.kwargs)} (TE passes every slot positionally)"
    if len(node.args) != len(schema.arguments):
        return f"{len(node.args)} arguments for a schema of {len(schema.arguments)}"
    out = []
    for a, v in zip(schema.arguments, node.args):
        t = str(a.type)
        is_tensor = t in ("Tensor", "Tensor?", "Optional[Tensor]", "List[Tensor]", "Tensor[]")
        vals = v if isinstance(v, (list, tuple)) else [v]
        nodes = [x for x in vals if isinstance(x, torch.fx.Node)]
        if nodes and not is_tensor:
            return f"slot {a.name} ({t}) holds graph values"
        out.extend((a.name, x) for x in nodes)
    return out


def subclass_reason(node: torch.fx.Node) -> str | None:
    """Why a quantized-tensor subclass might reach ``node``'s tensor slots (``None``: every FX node there
    carries a ``meta["val"]`` of type exactly ``torch.Tensor`` or ``FakeTensor``)."""
    from torch._subclasses.fake_tensor import FakeTensor

    slots = _tensor_slot_nodes(node)
    if isinstance(slots, str):
        return slots
    plain = (torch.Tensor, FakeTensor)
    for slot, x in slots:
        val = x.meta.get("val")
        if val is None:
            return f"slot {slot}: {x.name} has no meta['val'] (cannot prove it is a plain tensor)"
        if type(val) not in plain:
            return f"slot {slot}: {x.name} is a {type(val).__qualname__} (a tensor subclass the wrapper op may flatten)"
    return None


def _same_call(old: Any, new: Any) -> bool:
    """Whether plan ``old`` makes the same call as ``new``: base op, arg count, the same constant objects."""
    if not isinstance(old, dc.DirectTECall):
        return False
    a, b = old.__reduce__()[1], new.__reduce__()[1]
    return (a[0] == b[0] and a[1] == b[1] and len(a[2]) == len(b[2])
            and all(i == j and same_objects(x, y) for (i, x), (j, y) in zip(a[2], b[2])))


def _constants_reason(node: torch.fx.Node, gm: torch.fx.GraphModule) -> tuple[list[tuple[int, Any]], str | None]:
    """The node's constant slots ``[(index, value)]`` and why they cannot be fixed (``None``: ok)."""
    consts = []
    for i, (a, v) in enumerate(zip(node.target._schema.arguments, node.args)):
        if isinstance(v, torch.fx.Node):
            continue
        if isinstance(v, (list, tuple)):
            if any(isinstance(x, torch.fx.Node) for x in v):
                if not all(isinstance(x, torch.fx.Node) for x in v):
                    return consts, f"slot {a.name} mixes graph values and constants"
                continue
            if v:
                return consts, f"slot {a.name} is a non-empty constant list"
            consts.append((i, []))
            continue
        if v is None:
            consts.append((i, None))
            continue
        if hoisted_name(v, gm) is None:
            return consts, (f"slot {a.name} holds a {type(v).__name__} that is not a hoisted constant of this graph "
                            "(hoist_te_constants off or skipped): the op path rebuilds it on every call, a "
                            "direct call would keep one object")
        consts.append((i, v))
    return consts, None


class CallTEImplDirectly(TEPass):
    """Retarget TE wrapper ops to their base ops and mark them for a direct call of TE's impl.

    Records: ``"retargeted"`` (``from``, ``to``), ``"direct_call"`` (the call), ``"kept"`` (``op``,
    ``retargeted``, ``reason``)."""

    name = "call_te_impl_directly"
    stages = frozenset({Stage.POST_GRAD_FWD, Stage.POST_GRAD_BWD})
    description = "retarget TE wrapper ops to their base ops; Inductor calls TE's impl directly (no dispatcher)"

    source_modules = (dc, direct_lowering, te_base_op)  # they decide what the generated code does

    @dataclasses.dataclass(frozen=True)
    class Config(PassConfig):
        direct_call: bool = True

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> TEPassResult:
        records: list[PassRecord] = []
        plans: list[tuple[torch.fx.Node, Any, Any]] = []  # (node, new target or None, DirectTECall or None)
        lowering_reason = functools.cache(direct_lowering.lowering_reason)  # per base op, once a run
        for node in gm.graph.nodes:
            fam = op_family(node.target) if node.op == "call_function" else None
            if fam is None:
                continue
            qual = op_qualname(node.target)
            base_q = fam.base_of(qual) or (qual if fam.is_base(qual) else None)
            new_target = None
            if fam.base_of(qual) is not None:
                why = subclass_reason(node)
                if why is not None:
                    records.append(PassRecord("kept", node.name, {"op": qual, "retargeted": False, "reason": why}))
                    continue
                new_target = overload(base_q)
            base_op = overload(base_q)
            call, why = None, None
            if not self.cfg.direct_call:
                why = "direct_call=False (retarget only)"
            else:
                why = lowering_reason(base_op)
                if why is None:
                    shape = _tensor_slot_nodes(node)
                    why = shape if isinstance(shape, str) else None
                if why is None:
                    consts, why = _constants_reason(node, gm)
                if why is None:
                    try:
                        call = dc.DirectTECall(base_q, len(node.args), consts)
                    except DirectCallUnavailable as e:
                        why = str(e)
            if call is not None and new_target is None and _same_call(node.meta.get(dc.META_KEY), call):
                records.append(PassRecord("kept", node.name, {"op": base_q, "retargeted": False,
                                                              "reason": "already calls TE's impl directly"}))
                continue
            if call is None:
                records.append(PassRecord("kept", node.name, {"op": base_q, "retargeted": new_target is not None,
                                                              "reason": why}))
            if new_target is not None or call is not None:
                plans.append((node, new_target, call))
        if not plans:
            if records:
                return TEPassResult(gm, False, records)
            raise PassSkipped("no TE op nodes")

        for node, new_target, call in plans:
            if new_target is not None:
                records.append(PassRecord("retargeted", node.name, {"from": op_qualname(node.target),
                                                                    "to": op_qualname(new_target)}))
                ctx.journal.set_target(node, new_target)
            if call is not None:
                ctx.journal.set_meta(node, dc.META_KEY, call)
                records.append(PassRecord("direct_call", node.name, call.describe()))
        return TEPassResult(gm, True, records)
