"""TE's own LayerNorm / RMSNorm kernels as the ``te_passes::te_norm_fwd`` / ``te_norm_bwd`` ops:
the untouched-model polyfills' norm under ``TE_PASSES_UNTOUCHED_NORM=te`` (numerics of TE eager;
the default is the torch-ops norm, which Inductor fuses). Calls ``transformer_engine_torch``'s
``layernorm_fwd`` / ``rmsnorm_fwd`` / ``layernorm_bwd`` / ``rmsnorm_bwd`` as TE's
``ops/basic/layer_norm.py`` / ``rmsnorm.py`` do (no output quantizer). Docs: docs/untouched.md.
"""

from __future__ import annotations

import torch

_NS = "te_passes"


@torch.library.custom_op(f"{_NS}::te_norm_fwd", mutates_args=())
def te_norm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, rms: bool,
                zero_centered_gamma: bool, sm_margin: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` [..., h] -> ``(y [..., h] in x.dtype, mu [...] fp32 (LayerNorm; RMSNorm: empty [0]),
    rsigma [...] fp32)``: the statistics per row, shaped like ``x`` without its last dim (so that a
    graph can broadcast them against ``x``: ``widen_quantized_inputs``)."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.constants import TE_DType

    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    if rms:
        y, _, rs = tex.rmsnorm_fwd(x2, weight, eps, None, None, TE_DType[x.dtype], sm_margin, zero_centered_gamma)
        mu = x2.new_empty((0,), dtype=torch.float32)
    else:
        y, mu, rs = tex.layernorm_fwd(x2, weight, bias, eps, None, None, TE_DType[x.dtype], sm_margin,
                                      zero_centered_gamma)
        mu = mu.view(x.shape[:-1])
    return y.view(x.shape), mu, rs.view(x.shape[:-1])


@te_norm_fwd.register_fake
def _(x, weight, bias, eps, rms, zero_centered_gamma, sm_margin):
    rows = x.shape[:-1]
    return (torch.empty_like(x), x.new_empty((0,) if rms else rows, dtype=torch.float32),
            x.new_empty(rows, dtype=torch.float32))


@torch.library.custom_op(f"{_NS}::te_norm_bwd", mutates_args=())
def te_norm_bwd(dy: torch.Tensor, x: torch.Tensor, mu: torch.Tensor, rsigma: torch.Tensor, weight: torch.Tensor,
                rms: bool, zero_centered_gamma: bool, sm_margin: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx [..., h], dweight [h], dbias [h] (empty for RMSNorm))``."""
    import transformer_engine_torch as tex

    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    dy2 = dy.reshape(x2.shape).contiguous()
    rs2 = rsigma.reshape(-1)
    if rms:
        dx, dw = tex.rmsnorm_bwd(dy2, x2, rs2, weight, sm_margin, zero_centered_gamma)
        db = weight.new_empty((0,))
    else:
        dx, dw, db = tex.layernorm_bwd(dy2, x2, mu.reshape(-1), rs2, weight, sm_margin, zero_centered_gamma)
    return dx.view(x.shape), dw, db


@te_norm_bwd.register_fake
def _(dy, x, mu, rsigma, weight, rms, zero_centered_gamma, sm_margin):
    return torch.empty_like(x), torch.empty_like(weight), weight.new_empty((0,) if rms else weight.shape)


def setup_norm_context(ctx, inputs, output):
    """``register_autograd`` ``setup_context`` of a norm forward op with ``te_norm_fwd``'s schema:
    saves x, mean, rsigma, weight for :func:`norm_backward`."""
    x, weight, bias, _eps, rms, zcg, _sm = inputs
    _, mu, rs = output
    ctx.save_for_backward(x, mu, rs, weight)
    ctx.rms, ctx.zcg, ctx.has_bias = rms, zcg, bias is not None


def norm_backward(ctx, dy, _dmu, _drs):
    """``register_autograd`` backward of a norm forward op with ``te_norm_fwd``'s schema: ``te_norm_bwd``
    (TE's kernel) with ``sm_margin`` 0 -> grads of x, weight, bias."""
    x, mu, rs, weight = ctx.saved_tensors
    dx, dw, db = te_norm_bwd(dy, x, mu, rs, weight, ctx.rms, ctx.zcg, 0)
    return dx, dw, (db if ctx.has_bias else None), None, None, None, None


te_norm_fwd.register_autograd(norm_backward, setup_context=setup_norm_context)


def te_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, normalization: str,
            zero_centered_gamma: bool, sm_margin: int = 0) -> torch.Tensor:
    """TE's ``normalization`` (``"LayerNorm"`` / ``"RMSNorm"``) of ``x`` [..., h] with TE's kernel,
    output in ``x.dtype``. Raises ``ValueError`` for another normalization."""
    if normalization not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"normalization {normalization!r} is neither 'LayerNorm' nor 'RMSNorm'")
    rms = normalization == "RMSNorm"
    return te_norm_fwd(x, weight, None if rms else bias, eps, rms, zero_centered_gamma, sm_margin)[0]
