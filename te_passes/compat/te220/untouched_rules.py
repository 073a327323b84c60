"""Which ``te.LayerNormLinear`` / ``te.LayerNormMLP`` / ``DotProductAttention`` configurations and calls the
untouched-model polyfills and ``compile_friendly`` express exactly: each function returns the reason one
is not, or ``None`` (TE ``module/layernorm_linear.py``, ``layernorm_mlp.py``, ``base.py``). Docs: docs/untouched.md."""

from __future__ import annotations

from typing import Any, Callable

import torch

from te_passes.te.norm_act import ACTIVATIONS

#: The module whose ``SplitAlongDim`` (an ``autograd.Function`` comparing ``data_ptr``\ s) splits GQA's q/k/v
#: and cross attention's k/v.
SPLIT_ALONG_DIM_MODULE = "transformer_engine.pytorch.attention.multi_head_attention"

#: The fix named for DelayedScaling (its amax history lives in each module's fp8 meta).
DELAYED_SCALING_FIX = ("use a stateless recipe: te.autocast(recipe=Float8CurrentScaling()) (or "
                       "MXFP8BlockScaling() on Blackwell), which compiles into the graph")


def common_problem(mod: Any) -> str | None:
    """What neither the untouched-model polyfills nor ``compile_friendly`` express for a
    ``te.LayerNormLinear`` / ``te.LayerNormMLP`` (the reason), or ``None``."""
    from transformer_engine.pytorch.cpu_offload import is_cpu_offload_enabled

    if getattr(mod, "tp_size", 1) != 1:
        return (f"tensor parallel (tp_size={mod.tp_size}): the norm/GEMM split with sequence-parallel "
                "gathers is not verified")
    if getattr(mod, "fuse_wgrad_accumulation", False):
        return "fuse_wgrad_accumulation (main_grad): te.Linear runs it eagerly under torch.compile"
    store = getattr(mod, "wgrad_store", None)
    if store is not None and store.delay_wgrad_compute():
        return "delay_wgrad_compute: te.Linear runs it eagerly under torch.compile"
    ub = [k for k in ("ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad",
                      "ub_bulk_wgrad", "ub_overlap_ag_fprop", "ub_overlap_rs_fprop", "ub_overlap_ag_dgrad")
          if getattr(mod, k, False)]
    if ub:
        return f"Userbuffers overlap ({', '.join(ub)}): the norm would leave TE's UB-fused GEMM"
    if getattr(mod, "return_layernorm_output", False):
        return "return_layernorm_output: not expressed (TE returns its internal norm output)"
    if getattr(mod, "symmetric_ar_type", None) is not None:
        return f"symmetric_ar_type={mod.symmetric_ar_type!r}"
    if getattr(mod, "primary_weights_in_fp8", False):
        return "quantized primary weights (fp8_model_init)"
    if getattr(mod, "fsdp_group", None) is not None:
        return "manual TE FSDP (fsdp_group)"
    if getattr(mod, "normalization", None) not in ("LayerNorm", "RMSNorm"):
        return f"normalization {getattr(mod, 'normalization', None)!r}"
    if is_cpu_offload_enabled():
        return "CPU activation offloading is enabled"
    from transformer_engine.pytorch.quantized_tensor import QuantizedTensor

    for pname, p in mod.named_parameters(recurse=False):
        if isinstance(p, QuantizedTensor) or type(p).__name__ in ("DTensor", "DistributedWeight"):
            return f"parameter {pname} is a {type(p).__name__} (quantized or distributed weight)"
    return None


def layernorm_linear_config_problem(mod: Any) -> str | None:
    """Why ``te.LayerNormLinear`` ``mod``'s configuration is not expressed, or ``None``."""
    p = common_problem(mod)
    if p:
        return p
    if getattr(mod, "return_layernorm_output_gathered", False):
        return "return_layernorm_output_gathered"
    if mod.parallel_mode not in (None, "column"):
        return f"parallel_mode={mod.parallel_mode!r}"
    return None


