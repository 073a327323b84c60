"""Per-call amax-reduction groups: keep them off TE's persistent quantizers (TE 2.20).

The problem (issue 8, measured on two H200s and reproduced on CPU in
``tests/test_amax_groups.py``)::

    eager step of a sequence-parallel fp8 te.Linear
      _linear_forward_impl   set_quantizer_amax_reduction_group(input_quantizer, tp_group)   # linear.py:448
      _linear_backward_impl  set_quantizer_amax_reduction_group(grad_output_quantizer, tp_group)  # :1150
      -> the module's *persistent* quantizer keeps ``amax_reduction_group = <ProcessGroup>``

    next torch.compile trace of the same module (Linear.forward, linear.py:2438-2441)
      if getattr(q, "amax_reduction_group", None) is not None:    # Dynamo reads the group ...
          set_quantizer_amax_reduction_group(q, None)             # ... and traces the strip
      _linear_forward_fake: TensorSpec(quantizer=input_quantizer) -> q.copy()
          # the copy reads the group through Dynamo's stale view and carries it
      FX codegen: Float8CurrentScalingQuantizer.__fx_repr__ -> _value_key
          -> TypeError: ... 'amax_reduction_group' holds a torch.distributed.ProcessGroup
    (row parallel: the guard on ``quantizers['scaling_bwd'][0].amax_reduction_group.group_name``
     cannot be built, because the traced strip already ran on the real object)

A second trace works only because the failed one left the real object stripped. Every eager
step of the same module re-arms the failure (and, once a compile succeeded, turns the guard on
the group into a recompile).

The fix at the TE-integration depth: the group on those two quantizers is *per-call* state —
TE's forward and backward impls set it (to ``tp_group`` or ``None``) at their start on every
call, eager or inside the compiled op (where the group crosses the op boundary as a process-
group name in the config bundle, ``dynamo/custom_op.py`` ``PROCESS_GROUP``). So te_passes

1. wraps TE's ``_linear_forward_impl`` / ``_linear_backward_impl`` (rebinding the names in
   ``transformer_engine.pytorch.module.linear``, as :mod:`te_passes.runtime.ub_guard` does for the UB
   functions) so that the groups they set for one call are released when the call returns —
   the module's quantizers look to Dynamo as they did before any eager step. Precisely: when the
   *last* wrapped call running on a quantizer returns (count of calls in flight, all threads),
   the quantizer gets back the group it had before the first of them began. So a nested call, or
   a forward on one thread overlapping a backward of the same module on the autograd engine's
   device thread, keeps the group until it has quantized (dropping it earlier would silently skip
   the TP amax reduction), and a group set outside the impls (not TE 2.20's per-call one) is never
   dropped by a call; and
2. when the hooks are installed (when ``te_inductor`` is looked up, i.e. at ``torch.compile``),
   sweeps the live ``te.Linear`` modules once and releases the groups left by eager steps that
   ran before te_passes was loaded.

Releasing is safe only because TE re-applies the group on every call; :func:`install_amax_group_hooks`
checks that (each wrapped impl must call ``set_quantizer_amax_reduction_group`` itself) and
refuses to install, saying why, when a TE version does not. Groups TE does *not* re-apply per
call (FSDP2 weight quantizers, ``module/base.py:1862``) are never touched: only the input and
grad-output quantizers of ``te.Linear`` are.

Usage flags (issue 17). The same wrappers also put back the quantizers' usage flags
(``rowwise_usage`` / ``columnwise_usage``, written by TE's ``Quantizer.set_usage``,
``quantized_tensor.py:575``) when the last call in flight on a quantizer returns. Without this,
alternating eager and compiled steps of one sequence-parallel fp8 te.Linear recompiles once per
alternation: Dynamo guards ``quantizers['scaling_fwd'][0].columnwise_usage == True`` (the value
``_linear_forward_fake`` sets on the module's quantizer while it is traced, ``linear.py:835``),
and TE's eager impl leaves ``False`` (``linear.py:488`` / ``:502``: fp8 all-gather is
row-wise only). Restoring is safe because TE 2.20.2's impls write both flags before every use of
each quantizer they touch; no later reader depends on what a call left (each read below is
preceded, in the same call, by the ``set_usage`` named)::

    _linear_forward_impl  input_quantizer   482 (both; 488/492 narrow it) -> quantize 494;
                                            502 (both) -> gather_along_first_dim 504 /
                                            fill_userbuffers_buffer_for_all_gather 510;
                                            524 (both) -> quantize 532
                          weight_quantizer  571 (both) -> quantize_weight 576 (reads usage,
                                            base.py:765-785/837); a quantized weight is used
                                            through its own ``_quantizer`` (573), the module's
                                            is not read
                          output_quantizer  617 (both) -> general_gemm 635
    _linear_backward_impl grad_output_q.    1243 (both; 1248/1261 narrow it) ->
                                            grad_output_preprocess 1272 (base.py:1688);
                                            set_quantizer_usage_for_wgrad_all_gather 1494
                                            (_common.py:55, both) -> gather 1497;
                                            1544 (both) -> fill_userbuffers 1550;
                                            1566 (both) -> quantize 1567
                          input_quantizer   1305/1310 (both) -> quantize 1311;
                                            set_quantizer_usage_for_wgrad_all_gather 1321 ->
                                            fill_userbuffers 1323 / gather 1331;
                                            1520 (both) -> quantize 1521
                          weight_quantizer  1368 / 1378 (both) -> quantize 1369 / 1379
                          grad_input_q.     1396 (both) -> general_gemm 1429

The helpers called with a quantizer read its usage only after the caller's ``set_usage``
(``gather_along_first_dim``: distributed.py:1086/1160-1204; it even saves, narrows and puts back
the flags itself around its quantize, 1037-1043 / 1056-1060, the pattern the wrappers follow).
Other readers of a module quantizer's usage, all preceded by their own ``set_usage``:
``_linear_forward_fake`` (835/870/908), ``reset_parameters`` (base.py:1848),
``fill_userbuffers_buffer_for_all_gather`` (base.py:661). Quantized tensors never share the
module's quantizer (``Float8TensorStorage.__new__`` copies it, float8_tensor_storage.py:113), and
the compiled op runs TE's impls as registered at import (``register_custom_op(fwd_impl=...)``,
linear.py:1798) on quantizers rebuilt from the graph's constants, so it never reads or writes
the module's flags. Not restored: ``grad_weight_quantizer`` (the wgrad GEMM uses it without a
``set_usage``; ``None`` for te.Linear outside debug mode) and the weight quantizer when the weight
is quantized (``setup_ctx`` then passes the parameter's own quantizer, linear.py:1028, whose flags
``quantize_weight`` (base.py:837) and FSDP2's all-gather read across calls) or a distributed
weight (``materialize_weight_for_forward`` runs before 571). :func:`usage_unsafe_reason` checks at
install that each impl still has exactly the audited ``set_usage`` call sites
(:data:`AUDITED_USAGE_CALLS`) and otherwise leaves the flags alone, with a warning (the
amax-group part still installs).

Once installed the hooks act process-wide, so every backend in the process (plain Inductor
included) gets the same first-call behaviour.
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import gc
import sys
import threading
from typing import Any, Callable, Iterable

from te_passes._logging import get_logger

log = get_logger()

#: TE module holding the Linear impls and (by import) ``set_quantizer_amax_reduction_group``.
TE_LINEAR_MODULE = "transformer_engine.pytorch.module.linear"
#: TE's setter (``transformer_engine.pytorch.module._common``, TE 2.20.2).
SETTER_NAME = "set_quantizer_amax_reduction_group"
#: impl function name -> the args-dataclass fields whose quantizer the impl gives a group.
#: Mirrors ``module/linear.py`` (TE 2.20.2): forward line 448 (input), backward 1142/1150.
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

#: impl function name -> the args-dataclass fields whose quantizer's usage flags the impl writes
#: before each use (module docstring: call sites in TE 2.20.2), restored after the call.
PER_CALL_USAGE_FIELDS: dict[str, tuple[str, ...]] = {
    "_linear_forward_impl": ("input_quantizer", "weight_quantizer", "output_quantizer"),
    "_linear_backward_impl": ("input_quantizer", "weight_quantizer", "grad_input_quantizer",
                              "grad_output_quantizer"),
}
#: impl -> the args field holding the weight whose kind decides whether ``weight_quantizer`` is
#: restored (not for a quantized or distributed weight; see the module docstring).
_WEIGHT_FIELD: dict[str, str] = {"_linear_forward_impl": "weight", "_linear_backward_impl": "saved_weight"}
#: The usage-setting call sites audited in TE 2.20.2 ``module/linear.py`` (line numbers), per impl
#: and callee name. :func:`usage_unsafe_reason` requires each impl's code to have exactly this
#: many calls of each name: an added or removed call site means the audit no longer holds.
AUDITED_USAGE_CALLS: dict[str, dict[str, tuple[int, ...]]] = {
    "_linear_forward_impl": {"set_usage": (482, 488, 492, 502, 524, 571, 617)},
    "_linear_backward_impl": {
        "set_usage": (1243, 1248, 1261, 1305, 1310, 1368, 1378, 1396, 1520, 1544, 1566),
        "set_quantizer_usage_for_wgrad_all_gather": (1321, 1494),
    },
}


@dataclasses.dataclass
class _HookState:
    installed: bool = False
    originals: dict[str, Callable] = dataclasses.field(default_factory=dict)
    replacements: dict[str, Callable] = dataclasses.field(default_factory=dict)
    refused: str | None = None      # why the hooks were not installed (TE layout not understood)
    released_at_install: int = 0    # groups the install-time sweep released
    released_after_calls: int = 0   # groups released after wrapped impl calls (process total)
    usage_refused: str | None = None  # why usage flags are not restored (TE code not as audited)
    usage_restored_after_calls: int = 0  # quantizers whose usage flags a call's end put back


_STATE = _HookState()
_LOCK = threading.Lock()
#: Guards :data:`_IN_FLIGHT` and every release of a per-call group (wrappers and sweep).
_CALLS_LOCK = threading.Lock()
#: ``id(quantizer TE's setter writes to)`` -> ``[wrapped impl calls now running with it (all
#: threads), its amax_reduction_group before the first of them began]``. Only the *last* running
#: call puts the group back, and it puts back what was there before (``None`` under TE 2.20.2
#: once the sweep ran): TE's impls never release the group themselves, so overlapping calls (a
#: nested call, or the autograd engine's device thread running a backward while another thread
#: runs a forward of the same module) rely on it staying set until they have quantized; and a
#: group that was on the quantizer before the call (not TE 2.20's per-call one) is never dropped.
_IN_FLIGHT: dict[int, list] = {}
#: ``id(quantizer TE's set_usage writes to)`` -> ``[wrapped calls now running with it, its
#: (rowwise_usage, columnwise_usage) before the first of them began]``; same rule as
#: :data:`_IN_FLIGHT`: only the last running call writes the flags back, so no call ever sees
#: them change under it.
_USAGE_IN_FLIGHT: dict[int, list] = {}
_NO_PARENT = object()
_UNSET = object()
_PG_TYPE: Any = _UNSET   # torch.distributed.ProcessGroup, or None without torch.distributed
_SETTER: Any = None      # TE's set_quantizer_amax_reduction_group, once imported


def _dist_group_type() -> type | None:
    # Cached: ``from torch._C._distributed_c10d import ProcessGroup`` costs ~2 us per
    # execution, and this runs for every quantizer of every wrapped eager call.
    global _PG_TYPE
    if _PG_TYPE is _UNSET:
        try:
            import torch.distributed as dist
        except ImportError:  # pragma: no cover - torch without distributed
            dist = None
        if dist is None or not dist.is_available():
            _PG_TYPE = None
        else:
            from torch._C._distributed_c10d import ProcessGroup

            _PG_TYPE = ProcessGroup
    return _PG_TYPE


def _setter() -> Callable:
    global _SETTER
    if _SETTER is None:
        from transformer_engine.pytorch.module._common import set_quantizer_amax_reduction_group

        _SETTER = set_quantizer_amax_reduction_group
    return _SETTER


def _group_key(quantizer: Any) -> int:
    """Identity of the object TE's setter writes the group to (a ``DebugQuantizer``'s parent)."""
    return id(getattr(quantizer, "parent_quantizer", quantizer))


def holds_process_group(quantizer: Any) -> bool:
    """Whether ``quantizer`` (or the ``parent_quantizer`` a TE ``DebugQuantizer`` delegates to)
    stores a ``torch.distributed.ProcessGroup`` in ``amax_reduction_group`` — the state TE 2.20.2's
    ``Quantizer._check_value_has_no_process_group`` (``quantized_tensor.py``) rejects in a graph."""
    if quantizer is None:
        return False
    group = getattr(getattr(quantizer, "parent_quantizer", quantizer), "amax_reduction_group", None)
    if group is None:  # the common case; isinstance(x, ProcessGroup) alone costs ~0.3 us
        return False
    pg = _dist_group_type()
    return pg is not None and isinstance(group, pg)


def release_group(quantizer: Any) -> bool:
    """Clear a per-call amax-reduction group from ``quantizer``; returns whether one was held.

    Uses TE's own ``set_quantizer_amax_reduction_group(quantizer, None)`` (``module/_common.py``,
    TE 2.20.2: ``with_amax_reduction = False``, ``amax_reduction_group = None``), i.e. exactly the
    state TE's forward gives the quantizer under ``torch.compile`` (linear.py:2438-2441) and the
    state of a freshly built quantizer.
    """
    if not holds_process_group(quantizer):
        return False
    _setter()(quantizer, None)
    return True


def unsafe_reason(linear_module: Any) -> str | None:
    """Why wrapping ``linear_module``'s impls would not be safe, or ``None`` when it is.

    Safe means: each impl in :data:`PER_CALL_GROUP_FIELDS` exists and itself calls
    ``set_quantizer_amax_reduction_group`` (so the group is re-applied on every call and
    releasing it after the call changes nothing TE reads later).
    """
    for name in PER_CALL_GROUP_FIELDS:
        code = _impl_code(linear_module, name)
        if code is None:
            return f"{linear_module.__name__}.{name} is missing"
        if SETTER_NAME not in code.co_names:
            return (f"{linear_module.__name__}.{name} no longer calls {SETTER_NAME} on every call; "
                    "releasing the group after a call would drop an amax reduction")
    if not callable(getattr(linear_module, SETTER_NAME, None)):
        return f"{linear_module.__name__}.{SETTER_NAME} is missing"
    return None


def _impl_code(linear_module: Any, name: str) -> Any:
    fn = getattr(linear_module, name, None)
    fn = getattr(fn, "__wrapped__", fn) if getattr(fn, "_te_passes_amax_hook", False) else fn
    return getattr(fn, "__code__", None)


def _calls_by_name(code: Any, names: Iterable[str]) -> dict[str, int]:
    """How many source lines of ``code`` (nested code objects, e.g. ``_linear_backward_impl``'s
    ``wgrad_gemm`` closure, included) load each of ``names`` as an attribute or global: call
    sites, counted by line so that bytecode the compiler duplicates (``finally`` bodies) counts
    once. The same numbers on CPython 3.10-3.13 for TE 2.20.2's impls."""
    wanted = set(names)
    sites: dict[str, set] = {n: set() for n in wanted}
    stack = [code]
    while stack:
        c = stack.pop()
        for ins in dis.get_instructions(c):
            if ins.opname in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_GLOBAL") and ins.argval in wanted:
                line = getattr(getattr(ins, "positions", None), "lineno", None)
                sites[ins.argval].add(line if line is not None else (id(c), ins.offset))
        stack.extend(k for k in c.co_consts if hasattr(k, "co_code"))
    return {n: len(v) for n, v in sites.items()}


