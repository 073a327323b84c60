"""TE's LayerNorm / RMSNorm (``module/layernorm_linear.py``) and ``LayerNormMLP`` activations
(``transformer_engine/common/util/math.h``) in traceable torch ops: the math shared by the
untouched-model polyfills (:mod:`te_passes.compat.untouched.polyfills`) and ``compile_friendly``
(:mod:`te_passes.compat.untouched.rewrite`). Docs: docs/untouched.md."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def normalize(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
              normalization: str, zero_centered_gamma: bool) -> torch.Tensor:
    """TE's LayerNorm / RMSNorm over the last dim, in fp32, output in ``x.dtype``."""
    shape = (x.shape[-1],)
    w = weight.float()
    if zero_centered_gamma:
        w = w + 1.0
    if normalization == "LayerNorm":
        y = F.layer_norm(x.float(), shape, w, None if bias is None else bias.float(), eps)
    elif normalization == "RMSNorm":
        y = F.rms_norm(x.float(), shape, w, eps)
    else:
        raise ValueError(f"normalization {normalization!r} is neither 'LayerNorm' nor 'RMSNorm'")
    return y.to(x.dtype)


def _gated(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor, dict], torch.Tensor]:
    # TE's gated kernels (gated_act_fn): act(first half) * second half of the last dim.
    def f(x: torch.Tensor, params: dict) -> torch.Tensor:
        a, b = x.chunk(2, dim=-1)
        return act(a) * b
    return f


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")  # TE's gelu is the tanh approximation (math.h)


def _qgelu(x: torch.Tensor, alpha: float = 1.702) -> torch.Tensor:
    return x * torch.sigmoid(alpha * x)  # "quick GELU" (math.h qgelu_with_alpha)


