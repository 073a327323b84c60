"""Data-free fakes of TE's fused (cuDNN) attention forward / backward, for the
``register_custom_op`` family te_passes registers (:mod:`te_passes.ops.fused_attn`).

See docs/internals.md#te_passestefused_attnpy."""

from __future__ import annotations

from typing import Any, Callable

import torch

#: q/k/v layouts whose fakes are exact (separate, contiguous q, k and v).
SUPPORTED_LAYOUTS: frozenset[str] = frozenset({"sbhd_sbhd_sbhd", "bshd_bshd_bshd"})
#: Activation dtypes of the bf16/fp16 backend.
SUPPORTED_DTYPES: frozenset[torch.dtype] = frozenset({torch.bfloat16, torch.float16})
#: ``_fused_attn_forward_impl``'s ``saved_from`` in bf16/fp16 without bias / softmax offset:
#: (q_fp8, k_fp8, v_fp8, out_fp8, q, k, v, out, stats, rng_state, bias, softmax_offset).
F16_SAVED_FROM: tuple[str | None, ...] = (None, None, None, None, "q", "k", "v", "out", None, None, None, None)


class FusedAttnFakeError(ValueError):
    """The fused-attention fake was asked for a configuration it cannot describe exactly."""


def _is_quantized(spec: Any) -> bool:
    return getattr(spec, "quantizer", None) is not None


def fake_problem(args: Any) -> str | None:
    """Why the fakes cannot describe ``FusedAttnFwdArgs`` ``args`` exactly, or ``None``.

    ``args`` may hold tensors or TE ``TensorSpec``\\ s (what TE's framework hands a fake)."""
    from transformer_engine.pytorch.cpp_extensions.fused_attn import FusedAttnBackend

    if args.fp8 or args.fp8_output or args.bf16_backward:
        return "FP8 attention (fp8 / fp8_output / bf16_backward)"
    for name in ("q", "k", "v"):
        t = getattr(args, name)
        if t is None or _is_quantized(t) or not hasattr(t, "shape"):
            return f"{name} is {type(t).__name__}, not a plain tensor"
        if t.dtype not in SUPPORTED_DTYPES:
            return f"{name}.dtype={t.dtype} (bf16/fp16 backend only)"
        if len(t.shape) != 4:
            return f"{name} has {len(t.shape)} dims, not 4"
    if args.qkv_layout not in SUPPORTED_LAYOUTS:
        return (f"qkv_layout={args.qkv_layout!r}: fakes are exact for {sorted(SUPPORTED_LAYOUTS)} only "
                "(packed layouts return strided dq/dk/dv views; thd stats depend on the cuDNN runtime)")
    if args.attn_bias_type != "no_bias" or args.attn_bias is not None:
        return f"attn_bias_type={args.attn_bias_type!r}"
    if args.softmax_type != "vanilla" or args.softmax_offset is not None:
        return f"softmax_type={args.softmax_type!r}"
    if args.return_max_logit:
        return "return_max_logit"
    if args.use_FAv2_bwd:
        return "use_FAv2_bwd (NVTE_FUSED_ATTN_USE_FAv2_BWD)"
    if args.page_table_k is not None or args.page_table_v is not None:
        return "paged KV cache (page_table_k / page_table_v)"
    if int(args.fused_attention_backend) != int(FusedAttnBackend["F16_arbitrary_seqlen"]):
        return f"fused_attention_backend={args.fused_attention_backend!r} (F16_arbitrary_seqlen only)"
    return None


def _batch(shape: tuple[int, ...], fmt: str) -> int:
    return shape[0] if fmt == "bshd" else shape[1]


def make_fakes() -> tuple[Callable[[Any], tuple], Callable[[Any], tuple]]:
    """``(forward_fake, backward_fake)`` for ``register_custom_op``, bound to TE's classes once (the
    fakes run inside Dynamo's trace and import nothing); they raise :class:`FusedAttnFakeError` for
    arguments outside :func:`fake_problem`'s set."""
    from transformer_engine.pytorch.attention.dot_product_attention import utils as dpa_utils
    from transformer_engine.pytorch.cpp_extensions.fused_attn import FusedAttnBackend
    from transformer_engine.pytorch.dynamo.tensor_spec import TensorSpec

    def forward_fake(args: Any) -> tuple:
        problem = fake_problem(args)
        if problem is not None:
            raise FusedAttnFakeError(f"te_passes fused-attention op: no exact fake for {problem}")
        q, v = args.q, args.v
        _, q_format, _ = dpa_utils.get_qkv_format(args.qkv_layout)
        device = args.cu_seqlens_q.device  # fused_attn_fwd's CUDAGuard: all outputs on this device
        out = TensorSpec(shape=(*tuple(q.shape[:-1]), int(v.shape[-1])), dtype=q.dtype, device=device)
        stats = TensorSpec(shape=(_batch(tuple(q.shape), q_format), int(q.shape[-2]), int(args.max_seqlen_q), 1),
                           dtype=torch.float32, device=device)
        rng_state = TensorSpec(shape=(2,), dtype=torch.int64, device=device)
        saved = (None,) * 8 + (stats, rng_state, None, None)
        ctx_attrs = {
            "fp8": False, "is_input_fp8": False, "saved_from": F16_SAVED_FROM,
            "fused_attention_backend": args.fused_attention_backend, "nominal_dtype": q.dtype,
            "qkv_type": None, "qkv_layout": args.qkv_layout, "original_qkv_layout": args.qkv_layout,
            "o_format": q_format, "qkv_scale_inv_format": None,
            "QKV_quantizer": None, "O_quantizer": None, "S_quantizer": None,
            "dQKV_quantizer": None, "dO_quantizer": None, "dP_quantizer": None,
        }
        return out, None, saved, ctx_attrs

    def backward_fake(args: Any) -> tuple:
        if args.fp8 or args.use_FAv2_bwd or args.dqkv_layout not in SUPPORTED_LAYOUTS \
                or args.attn_bias_type != "no_bias" or args.softmax_type != "vanilla" \
                or int(args.fused_attention_backend) != int(FusedAttnBackend["F16_arbitrary_seqlen"]):
            raise FusedAttnFakeError(
                f"te_passes fused-attention op: no exact backward fake for fp8={args.fp8}, "
                f"use_FAv2_bwd={args.use_FAv2_bwd}, dqkv_layout={args.dqkv_layout!r}, "
                f"attn_bias_type={args.attn_bias_type!r}, softmax_type={args.softmax_type!r}")
        grads = tuple(TensorSpec(shape=tuple(t.shape), dtype=args.nominal_dtype, device=t.device)
                      for t in (args.q, args.k, args.v))
        return (*grads, None, None)

    return forward_fake, backward_fake


#: cuDNN's fused attention (F16_arbitrary_seqlen) head dims: multiples of 8 up to this (``get_attention_backend``).
CUDNN_MAX_HEAD_DIM = 256


def head_dim_problem(d: Any) -> str | None:
    """``None`` when ``d`` is a head dim cuDNN's fused attention takes, else ``"<d>: why"``."""
    if not isinstance(d, int) or d % 8 or d > CUDNN_MAX_HEAD_DIM:
        return f"{d}: cuDNN's fused attention takes multiples of 8 up to {CUDNN_MAX_HEAD_DIM}"
    return None