def usage_unsafe_reason(linear_module: Any) -> str | None:
    """Why restoring usage flags after TE's Linear impls would not be proven safe, or ``None``.

    Proven means: each impl in :data:`PER_CALL_USAGE_FIELDS` exists and its code (nested code
    objects included) has exactly the ``set_usage`` / ``set_quantizer_usage_for_wgrad_all_gather``
    call sites audited for TE 2.20.2 (:data:`AUDITED_USAGE_CALLS`; the audit is in the module
    docstring). A different count means TE's impl changed where it sets usage, so "every use is
    preceded by a ``set_usage`` in the same call" must be re-read before the flags may be put back.
    """
    for name, audited in AUDITED_USAGE_CALLS.items():
        code = _impl_code(linear_module, name)
        if code is None:
            return f"{linear_module.__name__}.{name} is missing"
        found = _calls_by_name(code, audited)
        diff = {callee: (len(lines), found[callee]) for callee, lines in audited.items()
                if found[callee] != len(lines)}
        if diff:
            said = ", ".join(f"{callee}: {n} call site(s) audited (TE 2.20.2 lines "
                             f"{list(audited[callee])}), {m} found" for callee, (n, m) in diff.items())
            return (f"{linear_module.__name__}.{name} no longer has the audited usage-setting calls "
                    f"({said}); putting usage flags back after a call is not proven safe")
    return None


