"""TE's DelayedScaling state: where it lives, and whether te_passes can update it in a graph.

Pure TE knowledge (no hooks): the per-module ``fp8_meta`` state (``DelayedScalingRecipeState``:
``scale`` fp32 ``[n]``, ``amax_history`` fp32 ``[amax_history_len, n]``), the process-wide
buffers of ``FP8GlobalStateManager.quantization_state`` and the refusals of the in-graph update.
docs/design.md "DelayedScaling".
"""

from __future__ import annotations

import os
from typing import Any

from te_passes.te.version import is_supported, te_module

#: TE module holding the recipe state and the global state manager.
TE_QUANTIZATION_MODULE = "transformer_engine.pytorch.quantization"
#: TE's fused update kernel (``transformer_engine_torch``, csrc/extensions/recipe.cpp).
TE_UPDATE_KERNEL = "fused_amax_and_scale_update_after_reduction"
#: ``fp8_meta`` keys of the forward / backward ``DelayedScalingRecipeState``.
META_KEYS = {True: "scaling_fwd", False: "scaling_bwd"}
#: the buffers of ``FP8GlobalState`` the update reads and writes (``quantization.py`` ``FP8GlobalState``).
GLOBAL_BUFFERS = ("global_amax_buffer", "global_amax_history_buffer", "global_scale_buffer",
                  "autocast_arguments")
#: TE's switch to its unfused Python update (``reduce_and_update_fp8_tensors``).
UNFUSED_ENV = "NVTE_UNFUSED_FP8_UPDATE"


def unfused_requested() -> bool:
    """Whether ``NVTE_UNFUSED_FP8_UPDATE`` asks for TE's Python update (read as TE reads it)."""
    return bool(int(os.getenv(UNFUSED_ENV, "0")))


def layout_unchecked_reason(quantization: Any | None = None, tex: Any | None = None) -> str | None:
    """Why the installed TE's delayed-scaling layout is not the one te_passes was written against
    (``None`` when it is): an unsupported series (``te.version.SUPPORTED_TE``), or a missing
    piece of ``transformer_engine.pytorch.quantization`` / the update kernel.

    ``quantization`` / ``tex`` default to the loaded TE modules (``None`` while TE is not loaded).
    """
    if not is_supported():
        return "the installed Transformer Engine series is not one whose delayed-scaling layout was checked"
    q = quantization if quantization is not None else te_module(TE_QUANTIZATION_MODULE)
    if q is None:
        return "transformer_engine.pytorch.quantization is not loaded"
    manager = getattr(q, "FP8GlobalStateManager", None)
    state_cls = getattr(q, "FP8GlobalState", None)
    recipe_state = getattr(q, "DelayedScalingRecipeState", None)
    if manager is None or state_cls is None or recipe_state is None:
        return "FP8GlobalStateManager / FP8GlobalState / DelayedScalingRecipeState not found"
    fields = set(getattr(state_cls, "__dataclass_fields__", {}))
    missing = [b for b in GLOBAL_BUFFERS if b not in fields]
    if missing:
        return f"FP8GlobalState has no {', '.join(missing)}"
    if getattr(recipe_state, "_persistent_state_buffers", None) != ("scale", "amax_history"):
        return "DelayedScalingRecipeState's persistent state is not (scale, amax_history)"
    for name in ("reduce_and_update_fp8_tensors", "split_key_in_buffer"):
        if not hasattr(manager, name):
            return f"FP8GlobalStateManager.{name} not found"
    for name in ("check_recipe_support", "get_fp8_te_dtype", "get_fp8_max", "split_and_copy",
                 "_amax_and_scale_update"):
        if not callable(getattr(q, name, None)):
            return f"quantization.{name} not found"
    if tex is None:
        tex = getattr(q, "tex", None)
    if tex is None or not callable(getattr(tex, TE_UPDATE_KERNEL, None)):
        return f"transformer_engine_torch.{TE_UPDATE_KERNEL} not found"
    return None


def update_refused_reason(recipe: Any) -> str | None:
    """Why the scale update of ``recipe`` (a ``DelayedScaling``) cannot go into a graph, or ``None``.

    Callable ``amax_compute_algo`` / ``scaling_factor_compute_algo`` are user Python run by TE's
    unfused update; te_passes does not trace them into a graph.
    """
    if callable(getattr(recipe, "amax_compute_algo", None)):
        return "a callable amax_compute_algo (user Python in TE's unfused update)"
    if callable(getattr(recipe, "scaling_factor_compute_algo", None)):
        return "a callable scaling_factor_compute_algo (user Python in TE's unfused update)"
    if getattr(recipe, "amax_compute_algo", None) not in ("max", "most_recent"):
        return f"amax_compute_algo {getattr(recipe, 'amax_compute_algo', None)!r} (TE knows 'max', 'most_recent')"
    return None


def module_delayed_state(fp8_meta: dict) -> dict[bool, tuple[Any, Any]]:
    """``{forward: (scale, amax_history)}`` of a TE module's ``fp8_meta`` for the directions that
    hold delayed-scaling state (``DelayedScalingRecipeState``: ``scale`` ``[n]``,
    ``amax_history`` ``[amax_history_len, n]``, fp32). Empty for other recipes."""
    out = {}
    for forward, key in META_KEYS.items():
        state = fp8_meta.get(key)
        if type(state).__name__ == "DelayedScalingRecipeState":
            out[forward] = (state.scale, state.amax_history)
    return out
