"""Which backend TE's ``DotProductAttention`` would run a call on: TE's own selection
(``attention/dot_product_attention/utils.py`` ``get_attention_backend``, TE 2.20.2: the
``NVTE_FLASH_ATTN`` / ``NVTE_FUSED_ATTN`` / ``NVTE_UNFUSED_ATTN`` switches, the device, cuDNN and
flash-attn versions, the call's shapes), asked eagerly for the plain-tensor calls the untouched-model
polyfill may send to TE's fused op. Docs: docs/untouched.md "Attention backend"."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import guard_scalar

#: The fused-attention sub-backend the polyfill's op runs (``FusedAttnBackend`` name).
FUSED_OP_BACKEND = "F16_arbitrary_seqlen"
#: TE's backend switches, read by TE's selection as TE reads them (``os.environ.get``), at trace time.
SWITCHES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


def selection_key(mod: Any, fmt: str, mask: str, q: Any, k: Any, v: Any, window: tuple, brd: bool) -> tuple | None:
    """The ``AttentionParams`` fields TE's ``DotProductAttention.forward`` fills for a plain-tensor
    ``sbhd`` / ``bshd`` call without mask tensor, bias, KV cache, context parallelism, FP8 or score
    mod (what ``runtime.untouched.attention.dpa_problem`` leaves), as ``((field, value), ...)`` of
    plain constants: q [s_q, b, h, d] (``sbhd``) / [b, s_q, h, d] (``bshd``), k / v [s_kv, b, g, d];
    the layout ``<fmt>_<fmt>_<fmt>`` (the one the fused op runs). Symbolic sequence lengths are
    specialised under a guard (as the fused op does); ``batch_size`` is 1 (see the body)."""
    seq = 0 if fmt == "sbhd" else 1
    # the fused op specialises the sequence lengths under a guard anyway (runtime/untouched/attention.py);
    # the batch stays dynamic: asked as 1 (TE 2.20.2 reads it only for THD layouts and cuDNN's query)
    s_q, s_kv = guard_scalar(q.shape[seq]), guard_scalar(k.shape[seq])
    batch, heads, groups, d_qk, d_v = 1, q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    return (("qkv_dtype", q.dtype), ("qkv_layout", f"{fmt}_{fmt}_{fmt}"), ("batch_size", batch),
            ("num_heads", heads), ("num_gqa_groups", groups), ("max_seqlen_q", s_q), ("max_seqlen_kv", s_kv),
            ("head_dim_qk", d_qk), ("head_dim_v", d_v), ("attn_mask_type", mask), ("window_size", tuple(window)),
            ("bottom_right_diagonal", bool(brd)), ("attention_dropout", float(mod.attention_dropout)),
            ("deterministic", bool(mod.deterministic)), ("is_training", bool(mod.training)),
            ("softmax_type", mod.softmax_type), ("return_max_logit", bool(getattr(mod, "return_max_logit", False))),
            ("softmax_scale", float(mod.softmax_scale)), ("cp_comm_type", mod.cp_comm_type))


@torch._dynamo.assume_constant_result
def selected_backend(key: tuple) -> str:
    """TE's choice for the call ``key`` (:func:`selection_key`): ``"FlashAttention"``,
    ``"FusedAttention:<sub-backend>"`` (``FusedAttnBackend`` name), ``"UnfusedDotProductAttention"``
    or ``"none: <TE's error>"``. Runs TE's ``get_attention_backend`` eagerly (a trace-time constant:
    TE's global ``_attention_backends`` cache is neither read nor written, so nothing is guarded on it;
    the switches are read when the frame is traced). ``qkv_type`` is ``torch.Tensor``; ``fp8`` is
    ``False`` (an FP8 ``DotProductAttention`` call never takes the fused op: ``dpa_call_problem``)."""
    from transformer_engine.pytorch.attention.dot_product_attention import utils as dpa_utils
    from transformer_engine.pytorch.cpp_extensions.fused_attn import FusedAttnBackend

    params = dpa_utils.AttentionParams(qkv_type=torch.Tensor, fp8=False, fp8_meta=None, **dict(key))
    try:
        use_flash, _, use_fused, fused_backend, use_unfused, _ = dpa_utils.get_attention_backend(params)
    except Exception as e:  # noqa: BLE001 - TE's own refusal (no device, no cuDNN): named
        return f"none: get_attention_backend raised {type(e).__name__}: {e}"
    if use_flash:
        return "FlashAttention"
    if use_fused:
        return f"FusedAttention:{FusedAttnBackend(int(fused_backend)).name}"
    return "UnfusedDotProductAttention" if use_unfused else "none: no backend available"


def backend_problem(mod: Any, fmt: str, mask: str, q: Any, k: Any, v: Any, window: tuple, brd: bool) -> str | None:
    """Why TE would not run this call on ``FusedAttention`` with the op's sub-backend
    (:data:`FUSED_OP_BACKEND`), or ``None``: TE's selection (:func:`selected_backend`) for the call's
    :func:`selection_key`."""
    key = selection_key(mod, fmt, mask, q, k, v, window, brd)
    if key is None:
        return None
    got = selected_backend(key)
    if got == f"FusedAttention:{FUSED_OP_BACKEND}":
        return None
    return f"TE's attention-backend selection picks {got} for this call, not FusedAttention ({FUSED_OP_BACKEND})"