def _usage_targets(args: Any, fields: tuple[str, ...], weight_field: str | None) -> list | None:
    """The objects TE's ``set_usage`` writes to for the quantizers in ``fields`` of ``args``
    (a ``DebugQuantizer``'s ``parent_quantizer``; a DebugQuantizer around no quantizer is a
    per-call object and skipped), or ``None`` when there are none."""
    out = None
    for f in fields:
        q = getattr(args, f, None)
        if q is None:
            continue
        if f == "weight_quantizer" and weight_field is not None and _weight_not_plain(args, weight_field):
            continue
        p = getattr(q, "parent_quantizer", _NO_PARENT)
        t = q if p is _NO_PARENT else p
        if t is None:
            continue
        if out is None:
            out = []
        out.append(t)
    return out


def _weight_not_plain(args: Any, weight_field: str) -> bool:
    # A quantized weight (primary fp8 parameters: TE uses / saves the parameter's own quantizer,
    # linear.py:573/1028) or a distributed one (is_distributed_weight, distributed_weight.py:62).
    w = getattr(args, weight_field, None)
    if getattr(args, "is_weight_param_quantized", False) or getattr(w, "is_distributed_weight", False):
        return True
    storage = _quantized_storage_type()
    return storage is not None and isinstance(w, storage)


