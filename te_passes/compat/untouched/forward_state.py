"""TE's first-forward lazy state of a module, done with the state the trace runs it under: the replacement of
``TransformerEngineBaseModule.prepare_forward`` (TE 2.20.2 ``pytorch/module/base.py``; a class rebind, row
``untouched.prepare_forward``) for te_inductor frames.

TE's ``prepare_forward`` reads ``self.fp8`` (``if self.fp8 and in_fp8_activation_recompute_phase()``) and
``init_fp8_metadata`` reads ``fp8_initialized`` and ``fp8_meta["recipe"]`` (``set_activation_dtype``:
``activation_dtype``) *before* writing the values of the ``te.autocast`` state active now. Dynamo guards on the
values the module held before the frame; when those come from another state (a ``te.autocast`` inside the
compiled function, where the compile-start callback saw none; a nested ``te.autocast(enabled=False)`` LM head
prepared with the outer fp8 state) the second step fails the guards: one recompile (issue 38). The polyfill's
``comptime`` body runs TE's lazy init eagerly with the traced call's state (dtype, fp8, recipe) *before* TE's
``prepare_forward`` reads it, then TE's own ``prepare_forward`` is traced (its writes are then no-ops). When the
trace already read some of that state (TE's ``MultiheadAttention`` sets ``proj``'s quantizer roles first, and
Dynamo caches the values of ``proj.__dict__``), changing it would leave guards that disagree with the graph: the
analysis is restarted after preparing, once per module and state. Not in TE's activation-recompute phase (TE
needs the previous ``fp8`` there) nor under fp8 calibration. Docs:
docs/untouched.md "Recompiles"."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch._dynamo.comptime import comptime

from te_passes.compat import table
from te_passes.compat.delayed_scaling.state import DELAYED_ATTR
from te_passes.compat.untouched.state import PREPARED_KEY, active_frames, keeping_fp8_initialized, prepare_all

#: TE's class and method the row rebinds (``transformer_engine/pytorch/module/base.py``).
TE_BASE_MODULE = "transformer_engine.pytorch.module.base"
TARGET = "TransformerEngineBaseModule.prepare_forward"
#: The module attributes TE's first forward reads before it writes them (``prepare_forward``,
#: ``set_activation_dtype``, ``init_fp8_metadata``) or that ``state.prepare_te_module`` writes: once the trace
#: has read one of them (or the module's ``__dict__`` itself) preparing the module restarts the analysis.
STATE_ATTRS: tuple[str, ...] = ("fp8", "fp8_initialized", "fp8_meta", "fp8_parameters", "fp8_calibration",
                                "activation_dtype", "allow_different_data_and_param_types", "quantizers",
                                "_is_fsdp2")
#: Module attribute: the prepared keys (:data:`PREPARED_KEY`) the analysis was restarted for (once per module and key).
RESTARTED_KEY = table.register_stamp("_te_passes_restarted_for", "the (dtype, fp8, recipe) states a TE module was "
                                     "prepared again with in a trace, restarting Dynamo's analysis (once per state)")
#: TE's own ``prepare_forward`` (the class attribute the row rebinds to the polyfill); set by the row's plan.
TE_FUNCTION: list[Callable[..., Any]] = []


def _object_of(vt: Any) -> Any:
    """The object variable tracker ``vt`` stands for, without realising a lazy one (realising installs guards)."""
    if type(vt).__name__ in ("LazyVariableTracker", "LazyConstantVariable"):
        if not vt.is_realized():
            return vt.peek_value()
        vt = vt.unwrap()
    return vt.__dict__.get("value")


def _state_read(tx: Any, vt: Any, mod: torch.nn.Module) -> bool:
    """Whether the trace of ``tx`` already read (or wrote) any of :data:`STATE_ATTRS` of ``mod`` (``vt``: its
    variable tracker), under any source it reached ``mod`` by. Unknown (another Dynamo): ``True``."""
    try:
        if tx.output.side_effects.has_pending_mutation(vt):
            return True
        cache = tx.output.variable_tracker_cache
        bases = {src.name for src, v in list(cache.items()) if _object_of(v) is mod}
        if vt.source is not None:
            bases.add(vt.source.name)
        prefixes = tuple(p for b in bases for a in STATE_ATTRS for p in (f"{b}.{a}", f"{b}.__dict__['{a}']"))
        whole = {f"{b}.__dict__" for b in bases}  # fast_setattr's self.__dict__[name] = value
        names = [src.name for src in list(cache)] + [g.name for g in list(tx.output.guards)]  # guards: bools too
        return any(n in whole or n.startswith(prefixes) for n in names)
    except Exception:  # noqa: BLE001 - another Dynamo: leave the module to TE
        return True


def prepare_traced_state(ctx: Any) -> None:
    """Comptime body of the polyfill: TE's lazy init of ``self`` with the traced call's dtype / fp8 / recipe
    (``prepare_te_module`` with the call's ``num_gemms`` / ``allow_different_data_and_param_types``), unless
    it already has that state, the trace already read it, or the recipe is DelayedScaling and the module's
    state was not registered at compile start."""
    try:
        vt = ctx.get_local("self")._i_will_not_complain_if_bc_breaks_VariableTracker()
        tx = ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator()
        mod = getattr(vt, "value", None)
        inp = ctx.get_local("inp").as_fake()
        fp8 = ctx.get_local("fp8").as_python_constant()
        args = (ctx.get_local("num_gemms").as_python_constant(),
                ctx.get_local("allow_different_data_and_param_types").as_python_constant())
        recipe_vt = ctx.get_local("recipe")._i_will_not_complain_if_bc_breaks_VariableTracker()
    except Exception:  # noqa: BLE001 - a traced value where a constant was expected: TE's own init
        return
    recipe = getattr(recipe_vt, "value", None)
    if not isinstance(mod, torch.nn.Module) or not isinstance(fp8, bool) or not isinstance(inp, torch.Tensor):
        return
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled() else inp.dtype
    key = (dtype, fp8, id(recipe) if recipe is not None and fp8 else None)
    if mod.__dict__.get(PREPARED_KEY) == key:
        return
    if fp8 and getattr(recipe, "delayed", lambda: False)() and mod.__dict__.get(DELAYED_ATTR) != id(recipe):
        return  # DelayedScaling: registered at compile start (compat/delayed_scaling) or TE's traced init
    read = _state_read(tx, vt, mod)
    tried = mod.__dict__.get(RESTARTED_KEY, frozenset())
    if read and key in tried:
        return  # restarted for this state once already (a module run under two states in one frame): recompile
    prepare_all([], dtype, fp8, recipe, (mod,), gemm_args=args)
    if read and mod.__dict__.get(PREPARED_KEY) == key:
        table.stamp(mod, RESTARTED_KEY, tried | {key})
        # the trace holds values read before: trace the frame anew on the state now prepared (the restart that
        # also clears Dynamo's speculation log: the new trace takes other branches)
        raise torch._dynamo.exc.UnspecializeRestartAnalysis(
            restart_reason=f"te_passes: {type(mod).__name__} is traced under fp8={fp8} after the trace read the "
                           f"state it was prepared with: prepared again")


def prepare_forward(self, inp, num_gemms=1, allow_non_contiguous=False, allow_different_data_and_param_types=False):
    """Polyfill of TE's ``TransformerEngineBaseModule.prepare_forward(inp, num_gemms, allow_non_contiguous,
    allow_different_data_and_param_types) -> inp``: in te_inductor frames TE's lazy init first (module
    docstring), then TE's function; other backends' frames run TE's function alone."""
    if torch.compiler.is_compiling() and active_frames():
        from transformer_engine.pytorch.distributed import in_fp8_activation_recompute_phase
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        qstate = FP8GlobalStateManager.quantization_state
        if not qstate.fp8_calibration and not in_fp8_activation_recompute_phase():
            fp8, recipe = qstate.fp8_enabled, qstate.fp8_recipe  # noqa: F841 - read by prepare_traced_state
            comptime(prepare_traced_state)
            # TE's `if self.fp8 and in_fp8_activation_recompute_phase()` reads the fp8 flag the previous call left
            # (init_fp8_metadata writes this call's below): write this call's first, as a traced side effect, so
            # the graph guards on the te.autocast state, not on the previous call's (fp8 <-> bf16 calls alternating)
            self.fast_setattr("fp8", fp8)
            return keeping_fp8_initialized(self, fp8, lambda: TE_FUNCTION[0](
                self, inp, num_gemms, allow_non_contiguous, allow_different_data_and_param_types))
    return TE_FUNCTION[0](self, inp, num_gemms, allow_non_contiguous, allow_different_data_and_param_types)


def keep_te_function(f: Callable[..., Any]) -> None:
    """Keep TE's ``prepare_forward`` ``f`` (the function the row rebinds away from the class) for the polyfill."""
    TE_FUNCTION[:] = [f]


__all__ = ["STATE_ATTRS", "TARGET", "keep_te_function", "prepare_forward", "prepare_traced_state"]
