"""Untouched TE models in one graph under ``te_inductor``: polyfills of TE's ``torch.compiler.disable``\\ d forwards.

See docs/internals.md#te_passescompatuntouchedpolyfillspy and docs/untouched.md.."""

from __future__ import annotations

import dataclasses
import importlib
import sys
import threading
import types
from typing import Any, Callable

import torch
from torch._dynamo.comptime import comptime

from te_passes.config import UNTOUCHED_NORM_CHOICES, UNTOUCHED_NORM_ENV, TePassesOptionError, unwrapped, untouched_norm
from te_passes.compat.delayed_scaling import linear as delayed_linear
from te_passes.ops.fused_attn import install_fused_attention_op
from te_passes.ops.shared_linear import owner_delayed_slots
from te_passes.ops.te_act import te_activation
from te_passes.ops.te_norm import te_norm
from te_passes.compat.autocast import recipe_state
from te_passes.compat.untouched.attention import (dpa_fused_forward, dpa_problem, fused_attention_call_problem,
                                                   fused_attention_forward, unpack_qkv)
from te_passes.compat.untouched.gate import (BACKEND_MARK, ENV, OPTION, PREPARE_FIX, Island, island_fix_for, note_island,  # noqa: F401
                                              backend_wants_polyfills, clear_island_records, island_records,
                                              untouched_enabled)
from te_passes.compat.untouched.rope_norm import install_rope_norm_polyfills, named_island
from te_passes.compat.untouched.state import (BUILD_CONTEXTS, STATE_ATTR, UntouchedState, active_frames,  # noqa: F401
                                               run_eager, prepare_layernorm_linear,
                                               prepare_layernorm_mlp, register_start_callback, on_compile_start,
                                               prepare_te_module, prime_recipe)
from te_passes.te.norm_act import activation, normalize
from te_passes.compat.delayed_scaling.scaling import te_inductor_tracing
from te_passes.te.untouched_rules import DELAYED_SCALING_FIX, norm_call_problem

from te_passes.te.version import is_supported, te_version

#: ``TE_PASSES_UNTOUCHED_NORM``: ``te`` (default: TE's own norm and LayerNormMLP activation kernels as
#: the ``te_passes::te_norm_fwd`` / ``te_act_fwd`` ops; TE eager's numerics, measured as fast as the
#: torch-ops norm: docs/untouched.md) or ``torch`` (LayerNorm / RMSNorm and the activation in torch
#: ops, fused by Inductor; also what CPU Inductor runs need: TE's kernels are CUDA-only).
NORM_ENV = UNTOUCHED_NORM_ENV  # checked with the options (te_passes.config.check_environment)
NORM_CHOICES = UNTOUCHED_NORM_CHOICES

#: ``disabled_f`` targets: TE function qualname -> (attribute path under ``transformer_engine.pytorch``, TE module).
TARGETS: dict[str, tuple[str, str, str]] = {
    "LayerNormLinear.forward": ("transformer_engine.pytorch.module.layernorm_linear", "LayerNormLinear",
                                "te.LayerNormLinear"),
    "LayerNormMLP.forward": ("transformer_engine.pytorch.module.layernorm_mlp", "LayerNormMLP", "te.LayerNormMLP"),
    "FusedAttention.forward": ("transformer_engine.pytorch.attention.dot_product_attention.backends",
                               "FusedAttention", "te.FusedAttention"),
    # no_torch_dynamo(when=_needs_eager_dpa): traced by TE itself; the polyfill replaces the inner
    # function with TE's fused attention op (no backend selection, no lazy state: no recompile)
    "DotProductAttention.forward": ("transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention",
                                    "DotProductAttention", "te.DotProductAttention"),
}


# --------------------------------------------------------------------------- shared forwards
def norm_impl(environ: Any = None) -> str:
    """``TE_PASSES_UNTOUCHED_NORM`` (``te`` default, or ``torch``); raises ``TePassesOptionError`` (as Dynamo
    re-raises it unwrapped: this runs while Dynamo traces)."""
    try:
        return untouched_norm(environ)
    except TePassesOptionError as e:
        raise unwrapped(e) from None


@torch._dynamo.assume_constant_result
def _norm_choice() -> str:
    return norm_impl()


def _te_kernels() -> bool:
    return (_norm_choice() if torch.compiler.is_compiling() else norm_impl()) == "te"


