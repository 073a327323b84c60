"""``prepare_te_state``: do TE's first-forward lazy initialisation before ``torch.compile`` sees it.

See docs/internals.md#te_passescompatuntouchedrewritete_statepy."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from te_passes.compat.untouched.rewrite.module_state import is_rewritten, state_of
from te_passes.compat.te220.module_init import forward_prepare_args


def te_modules_to_prepare(model: torch.nn.Module) -> tuple[list[tuple[str, Any, tuple[int, bool]]], list[str]]:
    """``(prepared, skipped)``: the TE modules of ``model`` whose first-forward state :func:`prepare_te_state`
    sets as ``(name, module, (num_gemms, allow_different_data_and_param_types))``, and a line per TE module
    of a class whose ``num_gemms`` is unknown (a guess could leave TE with the wrong quantizers)."""
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    prepared, skipped = [], []
    for name, m in model.named_modules():
        if is_rewritten(m):
            prepared.extend((f"{name}.<hidden te.Linear {i}>", lin, (1, False))
                            for i, lin in enumerate(state_of(m).linears))
            continue
        if not isinstance(m, TransformerEngineBaseModule):
            continue
        args = forward_prepare_args(m)
        if args is None:
            skipped.append(f"{name or '<model>'} ({type(m).__qualname__}): not an audited TE 2.20.2 class, "
                           "its prepare_forward arguments are unknown; not prepared (may recompile on step 2)")
        else:
            prepared.append((name or "<model>", m, args))
    return prepared, skipped


def prime_recipe(recipe: Any) -> None:
    """Fill what TE's first ``te.autocast(recipe=recipe)`` caches: the recipe's repr and the
    ``autocast_arguments`` entry keyed by it. Raises ``TypeError``: ``recipe`` is not a TE ``Recipe``."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import Recipe

    if not isinstance(recipe, Recipe):
        raise TypeError("prime_recipe: expected a transformer_engine.common.recipe.Recipe, "
                        f"got {type(recipe).__name__}")
    str(recipe)
    with te.autocast(enabled=False, recipe=recipe):
        pass


def prepare_te_state(model: torch.nn.Module, recipe: Any, *, fp8: bool,
                     dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Run TE's first-forward lazy initialisation for ``model`` eagerly, so the first trace sees the
    steady state (docs/internals.md#te_passescompatuntouchedrewritete_statepy).

    Args:
        model: the model about to be compiled (after :func:`te_passes.compile_friendly`, if used).
        recipe: the very recipe object the compiled function passes to ``te.autocast``, or ``None``.
        fp8: ``enabled`` of that ``te.autocast``. dtype: the activation dtype of the calls.

    Returns:
        What was initialised, one line per kind, plus a line per TE module left unprepared.

    Raises:
        ValueError: ``fp8=True`` without a recipe.
        TypeError: ``model`` is not a ``torch.nn.Module``, a prepared module's parameters are not ``dtype``
            (under ``torch.autocast``: prepare inside it), ``recipe`` is not a TE ``Recipe``, ``fp8`` not a
            bool, ``dtype`` not a ``torch.dtype``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"prepare_te_state: model must be a torch.nn.Module (the model about to be compiled), "
                        f"got {type(model).__name__}")
    import transformer_engine.pytorch as te

    if not isinstance(fp8, bool):
        raise TypeError(f"prepare_te_state: fp8 must be a bool (True or False), got {fp8!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"prepare_te_state: dtype must be a torch.dtype (e.g. torch.bfloat16), got {dtype!r}")
    if fp8 and recipe is None:
        raise ValueError("prepare_te_state: fp8=True needs the recipe the compiled function uses")
    done = []
    defaults = [state_of(m).recipe for m in model.modules() if is_rewritten(m) and state_of(m).recipe is not None]
    for r in defaults:  # CompileFriendlyMultiheadAttention enters these with FP8 off
        prime_recipe(r)
    if defaults:
        done.append(f"{len(defaults)} MultiheadAttention default recipe(s): repr, autocast_arguments")
    if recipe is not None:
        prime_recipe(recipe)
        done.append("recipe repr, autocast_arguments")
    mods, skipped = te_modules_to_prepare(model)
    # no_grad: with grad on, the outer te.autocast's exit runs TE's DelayedScaling scale update
    with torch.no_grad(), te.autocast(enabled=fp8, recipe=recipe) if recipe is not None else contextlib.nullcontext():
        probe = torch.empty(0, dtype=dtype)
        for name, m, (num_gemms, allow_mixed) in mods:
            _ = m.is_fsdp2
            # what prepare_forward(inp, num_gemms, ...) does before and in its lazy-init calls
            m.fast_setattr("allow_different_data_and_param_types", allow_mixed)
            try:
                m.set_activation_dtype(probe)
            except TypeError as e:  # TE: parameters of another dtype than the activations
                raise TypeError(f"prepare_te_state: {name} ({type(m).__name__}) with dtype={dtype}: "
                                f"{e} (pass dtype= the dtype the model is called with)") from e
            m.init_fp8_metadata(num_gemms=num_gemms)
    if recipe is not None:  # again: NVTE_DPA_FP8_RECIPE=F16 makes DPA set recipe attributes (clears the repr)
        prime_recipe(recipe)
    kinds = sorted({type(m).__name__ for _, m, _ in mods})
    done.append(f"{len(mods)} TE module(s) ({', '.join(kinds)}): is_fsdp2, activation_dtype, fp8 metadata")
    done.extend(skipped)
    return done


def unprepared_te_state(model: torch.nn.Module, recipe: Any, *, fp8: bool,
                        dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """What of TE's first-forward state the first compiled call would still change, a line per module
    (name, class, attribute, found vs expected) ending in the fix."""
    fix = "call te_passes.prepare_te_state(model, recipe, fp8=...) before torch.compile"
    out = []
    if recipe is not None and "_cached_repr" not in recipe.__dict__:
        out.append(f"recipe {type(recipe).__name__}: repr not cached (Recipe.__repr__ caches it on the "
                   f"first te.autocast): {fix}")
    mods, skipped = te_modules_to_prepare(model)
    for name, m, (num_gemms, _) in mods:
        found = {"activation_dtype": m.activation_dtype, "fp8": m.fp8, "is_fsdp2 cached": "_is_fsdp2" in m.__dict__}
        want = {"activation_dtype": dtype, "fp8": fp8, "is_fsdp2 cached": True}
        if fp8:
            found.update(fp8_initialized=m.fp8_initialized, num_gemms=m.fp8_meta.get("num_gemms"))
            want.update(fp8_initialized=True, num_gemms=num_gemms)
            if type(m).__name__ != "DotProductAttention":  # DPA may hold its own recipe (NVTE_DPA_FP8_RECIPE)
                # init_fp8_metadata re-initialises when the autocast recipe != fp8_meta["recipe"]
                found["recipe equal"] = m.fp8_meta.get("recipe") == recipe
                want["recipe equal"] = True
        bad = [f"{k} {found[k]!r} (first forward sets {want[k]!r})" for k in want if found[k] != want[k]]
        if bad:
            out.append(f"{name} ({type(m).__name__}): {', '.join(bad)}: {fix}")
    return out + skipped
