"""Per-call amax-reduction groups: keep them off TE's persistent quantizers.

See docs/internals.md#te_passescompatautocastamax_groupspy."""

from __future__ import annotations

import dataclasses
import functools
import gc
import sys
import threading
from typing import Any, Callable, Iterable

from te_passes._logging import get_logger
from te_passes.compat import table
from te_passes.compat.autocast.quantizer_usage import (  # noqa: F401 - AUDITED_USAGE_CALLS: re-exported
    WEIGHT_FIELD, AUDITED_USAGE_CALLS, PER_CALL_USAGE_FIELDS, impl_code, usage_targets,
    usage_unsafe_reason)
from te_passes.te.version import te_module

log = get_logger()

#: TE module holding the Linear impls and (by import) ``set_quantizer_amax_reduction_group``.
TE_LINEAR_MODULE = "transformer_engine.pytorch.module.linear"
#: TE's setter (``transformer_engine.pytorch.module._common``).
SETTER_NAME = "set_quantizer_amax_reduction_group"
#: impl function name -> the args-dataclass fields whose quantizer the impl gives a group.
#: Mirrors ``module/linear.py``: forward line 448 (input), backward 1142/1150.
PER_CALL_GROUP_FIELDS: dict[str, tuple[str, ...]] = {
    "_linear_forward_impl": ("input_quantizer",),
    "_linear_backward_impl": ("input_quantizer", "grad_output_quantizer"),
}
#: ``Linear.quantizers`` slots of those quantizers: (dict key, TE constant namespace, index name).
#: Mirrors ``Linear._get_quantizers`` (linear.py:2589/2597).
LINEAR_QUANTIZER_SLOTS: tuple[tuple[str, str, str], ...] = (
    ("scaling_fwd", "FP8FwdTensorIdx", "GEMM1_INPUT"),
    ("scaling_bwd", "FP8BwdTensorIdx", "GRAD_OUTPUT1"),
)


#: The patch-table row that wraps the impls (:mod:`te_passes.compat.autocast.rows`).
ROW = "autocast.linear_impls"
#: Marker on the wrappers (our own functions): the usage-flag fields they restore, and why none (or ``None``).
USAGE_FIELDS_ATTR = "_te_passes_usage_fields"
USAGE_REFUSED_ATTR = "_te_passes_usage_refused"


#: Guards :data:`_CALLS` and every release of a per-call group (wrappers and sweep).
_CALLS_LOCK = threading.Lock()


@dataclasses.dataclass
class _CallState:
    """The process state of the wrapped impl calls (changed under ``_CALLS_LOCK``).

    ``groups``: ``id(quantizer TE's setter writes to)`` -> ``[wrapped impl calls now running with it (all
    threads), its amax_reduction_group before the first of them began]``. Only the *last* running call puts
    back what was there before: overlapping calls (nested, or a backward on the autograd thread) rely on the
    group staying set until they have quantized, and a group set before the call is never dropped.
    ``usage``: the same for ``id(quantizer TE's set_usage writes to)`` and its ``(rowwise_usage,
    columnwise_usage)``. ``stats``: process totals: groups the install-time sweep released
    (``released_at_install``), groups released after wrapped impl calls (``released_after_calls``),
    quantizers whose usage flags a call's end put back (``usage_restored_after_calls``)."""

    groups: dict[int, list] = dataclasses.field(default_factory=dict)
    usage: dict[int, list] = dataclasses.field(default_factory=dict)
    stats: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(
        ("released_at_install", "released_after_calls", "usage_restored_after_calls"), 0))


_CALLS = _CallState()


@functools.lru_cache(maxsize=None)  # this runs for every quantizer of every wrapped eager call
def _dist_group_type() -> type | None:
    """``torch.distributed.ProcessGroup``, or ``None`` without torch.distributed."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        dist = None
    if dist is None or not dist.is_available():
        return None
    from torch._C._distributed_c10d import ProcessGroup

    return ProcessGroup


@functools.lru_cache(maxsize=None)
def _setter() -> Callable:
    """TE's ``set_quantizer_amax_reduction_group``, imported once."""
    from transformer_engine.pytorch.module._common import set_quantizer_amax_reduction_group

    return set_quantizer_amax_reduction_group


def _group_key(quantizer: Any) -> int:
    """Identity of the object TE's setter writes the group to (a ``DebugQuantizer``'s parent)."""
    return id(getattr(quantizer, "parent_quantizer", quantizer))


def holds_process_group(quantizer: Any) -> bool:
    """Whether ``quantizer`` (or the ``parent_quantizer`` a TE ``DebugQuantizer`` delegates to) stores a
    ``torch.distributed.ProcessGroup`` in ``amax_reduction_group``, the state TE's
    ``Quantizer._check_value_has_no_process_group`` (``quantized_tensor.py``) rejects in a graph."""
    if quantizer is None:
        return False
    group = getattr(getattr(quantizer, "parent_quantizer", quantizer), "amax_reduction_group", None)
    if group is None:  # the common case, before the isinstance check
        return False
    pg = _dist_group_type()
    return pg is not None and isinstance(group, pg)


