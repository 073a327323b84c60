"""Quantizer usage flags after TE's Linear impls: what
:mod:`te_passes.compat.autocast.amax_groups`' wrappers put back, and the audit that makes it safe.

See docs/internals.md#te_passescompatautocastquantizer_usagepy."""

from __future__ import annotations

import dis
import functools
from typing import Any, Iterable

#: impl function name -> the args-dataclass fields whose quantizer's usage flags the impl writes
#: before each use (docs/internals.md: call sites in TE 2.20.2), restored after the call.
PER_CALL_USAGE_FIELDS: dict[str, tuple[str, ...]] = {
    "_linear_forward_impl": ("input_quantizer", "weight_quantizer", "output_quantizer"),
    "_linear_backward_impl": ("input_quantizer", "weight_quantizer", "grad_input_quantizer",
                              "grad_output_quantizer"),
}
#: impl -> the args field holding the weight whose kind decides whether ``weight_quantizer`` is
#: restored (not for a quantized or distributed weight; see docs/internals.md).
WEIGHT_FIELD: dict[str, str] = {"_linear_forward_impl": "weight", "_linear_backward_impl": "saved_weight"}
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

def impl_code(linear_module: Any, name: str) -> Any:
    fn = getattr(linear_module, name, None)
    fn = getattr(fn, "__wrapped__", fn) if getattr(fn, "_te_passes_amax_hook", False) else fn
    return getattr(fn, "__code__", None)


def _calls_by_name(code: Any, names: Iterable[str]) -> dict[str, int]:
    """How many source lines of ``code`` (nested code objects, e.g. ``_linear_backward_impl``'s
    ``wgrad_gemm`` closure, included) load each of ``names`` as an attribute or global: call
    sites, counted by line so that bytecode the compiler duplicates (``finally`` bodies) counts once."""
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
    """Why restoring usage flags after TE's Linear impls would not be proven safe, or ``None``."""
    for name, audited in AUDITED_USAGE_CALLS.items():
        code = impl_code(linear_module, name)
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


def usage_targets(args: Any, fields: tuple[str, ...], weight_field: str | None) -> list | None:
    """The objects TE's ``set_usage`` writes to for the quantizers in ``fields`` of ``args``
    (a ``DebugQuantizer``'s ``parent_quantizer``; a DebugQuantizer around no quantizer is a
    per-call object and skipped), or ``None`` when there are none."""
    out = []
    for f in fields:
        q = getattr(args, f, None)
        if q is None or f == "weight_quantizer" and weight_field is not None and _weight_not_plain(args, weight_field):
            continue
        t = getattr(q, "parent_quantizer", q)
        if t is not None:
            out.append(t)
    return out or None


def _weight_not_plain(args: Any, weight_field: str) -> bool:
    # A quantized weight (primary fp8 parameters: TE uses / saves the parameter's own quantizer,
    # linear.py:573/1028) or a distributed one (is_distributed_weight, distributed_weight.py:62).
    w = getattr(args, weight_field, None)
    if getattr(args, "is_weight_param_quantized", False) or getattr(w, "is_distributed_weight", False):
        return True
    storage = _quantized_storage_type()
    return storage is not None and isinstance(w, storage)


@functools.lru_cache(maxsize=None)
def _quantized_storage_type() -> type | None:
    """TE's ``QuantizedTensorStorage``, imported once (``None`` where TE's layout changed: then nothing is restored)."""
    try:
        from transformer_engine.pytorch.quantized_tensor import QuantizedTensorStorage
    except ImportError:  # pragma: no cover - TE layout changed
        return None
    return QuantizedTensorStorage
