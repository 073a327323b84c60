"""Why a TE module cannot be rewritten exactly by :func:`~te_passes.compat.untouched.rewrite.compile_friendly.compile_friendly`
(checked at rewrite time), and the rewritten modules' per-call checks (raising ``CompileFriendlyError``
while tracing). docs/internals.md#te_passescompatuntouchedrewriterefusalspy."""

from __future__ import annotations

from typing import Any, Callable

import torch

from te_passes.compat.untouched.rewrite.module_state import STATE_ATTR, CompileFriendlyError, state_of, te_module
from te_passes.compat.te220.untouched_rules import (NEUTRAL_KWARGS, dpa_call_problem, dpa_config_problem,
                                                    layernorm_linear_config_problem, layernorm_mlp_config_problem,
                                                    norm_call_problem)


def _module_problem(mod: Any, cls: type, label: str) -> str | None:
    """``"already rewritten"``, or ``mod`` is a subclass of TE's ``cls`` (its forward may differ)."""
    if STATE_ATTR in mod.__dict__:
        return "already rewritten"
    if type(mod) is not cls:
        return f"{type(mod).__qualname__} is a subclass of {label} (its forward may differ)"
    return None


def layernorm_linear_problem(mod: Any) -> str | None:
    """Why ``te.LayerNormLinear`` ``mod`` cannot be rewritten exactly, or ``None``."""
    cls = te_module().LayerNormLinear
    return _module_problem(mod, cls, "te.LayerNormLinear") or layernorm_linear_config_problem(mod)


def layernorm_mlp_problem(mod: Any) -> str | None:
    """Why ``te.LayerNormMLP`` ``mod`` cannot be rewritten exactly, or ``None``."""
    return _module_problem(mod, te_module().LayerNormMLP, "te.LayerNormMLP") or layernorm_mlp_config_problem(mod)


def attention_problem(mod: Any, path: str = "SDPA") -> str | None:
    """Why ``DotProductAttention`` ``mod`` cannot go through SDPA (or ``path``: the fused op, which
    shares these rules) exactly, or ``None``."""
    return _module_problem(mod, te_module().DotProductAttention, "DotProductAttention") or dpa_config_problem(mod, path)


def multihead_attention_problem(mod: Any) -> str | None:
    """Why ``te.MultiheadAttention`` ``mod`` is not wrapped, or ``None``."""
    return _module_problem(mod, te_module().MultiheadAttention, "te.MultiheadAttention")


def multihead_attention_note(mod: Any) -> str | None:
    """What in TE's own ``MultiheadAttention.forward`` (not rewritten) still breaks the graph."""
    if getattr(mod, "attention_type", "self") == "self" and \
            mod.num_attention_heads_per_partition != mod.num_gqa_groups_per_partition:
        return ("with GQA (num_gqa_groups < heads) TE's q/k/v split uses SplitAlongDim, whose "
                "backward reads data_ptr: one graph break per layer")
    return None


def check_norm_call(mod: Any) -> None:
    """Raise the rewritten LayerNormLinear / LayerNormMLP's per-call refusal (``norm_call_problem``)."""
    if (problem := norm_call_problem()) is not None:
        raise CompileFriendlyError(f"rewritten {state_of(mod).original_cls.__name__} {mod.name or ''}: {problem}; "
                                   "or restore() the model")


def check_sdpa_call(mod: Any, qkv_format: str | None, mask: str | None, attention_mask: Any, kwargs: dict,
                    path: str = "SDPA") -> tuple[str, str]:
    """``(qkv_format, mask)`` of a call of the rewritten ``DotProductAttention`` (``path``: SDPA or the fused
    op), its defaults filled in; raises its per-call refusal (``dpa_call_problem``), ``TypeError`` for an
    unknown keyword."""
    qkv_format, mask = qkv_format or mod.qkv_format, mask or mod.attn_mask_type
    where = f"rewritten DotProductAttention (layer_number={getattr(mod, 'layer_number', None)})"
    unknown = [k for k in kwargs if k not in NEUTRAL_KWARGS]
    if unknown:
        raise TypeError(f"{where}: unexpected keyword argument {unknown[0]!r}")
    if (problem := dpa_call_problem(qkv_format, mask, attention_mask, kwargs, path)) is not None:
        raise CompileFriendlyError(f"{where}: {problem}")
    return qkv_format, mask