def release_group(quantizer: Any) -> bool:
    """Clear a per-call amax-reduction group from ``quantizer``; returns whether one was held."""
    if not holds_process_group(quantizer):
        return False
    _setter()(quantizer, None)
    return True


def unsafe_reason(linear_module: Any) -> str | None:
    """Why wrapping ``linear_module``'s impls would not be safe, or ``None``: safe when each impl in
    :data:`PER_CALL_GROUP_FIELDS` exists and calls ``set_quantizer_amax_reduction_group`` itself (the
    group is re-applied on every call, so releasing it after the call changes nothing TE reads later)."""
    for name in PER_CALL_GROUP_FIELDS:
        code = impl_code(linear_module, name)
        if code is None:
            return f"{linear_module.__name__}.{name} is missing"
        if SETTER_NAME not in code.co_names:
            return (f"{linear_module.__name__}.{name} no longer calls {SETTER_NAME} on every call; "
                    "releasing the group after a call would drop an amax reduction")
    if not callable(getattr(linear_module, SETTER_NAME, None)):
        return f"{linear_module.__name__}.{SETTER_NAME} is missing"
    return None


def _wrap_impl(orig: Callable, fields: tuple[str, ...], usage_fields: tuple[str, ...] = (),
               weight_field: str | None = None) -> Callable:
    """``orig`` (a TE impl taking the args dataclass first) that, when the last call running on a quantizer
    in ``fields`` ends, gives it back the amax-reduction group it had before the first of those calls
    (``_CALLS.groups``), and each quantizer in ``usage_fields`` its usage flags (``_CALLS.usage``)."""
    @functools.wraps(orig)
    def impl(args, *rest, **kwargs):
        held = None  # [(quantizer, object TE's setter writes to)]; kept lean: runs per eager call
        if getattr(args, "sequence_parallel", True):
            # TE gives a group only to sequence-parallel calls (linear.py:448/1142/1150): a
            # non-SP call sets None itself, so it has no group to release.
            held = [(q, getattr(q, "parent_quantizer", q)) for f in fields
                    if (q := getattr(args, f, None)) is not None] or None
        usage = usage_targets(args, usage_fields, weight_field) if usage_fields else None
        if held is None and usage is None:
            return orig(args, *rest, **kwargs)
        with _CALLS_LOCK:
            for _, t in held or ():  # [count, value before the first running call]
                _CALLS.groups.setdefault(id(t), [0, getattr(t, "amax_reduction_group", None)])[0] += 1
            for t in usage or ():
                _CALLS.usage.setdefault(id(t), [0, (getattr(t, "rowwise_usage", None),
                                                       getattr(t, "columnwise_usage", None))])[0] += 1
        try:
            return orig(args, *rest, **kwargs)
        finally:
            with _CALLS_LOCK:  # restored under the lock: no call can start (and set it) meanwhile
                last, last_usage = [], []
                for q, t in held or ():  # every count first, so a failing restore cannot leak one
                    entry = _CALLS.groups[id(t)]
                    entry[0] -= 1
                    if not entry[0]:
                        del _CALLS.groups[id(t)]
                        last.append((q, t, entry[1]))
                for t in usage or ():
                    entry = _CALLS.usage[id(t)]
                    entry[0] -= 1
                    if not entry[0]:
                        del _CALLS.usage[id(t)]
                        last_usage.append((t, entry[1]))
                for q, t, before in last:
                    if before is None:
                        if release_group(q):
                            _CALLS.stats["released_after_calls"] += 1
                    elif getattr(t, "amax_reduction_group", None) is not before:
                        _setter()(q, before)
                for t, (row, col) in last_usage:
                    if (row is not None and col is not None
                            and (t.rowwise_usage, t.columnwise_usage) != (row, col)):
                        t.set_usage(rowwise=row, columnwise=col)  # TE's Quantizer.set_usage
                        _CALLS.stats["usage_restored_after_calls"] += 1

    impl._te_passes_amax_hook = True  # type: ignore[attr-defined]  # our own function (quantizer_usage.impl_code)
    impl._te_passes_usage_fields = usage_fields  # type: ignore[attr-defined]  # USAGE_FIELDS_ATTR
    return impl