def layernorm_mlp_config_problem(mod: Any) -> str | None:
    """Why ``te.LayerNormMLP`` ``mod``'s configuration is not expressed, or ``None``."""
    from transformer_engine.pytorch.module.layernorm_mlp import _get_act_func_supported_list

    p = common_problem(mod)
    if p:
        return p
    te_acts = set(_get_act_func_supported_list(None))
    if mod.activation not in te_acts:
        return f"activation {mod.activation!r} is not one of TE's {sorted(te_acts)}"
    if mod.activation not in ACTIVATIONS:
        return f"activation {mod.activation!r} has no torch expression here"
    if getattr(mod, "checkpoint", False):
        return ("checkpoint=True (TE's own activation recompute); the torch alternative te_inductor compiles: "
                "torch.utils.checkpoint.checkpoint(module, x, use_reentrant=False) around the module")
    if getattr(mod, "gemm_gelu_fusion", False):
        return "NVTE_GEMM_GELU_FUSION (GEMM+GELU fused with UB overlap)"
    if mod.activation_params and mod.activation != "clamped_swiglu":
        return f"activation_params {mod.activation_params!r} for {mod.activation!r}"
    return None


#: Why DelayedScaling is not expressed where nothing more specific is known.
DELAYED_SCALING_PROBLEM = (f"DelayedScaling keeps amax history in the module's fp8 meta (its _extra_state); a "
                           f"hidden te.Linear would keep its own and checkpoints would not carry it: {DELAYED_SCALING_FIX}")


