"""``compile_friendly(model)``: make TE modules that TE runs eagerly traceable as one graph.

See docs/internals.md#te_passescompatuntouchedrewritecompile_friendlypy."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import torch

from te_passes.compat.untouched.rewrite.fused_attention import (AUTO_ATTR, rewrite_fused_attention, auto_attention_problem,
                                               fused_attention_problem)
from te_passes.compat.untouched.rewrite.module_state import (  # noqa: F401 - is_rewritten: public, re-exported
    STATE_ATTR, CompileFriendlyError, te_module, is_rewritten)
from te_passes.compat.untouched.rewrite.refusals import (attention_problem, layernorm_linear_problem, layernorm_mlp_problem,
                                        multihead_attention_problem)
from te_passes.compat.untouched.rewrite.rewriters import (rewrite_attention, rewrite_layernorm_linear, rewrite_layernorm_mlp,
                                         rewrite_multihead_attention)
from te_passes.te.version import is_supported, te_version

ATTENTION_CHOICES: tuple[str, ...] = ("sdpa", "te_fused", "auto", "keep")

#: Model attribute holding the records of the last :func:`compile_friendly` call.
RECORDS_ATTR = "te_passes_rewrites"


@dataclasses.dataclass(frozen=True)
class RewriteRecord:
    """What :func:`compile_friendly` did with one module."""

    module: str
    kind: str
    action: str
    reason: str | None = None
    detail: str = ""

    def __str__(self) -> str:
        name = self.module or "<root>"
        tail = f": {self.reason}" if self.reason else (f" -> {self.detail}" if self.detail else "")
        return f"{name} ({self.kind}) {self.action}{tail}"


def _plan(model: torch.nn.Module, attention: str) -> list[tuple[str, Any, str, str | None, Callable | None]]:
    """``[(name, module, kind, problem or None, rewriter or None)]`` for each TE module ``kind`` of ``model``."""
    te = te_module()
    choose = {"MultiheadAttention": lambda m: (multihead_attention_problem(m), rewrite_multihead_attention),
              "LayerNormLinear": lambda m: (layernorm_linear_problem(m), rewrite_layernorm_linear),
              "LayerNormMLP": lambda m: (layernorm_mlp_problem(m), rewrite_layernorm_mlp),
              "DotProductAttention": {"keep": lambda m: ("attention='keep'", None), "auto": _auto_choice,
                                      "te_fused": lambda m: (fused_attention_problem(m), rewrite_fused_attention),
                                      "sdpa": lambda m: (attention_problem(m), rewrite_attention)}[attention]}
    return [(name, mod, kind, *how(mod)) for name, mod in model.named_modules()
            for kind, how in choose.items() if isinstance(mod, getattr(te, kind))]


def _auto_choice(mod: Any) -> tuple[str | None, Callable]:
    """``attention="auto"``: the fused op unless :func:`auto_attention_problem` objects, else SDPA (the
    record says why), else refused with both reasons."""
    fused = auto_attention_problem(mod)
    if fused is None:
        return None, lambda m: rewrite_fused_attention(m, auto=True)
    if (sdpa := attention_problem(mod)) is None:
        return None, lambda m: f"{rewrite_attention(m)} (te_fused not used: {fused})"
    return f"te_fused: {fused}; sdpa: {sdpa}", rewrite_attention


def compile_friendly(model: torch.nn.Module, *, attention: str = "sdpa", strict: bool = False) -> torch.nn.Module:
    """Rewrite, in place, the TE modules of ``model`` (the root included) that TE runs eagerly under
    ``torch.compile`` into traceable equivalents (docs/internals.md); returns ``model``, with
    ``model.te_passes_rewrites`` = a :class:`RewriteRecord` per TE module considered.

    Args:
        model: any ``torch.nn.Module``; its ``te.LayerNormLinear``, ``te.LayerNormMLP``,
            ``DotProductAttention`` and ``te.MultiheadAttention`` modules are considered.
        attention: ``"sdpa"`` (torch's ``scaled_dot_product_attention``), ``"keep"`` (TE's own),
            ``"te_fused"`` (TE's cuDNN attention as the ``transformer_engine_compile::fused_attn``
            op; refused with the reason where unavailable) or ``"auto"`` (``"te_fused"`` where its
            checks and cuDNN's head dims allow, per call SDPA for q/k/v not bf16/fp16 on CUDA; else
            ``"sdpa"``).
        strict: raise :class:`CompileFriendlyError` listing every refused module, before changing any.

    Raises:
        ValueError: ``attention`` is not one of :data:`ATTENTION_CHOICES`.
        TypeError: ``model`` is not a ``torch.nn.Module`` or ``strict`` is not a bool.
        CompileFriendlyError: ``strict=True`` and a module was refused.
        ImportError: Transformer Engine is not importable.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"compile_friendly: model must be a torch.nn.Module, got {type(model).__name__}")
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"attention must be one of {list(ATTENTION_CHOICES)}, got {attention!r}")
    if not isinstance(strict, bool):
        raise TypeError(f"compile_friendly: strict must be a bool (True or False), got {strict!r}")
    if not is_supported():
        raise CompileFriendlyError(f"compile_friendly mirrors TE 2.20.x module internals; installed TE is "
                                   f"{te_version()}")
    plan = _plan(model, attention)
    refused = [f"{n or '<root>'} ({k}): {p}" for n, _, k, p, fn in plan if p is not None and fn is not None]
    if strict and refused:
        raise CompileFriendlyError("compile_friendly refused: " + "; ".join(refused))
    records = [RewriteRecord(name, kind, "rewritten", None, fn(mod)) if problem is None
               else RewriteRecord(name, kind, "kept" if fn is None else "refused", problem)
               for name, mod, kind, problem, fn in plan]
    object.__setattr__(model, RECORDS_ATTR, records)
    return model


def restore(model: torch.nn.Module) -> list[str]:
    """Undo :func:`compile_friendly` on every module of ``model``; returns their names."""
    out = []
    for name, mod in model.named_modules():
        st = mod.__dict__.pop(STATE_ATTR, None)
        mod.__dict__.pop(AUTO_ATTR, None)
        if st is not None:
            mod.__class__ = st.original_cls
            out.append(name)
    return out


def rewrite_records(model: torch.nn.Module) -> list[RewriteRecord]:
    """The records of the last :func:`compile_friendly` call on ``model`` (``[]`` if none)."""
    return list(model.__dict__.get(RECORDS_ATTR, []))


def describe(records: Iterable[RewriteRecord]) -> str:
    """One line per record."""
    return "\n".join(str(r) for r in records)