def linear_quantizers_with_groups(modules: Iterable[Any]) -> list[Any]:
    """The per-call quantizers (:data:`LINEAR_QUANTIZER_SLOTS`) of the given ``te.Linear``
    modules that hold a process group. Other slots (the weight quantizer's FSDP2 group) are not
    looked at."""
    import transformer_engine.pytorch.constants as te_constants

    out = []
    for mod in modules:
        quantizers = getattr(mod, "quantizers", None)
        if not isinstance(quantizers, dict):
            continue
        for key, ns, idx_name in LINEAR_QUANTIZER_SLOTS:
            slot = quantizers.get(key) or []
            idx = getattr(getattr(te_constants, ns), idx_name)
            if idx < len(slot) and holds_process_group(slot[idx]):
                out.append(slot[idx])
    return out


def sweep_live_linear_modules(modules: Iterable[Any] | None = None) -> int:
    """Release per-call groups left on live ``te.Linear`` modules; returns how many. ``modules`` defaults
    to every live ``transformer_engine.pytorch.Linear`` ``gc.get_objects()`` finds (none looked for while
    ``torch.distributed`` is not initialised: then no group can exist)."""
    if modules is None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return 0
        linear_mod = sys.modules.get(TE_LINEAR_MODULE)
        if linear_mod is None:
            return 0
        cls = linear_mod.Linear
        # type(), not isinstance(): a dead weakref.proxy raises on __class__.
        modules = [o for o in gc.get_objects() if issubclass(type(o), cls)]
    released = 0
    with _CALLS_LOCK:  # skip quantizers a wrapped call (another thread) is running with
        for q in linear_quantizers_with_groups(modules):
            if _group_key(q) not in _CALLS.groups:
                released += release_group(q)
    return released


def linear_impl_changes() -> list[table.Rebind]:
    """The plan of row ``autocast.linear_impls``: wrap ``module/linear.py``'s :data:`PER_CALL_GROUP_FIELDS` impls
    (:func:`_wrap_impl`), restoring usage flags too unless :func:`usage_unsafe_reason` (then with a warning).

    Raises:
        table.Refused: ``"pending: ..."`` while TE's ``module/linear.py`` is not imported; :func:`unsafe_reason`
            (logged as a warning: an eager step before the first compile of a sequence-parallel fp8 te.Linear
            can then make that trace fail)."""
    mod = te_module(TE_LINEAR_MODULE)
    if mod is None:
        raise table.Refused(f"pending: {TE_LINEAR_MODULE} is not imported yet")
    reason = unsafe_reason(mod)
    if reason is not None:
        log.warning("te_passes: not wrapping TE's Linear impls (%s); an eager step before the first compile of a "
                    "sequence-parallel fp8 te.Linear can make that trace fail", reason)
        raise table.Refused(reason)
    usage_reason = usage_unsafe_reason(mod)
    if usage_reason is not None:
        log.warning("te_passes: not restoring TE quantizer usage flags after eager Linear calls (%s); alternating "
                    "eager and compiled steps of one module may recompile", usage_reason)
    changes = []
    for n, fields in PER_CALL_GROUP_FIELDS.items():
        impl = _wrap_impl(getattr(mod, n), fields, PER_CALL_USAGE_FIELDS[n] if usage_reason is None else (),
                          WEIGHT_FIELD[n])
        impl._te_passes_usage_refused = usage_reason  # type: ignore[attr-defined]  # USAGE_REFUSED_ATTR (ours)
        changes.append(table.Rebind(mod, n, impl))
    return changes


def release_at_install() -> None:
    """Row ``autocast.linear_impls``' after-install step: :func:`sweep_live_linear_modules` (count in
    ``_CALLS.stats["released_at_install"]``, logged)."""
    _CALLS.stats["released_at_install"] = sweep_live_linear_modules()
    if _CALLS.stats["released_at_install"]:
        log.info("te_passes: released %d amax-reduction group(s) left on te.Linear quantizers by "
                 "earlier eager steps", _CALLS.stats["released_at_install"])


def _live_impls() -> list[Any]:
    mod = sys.modules.get(TE_LINEAR_MODULE)
    return [getattr(mod, n, None) for n in PER_CALL_USAGE_FIELDS] if mod is not None else []


def usage_restore_installed() -> bool:
    """Whether the wrappers in place put quantizer usage flags back after each eager call."""
    impls = _live_impls()
    return table.refusal(ROW) is None and bool(impls) and all(getattr(f, USAGE_FIELDS_ATTR, ()) for f in impls)


def hook_stats() -> dict[str, Any]:
    """The process totals (:class:`_CallState` ``stats``) with ``"installed"`` (row ``autocast.linear_impls``
    active), ``"refused"`` (``table.refusal``) and ``"usage_refused"``: why the wrappers in place do not restore
    usage flags (:func:`usage_unsafe_reason` when they were built), or ``None`` (also while the row is not
    active: ``"refused"`` says why)."""
    return {"installed": table.refusal(ROW) is None, "refused": table.refusal(ROW), **_CALLS.stats,
            "usage_refused": next((r for f in _live_impls() if (r := getattr(f, USAGE_REFUSED_ATTR, None))), None)}
