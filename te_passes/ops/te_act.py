"""TE's own LayerNormMLP activation kernels as the ``te_passes::te_act_fwd`` / ``te_act_bwd`` ops:
the untouched-model polyfills' activation under ``TE_PASSES_UNTOUCHED_NORM=te`` (the default; TE
eager's numerics). Calls ``transformer_engine_torch``'s ``gelu`` / ``dgelu`` and kin with no
quantizer, as ``module/layernorm_mlp.py`` (``_get_act_func_supported_list``, TE 2.20.2) does when
it does not fuse the FP8 cast. Docs: docs/untouched.md.
"""

from __future__ import annotations

import torch

from te_passes.te.norm_act import ACTIVATIONS, GATED

_NS = "te_passes"
FWD_OP = f"{_NS}::te_act_fwd"
BWD_OP = f"{_NS}::te_act_bwd"


def _params(name: str, limit: float, alpha: float, offset: float) -> dict:
    # tex.clamped_swiglu / clamped_dswiglu take (limit, alpha, glu_linear_offset); the others none
    return {"limit": limit, "alpha": alpha, "glu_linear_offset": offset} if name == "clamped_swiglu" else {}


@torch.library.custom_op(FWD_OP, mutates_args=())
def te_act_fwd(x: torch.Tensor, name: str, limit: float, alpha: float, offset: float) -> torch.Tensor:
    """``tex.<name>(x, None)``: ``x`` [..., n] (gated: [..., 2n]) -> [..., n] in ``x.dtype``
    (TE computes in fp32 and rounds on the way out)."""
    import transformer_engine_torch as tex

    return getattr(tex, name)(x.contiguous(), None, **_params(name, limit, alpha, offset))


@te_act_fwd.register_fake
def _(x, name, limit, alpha, offset):
    shape = (*x.shape[:-1], x.shape[-1] // 2) if name in GATED else x.shape
    return x.new_empty(shape)


def backward_kernel(name: str) -> str:
    """The name of ``tex``'s backward function of activation ``name`` (``dgelu``, ``clamped_dswiglu``)."""
    return "clamped_dswiglu" if name == "clamped_swiglu" else f"d{name}"


@torch.library.custom_op(BWD_OP, mutates_args=())
def te_act_bwd(grad: torch.Tensor, x: torch.Tensor, name: str, limit: float, alpha: float,
               offset: float) -> torch.Tensor:
    """``tex.d<name>(grad, x, None)``: the gradient [x.shape] in ``x.dtype``."""
    import transformer_engine_torch as tex

    return getattr(tex, backward_kernel(name))(grad.contiguous(), x.contiguous(), None,
                                          **_params(name, limit, alpha, offset))


@te_act_bwd.register_fake
def _(grad, x, name, limit, alpha, offset):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    x, ctx.name, ctx.limit, ctx.alpha, ctx.offset = inputs
    ctx.save_for_backward(x)


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return te_act_bwd(grad, x, ctx.name, ctx.limit, ctx.alpha, ctx.offset), None, None, None, None


te_act_fwd.register_autograd(_backward, setup_context=_setup)


def te_activation(x: torch.Tensor, name: str, params: dict | None = None) -> torch.Tensor:
    """TE's LayerNormMLP activation ``name`` of ``x`` with TE's kernel, output in ``x.dtype``;
    ``params``: ``activation_params`` (``clamped_swiglu``: ``limit``, ``alpha``,
    ``glu_linear_offset``, TE's defaults 7.0, 1.702, 1.0). Raises ``KeyError`` for an activation
    outside ``te.norm_act.ACTIVATIONS``."""
    if name not in ACTIVATIONS:
        raise KeyError(f"activation {name!r} is not one of TE's LayerNormMLP activations {sorted(ACTIVATIONS)}")
    p = params or {}
    return te_act_fwd(x, name, float(p.get("limit", 7.0)), float(p.get("alpha", 1.702)),
                      float(p.get("glu_linear_offset", 1.0)))
