"""What TE's op impls read from TE's process state while they run: the inventory, what compiled
code gives each read, and the bytecode check that an installed TE's impls read nothing else
(:func:`runtime_state_refusal`). Docs: docs/design.md "TE global state read at run time".
"""

from __future__ import annotations

import collections
import dataclasses
import dis
import functools
import types
from typing import Any, Iterable, Iterator, Mapping, Sequence

from te_passes.te.version import SUPPORTED_TE, is_supported, te_version

#: How compiled code gets the value a read would see under the user's ``te.autocast``: ``"autocast"``
#: (set around the compiled call, ``runtime.te_patches.recipe_state``), ``"process"`` (a process-wide
#: value, the same eager and compiled), ``"ub_guard"`` (UB registry changes recompile), ``"constant"``.
DELIVERIES: tuple[str, ...] = ("autocast", "process", "ub_guard", "constant")

#: ``FP8GlobalStateManager.quantization_state`` fields ``te.autocast`` sets, and the runtime around a compiled call.
AUTOCAST_FIELDS: tuple[str, ...] = ("fp8_enabled", "fp8_calibration", "fp8_recipe", "fp8_distributed_group")


@dataclasses.dataclass(frozen=True)
class ImplRef:
    """A TE function whose run-time reads are inventoried (``path``: relative to ``transformer_engine/pytorch``)."""

    key: str
    module: str
    qualname: str
    path: str
    role: str  # "impl" (called by compiled code) or "helper" (called by an impl)


@dataclasses.dataclass(frozen=True)
class StateRead:
    """One read of TE process state inside an inventoried function."""

    impl: str
    line: int
    accessor: str
    expr: str
    state: str
    when: str
    eager: str
    compiled_before: str
    delivery: str


_LINEAR = "transformer_engine.pytorch.module.linear"
_DPA = "transformer_engine.pytorch.attention.dot_product_attention.backends"

#: Every inventoried function.
IMPLS: Mapping[str, ImplRef] = {r.key: r for r in (
    ImplRef("linear.forward", _LINEAR, "_linear_forward_impl", "module/linear.py", "impl"),
    ImplRef("linear.backward", _LINEAR, "_linear_backward_impl", "module/linear.py", "impl"),
    ImplRef("fused_attn.forward", _DPA, "_fused_attn_forward_impl",
            "attention/dot_product_attention/backends.py", "impl"),
    ImplRef("fused_attn.backward", _DPA, "_fused_attn_backward_impl",
            "attention/dot_product_attention/backends.py", "impl"),
    ImplRef("norm.apply_normalization", "transformer_engine.pytorch.module._common", "apply_normalization",
            "module/_common.py", "impl"),
    ImplRef("quantization.get_fp8_recipe", "transformer_engine.pytorch.quantization",
            "FP8GlobalStateManager.get_fp8_recipe", "quantization.py", "helper"),
    ImplRef("distributed.is_fp8_activation_recompute_enabled", "transformer_engine.pytorch.distributed",
            "is_fp8_activation_recompute_enabled", "distributed.py", "helper"),
    ImplRef("distributed.in_fp8_activation_recompute_phase", "transformer_engine.pytorch.distributed",
            "in_fp8_activation_recompute_phase", "distributed.py", "helper"),
    ImplRef("graph.is_graph_capturing", "transformer_engine.pytorch.graph", "is_graph_capturing", "graph.py",
            "helper"),
    ImplRef("cpu_offload.is_cpu_offload_enabled", "transformer_engine.pytorch.cpu_offload",
            "is_cpu_offload_enabled", "cpu_offload.py", "helper"),
)}

#: The impls each TE op family's compiled calls run (the ``"helper"`` ones belong to every family).
FAMILY_IMPLS: Mapping[str, tuple[str, ...]] = {
    "linear": ("linear.forward", "linear.backward"),
    "fused_attn": ("fused_attn.forward", "fused_attn.backward"),
}

_DEFAULT = "TE's default recipe (get_default_fp8_recipe: DelayedScaling on Hopper, MXFP8 on Blackwell)"
_R = "the te.autocast recipe"

