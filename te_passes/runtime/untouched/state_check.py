"""A TE module prepared under another ``te.autocast`` state than the one the trace runs it under, caught in the
trace: :mod:`te_passes.runtime.untouched.state` prepares every TE module a te_inductor frame reaches at compile
start with the state active then (TE's first-forward lazy init: ``init_fp8_metadata`` ...), which is wrong for
a module the compiled function runs under its own ``te.autocast`` (an LM head under ``te.autocast(enabled=False)``
inside an fp8 region; an fp8 ``te.autocast`` inside the compiled function). TE's traced ``prepare_forward`` then
writes the state it computes (``self.fp8``) as a side effect, and the first graph's guards on the prepared state
fail on step 2: one recompile. Here TE's ``utils.nvtx_range_push`` — the call that closes
``TransformerEngineBaseModule.prepare_forward`` (``module/base.py``), right after ``init_fp8_metadata`` — gets a
polyfill whose ``comptime`` body compares the module's traced ``fp8`` with the one it was prepared with; on a
difference it prepares the module again with the traced state and restarts Dynamo's analysis of the frame
(``torch._dynamo.exc.UnspecializeRestartAnalysis``, once per module and state), so the first graph is traced, and
guarded, on the state every later step has. Docs: docs/untouched.md "Recompiles"."""

from __future__ import annotations

import threading
import types
from typing import Any

import torch
from torch._dynamo.comptime import comptime

from te_passes.runtime.te_patches.recipe_state import traced_autocast
from te_passes.runtime.untouched.state import PREPARED_KEY, active_frames, prepare_all

#: The TE function whose call closes ``prepare_forward`` (``transformer_engine/pytorch/utils.py``).
TE_UTILS_MODULE = "transformer_engine.pytorch.utils"
HOOKED = "nvtx_range_push"
#: Module attribute: the set of traced ``fp8`` values a module was prepared again with (one restart per module
#: and state).
REPREPARED_KEY = "_te_passes_reprepared"

_STATE: dict[str, Any] = {"te": None, "refused": None}
_LOCK = threading.Lock()


def _traced_fp8(ctx: Any) -> tuple[torch.nn.Module, bool] | None:
    """``(module, fp8)``: the ``self`` of the ``prepare_forward`` frame that called the polyfill and its ``fp8``
    as the trace sees it now (TE's pending write), or ``None`` (not a module te_passes prepared, not a bool)."""
    try:
        tx = ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator()
        vt = ctx.get_local("self", stacklevel=1)._i_will_not_complain_if_bc_breaks_VariableTracker()
        mod = getattr(vt, "value", None)
        if not isinstance(mod, torch.nn.Module) or PREPARED_KEY not in mod.__dict__:
            return None
        se = tx.output.side_effects
        if not se.has_pending_mutation_of_attr(vt, "fp8"):
            return None  # the trace kept the prepared value
        fp8 = se.load_attr(vt, "fp8").as_python_constant()
    except Exception:  # noqa: BLE001 - another caller, another Dynamo: nothing to check
        return None
    return (mod, fp8) if isinstance(fp8, bool) else None


def check_prepared_state(ctx: Any) -> None:
    """Comptime body of the polyfill: prepare ``self`` again and restart the analysis when the trace runs it
    under another fp8 state than it was prepared with (at most once per module and state: a second
    difference is left to Dynamo's recompile, as before).

    Raises:
        torch._dynamo.exc.UnspecializeRestartAnalysis: the module was prepared again; Dynamo traces the frame
            anew (the ``RestartAnalysis`` whose handler clears Dynamo's speculation log).
    """
    found = _traced_fp8(ctx)
    if found is None:
        return
    mod, fp8 = found
    dtype, prepared_fp8, _ = mod.__dict__[PREPARED_KEY]
    tried = mod.__dict__.setdefault(REPREPARED_KEY, set())
    if fp8 == prepared_fp8 or fp8 in tried:  # a module run under both states in one frame: restarts stop here
        return
    try:
        state = traced_autocast(ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator())
    except Exception:  # noqa: BLE001 - the state is unknown: leave it to a recompile
        return
    if fp8 and getattr(state.fp8_recipe, "delayed", lambda: False)():
        return  # DelayedScaling's state is registered at compile start (runtime/delayed/state.py), not here
    tried.add(fp8)
    prepare_all([mod], dtype, fp8, state.fp8_recipe)
    # Dynamo's restart that also clears its speculation log (the new trace takes other branches)
    raise torch._dynamo.exc.UnspecializeRestartAnalysis(
        restart_reason=f"te_passes: {type(mod).__name__} was prepared with fp8={prepared_fp8} at compile start and "
                       f"is traced under fp8={fp8}: prepared again")


def _te_copy(f: Any) -> Any:
    g = types.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    g.__qualname__, g.__module__ = f.__qualname__, f.__module__
    return g


def _nvtx_range_push(msg: str) -> None:
    if active_frames():
        comptime(check_prepared_state)
    return _STATE["te"](msg)


def install_state_check() -> bool:
    """Register the polyfill of TE's ``utils.nvtx_range_push`` (idempotent); ``False`` while TE is not imported
    or when refused (:func:`refused_reason`). Eager code and other backends run TE's function unchanged."""
    import sys

    with _LOCK:
        if _STATE["te"] is not None or _STATE["refused"] is not None:
            return _STATE["te"] is not None
        utils = sys.modules.get(TE_UTILS_MODULE)
        if utils is None:
            return False
        orig = getattr(utils, HOOKED, None)
        if not isinstance(orig, types.FunctionType):
            _STATE["refused"] = f"{TE_UTILS_MODULE}.{HOOKED} is {orig!r}, not a Python function"
            return False
        try:
            torch.compiler.substitute_in_graph(orig, skip_signature_check=True)(_nvtx_range_push)
        except (TypeError, ValueError) as e:
            _STATE["refused"] = f"substitute_in_graph({HOOKED}): {e}"
            return False
        _STATE["te"] = _te_copy(orig)  # traced as TE's own code, never as the polyfill
        return True


def refused_reason() -> str | None:
    """Why :func:`install_state_check` registered no polyfill (``None``: it did, or has not run)."""
    return _STATE["refused"]