def _srelu(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


def _clamped_swiglu(x: torch.Tensor, params: dict) -> torch.Tensor:
    # math.h ClampedSwiGLUParam / clamped_silu: the activated half is clamped from above and goes
    # through qgelu with ``alpha``; the linear half is clamped to [-limit, limit] plus the offset.
    limit = float(params.get("limit", 7.0))
    alpha = float(params.get("alpha", 1.702))
    offset = float(params.get("glu_linear_offset", 1.0))
    a, b = x.chunk(2, dim=-1)
    return _qgelu(a.clamp(max=limit), alpha) * (b.clamp(-limit, limit) + offset)


#: TE ``LayerNormMLP`` activations (``_get_act_func_supported_list``) -> ``f(x_fp32, params)``.
ACTIVATIONS: dict[str, Callable[[torch.Tensor, dict], torch.Tensor]] = {
    "gelu": lambda x, p: _gelu_tanh(x),
    "geglu": _gated(_gelu_tanh),
    "glu": _gated(torch.sigmoid),
    "qgelu": lambda x, p: _qgelu(x),
    "qgeglu": _gated(_qgelu),
    "relu": lambda x, p: F.relu(x),
    "reglu": _gated(F.relu),
    "srelu": lambda x, p: _srelu(x),
    "sreglu": _gated(_srelu),
    "silu": lambda x, p: F.silu(x),
    "swiglu": _gated(F.silu),
    "clamped_swiglu": _clamped_swiglu,
}


#: Activations whose backward TE fuses with fc1's grad-output FP8 cast and the bias gradient under
#: DelayedScaling and MXFP8 (``_get_act_func_supported_list(recipe)[name][2]``, a ``tex.dbias_d*`` kernel:
#: from fp32 values); the others' gradient TE computes in the input dtype and quantizes that
#: (``module/layernorm_mlp.py``, TE 2.20.2). Checked against TE by tests/te/test_norm_act.py.
DBIAS_FUSED: frozenset[str] = frozenset({"gelu", "qgelu", "relu", "srelu", "silu"})

#: What TE eager's ``LayerNormLinear`` / ``LayerNormMLP`` quantize for a GEMM input that one of its
#: norm / activation kernels produced, per the GEMM's quantizer class (TE 2.20.2:
#: ``csrc/extensions/normalization.cpp`` ``layernorm_fwd`` / ``rmsnorm_fwd``, ``activation.cpp``
#: ``activation_helper``, ``bias.cpp`` ``dact_dbias``, ``module/layernorm_mlp.py``), source
#: ``"norm"`` (the norm's output), ``"act"`` (the activation, fc2's input) or ``"dact"`` (the
#: activation's gradient, fc1's grad output; only for :data:`DBIAS_FUSED` activations):
#: ``"fp32"``: the kernel writes the quantized tensor from its fp32 values (scale, amax and cast);
#: ``"amax"``: the kernel writes the input dtype plus the amax of its fp32 values, and the cast
#: scales the rounded values by that amax (Float8CurrentScaling's ``FUSED_ACTIVATION_AMAX_FP8``).
#: Absent: the kernel writes the input dtype and the cast takes that tensor's own amax (the norm
#: kernels' amax is of the rounded values, ``rmsnorm_fwd_kernels.cuh``), as the untouched split
#: does. MXFP8's norm is unfused unless ``NVTE_NORM_FWD_USE_CUDNN=1`` (:data:`CUDNN_NORM_ENV`).
FUSED_QUANTIZE: dict[str, dict[str, str]] = {
    "Float8Quantizer": {"norm": "fp32", "act": "fp32", "dact": "fp32"},        # DelayedScaling
    "MXFP8Quantizer": {"act": "fp32", "dact": "fp32"},                          # MXFP8BlockScaling
    "Float8CurrentScalingQuantizer": {"act": "amax"},                           # Float8CurrentScaling
    "Float8BlockQuantizer": {},                                                 # Float8BlockScaling
}
#: The recipe each quantizer class of :data:`FUSED_QUANTIZE` belongs to (``transformer_engine.common.recipe``).
QUANTIZER_RECIPES: dict[str, str] = {"Float8Quantizer": "DelayedScaling", "MXFP8Quantizer": "MXFP8BlockScaling",
                                     "Float8CurrentScalingQuantizer": "Float8CurrentScaling",
                                     "Float8BlockQuantizer": "Float8BlockScaling"}
#: TE's switch to cuDNN's norm kernels; with an MXFP8 quantizer and both dims multiples of 128 TE's
#: norm then writes MXFP8 straight from cuDNN's fp32 values (``normalization.cpp``).
CUDNN_NORM_ENV = "NVTE_NORM_FWD_USE_CUDNN"


def fused_quantize(quantizer_cls: str, source: str, activation: str | None = None) -> str | None:
    """:data:`FUSED_QUANTIZE`'s rule (``"fp32"``, ``"amax"`` or ``None``: the split's bf16 value is
    TE eager's) for a GEMM input of quantizer class ``quantizer_cls`` (its ``__name__``) produced
    by ``source`` (``"norm"``, ``"act"``, ``"dact"``; ``activation``: the activation's name, which
    decides ``"dact"``). Raises ``KeyError`` for a quantizer class TE's table was not read for
    (NVFP4, custom recipes) and ``ValueError`` for another source."""
    if source not in ("norm", "act", "dact"):
        raise ValueError(f"source {source!r} is not 'norm', 'act' or 'dact'")
    if quantizer_cls not in FUSED_QUANTIZE:
        raise KeyError(f"quantizer class {quantizer_cls!r}: which values TE's fused kernels quantize for it was "
                       f"not read (known: {sorted(FUSED_QUANTIZE)})")
    if source == "dact" and activation not in DBIAS_FUSED:
        return None
    return FUSED_QUANTIZE[quantizer_cls].get(source)


#: Gated activations: act(first half) * second half of the last dim, [..., 2n] -> [..., n]
#: (``activation.cpp``'s ``shape_divisor=2``, TE 2.20.2; LayerNormMLP's fc1 is twice as wide for them).
GATED: frozenset[str] = frozenset({"geglu", "glu", "qgeglu", "reglu", "sreglu", "swiglu", "clamped_swiglu"})


def activation(x: torch.Tensor, name: str, params: dict | None = None) -> torch.Tensor:
    """TE's ``LayerNormMLP`` activation ``name`` of ``x`` ([..., n] or, gated, [..., 2n] ->
    [..., n]) in torch ops, computed in fp32 like TE's kernels, returned in ``x.dtype``: the
    polyfills' activation under ``TE_PASSES_UNTOUCHED_NORM=torch`` (the default is TE's kernel,
    :mod:`te_passes.ops.te_act`). ``params``: ``activation_params`` (``clamped_swiglu``:
    ``limit``, ``alpha``, ``glu_linear_offset``). Raises ``KeyError`` for an activation outside
    :data:`ACTIVATIONS`."""
    return ACTIVATIONS[name](x.float(), params or {}).to(x.dtype)
