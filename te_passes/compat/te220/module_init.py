"""What TE modules' first forward initialises lazily (for :func:`te_passes.compat.untouched.rewrite.te_state.prepare_te_state`)."""

from __future__ import annotations

from typing import Any


def forward_prepare_args(module: Any) -> tuple[int, bool] | None:
    """``(num_gemms, allow_different_data_and_param_types)`` ``module``'s forward passes to
    ``prepare_forward``, or ``None`` for a class not audited here."""
    import transformer_engine.pytorch as te

    cls = type(module)
    if cls in (te.Linear, te.LayerNormLinear):
        return 1, False
    if cls is te.LayerNormMLP:
        return 2, False
    if cls is te.GroupedLinear:
        return int(module.num_gemms), False
    if cls is te.DotProductAttention:
        return 3, module.softmax_type != "vanilla"
    return None