_STORAGE_TYPE: Any = _UNSET


def _quantized_storage_type() -> type | None:
    global _STORAGE_TYPE
    if _STORAGE_TYPE is _UNSET:
        try:
            from transformer_engine.pytorch.quantized_tensor import QuantizedTensorStorage
        except ImportError:  # pragma: no cover - TE layout changed; then nothing is restored
            QuantizedTensorStorage = None  # noqa: N806
        _STORAGE_TYPE = QuantizedTensorStorage
    return _STORAGE_TYPE


def _wrap_impl(orig: Callable, fields: tuple[str, ...], usage_fields: tuple[str, ...] = (),
               weight_field: str | None = None) -> Callable:
    """``orig`` (a TE impl taking the args dataclass first) that, when the last call running on
    a quantizer in ``fields`` returns (or raises), gives that quantizer back the amax-reduction
    group it had before the first of those calls began (i.e. releases the group TE set for the
    call; see :data:`_IN_FLIGHT`); and likewise gives each quantizer in ``usage_fields`` back its
    ``rowwise_usage`` / ``columnwise_usage`` (:data:`_USAGE_IN_FLIGHT`). The weight quantizer is
    left alone when ``args.<weight_field>`` is a quantized or distributed weight.

    Overhead per call on this project's 2-core CPU box (``benchmarks/bench_amax_hooks.py``):
    see docs/benchmarks.md ("amax-group hook cost").
    """
    @functools.wraps(orig)
    def impl(args, *rest, **kwargs):
        held = None  # [(quantizer, object TE's setter writes to)]; kept lean: runs per eager call
        if getattr(args, "sequence_parallel", True):
            # TE gives a group only to sequence-parallel calls (linear.py:448/1142/1150): a
            # non-SP call sets None itself, so it has no group to release.
            for f in fields:
                q = getattr(args, f, None)
                if q is not None:
                    if held is None:
                        held = []
                    held.append((q, getattr(q, "parent_quantizer", q)))
        usage = _usage_targets(args, usage_fields, weight_field) if usage_fields else None
        if held is None and usage is None:
            return orig(args, *rest, **kwargs)
        with _CALLS_LOCK:
            for _, t in held or ():
                entry = _IN_FLIGHT.get(id(t))
                if entry is None:
                    _IN_FLIGHT[id(t)] = [1, getattr(t, "amax_reduction_group", None)]
                else:
                    entry[0] += 1
            for t in usage or ():
                entry = _USAGE_IN_FLIGHT.get(id(t))
                if entry is None:
                    _USAGE_IN_FLIGHT[id(t)] = [1, (getattr(t, "rowwise_usage", None),
                                                   getattr(t, "columnwise_usage", None))]
                else:
                    entry[0] += 1
        try:
            return orig(args, *rest, **kwargs)
        finally:
            with _CALLS_LOCK:  # restored under the lock: no call can start (and set it) meanwhile
                last = None
                for q, t in held or ():  # every count first, so a failing restore cannot leak one
                    entry = _IN_FLIGHT[id(t)]
                    entry[0] -= 1
                    if not entry[0]:
                        del _IN_FLIGHT[id(t)]
                        last = [(q, t, entry[1])] if last is None else [*last, (q, t, entry[1])]
                last_usage = None
                for t in usage or ():
                    entry = _USAGE_IN_FLIGHT[id(t)]
                    entry[0] -= 1
                    if not entry[0]:
                        del _USAGE_IN_FLIGHT[id(t)]
                        last_usage = [(t, entry[1])] if last_usage is None else [*last_usage, (t, entry[1])]
                for q, t, before in last or ():
                    if before is None:
                        if release_group(q):
                            _STATE.released_after_calls += 1
                    elif getattr(t, "amax_reduction_group", None) is not before:
                        _setter()(q, before)
                for t, (row, col) in last_usage or ():
                    if (row is not None and col is not None
                            and (t.rowwise_usage, t.columnwise_usage) != (row, col)):
                        t.set_usage(rowwise=row, columnwise=col)  # TE's Quantizer.set_usage
                        _STATE.usage_restored_after_calls += 1

    impl._te_passes_amax_hook = True  # type: ignore[attr-defined]
    impl._te_passes_usage_fields = usage_fields  # type: ignore[attr-defined]
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
    """Release per-call groups left on live ``te.Linear`` modules; returns how many.

    ``modules`` defaults to every live ``transformer_engine.pytorch.Linear`` found by
    ``gc.get_objects()`` (about 0.2 s per 400k tracked objects on a 2-core box; skipped when
    ``torch.distributed`` is not initialised, since then no group can exist).
    """
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
            if _group_key(q) not in _IN_FLIGHT:
                released += release_group(q)
    return released


