"""Untouched TE models in one graph under ``te_inductor``: polyfills of TE's ``torch.compiler.disable``\\ d forwards.

See docs/internals.md#te_passescompatuntouchedpolyfillspy and docs/untouched.md.."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch._dynamo.comptime import comptime

from te_passes.compat.delayed_scaling import linear as delayed_linear
from te_passes.compat.delayed_scaling.scaling import te_inductor_tracing
from te_passes.ops.shared_linear import owner_delayed_slots
from te_passes.ops.te_act import te_activation
from te_passes.ops.te_norm import te_norm
from te_passes.compat.untouched.attention import (dpa_fused_forward, dpa_problem, fused_attention_call_problem,
                                                   fused_attention_forward, unpack_qkv)
from te_passes.compat.untouched.gate import (ENV, OPTION, PREPARE_FIX, Island, island_fix_for, note_island,  # noqa: F401
                                              clear_island_records, environment_options, island_records,
                                              norm_choice)
from te_passes.compat.untouched.rope_norm import function_copy, named_island
from te_passes.compat.untouched.state import (STATE_ATTR, UntouchedState, active_frames, prepare_layernorm_linear,
                                               prepare_layernorm_mlp, prepare_te_module, prime_recipe, run_eager)
from te_passes.te.norm_act import activation, normalize
from te_passes.compat.te220.untouched_rules import DELAYED_SCALING_FIX, norm_call_problem

#: ``te_passes.untouched_norm`` / ``TE_PASSES_UNTOUCHED_NORM``: ``te`` (default: TE's own norm and LayerNormMLP
#: activation kernels as the ``te_passes::te_norm_fwd`` / ``te_act_fwd`` ops; TE eager's numerics, measured as
#: fast as the torch-ops norm: docs/untouched.md) or ``torch`` (LayerNorm / RMSNorm and the activation in torch
#: ops, fused by Inductor; also what CPU Inductor runs need: TE's kernels are CUDA-only).
NORM_ENV = "TE_PASSES_UNTOUCHED_NORM"

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
def te_kernels() -> bool:
    """Whether the polyfills' norm / activation run TE's kernels: ``te_passes.untouched_norm == "te"`` of the
    frame traced now (a constant in the trace), eagerly that of ``TE_PASSES_UNTOUCHED_NORM``.

    Raises:
        TePassesOptionError: a bad option or ``TE_PASSES_*`` value (unwrapped: Dynamo re-raises it as is)."""
    return (norm_choice() if torch.compiler.is_compiling() else environment_options().untouched_norm) == "te"


def _norm(mod: Any, inp: torch.Tensor) -> torch.Tensor:
    if te_kernels():
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
    act = te_activation if te_kernels() else activation
    return fc2(act(h, mod.activation, mod.activation_params), is_first_microbatch=is_first_microbatch)


# --------------------------------------------------------------------------- the polyfills
@dataclasses.dataclass
class _KeptTE:
    """TE's functions the polyfills run, set by the rows' plans (:func:`keep_te_function`): ``copies``, per
    target TE's own function, as the other backends' frames run it; ``islands``, per target TE's function
    under ``torch._dynamo.disable``, named: te_inductor's islands; ``default_recipe``, TE's default recipe,
    built once eagerly (:func:`_build_default_recipe`)."""

    copies: dict[str, Callable[..., Any]] = dataclasses.field(default_factory=dict)
    islands: dict[str, Callable[..., Any]] = dataclasses.field(default_factory=dict)
    default_recipe: list[Any] = dataclasses.field(default_factory=list)


_KEPT = _KeptTE()


def keep_te_function(target: str, disabled_f: Callable[..., Any], f: Callable[..., Any]) -> None:
    """Keep TE's function for the polyfill of ``target`` (a key of :data:`POLYFILLS` or ``"noop_cat"`` /
    ``"get_default_fp8_recipe"``): ``disabled_f`` is what the polyfill substitutes, ``f`` TE's undisabled
    function (:func:`closure_layout`; the same object for a conditional wrapper or a plain function, whose
    fallback is then a copy of ``f``, else ``f`` under ``torch._dynamo.disable`` plus a named island)."""
    if disabled_f is f:
        _KEPT.copies[target] = function_copy(f)
    else:
        _KEPT.copies[target] = torch._dynamo.disable(f, recursive=True)
        _KEPT.islands[target] = named_island(f, target)


def _delayed_problem(mod: Any, st: UntouchedState) -> str | None:
    """Under DelayedScaling (trace time): why the hidden te.Linears cannot run on ``mod``'s own
    quantizers (TE's op pair not installed, or ``mod``'s state not registered in TE's global amax
    buffers before the trace), or ``None``. Read only when the recipe is DelayedScaling."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as manager

    if not manager.is_fp8_enabled() or not manager.get_fp8_recipe().delayed():
        return None
    if (refused := delayed_linear.refused_reason()) is not None:  # compat/delayed_scaling's rows
        return f"DelayedScaling: te.Linear's DelayedScaling op pair is not installed ({refused}): {DELAYED_SCALING_FIX}"
    if not te_inductor_tracing():  # compat/delayed_scaling's gate: the backends that take its ops
        return f"DelayedScaling: the backend does not take te_passes' DelayedScaling ops: {DELAYED_SCALING_FIX}"
    if any(owner_delayed_slots(g, manager) is None for g in st.gemms):
        return ("its DelayedScaling state was not registered in TE's global amax buffers before the trace "
                f"(the module is not reachable from the compiled frame): {PREPARE_FIX}")
    return None


