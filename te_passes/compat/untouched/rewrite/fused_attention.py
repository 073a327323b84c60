"""``compile_friendly(model, attention="te_fused")``: ``DotProductAttention``'s core attention through
TE's fused (cuDNN) kernels as the ``transformer_engine_compile::fused_attn`` op, one node for Dynamo
instead of TE's disabled ``FusedAttention.forward``. docs/internals.md#te_passescompatuntouchedrewritefused_attentionpy."""

from __future__ import annotations

import functools
from typing import Any

import torch

from te_passes.compat.untouched.rewrite.module_state import STATE_ATTR, CompileFriendlyError, ModuleState, te_module
from te_passes.compat.untouched.rewrite.refusals import attention_problem, check_sdpa_call
from te_passes.compat.untouched.rewrite.rewriters import rewriter_classes
from te_passes.ops.fused_attn import FusedAttentionOpUnavailable, fused_attention_op
from te_passes.compat.untouched.attention import dpa_fused_forward, unpack_qkv
from te_passes.compat.untouched.gate import environment_options, fused_attn_off
from te_passes.te.fused_attn import head_dim_problem

PATH = "te_fused"


def fused_attention_problem(mod: Any) -> str | None:
    """Why ``DotProductAttention`` ``mod`` cannot go through the fused op exactly, or ``None``."""
    if p := attention_problem(mod, path=PATH):
        return p
    if getattr(getattr(mod, "fused_attention", None), "use_FAv2_bwd", False):
        return "NVTE_FUSED_ATTN_USE_FAv2_BWD=1 (TE's flash-attn v2 backward): not expressed by the fused op"
    if off := fused_attn_off(environment_options()):  # TE_PASSES_FUSED_ATTN (no torch.compile options here)
        return f"TE fused-attention op unavailable: {off}"
    try:
        fused_attention_op()
    except FusedAttentionOpUnavailable as e:
        return str(e)
    return None


def auto_attention_problem(mod: Any) -> str | None:
    """What keeps ``attention="auto"`` from the fused op for ``mod``, or ``None``: :func:`fused_attention_problem`,
    head dims outside cuDNN's range (TE would not pick FusedAttention), a GPU older than sm80."""
    if p := fused_attention_problem(mod):
        return p
    for what in ("k", "v"):
        if p := head_dim_problem(getattr(mod, f"hidden_size_per_attention_head_{what}", None)):
            return f"head dim {what}={p}"
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0):
        return f"GPU compute capability {torch.cuda.get_device_capability()} < (8, 0)"
    return None


@functools.cache
def _fused_class() -> type:
    class FusedDotProductAttention(te_module().DotProductAttention):
        """``DotProductAttention`` through TE's fused attention custom op (``fused_attn``)."""

        def forward(self, query_layer=None, key_layer=None, value_layer=None, attention_mask=None,
                    qkv_format=None, attn_mask_type=None, qkv_layer=None, kv_layer=None,
                    qkv_interleave_dim=-3, **kwargs):
            from transformer_engine.pytorch.cpu_offload import is_cpu_offload_enabled

            fmt, mask = check_sdpa_call(self, qkv_format, attn_mask_type, attention_mask, kwargs, path=PATH)
            where = f"rewritten DotProductAttention (layer_number={getattr(self, 'layer_number', None)})"
            if is_cpu_offload_enabled():
                raise CompileFriendlyError(f"{where}: CPU activation offloading is enabled")
            q, k, v = unpack_qkv(fmt, qkv_layer, kv_layer, query_layer, key_layer, value_layer, qkv_interleave_dim,
                                 kwargs)
            for name, t in (("q", q), ("k", k), ("v", v)):
                if t.dtype not in (torch.bfloat16, torch.float16) or t.device.type != "cuda":
                    if self.__dict__.get(AUTO_ATTR):  # attention="auto": this call goes through SDPA
                        sdpa = rewriter_classes()["DotProductAttention"].forward
                        return sdpa(self, query_layer, key_layer, value_layer, attention_mask, qkv_format,
                                    attn_mask_type, qkv_layer, kv_layer, qkv_interleave_dim, **kwargs)
                    raise CompileFriendlyError(f"{where}: {name} is {t.dtype} on {t.device}; the fused op "
                                               "runs TE's bf16/fp16 cuDNN kernels on CUDA")
            return dpa_fused_forward(self, fmt, mask, q, k, v, kwargs)

    return FusedDotProductAttention


#: Module attribute set by ``attention="auto"``: calls the fused op cannot take go through SDPA.
AUTO_ATTR = "_te_passes_attention_auto"


def rewrite_fused_attention(mod: Any, auto: bool = False) -> str:
    mod.__dict__[STATE_ATTR] = ModuleState(type(mod))
    mod.__class__ = _fused_class()
    if auto:
        mod.__dict__[AUTO_ATTR] = True
    return (("auto: " if auto else "") + "TE fused attention op transformer_engine_compile::fused_attn "
            f"({mod.attn_mask_type}, {mod.qkv_format}, scale {mod.softmax_scale:.4g})")