#: The inventory: every read of TE process state in :data:`IMPLS` (TE 2.20.2 line numbers).
READS: tuple[StateRead, ...] = (
    # --- linear forward (module/linear.py _linear_forward_impl)
    StateRead("linear.forward", 414, "FP8GlobalStateManager", "FP8GlobalStateManager.get_fp8_recipe().custom()",
              "recipe", "save_original_input with an input quantizer of class Float8Quantizer",
              f"{_R}: CustomRecipe warns and drops save_original_input", f"{_DEFAULT}: CustomRecipe raised "
              "'DelayedScaling recipe is not supported with save_original_input'", "autocast"),
    StateRead("linear.forward", 457, "get_ub", "get_ub(ub_name + '_fprop', fp8)", "Userbuffers communicator",
              "ub_overlap_rs_fprop", "the registry's communicator", "the same (guarded)", "ub_guard"),
    StateRead("linear.forward", 460, "get_ub", "get_ub(ub_name + '_fprop', fp8)", "Userbuffers communicator",
              "ub_overlap_ag_fprop", "the registry's communicator", "the same (guarded)", "ub_guard"),
    StateRead("linear.forward", 538, "is_cpu_offload_enabled", "is_cpu_offload_enabled()", "CPU offload",
              "always", "TE's offload synchronizer", "the same (TE keeps CPU offload out of the op path)",
              "process"),
    StateRead("linear.forward", 568, "is_fp8_activation_recompute_enabled",
              "is_fp8_activation_recompute_enabled()", "fp8_enabled in a TE checkpoint region",
              "fp8 weight quantizer without column-wise usage",
              "True inside te.distributed.checkpoint with fp8 on",
              "fp8_enabled False when te.autocast was inside the compiled function", "autocast"),
    StateRead("linear.forward", 569, "in_fp8_activation_recompute_phase", "in_fp8_activation_recompute_phase()",
              "activation-recompute phase", "as line 568", "TE's process flag", "the same", "process"),
    StateRead("linear.forward", 609, "_2X_ACC_FPROP", "use_split_accumulator = _2X_ACC_FPROP",
              "module default (base.py)", "not fp8, or a recipe without fp8_gemm_fprop", "False", "False",
              "constant"),
    StateRead("linear.forward", 611, "FP8GlobalStateManager", "FP8GlobalStateManager.get_fp8_recipe()"
              ".fp8_gemm_fprop.use_split_accumulator", "recipe", "fp8",
              f"{_R}'s (Float8BlockScaling: True)", f"{_DEFAULT}'s (DelayedScaling: False)", "autocast"),
    # --- linear backward (_linear_backward_impl): no recipe read (dgrad/wgrad flags are args fields)
    *(StateRead("linear.backward", line, "get_ub", f"get_ub(ub_name + '{suffix}', fp8)", "Userbuffers communicator",
                "a UB dgrad/wgrad overlap flag", "the registry's communicator", "the same (guarded)", "ub_guard")
      for line, suffix in ((1211, "_dgrad"), (1216, "_dgrad"), (1222, "_dgrad"), (1227, "_wgrad"),
                           (1542, "_wgrad"))),
    # --- fused attention forward (backends.py _fused_attn_forward_impl)
    StateRead("fused_attn.forward", 1601, "is_cpu_offload_enabled", "is_cpu_offload_enabled()", "CPU offload",
              "always", "TE's offload synchronizer", "the same", "process"),
    StateRead("fused_attn.forward", 1606, "FP8GlobalStateManager", "FP8GlobalStateManager.get_fp8_recipe()",
              "recipe", "fp8 (fp8_meta['local_recipes'] overrides it)", _R,
              f"{_DEFAULT}; outside fp8 the default is built per call", "autocast"),
    StateRead("fused_attn.forward", 1625, "os", "int(os.getenv('NVTE_FP8_DPA_BWD', '1'))", "environment",
              "fp8", "the process environment at the call", "the same", "process"),
    StateRead("fused_attn.forward", 1717, "is_graph_capturing", "is_graph_capturing()",
              "make_graphed_callables capture", "not fp8", "TE's process flag", "the same", "process"),
    StateRead("fused_attn.forward", 1806, "is_graph_capturing", "is_graph_capturing()",
              "make_graphed_callables capture", "fp8", "TE's process flag", "the same", "process"),
    StateRead("fused_attn.forward", 1816, "is_cpu_offload_enabled", "is_cpu_offload_enabled()", "CPU offload",
              "always", "TE's offload synchronizer", "the same", "process"),
    StateRead("fused_attn.forward", 1816, "NVTE_CPU_OFFLOAD_V1", "NVTE_CPU_OFFLOAD_V1",
              "environment at TE's import (cpu_offload.py:28)", "always", "fixed at import", "the same", "constant"),
    # --- fused attention backward (_fused_attn_backward_impl)
    StateRead("fused_attn.backward", 2164, "is_graph_capturing", "is_graph_capturing()",
              "make_graphed_callables capture", "fp8", "TE's process flag", "the same", "process"),
    StateRead("fused_attn.backward", 2233, "is_graph_capturing", "is_graph_capturing()",
              "make_graphed_callables capture", "not fp8", "TE's process flag", "the same", "process"),
    # --- helpers the impls call
    *(StateRead("quantization.get_fp8_recipe", line, "cls", "cls.quantization_state.fp8_recipe", "recipe",
                "always", _R, "None (no autocast around the compiled call)", "autocast") for line in (609, 610)),
    StateRead("quantization.get_fp8_recipe", 611, "get_default_fp8_recipe", "get_default_fp8_recipe()",
              "device capability", "no recipe set", "not reached inside te.autocast", _DEFAULT, "autocast"),
    StateRead("distributed.is_fp8_activation_recompute_enabled", 281, "_IN_ACTIVATION_RECOMPUTE_REGION",
              "_IN_ACTIVATION_RECOMPUTE_REGION", "TE checkpoint region", "always", "TE's process flag", "the same",
              "process"),
    StateRead("distributed.is_fp8_activation_recompute_enabled", 281, "FP8GlobalStateManager",
              "FP8GlobalStateManager.is_fp8_enabled()", "fp8_enabled", "in a checkpoint region", "True",
              "False when te.autocast was inside the compiled function", "autocast"),
    StateRead("distributed.in_fp8_activation_recompute_phase", 286, "_ACTIVATION_RECOMPUTE_PHASE",
              "_ACTIVATION_RECOMPUTE_PHASE", "activation-recompute phase", "always", "TE's process flag", "the same",
              "process"),
    StateRead("graph.is_graph_capturing", 68, "_IS_GRAPH_CAPTURING", "_IS_GRAPH_CAPTURING",
              "make_graphed_callables capture", "always", "TE's process flag", "the same", "process"),
    StateRead("cpu_offload.is_cpu_offload_enabled", 35, "NVTE_CPU_OFFLOAD_V1", "NVTE_CPU_OFFLOAD_V1",
              "environment at TE's import", "always", "fixed at import", "the same", "constant"),
    StateRead("cpu_offload.is_cpu_offload_enabled", 36, "v1_code_path", "v1_code_path.is_cpu_offload_enabled()",
              "CPU offload (v1)", "NVTE_CPU_OFFLOAD_V1=1", "TE's offload state", "the same", "process"),
    StateRead("cpu_offload.is_cpu_offload_enabled", 37, "OFFLOAD_SYNCHRONIZER", "OFFLOAD_SYNCHRONIZER is not None",
              "CPU offload", "always", "TE's offload synchronizer", "the same", "process"),
)

