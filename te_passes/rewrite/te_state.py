"""``prepare_te_state``: do TE's first-forward lazy initialisation before ``torch.compile`` sees it.

TE 2.20.2 initialises state lazily on the first forward, and each piece is a Python attribute
Dynamo guards on while tracing that first call; the compiled first call then changes it, so the
second call fails the guard and every frame recompiles once (issue 15: 4 recompiles in one
``te.TransformerLayer``, 11 over 4 fp8 layers). Found on CPU with fake CUDA tensors
(docs/usage.md), the guards that fail on call 2:

* ``Recipe._cached_repr`` — ``te.autocast`` -> ``FP8GlobalStateManager.get_unique_autocast_key``
  -> ``str(recipe)`` caches the repr on the recipe (``common/recipe/__init__.py``);
* ``FP8GlobalStateManager.quantization_state.autocast_arguments`` — filled by the first
  ``autocast_enter`` (``pytorch/quantization.py``);
* ``module._is_fsdp2`` — the lazily cached ``TransformerEngineBaseModule.is_fsdp2`` property;
* ``module.fp8`` / ``fp8_meta`` / quantizers — ``init_fp8_metadata`` in ``prepare_forward``;
* ``module.activation_dtype`` — ``set_activation_dtype`` in ``prepare_forward``
  (``pytorch/module/base.py``).

:func:`prepare_te_state` performs exactly these with TE's own methods, eagerly, so the first
trace already sees the steady state.
"""

from __future__ import annotations

from typing import Any

import torch

from te_passes.rewrite.module_state import _state, is_rewritten


def _prepared_modules(model: torch.nn.Module) -> list[Any]:
    """The TE modules whose traced forward runs TE's ``prepare_forward``: every ``te.Linear`` in
    ``model`` and the hidden ``te.Linear``\\ s of modules rewritten by ``compile_friendly``."""
    import transformer_engine.pytorch as te

    mods = [m for m in model.modules() if isinstance(m, te.Linear)]
    for m in model.modules():
        if is_rewritten(m):
            mods.extend(_state(m).linears)
    return mods


def prepare_te_state(model: torch.nn.Module, recipe: Any, *, fp8: bool,
                     dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Run TE's first-forward lazy initialisation for ``model`` eagerly (see the module doc).

    Args:
        model: the model about to be compiled (call :func:`te_passes.compile_friendly` first if
            it is used: the hidden ``te.Linear``\\ s and the rewritten ``MultiheadAttention``\\ s'
            default recipes are prepared too).
        recipe: the recipe object the compiled function passes to ``te.autocast`` (the same
            object: its cached repr is part of the guard), or ``None`` when the compiled function
            enters no ``te.autocast`` (bf16 with ``compile_friendly``).
        fp8: ``enabled`` of that ``te.autocast``.
        dtype: the activation dtype the model will be called with.

    Returns:
        The names of what was initialised (for a record).

    Raises:
        ValueError: ``fp8=True`` without a recipe.
        TypeError: a prepared module's parameters are not ``dtype`` (TE's ``set_activation_dtype``).
    """
    import contextlib

    import transformer_engine.pytorch as te

    if fp8 and recipe is None:
        raise ValueError("prepare_te_state: fp8=True needs the recipe the compiled function uses")
    done = []
    defaults = [_state(m).recipe for m in model.modules() if is_rewritten(m) and _state(m).recipe is not None]
    for r in defaults:  # CompileFriendlyMultiheadAttention enters these with FP8 off
        str(r)
        with te.autocast(enabled=False, recipe=r):
            pass
    if defaults:
        done.append(f"{len(defaults)} MultiheadAttention default recipe(s): repr, autocast_arguments")
    if recipe is not None:
        str(recipe)
        done.append("recipe repr, autocast_arguments")
    mods = _prepared_modules(model)
    with te.autocast(enabled=fp8, recipe=recipe) if recipe is not None else contextlib.nullcontext():
        probe = torch.empty(0, dtype=dtype)
        for m in mods:
            _ = m.is_fsdp2
            # what te.Linear.forward's prepare_forward(inp) sets before set_activation_dtype
            m.fast_setattr("allow_different_data_and_param_types", False)
            m.set_activation_dtype(probe)
            m.init_fp8_metadata()
    done.append(f"{len(mods)} te.Linear: is_fsdp2, activation_dtype, fp8 metadata")
    return done