def install_amax_group_hooks(*, import_te: bool = False) -> bool:
    """Wrap TE's Linear impls and sweep live modules (idempotent). Returns whether installed.

    Without ``import_te`` does nothing until TE's ``module.linear`` is imported (``te_inductor``
    calls this on import, at the start of every Dynamo compile and on every compile).
    Refuses (returns ``False``, logs a warning once, keeps :func:`refused_reason`) when
    :func:`unsafe_reason` finds the TE layout not as expected.
    """
    if _STATE.installed:
        return True
    mod = sys.modules.get(TE_LINEAR_MODULE)
    if mod is None:
        if not import_te:
            return False
        import importlib

        import torch  # noqa: F401  (TE needs torch first)
        mod = importlib.import_module(TE_LINEAR_MODULE)
    with _LOCK:
        if _STATE.installed:
            return True
        reason = unsafe_reason(mod)
        if reason is not None:
            if _STATE.refused != reason:
                log.warning("te_passes: not wrapping TE's Linear impls (%s); an eager step before "
                            "the first compile of a sequence-parallel fp8 te.Linear can make that "
                            "trace fail", reason)
            _STATE.refused = reason
            return False
        usage_reason = usage_unsafe_reason(mod)
        if usage_reason is not None and _STATE.usage_refused != usage_reason:
            log.warning("te_passes: not restoring TE quantizer usage flags after eager Linear calls "
                        "(%s); alternating eager and compiled steps of one module may recompile",
                        usage_reason)
        _STATE.usage_refused = usage_reason
        originals = {n: getattr(mod, n) for n in PER_CALL_GROUP_FIELDS}
        replacements = {n: _wrap_impl(f, PER_CALL_GROUP_FIELDS[n],
                                      PER_CALL_USAGE_FIELDS[n] if usage_reason is None else (),
                                      _WEIGHT_FIELD[n])
                        for n, f in originals.items()}
        for n, f in replacements.items():
            setattr(mod, n, f)
        _STATE.originals, _STATE.replacements = originals, replacements
        _STATE.installed, _STATE.refused = True, None
    _STATE.released_at_install = sweep_live_linear_modules()
    if _STATE.released_at_install:
        log.info("te_passes: released %d amax-reduction group(s) left on te.Linear quantizers by "
                 "earlier eager steps", _STATE.released_at_install)
    return True