def _norm(mod: Any, inp: torch.Tensor) -> torch.Tensor:
    if _te_kernels():
        return te_norm(inp, mod.layer_norm_weight, mod.layer_norm_bias, mod.eps, mod.normalization,
                       mod.zero_centered_gamma)
    return normalize(inp, mod.layer_norm_weight, mod.layer_norm_bias, mod.eps, mod.normalization,
                     mod.zero_centered_gamma)


def layernorm_linear_forward(mod: Any, gemm: torch.nn.Module, inp: torch.Tensor, is_first_microbatch: Any = None,
                             fp8_output: bool = False, fp8_grad: bool = False) -> Any:
    """``te.LayerNormLinear`` ``mod``'s forward as norm + ``gemm`` (its hidden ``te.Linear``):
    ``inp`` [..., in_features] -> [..., out_features] (or ``(out, bias)`` with ``return_bias``).
    The one implementation behind the polyfill and ``compile_friendly``."""
    return gemm(_norm(mod, inp), is_first_microbatch=is_first_microbatch, fp8_output=fp8_output, fp8_grad=fp8_grad)


def layernorm_mlp_forward(mod: Any, fc1: torch.nn.Module, fc2: torch.nn.Module, inp: torch.Tensor,
                          is_first_microbatch: Any = None) -> Any:
    """``te.LayerNormMLP`` ``mod``'s forward as norm + ``fc1`` + activation + ``fc2``:
    ``inp`` [..., hidden] -> [..., hidden] (or ``(out, fc2_bias)`` with ``return_bias``)."""
    h = fc1(_norm(mod, inp), is_first_microbatch=is_first_microbatch)
    act = te_activation if _te_kernels() else activation
    return fc2(act(h, mod.activation, mod.activation_params), is_first_microbatch=is_first_microbatch)


# --------------------------------------------------------------------------- the polyfills
_lock = threading.Lock()
_COPIES: dict[str, Callable[..., Any]] = {}   # TE's function, disabled: the other backends' path
_ISLAND_FNS: dict[str, Callable[..., Any]] = {}  # TE's function, disabled, named: te_inductor's islands


def _disabled(f: Callable[..., Any], label: str | None) -> Callable[..., Any]:
    return torch._dynamo.disable(f, recursive=True) if label is None else named_island(f, label)


