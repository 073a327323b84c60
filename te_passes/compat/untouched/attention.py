"""The ``FusedAttention.forward`` polyfill's body (:mod:`te_passes.compat.untouched.polyfills`): TE's
fused (cuDNN) attention as the ``transformer_engine_compile::fused_attn`` op
(:mod:`te_passes.ops.fused_attn`) for the calls it expresses exactly, with the
``FusedAttnFwdArgs`` TE's own ``FusedAttention.forward`` builds (``attention/dot_product_attention/
backends.py``); q / k / v made contiguous with the layout ``sbhd_sbhd_sbhd`` / ``bshd_bshd_bshd``
(the same cuDNN graph as TE's packed layouts, other strides). Docs: docs/untouched.md.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import guard_scalar

from te_passes.compat.untouched.gate import fused_attn_switched_off
from te_passes.ops.fused_attn import fused_attention_op, refused_reason
from te_passes.compat.te220.attention_backend import backend_problem
from te_passes.te.fused_attn import head_dim_problem
from te_passes.compat.te220.untouched_rules import dpa_call_problem, dpa_config_problem, resolve_mask, window_call_problem

#: Mask types the op path expresses (``causal_bottom_right`` as TE resolves it: DPA passes the diagonal).
MASK_TYPES = ("no_mask", "causal", "causal_bottom_right")


def unpack_qkv(fmt: str, qkv_layer: Any, kv_layer: Any, q: Any, k: Any, v: Any, interleave_dim: int,
               kwargs: dict) -> tuple[Any, Any, Any]:
    """q, k, v from ``DotProductAttention.forward``'s (possibly packed) arguments (TE's ``_unpack_packed_qkv``)."""
    from transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention import _unpack_packed_qkv

    return _unpack_packed_qkv(qkv_layer, kv_layer, q, k, v, fmt, interleave_dim, kwargs.get("inference_params"))[:3]


def _format(layout: str) -> str | None:
    """``sbhd`` / ``bshd`` when every part of TE's ``qkv_layout`` (``sb3hd``, ``sbhd_sb2hd``,
    ``bshd_bshd_bshd``, ...) has that format, else ``None`` (``thd``, paged, mixed)."""
    parts = {p.replace("3", "").replace("2", "") for p in layout.split("_")}
    return parts.pop() if len(parts) == 1 and parts <= {"sbhd", "bshd"} else None


def fused_attention_call_problem(mod: Any, q: Any, k: Any, v: Any, call: dict[str, Any]) -> str | None:
    """Why this ``FusedAttention.forward`` call is not expressed by the op (trace-time Python), or ``None``."""
    from transformer_engine.pytorch.cpp_extensions.fused_attn import FusedAttnBackend

    reason = refused_reason() or fused_attn_switched_off()  # te_passes.fused_attn / TE_PASSES_FUSED_ATTN
    if reason:
        return f"TE fused-attention op unavailable: {reason}"
    layout = call["qkv_layout"]
    if _format(layout) is None:
        return f"qkv_layout={layout!r} (the op path takes sbhd / bshd layouts)"
    mask = call["attn_mask_type"]
    if mask not in MASK_TYPES:
        return f"attn_mask_type={mask!r} (the op path takes {list(MASK_TYPES)})"
    checks = (
        (call["attention_mask"] is not None, "an attention_mask tensor"),
        (call["inference_params"] is not None, "a KV cache (inference_params)"),
        (call["cp_group"] is not None, "context parallelism (cp_group)"),
        (call["score_mod"] is not None, "score_mod"),
        (bool(call["fp8"]) or bool(call["fp8_output"]), "FP8 attention (recipe fp8_dpa / fp8_mha)"),
        (call["core_attention_bias_type"] != "no_bias", f"core_attention_bias_type={call['core_attention_bias_type']!r}"),
        (call["softmax_offset"] is not None or mod.softmax_type != "vanilla", f"softmax_type={mod.softmax_type!r}"),
        (bool(call["pad_between_seqs"]), "pad_between_seqs"),
        (call["cu_seqlens_q_padded"] is not None or call["cu_seqlens_kv_padded"] is not None, "padded cu_seqlens"),
        (bool(mod.attention_dropout) and mod.training,
         f"attention_dropout={mod.attention_dropout} in training (the op's philox rng state under CUDA-graph "
         "replay is not verified against TE eager)"),
        (bool(mod.return_max_logit), "return_max_logit"),
        (bool(mod.use_FAv2_bwd), "NVTE_FUSED_ATTN_USE_FAv2_BWD=1 (TE's flash-attn v2 backward)"),
    )
    for bad, what in checks:
        if bad:
            return f"{what} is not expressed by the fused-attention op path"
    backend = call.get("fused_attention_backend")
    if backend != FusedAttnBackend["F16_arbitrary_seqlen"]:
        return f"fused_attention_backend={backend} (the op path runs F16_arbitrary_seqlen)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in (torch.bfloat16, torch.float16) or t.device.type != "cuda":
            return f"{name} is {t.dtype} on {t.device} (the op runs TE's bf16/fp16 cuDNN kernels on CUDA)"
    return None


def _constant(v: Any) -> Any:
    """``v`` with every symbolic scalar (``SymInt`` / ``SymFloat`` / ``SymBool``), also inside a tuple or
    list (``window_size``), specialised under a guard (Dynamo's ``guard_scalar``); anything else as it is."""
    if isinstance(v, (tuple, list)):
        return type(v)(_constant(x) for x in v)
    # Dynamo answers type(v) / isinstance for an unspecialised scalar with its Python type (float, int)
    symbolic = type(v) in (int, float, bool) or isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool))
    return guard_scalar(v) if symbolic else v


