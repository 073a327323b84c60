"""The per-module rewriters of :func:`~te_passes.compat.untouched.rewrite.compile_friendly.compile_friendly`: each builds
the module's hidden state and swaps its class for a subclass of its TE class whose ``forward`` is
traceable (:func:`rewriter_classes`). docs/internals.md#te_passescompatuntouchedrewriterewriterspy."""

from __future__ import annotations

import functools
from typing import Any

import torch.nn.functional as F

from te_passes.compat.untouched.rewrite.module_state import (STATE_ATTR, CompileFriendlyError, HiddenTrainMixin, ModuleState,
                                            state_of, te_module)
from te_passes.compat.untouched.rewrite.refusals import check_norm_call, check_sdpa_call, multihead_attention_note
from te_passes.ops.shared_linear import layernorm_linear_gemm, layernorm_mlp_gemms
from te_passes.compat.untouched.attention import unpack_qkv
from te_passes.compat.untouched.polyfills import layernorm_linear_forward, layernorm_mlp_forward


@functools.cache
def rewriter_classes() -> dict[str, type]:
    """The compile-friendly subclasses, built once TE is importable."""
    te = te_module()

    class CompileFriendlyLayerNormLinear(HiddenTrainMixin, te.LayerNormLinear):
        """``te.LayerNormLinear`` as normalisation + ``te.Linear`` (the untouched-model polyfill's forward)."""

        def forward(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False):
            check_norm_call(self)
            (lin,) = state_of(self).linears
            return layernorm_linear_forward(self, lin, inp, is_first_microbatch, fp8_output, fp8_grad)

    class CompileFriendlyLayerNormMLP(HiddenTrainMixin, te.LayerNormMLP):
        """``te.LayerNormMLP`` as normalisation + ``te.Linear`` + activation + ``te.Linear``: returns
        [..., hidden], or ``(output, fc2_bias)`` with ``return_bias``."""

        def forward(self, inp, is_first_microbatch=None):
            check_norm_call(self)
            fc1, fc2 = state_of(self).linears
            return layernorm_mlp_forward(self, fc1, fc2, inp, is_first_microbatch)

    class SdpaDotProductAttention(te.DotProductAttention):
        """``DotProductAttention`` through ``torch.nn.functional.scaled_dot_product_attention``."""

        def forward(self, query_layer=None, key_layer=None, value_layer=None, attention_mask=None,
                    qkv_format=None, attn_mask_type=None, qkv_layer=None, kv_layer=None,
                    qkv_interleave_dim=-3, **kwargs):
            qkv_format, mask = check_sdpa_call(self, qkv_format, attn_mask_type, attention_mask, kwargs)
            q, k, v = unpack_qkv(qkv_format, qkv_layer, kv_layer, query_layer, key_layer, value_layer,
                                 qkv_interleave_dim, kwargs)
            # [s, b, h, d] / [b, s, h, d] -> [b, h, s, d]
            perm = (1, 2, 0, 3) if qkv_format == "sbhd" else (0, 2, 1, 3)
            qt, kt, vt = (t.permute(*perm) for t in (q, k, v))
            sq, skv = qt.shape[2], kt.shape[2]
            if mask == "causal_bottom_right" and sq != skv:
                raise CompileFriendlyError(f"attn_mask_type='causal_bottom_right' with s_q={sq} != "
                                           f"s_kv={skv}: the SDPA path only expresses top-left causal")
            out = F.scaled_dot_product_attention(
                qt, kt, vt, dropout_p=0.0, is_causal=mask != "no_mask", scale=self.softmax_scale,
                enable_gqa=qt.shape[1] != kt.shape[1])
            # [b, h, s, d] -> [s, b, h*d] / [b, s, h*d]
            out = out.permute(2, 0, 1, 3) if qkv_format == "sbhd" else out.permute(0, 2, 1, 3)
            return out.reshape(*out.shape[:2], -1)

    class CompileFriendlyMultiheadAttention(te.MultiheadAttention):
        """``te.MultiheadAttention`` that supplies TE's default recipe when no ``te.autocast`` is active."""

        def forward(self, *args, **kwargs):
            from transformer_engine.pytorch.quantization import FP8GlobalStateManager

            if FP8GlobalStateManager.quantization_state.fp8_recipe is None:
                with te.autocast(enabled=False, recipe=state_of(self).recipe):
                    return super().forward(*args, **kwargs)
            return super().forward(*args, **kwargs)

    return dict(LayerNormLinear=CompileFriendlyLayerNormLinear, LayerNormMLP=CompileFriendlyLayerNormMLP,
                DotProductAttention=SdpaDotProductAttention, MultiheadAttention=CompileFriendlyMultiheadAttention)


def rewrite_multihead_attention(mod: Any) -> str:
    from transformer_engine.pytorch.quantization import get_default_fp8_recipe

    recipe = get_default_fp8_recipe()  # eagerly, what TE would build inside the compiled region
    str(recipe)  # caches the repr (a guard)
    mod.__dict__[STATE_ATTR] = ModuleState(type(mod), recipe=recipe)
    mod.__class__ = rewriter_classes()["MultiheadAttention"]
    note = multihead_attention_note(mod)
    return f"TE's default recipe ({type(recipe).__name__}, FP8 off) when no te.autocast is active" + \
        (f"; note: {note}" if note else "")


def rewrite_layernorm_linear(mod: Any) -> str:
    mod.__dict__[STATE_ATTR] = ModuleState(type(mod), (layernorm_linear_gemm(mod),))
    mod.__class__ = rewriter_classes()["LayerNormLinear"]
    return f"{mod.normalization} + te.Linear({mod.in_features}, {mod.out_features})"


def rewrite_layernorm_mlp(mod: Any) -> str:
    hidden = mod.layer_norm_weight.shape[0]
    fc1_out, ffn = mod.fc1_weight.shape[0], mod.fc2_weight.shape[1]
    mod.__dict__[STATE_ATTR] = ModuleState(type(mod), layernorm_mlp_gemms(mod))
    mod.__class__ = rewriter_classes()["LayerNormMLP"]
    return (f"{mod.normalization} + te.Linear({hidden}, {fc1_out}) + {mod.activation} + "
            f"te.Linear({ffn}, {hidden})")


def rewrite_attention(mod: Any) -> str:
    mod.__dict__[STATE_ATTR] = ModuleState(type(mod))
    mod.__class__ = rewriter_classes()["DotProductAttention"]
    return f"scaled_dot_product_attention ({mod.attn_mask_type}, {mod.qkv_format}, scale {mod.softmax_scale:.4g})"