#: Environment variables TE's C++ library reads inside the kernels the impls launch (``"process"``; not scanned).
NATIVE_ENV: tuple[str, ...] = (
    "NVTE_NORM_FWD_USE_CUDNN", "NVTE_NORM_BWD_USE_CUDNN", "NVTE_ZERO_CENTERED_GAMMA_IN_WTYPE",
    "NVTE_CUDNN_MXFP8_NORM_OUTPUT_IN_INPUT_DTYPE", "NVTE_EXT_MARGIN_SM", "NVTE_FUSED_ATTN_CACHE_DEBUG",
)

#: Global names whose load in an inventoried function is a read of TE process state (all in :data:`READS`).
STATE_NAMES: frozenset[str] = frozenset({
    "FP8GlobalStateManager", "get_default_fp8_recipe", "get_fp8_recipe", "is_cpu_offload_enabled",
    "is_fp8_activation_recompute_enabled", "in_fp8_activation_recompute_phase", "is_graph_capturing",
    "get_ub", "get_ub_is_fp8", "NVTE_CPU_OFFLOAD_V1", "_2X_ACC_FPROP", "_2X_ACC_DGRAD", "_2X_ACC_WGRAD",
    "TEDebugState", "os", "_IN_ACTIVATION_RECOMPUTE_REGION", "_ACTIVATION_RECOMPUTE_PHASE",
    "_IS_GRAPH_CAPTURING", "OFFLOAD_SYNCHRONIZER", "v1_code_path", "quantization_state",
    "get_autocast_state", "is_first_fp8_module",
})


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _codes(c)