def _delayed_problem(mod: Any, st: UntouchedState) -> str | None:
    """Under DelayedScaling (trace time): why the hidden te.Linears cannot run on ``mod``'s own
    quantizers (TE's op pair not installed, or ``mod``'s state not registered in TE's global amax
    buffers before the trace), or ``None``. Read only when the recipe is DelayedScaling."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as manager

    if not manager.is_fp8_enabled() or not manager.get_fp8_recipe().delayed():
        return None
    if not delayed_linear.installed():
        return (f"DelayedScaling: te.Linear's DelayedScaling op pair is not installed "
                f"({delayed_linear.refused_reason()}): {DELAYED_SCALING_FIX}")
    if not te_inductor_tracing():
        return f"DelayedScaling: the backend does not take te_passes' DelayedScaling ops: {DELAYED_SCALING_FIX}"
    if any(owner_delayed_slots(g, manager) is None for g in st.gemms):
        return ("its DelayedScaling state was not registered in TE's global amax buffers before the trace "
                f"(the module is not reachable from the compiled frame): {PREPARE_FIX}")
    return None


def _layernorm_linear(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False):
    if not active_frames():
        return _COPIES["LayerNormLinear.forward"](self, inp, is_first_microbatch, fp8_output, fp8_grad)
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    qstate = FP8GlobalStateManager.quantization_state
    fp8, recipe = qstate.fp8_enabled, qstate.fp8_recipe  # noqa: F841 - read by _prepare (comptime)
    comptime(prepare_layernorm_linear)
    st = getattr(self, STATE_ATTR)
    problem = st.problem or norm_call_problem(_delayed_problem(self, st))
    if problem is not None:
        note_island("te.LayerNormLinear", self.name or "", problem, island_fix_for(problem))
        return _ISLAND_FNS["LayerNormLinear.forward"](self, inp, is_first_microbatch, fp8_output, fp8_grad)
    (gemm,) = st.gemms
    gemm.training = self.training
    return layernorm_linear_forward(self, gemm, inp, is_first_microbatch, fp8_output, fp8_grad)


def _layernorm_mlp(self, inp, is_first_microbatch=None):
    if not active_frames():
        return _COPIES["LayerNormMLP.forward"](self, inp, is_first_microbatch)
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    qstate = FP8GlobalStateManager.quantization_state
    fp8, recipe = qstate.fp8_enabled, qstate.fp8_recipe  # noqa: F841 - read by _prepare (comptime)
    comptime(prepare_layernorm_mlp)
    st = getattr(self, STATE_ATTR)
    problem = st.problem or norm_call_problem(_delayed_problem(self, st))
    if problem is not None:
        note_island("te.LayerNormMLP", self.name or "", problem, island_fix_for(problem))
        return _ISLAND_FNS["LayerNormMLP.forward"](self, inp, is_first_microbatch)
    fc1, fc2 = st.gemms
    fc1.training = self.training
    fc2.training = self.training
    return layernorm_mlp_forward(self, fc1, fc2, inp, is_first_microbatch)


def _fused_attention(self, query_layer, key_layer, value_layer, qkv_layout="sbh3d", cu_seqlens_q=None,
                     cu_seqlens_kv=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, max_seqlen_q=None,
                     max_seqlen_kv=None, attn_mask_type="causal", attention_mask=None, window_size=None,
                     bottom_right_diagonal=None, fused_attention_backend=None, core_attention_bias_type="no_bias",
                     core_attention_bias=None, fast_zero_fill=True, cp_group=None, cp_global_ranks=None,
                     cp_stream=None, cp_comm_type="p2p", fp8=False, fp8_meta=None, quantizers=None,
                     pad_between_seqs=False, inference_params=None, softmax_offset=None, fp8_output=False,
                     score_mod=None, score_mod_bprop=None, score_mod_tensors=None, score_mod_bprop_tensors=None,
                     packed_qkv=None, packed_kv=None, bf16_backward=False, load_balancing_strategy=None):
    # TE's FusedAttention.forward signature (attention/dot_product_attention/backends.py); the
    # None defaults of fused_attention_backend / load_balancing_strategy are never passed by DPA.
    call = dict(qkv_layout=qkv_layout, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_kv_padded,
                max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv, attn_mask_type=attn_mask_type,
                attention_mask=attention_mask, window_size=window_size, bottom_right_diagonal=bottom_right_diagonal,
                fused_attention_backend=fused_attention_backend, core_attention_bias_type=core_attention_bias_type,
                core_attention_bias=core_attention_bias, fast_zero_fill=fast_zero_fill, cp_group=cp_group,
                cp_global_ranks=cp_global_ranks, cp_stream=cp_stream, cp_comm_type=cp_comm_type, fp8=fp8,
                fp8_meta=fp8_meta, quantizers=quantizers, pad_between_seqs=pad_between_seqs,
                inference_params=inference_params, softmax_offset=softmax_offset, fp8_output=fp8_output,
                score_mod=score_mod, score_mod_bprop=score_mod_bprop, score_mod_tensors=score_mod_tensors,
                score_mod_bprop_tensors=score_mod_bprop_tensors, packed_qkv=packed_qkv, packed_kv=packed_kv,
                bf16_backward=bf16_backward)
    if load_balancing_strategy is not None:
        call["load_balancing_strategy"] = load_balancing_strategy
    if fused_attention_backend is None:
        del call["fused_attention_backend"]
    if not active_frames():
        return _COPIES["FusedAttention.forward"](self, query_layer, key_layer, value_layer, **call)
    problem = fused_attention_call_problem(self, query_layer, key_layer, value_layer, call)
    if problem is not None:
        note_island("te.FusedAttention", f"layer_number={self.layer_number}", problem, island_fix_for(problem))
        return _ISLAND_FNS["FusedAttention.forward"](self, query_layer, key_layer, value_layer, **call)
    return fused_attention_forward(self, query_layer, key_layer, value_layer, call)


def _dot_product_attention(self, query_layer=None, key_layer=None, value_layer=None, attention_mask=None,
                           qkv_format=None, *args, **kwargs):
    te_forward = _COPIES["DotProductAttention.forward"]
    if args or not active_frames():
        return te_forward(self, query_layer, key_layer, value_layer, attention_mask, qkv_format, *args, **kwargs)
    kw = dict(kwargs)
    mask = kw.pop("attn_mask_type", None) or self.attn_mask_type
    qkv_layer, kv_layer = kw.pop("qkv_layer", None), kw.pop("kv_layer", None)
    interleave = kw.pop("qkv_interleave_dim", -3)
    fmt = qkv_format or self.qkv_format
    if fmt in ("sbhd", "bshd"):
        q, k, v = unpack_qkv(fmt, qkv_layer, kv_layer, query_layer, key_layer, value_layer, interleave, kw)
        if dpa_problem(self, fmt, mask, attention_mask, q, k, v, kw) is None:
            return dpa_fused_forward(self, fmt, mask, q, k, v, kw)
    # TE's own (traced) forward: its backend choice; FusedAttention.forward then meets its polyfill
    return te_forward(self, query_layer, key_layer, value_layer, attention_mask, qkv_format, *args, **kwargs)


def _noop_cat(tensors, dim=0):
    if not active_frames():
        return _COPIES["noop_cat"](tensors, dim)
    # TE's _NoopCatFunc compares storages / data_ptrs (not traceable); torch.cat gives the same
    # values (a copy of the weight splits per call, as compile_friendly's hidden te.Linear)
    if len(tensors) == 1:
        return tensors[0]
    return torch.cat(tensors, dim=dim)


def _default_recipe_polyfill():
    if not active_frames():
        return _COPIES["get_default_fp8_recipe"]()
    comptime(_build_default_recipe)
    return _DEFAULT_RECIPE[0]


_DEFAULT_RECIPE: list[Any] = []


def _build_default_recipe(ctx: Any) -> None:
    """Comptime: TE's default recipe, built once eagerly (TE asserts it is not built while compiling)
    and primed (cached repr, autocast key)."""
    if _DEFAULT_RECIPE:
        return
    with run_eager():
        r = _COPIES["get_default_fp8_recipe"]()
    prime_recipe(r)
    _DEFAULT_RECIPE.append(r)


_POLYFILLS: dict[str, Callable[..., Any]] = {
    "LayerNormLinear.forward": _layernorm_linear,
    "LayerNormMLP.forward": _layernorm_mlp,
    "FusedAttention.forward": _fused_attention,
    "DotProductAttention.forward": _dot_product_attention,
}


@dataclasses.dataclass(frozen=True)
class PolyfillStatus:
    """One polyfill target: ``installed`` or not, and why not (``reason``)."""

    target: str
    installed: bool
    reason: str | None = None


_STATUS: dict[str, PolyfillStatus] = {}


def polyfill_status() -> dict[str, PolyfillStatus]:
    """What :func:`install_untouched_polyfills` did, per target (empty before it ran with TE)."""
    return dict(_STATUS)


def closure_layout(fn: Any) -> tuple[Callable[..., Any], Callable[..., Any]] | str:
    """``(target, f)`` from TE's ``no_torch_dynamo`` wrapper ``fn`` (``transformer_engine/pytorch/
    jit.py``), or why ``fn`` has another layout. Plain (``co_freevars == ('disabled_f', 'f')``):
    the target is ``disabled_f`` (``torch.compiler.disable``\\ d ``f``); conditional (``when=``:
    ``disabled_report_and_run``, ``f``, ``parameter_names``, ``when``): the target is ``f``, which
    the wrapper calls when TE's ``when`` finds nothing against tracing."""
    code = getattr(fn, "__code__", None)
    if code is None or fn.__closure__ is None:
        return f"{getattr(fn, '__qualname__', fn)!r} is not a closure (TE made it traceable or wraps it otherwise)"
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__)))
    if set(cells) == {"disabled_f", "f"}:
        if not getattr(cells["disabled_f"], "_torchdynamo_disable", False):
            return f"{fn.__qualname__}'s disabled_f is not torch.compiler.disable'd"
        return cells["disabled_f"], cells["f"]
    if set(cells) == {"disabled_report_and_run", "f", "parameter_names", "when"}:
        return cells["f"], cells["f"]
    return f"{fn.__qualname__} closes over {code.co_freevars}, not TE's no_torch_dynamo layout"


