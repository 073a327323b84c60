"""TE's ``te.ops`` norms (``te.RMSNorm`` / ``te.LayerNorm``, ``ops/basic/rmsnorm.py`` / ``layer_norm.py``) as
``te_passes::te_ops_norm_fwd``: TE's kernels through ``te_passes::te_norm_fwd`` / ``te_norm_bwd``, under an op
of its own. A standalone ``te.ops`` norm returns its rounded output (a one-op fuser has no next op to fuse a
cast with), so a DelayedScaling te.Linear after it quantizes that rounded value as TE eager does;
``widen_quantized_inputs`` feeds fp32 only from ``te_norm_fwd`` (LayerNormLinear / LayerNormMLP, whose norm
kernel fuses the cast). Docs: docs/untouched.md.
"""

from __future__ import annotations

import torch

from te_passes.ops.te_norm import norm_backward, setup_norm_context, te_norm_fwd

FWD_OP = "te_passes::te_ops_norm_fwd"


@torch.library.custom_op(FWD_OP, mutates_args=())
def te_ops_norm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, rms: bool,
                    zero_centered_gamma: bool, sm_margin: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``te_norm_fwd``'s computation and results: ``x`` [..., h] -> ``(y [..., h] in x.dtype, mu [...] fp32
    (RMSNorm: empty [0]), rsigma [...] fp32)``."""
    return te_norm_fwd(x, weight, bias, eps, rms, zero_centered_gamma, sm_margin)


@te_ops_norm_fwd.register_fake
def _(x, weight, bias, eps, rms, zero_centered_gamma, sm_margin):
    return te_norm_fwd(x, weight, bias, eps, rms, zero_centered_gamma, sm_margin)  # its fake


te_ops_norm_fwd.register_autograd(norm_backward, setup_context=setup_norm_context)


def te_ops_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, normalization: str,
                zero_centered_gamma: bool, sm_margin: int = 0) -> torch.Tensor:
    """A ``te.ops`` ``normalization`` (``"LayerNorm"`` / ``"RMSNorm"``) of ``x`` [..., h] with TE's kernel, output in
    ``x.dtype`` (TE's backward with ``sm_margin`` 0). Raises ``ValueError`` for another normalization."""
    if normalization not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"normalization {normalization!r} is neither 'LayerNorm' nor 'RMSNorm'")
    rms = normalization == "RMSNorm"
    return te_ops_norm_fwd(x, weight, None if rms else bias, eps, rms, zero_centered_gamma, sm_margin)[0]