def scan_reads(fn: Any) -> collections.Counter:
    """Count the loads of :data:`STATE_NAMES` (and ``cls.quantization_state`` reads, as ``cls``) in
    ``fn``'s bytecode and its nested code objects; ``TypeError`` when ``fn`` has no Python code."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        raise TypeError(f"{fn!r} has no Python code to scan")
    found: collections.Counter = collections.Counter()
    for c in _codes(code):
        prev = None
        for ins in dis.get_instructions(c):
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF") and ins.argval in STATE_NAMES:
                found[ins.argval] += 1
            elif ins.opname in ("LOAD_FAST", "LOAD_DEREF") and ins.argval == "cls":
                prev = "cls"
                continue
            elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and prev == "cls" and ins.argval == "quantization_state":
                found["cls"] += 1
            prev = None
    return found


def expected_reads(impl: str) -> collections.Counter:
    """``Counter({accessor: count})`` of the inventory for :data:`IMPLS` key ``impl`` (else ``KeyError``)."""
    IMPLS[impl]
    return collections.Counter(r.accessor for r in READS if r.impl == impl)


def resolve(ref: ImplRef) -> Any:
    """The live function of ``ref`` (imports TE's module), unwrapped through ``__wrapped__`` (te_passes'
    hooks) down to TE's. Raises ``ImportError`` / ``AttributeError`` when it is not there,
    ``TypeError`` when what the name holds, unwrapped, is not TE's ``ref.qualname``."""
    import importlib

    import torch  # noqa: F401  (TE needs torch first)

    obj: Any = importlib.import_module(ref.module)
    for part in ref.qualname.split("."):
        obj = getattr(obj, part)
    seen = 0
    while hasattr(getattr(obj, "__func__", obj), "__wrapped__") and seen < 16:
        obj, seen = getattr(obj, "__func__", obj).__wrapped__, seen + 1
    fn = getattr(obj, "__func__", obj)
    if getattr(fn, "__module__", None) != ref.module or getattr(fn, "__qualname__", None) != ref.qualname:
        raise TypeError(f"{ref.module}.{ref.qualname} holds {getattr(fn, '__module__', '?')}."
                        f"{getattr(fn, '__qualname__', fn)!s}, not TE's function")
    return obj


def unknown_reads(impl: str, fn: Any = None) -> list[str]:
    """Differences between what ``impl``'s code reads (:func:`scan_reads` of ``fn``, default the
    live TE function) and the inventory: one sentence per accessor, empty when they agree."""
    ref = IMPLS[impl]
    if fn is None:
        try:
            fn = resolve(ref)
        except (ImportError, AttributeError, TypeError) as e:
            return [f"{ref.module}.{ref.qualname} is not there ({type(e).__name__}: {e})"]
    got, want = scan_reads(fn), expected_reads(impl)
    out = []
    for name in sorted(set(got) | set(want)):
        if got[name] != want[name]:
            out.append(f"{ref.module}.{ref.qualname} loads {name} {got[name]} time(s), the inventory "
                       f"lists {want[name]}")
    return out


def runtime_state_refusal(families: Iterable[str], v: str | None = None,
                          impls: Mapping[str, Sequence[Any]] | None = None) -> str | None:
    """Why compiled calls of these TE op families (``"linear"``, ``"fused_attn"``, ...) cannot be
    given the user's ``te.autocast`` state on TE ``v`` (default: installed), or ``None``."""
    v = te_version() if v is None else v
    if not is_supported(v):
        return (f"TE {v}: the TE state its impls read at run time is inventoried for TE "
                f"{', '.join(f'{a}.{b}.x' for a, b in sorted(SUPPORTED_TE))} only "
                "(te_passes.compat.te220.runtime_reads)")
    keys = [k for k, r in IMPLS.items() if r.role == "helper"]
    impls = impls or {}
    for fam in sorted(set(families)):
        if fam in FAMILY_IMPLS:
            keys.extend(FAMILY_IMPLS[fam])
            continue
        if fam not in impls:
            return (f"TE op family {fam!r}: the TE state its impls read at run time is not inventoried "
                    "(te_passes.compat.te220.runtime_reads.FAMILY_IMPLS) and its impls are unknown")
        for fn in impls[fam]:
            try:
                found = scan_reads(fn)
            except TypeError as e:
                return f"TE op family {fam!r}: {e}"
            if found:
                return (f"TE op family {fam!r}: its impl {getattr(fn, '__qualname__', fn)} reads TE state "
                        f"({', '.join(sorted(found))}) and is not inventoried (te_passes.compat.te220.runtime_reads)")
    problems = [p for k in keys for p in _unknown_reads(k)]
    if problems:
        return f"TE {v}: its impls read TE state the inventory does not list: " + "; ".join(problems)
    return None


@functools.lru_cache(maxsize=None)
def _unknown_reads(key: str) -> tuple[str, ...]:
    return tuple(unknown_reads(key))
