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

from te_passes.rewrite.module_state import STATE_ATTR, CompileFriendlyError, state_of, te_module
from te_passes.te.untouched_rules import (NEUTRAL_KWARGS, SDPA_MASK_TYPES, dpa_call_problem,  # noqa: F401
                                          dpa_config_problem, layernorm_linear_config_problem,
                                          layernorm_mlp_config_problem, norm_call_problem)


def _linear_module_problem(mod: Any, cls: type) -> str | None:
    """What refuses ``mod`` before its class's own checks: already rewritten, a subclass of TE's
    ``cls`` (its forward may differ); the configuration checks are in
    :mod:`te_passes.te.untouched_rules`."""
    if STATE_ATTR in mod.__dict__:
        return "already rewritten"
    if type(mod) is not cls:
        return f"{type(mod).__qualname__} is a subclass of te.{cls.__name__} (its forward may differ)"
    return None


def layernorm_linear_problem(mod: Any) -> str | None:
    """Why ``te.LayerNormLinear`` ``mod`` cannot be rewritten exactly, or ``None``."""
    return _linear_module_problem(mod, te_module().LayerNormLinear) or layernorm_linear_config_problem(mod)


def layernorm_mlp_problem(mod: Any) -> str | None:
    """Why ``te.LayerNormMLP`` ``mod`` cannot be rewritten exactly, or ``None``."""
    return _linear_module_problem(mod, te_module().LayerNormMLP) or layernorm_mlp_config_problem(mod)


def attention_problem(mod: Any, path: str = "SDPA") -> str | None:
    """Why ``DotProductAttention`` ``mod`` cannot go through SDPA (or ``path``, the fused-op
    rewrite's label, which shares these rules) exactly, or ``None``."""
    from transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention import (
        DotProductAttention,
    )

    if STATE_ATTR in mod.__dict__:
        return "already rewritten"
    if type(mod) is not DotProductAttention:
        return f"{type(mod).__qualname__} is a subclass of DotProductAttention (its forward may differ)"
    return dpa_config_problem(mod, path)


def multihead_attention_problem(mod: Any) -> str | None:
    """Why ``te.MultiheadAttention`` ``mod`` is not wrapped (see ``CompileFriendlyMultiheadAttention``)."""
    te = te_module()
    if STATE_ATTR in mod.__dict__:
        return "already rewritten"
    if type(mod) is not te.MultiheadAttention:
        return f"{type(mod).__qualname__} is a subclass of te.MultiheadAttention (its forward may differ)"
    return None


def multihead_attention_note(mod: Any) -> str | None:
    """What in TE's own ``MultiheadAttention.forward`` (not rewritten) still breaks the graph."""
    if getattr(mod, "attention_type", "self") == "self" and \
            mod.num_attention_heads_per_partition != mod.num_gqa_groups_per_partition:
        return ("with GQA (num_gqa_groups < heads) TE's q/k/v split uses SplitAlongDim, whose "
                "backward reads data_ptr: one graph break per layer")
    return None


def check_norm_call(mod: Any) -> None:
    """Per-call refusals of the rewritten LayerNormLinear / LayerNormMLP (trace-time Python):
    :func:`te_passes.te.untouched_rules.norm_call_problem`, raised."""
    problem = norm_call_problem()
    if problem is not None:
        raise CompileFriendlyError(f"rewritten {state_of(mod).original_cls.__name__} {mod.name or ''}: {problem}; "
                                   "or restore() the model")


def check_sdpa_call(mod: Any, qkv_format: str, mask: str, attention_mask: Any, kwargs: dict,
                     path: str = "SDPA") -> None:
    """Per-call refusals of the rewritten ``DotProductAttention`` (SDPA, or the fused op: ``path``):
    :func:`te_passes.te.untouched_rules.dpa_call_problem`, raised."""
    where = f"rewritten DotProductAttention (layer_number={getattr(mod, 'layer_number', None)})"
    unknown = [k for k in kwargs if k not in NEUTRAL_KWARGS]
    if unknown:
        raise TypeError(f"{where}: unexpected keyword argument {unknown[0]!r}")
    problem = dpa_call_problem(qkv_format, mask, attention_mask, kwargs, path)
    if problem is not None:
        raise CompileFriendlyError(f"{where}: {problem}")