def _fused_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: str, cu_q: Any, cu_kv: Any, *,
              is_training: bool, attn_scale: Any, deterministic: bool, layer_number: Any, **call: Any) -> torch.Tensor:
    """The ``fused_attn`` op on q / k / v (made contiguous) of format ``fmt``, as TE's ``FusedAttention.forward``
    builds its ``FusedAttnFwdArgs`` (``cu_q`` / ``cu_kv`` ``None``: full sequences); ``call``: the mask,
    window, diagonal, ``fast_zero_fill`` and backend fields."""
    from transformer_engine.pytorch.attention.dot_product_attention import utils as dpa_utils
    from transformer_engine.pytorch.attention.dot_product_attention.backends import FusedAttnFwdArgs

    q, k, v = (t.contiguous() for t in (q, k, v))
    seq_dim = 0 if fmt == "sbhd" else 1
    # TE's op holds max_seqlen_q / _kv in its OpaqueValueBundle, a compile-time constant: a symbolic
    # sequence length (automatic dynamic shapes, dynamic=True) is specialised here with a guard
    # (Dynamo's guard_scalar): one graph per sequence length, the batch dimension stays dynamic
    batch, s_q, s_kv = q.shape[1 - seq_dim], guard_scalar(q.shape[seq_dim]), guard_scalar(k.shape[seq_dim])
    # likewise every other scalar of the bundle: dynamic=True makes module floats symbolic (softmax_scale), and
    # Dynamo's automatic dynamic makes an int attribute of an FSDP2-managed module that differs between the
    # layers of one compiled frame symbolic on its recompile (layer_number 1, 2, ...)
    attn_scale, layer_number = _constant(attn_scale), _constant(layer_number)
    is_training, deterministic = _constant(is_training), _constant(deterministic)
    call = {f: _constant(v) for f, v in call.items()}
    cu_q = dpa_utils.get_full_cu_seqlens(batch, s_q, q.device) if cu_q is None else cu_q[: batch + 1]
    cu_kv = dpa_utils.get_full_cu_seqlens(batch, s_kv, k.device) if cu_kv is None else cu_kv[: batch + 1]
    args = FusedAttnFwdArgs(
        q=q, k=k, v=v, attn_bias=None, softmax_offset=None, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
        cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, page_table_k=None, page_table_v=None,
        packed_qkv=None, packed_kv=None, is_training=is_training, max_seqlen_q=s_q, max_seqlen_kv=s_kv,
        attn_scale=attn_scale, dropout_p=0.0, qkv_layout=f"{fmt}_{fmt}_{fmt}", attn_bias_type="no_bias",
        softmax_type="vanilla", deterministic=deterministic, use_FAv2_bwd=False, return_max_logit=False,
        rng_gen=None, fp8=False, fp8_meta=None, quantizers=None, fp8_output=False, bf16_backward=False,
        layer_number=layer_number, **call)
    out, _max_logit = fused_attention_op()(args)
    return out.view(*out.shape[:-2], -1)


#: The ``FusedAttention.forward`` arguments :func:`fused_attention_forward` passes on as they are.
_CALL_FIELDS = ("fast_zero_fill", "attn_mask_type", "window_size", "bottom_right_diagonal", "fused_attention_backend")