def _layernorm_linear(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False):
    if not active_frames():
        return _KEPT.copies["LayerNormLinear.forward"](self, inp, is_first_microbatch, fp8_output, fp8_grad)
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    qstate = FP8GlobalStateManager.quantization_state
    fp8, recipe = qstate.fp8_enabled, qstate.fp8_recipe  # noqa: F841 - read by _prepare (comptime)
    comptime(prepare_layernorm_linear)
    st = getattr(self, STATE_ATTR)
    problem = st.problem or norm_call_problem(_delayed_problem(self, st))
    if problem is not None:
        note_island("te.LayerNormLinear", self.name or "", problem, island_fix_for(problem))
        return _KEPT.islands["LayerNormLinear.forward"](self, inp, is_first_microbatch, fp8_output, fp8_grad)
    (gemm,) = st.gemms
    gemm.training = self.training
    return layernorm_linear_forward(self, gemm, inp, is_first_microbatch, fp8_output, fp8_grad)


def _layernorm_mlp(self, inp, is_first_microbatch=None):
    if not active_frames():
        return _KEPT.copies["LayerNormMLP.forward"](self, inp, is_first_microbatch)
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    qstate = FP8GlobalStateManager.quantization_state
    fp8, recipe = qstate.fp8_enabled, qstate.fp8_recipe  # noqa: F841 - read by _prepare (comptime)
    comptime(prepare_layernorm_mlp)
    st = getattr(self, STATE_ATTR)
    problem = st.problem or norm_call_problem(_delayed_problem(self, st))
    if problem is not None:
        note_island("te.LayerNormMLP", self.name or "", problem, island_fix_for(problem))
        return _KEPT.islands["LayerNormMLP.forward"](self, inp, is_first_microbatch)
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
        return _KEPT.copies["FusedAttention.forward"](self, query_layer, key_layer, value_layer, **call)
    problem = fused_attention_call_problem(self, query_layer, key_layer, value_layer, call)
    if problem is not None:
        note_island("te.FusedAttention", f"layer_number={self.layer_number}", problem, island_fix_for(problem))
        return _KEPT.islands["FusedAttention.forward"](self, query_layer, key_layer, value_layer, **call)
    return fused_attention_forward(self, query_layer, key_layer, value_layer, call)


def _dot_product_attention(self, query_layer=None, key_layer=None, value_layer=None, attention_mask=None,
                           qkv_format=None, *args, **kwargs):
    te_forward = _KEPT.copies["DotProductAttention.forward"]
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
        return _KEPT.copies["noop_cat"](tensors, dim)
    # TE's _NoopCatFunc compares storages / data_ptrs (not traceable); torch.cat gives the same
    # values (a copy of the weight splits per call, as compile_friendly's hidden te.Linear)
    if len(tensors) == 1:
        return tensors[0]
    return torch.cat(tensors, dim=dim)


def _default_recipe_polyfill():
    if not active_frames():
        return _KEPT.copies["get_default_fp8_recipe"]()
    comptime(_build_default_recipe)
    return _KEPT.default_recipe[0]


def _build_default_recipe(ctx: Any) -> None:
    """Comptime: TE's default recipe, built once eagerly (TE asserts it is not built while compiling)
    and primed (cached repr, autocast key)."""
    if _KEPT.default_recipe:
        return
    with run_eager():
        r = _KEPT.copies["get_default_fp8_recipe"]()
    prime_recipe(r)
    _KEPT.default_recipe.append(r)


#: TE's disabled forward (``<class>.forward``) -> its polyfill.
POLYFILLS: dict[str, Callable[..., Any]] = {
    "LayerNormLinear.forward": _layernorm_linear,
    "LayerNormMLP.forward": _layernorm_mlp,
    "FusedAttention.forward": _fused_attention,
    "DotProductAttention.forward": _dot_product_attention,
    "noop_cat": _noop_cat,
    "get_default_fp8_recipe": _default_recipe_polyfill,
}


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


__all__ = [
    "OPTION", "ENV", "NORM_ENV", "Island", "UntouchedState", "POLYFILLS", "TARGETS", "island_records",
    "clear_island_records", "layernorm_linear_forward", "layernorm_mlp_forward", "closure_layout", "te_kernels",
    "keep_te_function", "prepare_te_module",
]