def uninstall_amax_group_hooks() -> None:
    """Restore TE's impls where :func:`install_amax_group_hooks` rebound them (tests, debugging)."""
    with _LOCK:
        if not _STATE.installed:
            return
        mod = sys.modules.get(TE_LINEAR_MODULE)
        if mod is not None:
            for n, orig in _STATE.originals.items():
                if getattr(mod, n, None) is _STATE.replacements.get(n):
                    setattr(mod, n, orig)
        _STATE.installed = False
        _STATE.originals, _STATE.replacements = {}, {}


def amax_group_hooks_installed() -> bool:
    """Whether :func:`install_amax_group_hooks` is in effect."""
    return _STATE.installed


def refused_reason() -> str | None:
    """Why the last :func:`install_amax_group_hooks` refused, or ``None``."""
    return _STATE.refused


def usage_refused_reason() -> str | None:
    """Why the installed wrappers do not restore usage flags (:func:`usage_unsafe_reason`), or ``None``."""
    return _STATE.usage_refused


def usage_restore_installed() -> bool:
    """Whether the installed wrappers put quantizer usage flags back after each eager call."""
    mod = sys.modules.get(TE_LINEAR_MODULE)
    return bool(_STATE.installed and mod is not None and all(
        getattr(getattr(mod, n, None), "_te_passes_usage_fields", ()) for n in PER_CALL_USAGE_FIELDS))


def hook_stats() -> dict[str, Any]:
    """``{"installed", "refused", "released_at_install", "released_after_calls",
    "usage_refused", "usage_restored_after_calls"}`` (process totals)."""
    return {"installed": _STATE.installed, "refused": _STATE.refused,
            "released_at_install": _STATE.released_at_install,
            "released_after_calls": _STATE.released_after_calls,
            "usage_refused": _STATE.usage_refused,
            "usage_restored_after_calls": _STATE.usage_restored_after_calls}