def _copy(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` with another identity (same code, globals, defaults, closure): Dynamo traces it as TE's
    own function, never as the polyfill registered for ``f``."""
    g = types.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    g.__kwdefaults__ = dict(f.__kwdefaults__ or {}) or None
    g.__qualname__, g.__doc__, g.__module__ = f.__qualname__, f.__doc__, f.__module__
    return g


def _te_ships_op(qualname: str) -> str | None:
    """Why TE's own compiled op makes the polyfill unnecessary (TE#3534 / TE#3472), or ``None``."""
    from torch._library.custom_ops import OPDEFS

    names = {"LayerNormLinear.forward": ("layernorm_linear",), "LayerNormMLP.forward": ("layernorm_mlp",),
             "FusedAttention.forward": ("fused_attention", "dot_product_attention"),
             "DotProductAttention.forward": ("fused_attention", "dot_product_attention")}[qualname]
    for op in OPDEFS:
        ns, _, name = op.partition("::")
        if ns == "transformer_engine_compile" and name in names:
            return f"TE ships its own op {op}: stepping aside"
    return None


def install_untouched_polyfills() -> bool:
    """Register the polyfills once (idempotent, thread-safe); ``False`` while TE's modules are not
    imported. Per target, :func:`polyfill_status` says whether it went in and why not (another
    closure layout, TE ships its own op, TE < 2.20 / not supported). Never raises."""
    if "transformer_engine.pytorch" not in sys.modules:
        return False
    with _lock:
        if _STATUS:
            register_start_callback()  # torch._dynamo.reset() clears Dynamo's callbacks
            return any(s.installed for s in _STATUS.values())
        for qualname, (modname, cls_name, _te_module) in TARGETS.items():
            if not is_supported():
                _STATUS[qualname] = PolyfillStatus(qualname, False, f"TE {te_version()} is not a version te_passes "
                                                                    "mirrors")
                continue
            try:
                cls = getattr(importlib.import_module(modname), cls_name)
            except Exception as e:  # noqa: BLE001
                _STATUS[qualname] = PolyfillStatus(qualname, False, f"{modname}.{cls_name}: {type(e).__name__}: {e}")
                continue
            why = _te_ships_op(qualname)
            layout = closure_layout(cls.forward) if why is None else why
            if isinstance(layout, str):
                _STATUS[qualname] = PolyfillStatus(qualname, False, layout)
                continue
            disabled_f, f = layout
            if disabled_f is f:  # conditional wrapper: TE traces f itself; the fallback is a copy of f
                _COPIES[qualname] = _copy(f)
            else:
                _COPIES[qualname] = _disabled(f, None)
                _ISLAND_FNS[qualname] = _disabled(f, qualname)
            try:
                torch.compiler.substitute_in_graph(disabled_f, skip_signature_check=True)(_POLYFILLS[qualname])
            except (TypeError, ValueError) as e:  # someone else registered one
                _STATUS[qualname] = PolyfillStatus(qualname, False, f"substitute_in_graph: {e}")
                continue
            _STATUS[qualname] = PolyfillStatus(qualname, True)
        _install_default_recipe()
        for name, why in (install_rope_norm_polyfills(_te_kernels) if is_supported() else {}).items():
            _STATUS[name] = PolyfillStatus(name, why is None, why)  # RoPE and te.ops norms: rope_norm.py
        install_fused_attention_op(import_te=True)  # the FusedAttention polyfill's op (refusal: refused_reason())
        recipe_state.install_trace_hooks()  # its nodes record the te.autocast state they are traced under
        register_start_callback()
        return any(s.installed for s in _STATUS.values())


def _install_default_recipe() -> None:
    """The plain-function polyfills: ``quantization.get_default_fp8_recipe`` and
    ``module/_common.noop_cat`` (te.Linear's weight splits, e.g. ``MultiheadAttention.qkv``)."""
    for modname, name, poly in (("transformer_engine.pytorch.quantization", "get_default_fp8_recipe",
                                 _default_recipe_polyfill),
                                ("transformer_engine.pytorch.module._common", "noop_cat", _noop_cat)):
        orig = getattr(importlib.import_module(modname), name, None)
        if not isinstance(orig, types.FunctionType):
            _STATUS[name] = PolyfillStatus(name, False, f"{modname} has no {name} function")
            continue
        # a copy with another identity: Dynamo traces it as TE's own (no re-entry into the polyfill)
        _COPIES[name] = _copy(orig)
        try:
            torch.compiler.substitute_in_graph(orig, skip_signature_check=True)(poly)
        except (TypeError, ValueError) as e:
            _STATUS[name] = PolyfillStatus(name, False, f"substitute_in_graph: {e}")
            continue
        _STATUS[name] = PolyfillStatus(name, True)


__all__ = [
    "OPTION", "ENV", "NORM_ENV", "BACKEND_MARK", "Island", "PolyfillStatus", "UntouchedState",
    "install_untouched_polyfills", "polyfill_status", "island_records", "clear_island_records",
    "backend_wants_polyfills", "untouched_enabled", "layernorm_linear_forward", "layernorm_mlp_forward",
    "closure_layout", "norm_impl", "prepare_te_module",
]