def fused_attention_forward(mod: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            call: dict[str, Any]) -> torch.Tensor:
    """TE's ``FusedAttention.forward`` for a call :func:`fused_attention_call_problem` accepts:
    q [s_q, b, h, d] (``sbhd``) / [b, s_q, h, d] (``bshd``), k / v [s_kv, b, g, d] (GQA: ``g``
    divides ``h``) -> [s_q, b, h * d_v] / [b, s_q, h * d_v] in q's dtype."""
    return _fused_op(q, k, v, _format(call["qkv_layout"]), call["cu_seqlens_q"], call["cu_seqlens_kv"],
                     is_training=mod.training, attn_scale=mod.softmax_scale, deterministic=mod.deterministic,
                     layer_number=mod.layer_number, **{f: call[f] for f in _CALL_FIELDS})


def dpa_fused_forward(mod: Any, fmt: str, mask: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      kwargs: dict[str, Any]) -> torch.Tensor:
    """``DotProductAttention`` ``mod``'s core attention through the ``fused_attn`` op for a call
    :func:`te_passes.compat.te220.untouched_rules.dpa_call_problem` accepts (q/k/v already unpacked, bf16 /
    fp16 on CUDA): q [s_q, b, h, d] (``sbhd``) / [b, s_q, h, d] (``bshd``), k / v [s_kv, b, g, d]
    -> [s_q, b, h * d_v] / [b, s_q, h * d_v]. The one implementation behind the untouched-model
    polyfill and ``compile_friendly(attention="te_fused")``. Mirrors TE's
    ``DotProductAttention.forward`` (mask / window / diagonal) and ``FusedAttention.forward``."""
    from transformer_engine.pytorch.cpp_extensions.fused_attn import FusedAttnBackend

    window, brd = resolve_mask(mod, mask, kwargs.get("window_size"), kwargs.get("bottom_right_diagonal"))
    return _fused_op(q, k, v, fmt, None, None, is_training=mod.fused_attention.training,
                     attn_scale=mod.softmax_scale, deterministic=mod.deterministic,
                     layer_number=mod.fused_attention.layer_number, fast_zero_fill=kwargs.get("fast_zero_fill", True),
                     attn_mask_type=mask, window_size=window, bottom_right_diagonal=brd,
                     fused_attention_backend=FusedAttnBackend["F16_arbitrary_seqlen"])


def dpa_problem(mod: Any, fmt: str, mask: str, attention_mask: Any, q: Any, k: Any, v: Any,
                kwargs: dict[str, Any]) -> str | None:
    """Why this untouched ``DotProductAttention`` call does not take the fused op (trace time), or
    ``None``: the configuration (:func:`te_passes.compat.te220.untouched_rules.dpa_config_problem`), cuDNN's
    head-dim range, TE's FAv2 backward, the op's availability, the call's arguments, the dtypes, and
    the backend TE's own selection picks (:func:`te_passes.compat.te220.attention_backend.backend_problem`)."""
    from transformer_engine.pytorch.cpu_offload import is_cpu_offload_enabled

    p = (dpa_config_problem(mod, "fused-op") or dpa_call_problem(fmt, mask, attention_mask, kwargs, "fused-op")
         or window_call_problem(mod, fmt, q, k, kwargs))
    if p:
        return p
    reason = refused_reason() or fused_attn_switched_off()  # te_passes.fused_attn / TE_PASSES_FUSED_ATTN
    if reason:
        return f"TE fused-attention op unavailable: {reason}"
    if getattr(getattr(mod, "fused_attention", None), "use_FAv2_bwd", False):
        return "NVTE_FUSED_ATTN_USE_FAv2_BWD=1 (TE's flash-attn v2 backward): not expressed by the fused op"
    for what in ("k", "v"):
        p = head_dim_problem(getattr(mod, f"hidden_size_per_attention_head_{what}", None))
        if p:
            return f"head dim {what}={p}"
    if is_cpu_offload_enabled():
        return "CPU activation offloading is enabled"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in (torch.bfloat16, torch.float16) or t.device.type != "cuda":
            return f"{name} is {t.dtype} on {t.device} (the op runs TE's bf16/fp16 cuDNN kernels on CUDA)"
    window, brd = resolve_mask(mod, mask, kwargs.get("window_size"), kwargs.get("bottom_right_diagonal"))
    return backend_problem(mod, fmt, mask, q, k, v, window, brd)  # TE's own backend selection
