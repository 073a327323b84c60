"""TE's LayerNorm / RMSNorm (``module/layernorm_linear.py``) and ``LayerNormMLP`` activations
(``transformer_engine/common/util/math.h``) in traceable torch ops: the math shared by the
untouched-model polyfills (:mod:`te_passes.runtime.untouched.polyfills`) and ``compile_friendly``
(:mod:`te_passes.rewrite`). Docs: docs/untouched.md."""

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
#: DelayedScaling (``_get_act_func_supported_list(recipe)[name][2]``, a ``tex.dbias_d*`` kernel:
#: from fp32 values); the others' gradient TE computes in the input dtype and quantizes that
#: (``module/layernorm_mlp.py``, TE 2.20.2). Checked against TE by tests/te/test_norm_act.py.
DBIAS_FUSED: frozenset[str] = frozenset({"gelu", "qgelu", "relu", "srelu", "silu"})

#: Gated activations: act(first half) * second half of the last dim, [..., 2n] -> [..., n]
#: (``activation.cpp``'s ``shape_divisor=2``, TE 2.20.2; LayerNormMLP's fc1 is twice as wide for them).
GATED: frozenset[str] = frozenset({"geglu", "glu", "qgeglu", "reglu", "sreglu", "swiglu", "clamped_swiglu"})


def activation(x: torch.Tensor, name: str, params: dict | None = None) -> torch.Tensor:
    """TE's ``LayerNormMLP`` activation ``name`` of ``x`` ([..., n] or, gated, [..., 2n] ->
    [..., n]) in torch ops, computed in fp32 like TE's kernels, returned in ``x.dtype``: the
    polyfills' activation under ``TE_PASSES_UNTOUCHED_NORM=torch`` (the default is TE's kernel,
    :mod:`te_passes.runtime.ops.te_act`). ``params``: ``activation_params`` (``clamped_swiglu``:
    ``limit``, ``alpha``, ``glu_linear_offset``). Raises ``KeyError`` for an activation outside
    :data:`ACTIVATIONS`."""
    return ACTIVATIONS[name](x.float(), params or {}).to(x.dtype)