def norm_call_problem(delayed: str | None = DELAYED_SCALING_PROBLEM) -> str | None:
    """Why this call (the global TE / torch autocast state, read at trace time) is not expressed:
    DelayedScaling when ``delayed`` names why its state cannot be the module's (``None``: the hidden
    te.Linear runs on the module's own DelayedScaling quantizers) or ``torch.autocast``; else ``None``."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    qstate = FP8GlobalStateManager.quantization_state
    recipe = qstate.fp8_recipe
    if qstate.fp8_enabled and recipe is not None and recipe.delayed() and delayed is not None:
        return delayed
    if torch.is_autocast_enabled():
        return ("torch.autocast is enabled; TE casts the norm input to the autocast dtype inside its kernel, "
                "which the torch-ops norm does not express")
    return None


#: Mask types the SDPA path expresses; ``causal_bottom_right`` only when s_q == s_kv (checked per call).
SDPA_MASK_TYPES: frozenset[str] = frozenset({"no_mask", "causal", "causal_bottom_right"})


def dpa_config_problem(mod: Any, path: str = "SDPA") -> str | None:
    """Why ``DotProductAttention`` ``mod`` cannot go through SDPA (or ``path``, the fused-op
    rewrite's label, which shares these rules) exactly, or ``None``."""
    if mod.qkv_format not in ("sbhd", "bshd"):
        return f"qkv_format={mod.qkv_format!r} ({path} path: sbhd, bshd)"
    if mod.attn_mask_type not in SDPA_MASK_TYPES:
        return f"attn_mask_type={mod.attn_mask_type!r} ({path} path: {sorted(SDPA_MASK_TYPES)})"
    if p := window_problem(mod.window_size, mod.attn_mask_type, path):
        return p
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


#: The path label of the untouched-model polyfill's fused op (``runtime/untouched/attention.py``), the one
#: path that takes sliding windows.
FUSED_OP_PATH = "fused-op"


def window_problem(window: Any, mask: str, path: str = "SDPA") -> str | None:
    """Why ``window_size`` ``window`` (``None``, ``(-1, -1)``, ``(-1, 0)``: no window) with ``attn_mask_type``
    ``mask`` is not expressed by ``path``, or ``None``. Only :data:`FUSED_OP_PATH` takes a sliding window: the
    windows TE's ``get_attention_backend`` leaves to FusedAttention (``attention/dot_product_attention/
    utils.py``, "Filter: Sliding window attention": ``(>=0, >=0)``; a causal mask's ``(w, -1)`` is TE's
    ``(w, 0)``, ``check_set_window_size``), passed on as TE's ``FusedAttention.forward`` does. The call's
    other conditions (no dropout, ``s_q <= s_kv``, not FP8) are checked where the call is known."""
    w = tuple(window) if window is not None else (-1, -1)
    if w in ((-1, -1), (-1, 0)):
        return None
    if path != FUSED_OP_PATH:
        return f"sliding window {window} ({path} path: none)"
    ok = len(w) == 2 and w[0] >= 0 and (w[1] >= 0 or (w[1] == -1 and "causal" in mask))
    return None if ok else f"sliding window {window} with attn_mask_type={mask!r} (TE's FusedAttention: (>=0, >=0))"


def window_call_problem(mod: Any, qkv_format: str, q: Any, k: Any, kwargs: dict) -> str | None:
    """Why the sliding window of this ``DotProductAttention`` call (``kwargs["window_size"]``, else
    ``mod.window_size``; already accepted by :func:`window_problem`) cannot run for its sequence lengths
    (q / k [s, b, h, d] for ``sbhd``, [b, s, h, d] for ``bshd``): TE's FusedAttention refuses a window
    with ``s_q > s_kv`` (``get_attention_backend``)."""
    window = kwargs.get("window_size")
    window = mod.window_size if window is None else window
    if window is None or tuple(window) in ((-1, -1), (-1, 0)):
        return None
    seq = 0 if qkv_format == "sbhd" else 1
    s_q, s_kv = q.shape[seq], k.shape[seq]
    if s_q > s_kv:
        return f"sliding window {tuple(window)} with s_q={s_q} > s_kv={s_kv} (TE's FusedAttention refuses it)"
    return None


#: ``DotProductAttention.forward`` keyword arguments -> whether the SDPA path accepts the value given.
NEUTRAL_KWARGS: dict[str, Callable[[Any], bool]] = {
    **dict.fromkeys(("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "max_seqlen_q",
                     "max_seqlen_kv", "core_attention_bias", "alibi_slopes", "inference_params", "score_mod",
                     "score_mod_bprop", "score_mod_tensors", "score_mod_bprop_tensors", "thd_attention_policies"),
                    lambda v: v is None),
    **dict.fromkeys(("softcap", "checkpoint_core_attention", "pad_between_seqs", "fp8_output", "bf16_backward"),
                    lambda v: not v),
    # bottom_right_diagonal only changes causal masks with s_q != s_kv (checked)
    **dict.fromkeys(("bottom_right_diagonal", "fast_zero_fill", "thd_attention_policy_dispatch"), lambda v: True),
    "window_size": lambda v: v is None or tuple(v) in ((-1, -1), (-1, 0)),
    "core_attention_bias_type": lambda v: v in (None, "no_bias"),
    "num_splits": lambda v: v in (None, 1),
}


def dpa_call_problem(qkv_format: str, mask: str, attention_mask: Any, kwargs: dict, path: str = "SDPA") -> str | None:
    """Why this ``DotProductAttention.forward`` call (format, mask, keyword arguments, the TE
    autocast state) is not expressed by the SDPA / fused-op ``path``, or ``None``."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    for k, v in kwargs.items():
        ok = NEUTRAL_KWARGS.get(k)
        if ok is None:
            return f"keyword argument {k!r} is not one the {path} path knows"
        if k == "window_size":
            if p := window_problem(v, mask, path):
                return p
        elif not ok(v):
            return f"{k}={v!r} is not expressed by the {path} path"
    if qkv_format not in ("sbhd", "bshd"):
        return f"qkv_format={qkv_format!r} ({path} path: sbhd, bshd)"
    if mask not in SDPA_MASK_TYPES:
        return f"attn_mask_type={mask!r} ({path} path: {sorted(SDPA_MASK_TYPES)})"
    if attention_mask is not None:
        return f"an attention_mask tensor with attn_mask_type={mask!r}"
    qstate = FP8GlobalStateManager.quantization_state
    recipe = qstate.fp8_recipe
    if qstate.fp8_enabled and recipe is not None and (getattr(recipe, "fp8_dpa", False)
                                                      or getattr(recipe, "fp8_mha", False)):
        return "FP8 attention (recipe fp8_dpa/fp8_mha) is not expressed"
    return None


def resolve_mask(mod: Any, mask: str, window_size: Any, bottom_right_diagonal: Any) -> tuple[Any, bool]:
    """``(window_size, bottom_right_diagonal)`` as ``DotProductAttention.forward`` resolves them
    (``dpa_utils.check_set_window_size`` and the diagonal rules)."""
    from transformer_engine.pytorch.attention.dot_product_attention import utils as dpa_utils

    window = dpa_utils.check_set_window_size(mask, mod.window_size if window_size is None else window_size)
    brd = mod.bottom_right_diagonal if bottom_right_diagonal is None else bottom_right_diagonal
    if mask in {"causal", "padding_causal"}:
        brd = False
    if brd is None or mask in {"causal_bottom_right", "padding_causal_bottom_right"}:
        brd = True
    return tuple(window), brd
