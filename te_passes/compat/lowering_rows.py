"""The patch-table rows for te_passes' own ops (:mod:`te_passes.ops`): Inductor lowerings and the named-constant
``__fx_repr__`` of TE's classes.

The functions the rows install are built in :mod:`te_passes.ops` (``free.make_inductor_lowering``,
``direct_lowering.make_lowering``, ``constants.named_fx_repr``); the passes read only whether Inductor's lowering
table / a class holds ours (``free.lowering_reason``, ``direct_lowering.lowering_reason``, ``constants.can_name``).
"""

from __future__ import annotations

from typing import Any

from te_passes._logging import get_logger
from te_passes.compat.table import Change, Lowering, Rebind, Refused, Row
from te_passes.ops import constants, direct_lowering as dl, free

log = get_logger()

_TORCH = ">=2.14,<2.16"
_TE = "==2.20.*"


def _staged_lowering(L: Any, op: Any, fn: Any) -> Any:
    """``fn`` wrapped as ``torch._inductor.lowering.register_lowering(op, type_promotion_kind=None)`` wraps it
    (argument unpacking, IR validation), into a throwaway dict: the table registers the result."""
    staged: dict[Any, Any] = {}
    L.register_lowering(op, type_promotion_kind=None, lowering_dict=staged)(fn)
    return staged[op]


def _free_plan() -> list[Change]:
    from torch._inductor import lowering as L

    have = L.lowerings.get(free.free_storage)
    if have is not None and not getattr(have, free.LOWERING_MARK, False):
        raise Refused(f"{free.QUALNAME} already has an Inductor lowering that is not te_passes'")
    return [Lowering(free.free_storage, _staged_lowering(L, free.free_storage, free.make_inductor_lowering()))]


def _direct_call_plan() -> list[Change]:
    from torch._inductor import lowering as L
    from torch._library.utils import get_layout_constraint_tag

    why = dl.feature_error()
    if why is not None:
        raise Refused(why)
    changes: list[Change] = []
    for op in dl.base_ops():
        have = L.lowerings.get(op)
        if have is not None:
            if not dl.is_direct_lowering(have):
                log.info("te_passes: no direct-call lowering for %s: it has an Inductor lowering that is not "
                         "te_passes'", op)
            continue
        if op in L.decompositions:
            log.info("te_passes: no direct-call lowering for %s: Inductor decomposes it", op)
            continue
        constraint = L.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
        fallback = _staged_lowering(L, op, L.fallback_handler(op))
        changes.append(Lowering(op, dl.make_lowering(op, fallback, constraint), realized_inputs=True,
                                layout_constraint=constraint))
    return changes


def _named_constants_plan() -> list[Change]:
    out: list[Change] = []
    for cls in constants.te_constant_classes():
        orig = cls.__dict__["__fx_repr__"]
        if not constants.is_named_fx_repr(orig):
            out.append(Rebind(cls, "__fx_repr__", constants.named_fx_repr(orig)))
    return out


ROWS: tuple[Row, ...] = (
    Row(name="lowering.free_storage", target="torch._inductor.lowering.lowerings[te_passes::free_storage]",
        kind="lowering",
        why="the early-free op frees a materialized buffer and marks it never reused (V.graph.never_reuse_buffers): "
            "without it Inductor's wrapper would hand a freed buffer to a later kernel",
        drop_when="Inductor accepts a buffer-release op of its own (no upstream issue yet)",
        te="", torch=_TORCH, plan=_free_plan),
    Row(name="lowering.direct_call",
        target="torch._inductor.lowering.lowerings[transformer_engine_compile::*_base]",
        kind="lowering",
        why="Inductor's wrapper calls TE's impl directly (DirectTECall) instead of the dispatcher op; a fallback "
            "kernel otherwise. Every TE op family defined by the time of an install (sweep)",
        drop_when="TE's register_custom_op ops lower to a direct call of their impl in Inductor (no upstream issue "
                  "yet)",
        te=_TE, torch=_TORCH, plan=_direct_call_plan, sweep=True),
    Row(name="lowering.named_constants",
        target="transformer_engine.pytorch.dynamo.custom_op.OpaqueValueBundle.__fx_repr__ and each "
               "transformer_engine.pytorch.quantized_tensor.Quantizer subclass's __fx_repr__",
        kind="rebind",
        why="a hoisted TE constant renders as one wrapper-global name in its own graph's Inductor wrapper instead of "
            "being rebuilt on every call (hoist_te_constants); TE's expression everywhere else. Classes loaded "
            "later are swept",
        drop_when="Inductor hoists value-opaque constants out of the per-call wrapper code (no upstream issue yet)",
        te=_TE, torch=_TORCH, plan=_named_constants_plan, sweep=True),
)
