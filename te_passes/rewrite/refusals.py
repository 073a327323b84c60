"""Why a TE module cannot be rewritten exactly by
:func:`te_passes.rewrite.compile_friendly.compile_friendly` (checked once, at rewrite time), and
the per-call checks of the rewritten modules (trace-time Python, raising
:class:`~te_passes.rewrite.module_state.CompileFriendlyError`).

Mirrors TE 2.20.2 ``module/layernorm_linear.py``, ``module/layernorm_mlp.py``,
``attention/dot_product_attention/dot_product_attention.py`` and
``attention/multi_head_attention.py``."""

from __future__ import annotations

from typing import Any, Callable

import torch

from te_passes.rewrite.module_state import _STATE_ATTR, CompileFriendlyError, _state, _te
from te_passes.te.untouched_rules import (layernorm_linear_config_problem, layernorm_mlp_config_problem,
                                          norm_call_problem)


def _linear_module_problem(mod: Any, cls: type) -> str | None:
    """What refuses ``mod`` before its class's own checks: already rewritten, a subclass of TE's
    ``cls`` (its forward may differ); the configuration checks are in
    :mod:`te_passes.te.untouched_rules`."""
    if _STATE_ATTR in mod.__dict__:
        return "already rewritten"
    if type(mod) is not cls:
        return f"{type(mod).__qualname__} is a subclass of te.{cls.__name__} (its forward may differ)"
    return None


def layernorm_linear_problem(mod: Any) -> str | None:
    """Why ``te.LayerNormLinear`` ``mod`` cannot be rewritten exactly, or ``None``."""
    return _linear_module_problem(mod, _te().LayerNormLinear) or layernorm_linear_config_problem(mod)


def layernorm_mlp_problem(mod: Any) -> str | None:
    """Why ``te.LayerNormMLP`` ``mod`` cannot be rewritten exactly, or ``None``."""
    return _linear_module_problem(mod, _te().LayerNormMLP) or layernorm_mlp_config_problem(mod)


#: Mask types the SDPA path expresses; ``causal_bottom_right`` only when s_q == s_kv (checked per call).
SDPA_MASK_TYPES: frozenset[str] = frozenset({"no_mask", "causal", "causal_bottom_right"})


def attention_problem(mod: Any, path: str = "SDPA") -> str | None:
    """Why ``DotProductAttention`` ``mod`` cannot go through SDPA (or ``path``, the fused-op
    rewrite's label, which shares these rules) exactly, or ``None``.

    Supported (TE 2.20.2 ``DotProductAttention``): ``qkv_format`` ``sbhd`` / ``bshd``; mask
    ``no_mask`` / ``causal`` (top-left) / ``causal_bottom_right`` with s_q == s_kv; the window
    TE derives for those masks; GQA/MQA (``num_gqa_groups`` dividing the heads); equal K and V
    head dims; ``softmax_type="vanilla"``; no softcap; no dropout; no context parallelism; no
    max-logit output. FP8 attention (``fp8_dpa`` / ``fp8_mha``) is refused per call.
    """
    from transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention import (
        DotProductAttention,
    )

    if _STATE_ATTR in mod.__dict__:
        return "already rewritten"
    if type(mod) is not DotProductAttention:
        return f"{type(mod).__qualname__} is a subclass of DotProductAttention (its forward may differ)"
    if mod.qkv_format not in ("sbhd", "bshd"):
        return f"qkv_format={mod.qkv_format!r} ({path} path: sbhd, bshd)"
    if mod.attn_mask_type not in SDPA_MASK_TYPES:
        return f"attn_mask_type={mod.attn_mask_type!r} ({path} path: {sorted(SDPA_MASK_TYPES)})"
    if tuple(mod.window_size or (-1, -1)) not in ((-1, -1), (-1, 0)):
        return f"sliding window {mod.window_size}"
    if mod.attention_dropout:
        return (f"attention_dropout={mod.attention_dropout}: SDPA's dropout draws a different random "
                "stream than TE's attention backends" if path == "SDPA" else
                f"attention_dropout={mod.attention_dropout}: the {path} op's philox rng state under CUDA-graph "
                "replay is not verified against TE eager")
    if mod.softmax_type != "vanilla":
        return f"softmax_type={mod.softmax_type!r}"
    if mod.softcap:
        return f"softcap={mod.softcap}"
    if mod.cp_group is not None:
        return "context parallelism (cp_group)"
    if getattr(mod, "return_max_logit", False):
        return "return_max_logit"
    if mod.hidden_size_per_attention_head_k != mod.hidden_size_per_attention_head_v:
        return "different K and V head dims"
    if mod.tp_size != 1:
        return f"tensor parallel (tp_size={mod.tp_size})"
    return None


def multihead_attention_problem(mod: Any) -> str | None:
    """Why ``te.MultiheadAttention`` ``mod`` is not wrapped (see ``CompileFriendlyMultiheadAttention``)."""
    te = _te()
    if _STATE_ATTR in mod.__dict__:
        return "already rewritten"
    if type(mod) is not te.MultiheadAttention:
        return f"{type(mod).__qualname__} is a subclass of te.MultiheadAttention (its forward may differ)"
    return None


