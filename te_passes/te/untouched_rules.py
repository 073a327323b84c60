"""Which ``te.LayerNormLinear`` / ``te.LayerNormMLP`` configurations and calls the torch-ops
norm + ``te.Linear`` form expresses exactly (TE knowledge shared by the untouched-model polyfills,
:mod:`te_passes.runtime.untouched`, and ``compile_friendly``). Each function returns the reason a
configuration is not expressed, or ``None``. Mirrors TE ``module/layernorm_linear.py``,
``module/layernorm_mlp.py``, ``module/base.py``. Docs: docs/untouched.md."""

from __future__ import annotations

from typing import Any

import torch

from te_passes.te.norm_act import ACTIVATIONS

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
        return "checkpoint=True (TE's own activation recompute)"
    if getattr(mod, "gemm_gelu_fusion", False):
        return "NVTE_GEMM_GELU_FUSION (GEMM+GELU fused with UB overlap)"
    if mod.activation_params and mod.activation != "clamped_swiglu":
        return f"activation_params {mod.activation_params!r} for {mod.activation!r}"
    return None


def norm_call_problem() -> str | None:
    """Why this call (the global TE / torch autocast state, read at trace time) is not expressed:
    DelayedScaling (amax history in the module's fp8 meta) or ``torch.autocast``; else ``None``."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    qstate = FP8GlobalStateManager.quantization_state
    recipe = qstate.fp8_recipe
    if qstate.fp8_enabled and recipe is not None and recipe.delayed():
        return ("DelayedScaling keeps amax history in the module's fp8 meta (its _extra_state); a hidden "
                f"te.Linear would keep its own and checkpoints would not carry it: {DELAYED_SCALING_FIX}")
    if torch.is_autocast_enabled():
        return ("torch.autocast is enabled; TE casts the norm input to the autocast dtype inside its kernel, "
                "which the torch-ops norm does not express")
    return None