def multihead_attention_note(mod: Any) -> str | None:
    """What in TE's own ``MultiheadAttention.forward`` (not rewritten) still breaks the graph.

    TE 2.20.2 ``attention/multi_head_attention.py``: with GQA/MQA (``num_gqa_groups`` <
    heads), or whenever the packed q/k/v pass-through is not eligible (RoPE, QK norm, KV
    cache, CPU offload), q/k/v are split with ``SplitAlongDim``, an autograd.Function whose
    backward reads ``untyped_storage().data_ptr()``: Dynamo cannot trace it (one graph break).
    Returns that reason for self-attention with GQA, else ``None`` (the other conditions are
    call-time arguments).
    """
    if getattr(mod, "attention_type", "self") == "self" and \
            mod.num_attention_heads_per_partition != mod.num_gqa_groups_per_partition:
        return ("with GQA (num_gqa_groups < heads) TE's q/k/v split uses SplitAlongDim, whose "
                "backward reads data_ptr: one graph break per layer")
    return None


#: ``DotProductAttention.forward`` keyword arguments and the values the SDPA path accepts
#: (TE 2.20.2 signature); a callable decides for the value given.
_NEUTRAL_KWARGS: dict[str, Callable[[Any], bool]] = {
    "cu_seqlens_q": lambda v: v is None, "cu_seqlens_kv": lambda v: v is None,
    "cu_seqlens_q_padded": lambda v: v is None, "cu_seqlens_kv_padded": lambda v: v is None,
    "max_seqlen_q": lambda v: v is None, "max_seqlen_kv": lambda v: v is None,
    "window_size": lambda v: v is None or tuple(v) in ((-1, -1), (-1, 0)),
    "bottom_right_diagonal": lambda v: True,  # only changes causal masks with s_q != s_kv (checked)
    "softcap": lambda v: not v,
    "checkpoint_core_attention": lambda v: not v,
    "core_attention_bias_type": lambda v: v in (None, "no_bias"),
    "core_attention_bias": lambda v: v is None, "alibi_slopes": lambda v: v is None,
    "fast_zero_fill": lambda v: True,
    "inference_params": lambda v: v is None,
    "pad_between_seqs": lambda v: not v,
    "fp8_output": lambda v: not v, "bf16_backward": lambda v: not v,
    "num_splits": lambda v: v in (None, 1),
    "score_mod": lambda v: v is None, "score_mod_bprop": lambda v: v is None,
    "score_mod_tensors": lambda v: v is None, "score_mod_bprop_tensors": lambda v: v is None,
    "thd_attention_policies": lambda v: v is None,
    "thd_attention_policy_dispatch": lambda v: True,
}


def _check_norm_call(mod: Any) -> None:
    """Per-call refusals of the rewritten LayerNormLinear / LayerNormMLP (trace-time Python):
    :func:`te_passes.te.untouched_rules.norm_call_problem`, raised."""
    problem = norm_call_problem()
    if problem is not None:
        raise CompileFriendlyError(f"rewritten {_state(mod).original_cls.__name__} {mod.name or ''}: {problem}; "
                                   "or restore() the model")


def _check_sdpa_call(mod: Any, qkv_format: str, mask: str, attention_mask: Any, kwargs: dict,
                     path: str = "SDPA") -> None:
    """Per-call refusals of the rewritten ``DotProductAttention`` (SDPA, or the fused op: ``path``)."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    where = f"rewritten DotProductAttention (layer_number={getattr(mod, 'layer_number', None)})"
    for k, v in kwargs.items():
        ok = _NEUTRAL_KWARGS.get(k)
        if ok is None:
            raise TypeError(f"{where}: unexpected keyword argument {k!r}")
        if not ok(v):
            raise CompileFriendlyError(f"{where}: {k}={v!r} is not expressed by the {path} path; "
                                       "rewrite with attention='keep'")
    if qkv_format not in ("sbhd", "bshd"):
        raise CompileFriendlyError(f"{where}: qkv_format={qkv_format!r} ({path} path: sbhd, bshd)")
    if mask not in SDPA_MASK_TYPES:
        raise CompileFriendlyError(f"{where}: attn_mask_type={mask!r} ({path} path: {sorted(SDPA_MASK_TYPES)})")
    if attention_mask is not None:
        raise CompileFriendlyError(f"{where}: an attention_mask tensor with attn_mask_type={mask!r}")
    qstate = FP8GlobalStateManager.quantization_state
    recipe = qstate.fp8_recipe
    if qstate.fp8_enabled and recipe is not None and (getattr(recipe, "fp8_dpa", False)
                                                      or getattr(recipe, "fp8_mha", False)):
        raise CompileFriendlyError(f"{where}: FP8 attention (recipe fp8_dpa/fp8_mha) is not expressed")
