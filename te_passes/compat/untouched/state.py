"""TE's first-forward lazy state, done by te_passes for untouched models
(:mod:`te_passes.compat.untouched.polyfills`): a Dynamo start callback (recipes and TE modules the frame
reaches) and the ``comptime`` body of each polyfill (a module's hidden ``te.Linear``\\ s, modules
the trace has not read yet), so step 2 sees step 1's state. Docs: docs/untouched.md."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import weakref
from typing import Any, Callable

import torch

from te_passes._logging import get_logger
from te_passes.compat.delayed_scaling.scaling import mark_registered_state_static
from te_passes.compat.delayed_scaling.state import DELAYED_ATTR, model_fake_mode, prepare_delayed_scaling
from te_passes.ops.shared_linear import layernorm_linear_gemm, layernorm_mlp_gemms
from te_passes.compat import gate as frame_gate, table
from te_passes.compat.untouched.gate import frame_untouched_options, warn_new_recipe
from te_passes.compat.te220.module_init import forward_prepare_args
from te_passes.compat.untouched.rewrite.te_state import prime_recipe as prime_te_recipe
from te_passes.compat.te220.untouched_rules import layernorm_linear_config_problem, layernorm_mlp_config_problem

log = get_logger()

#: Module attribute holding a module's :class:`UntouchedState` (built during the first trace).
STATE_ATTR = table.register_stamp("_te_passes_untouched_state", "an untouched TE module's hidden te.Linears and "
                                  "why its configuration is not expressed (built at its first trace)")
#: Module attribute: ``(dtype, fp8, id(recipe) or None)`` te_passes ran TE's first-forward lazy init with.
PREPARED_KEY = table.register_stamp("_te_passes_prepared_key", "the (dtype, fp8, recipe) te_passes ran a TE "
                                    "module's first-forward lazy init with (not again for the same)")


@torch._dynamo.assume_constant_result
def active_frames() -> bool:
    """Trace time: whether the frame Dynamo traces now is compiled for a backend that takes the
    polyfills (folded as a constant; the cache entry is per backend). ``False`` outside a trace.

    Raises:
        TePassesOptionError: a bad option (:func:`te_passes.compat.untouched.gate.frame_untouched_options`)."""
    return frame_untouched_options() is not None


@dataclasses.dataclass
class UntouchedState:
    """What the first trace built for one untouched TE module: why its configuration is not
    expressed (``problem``, ``None`` if it is) and its hidden ``te.Linear``\\ s (``gemms``)."""

    problem: str | None
    gemms: tuple[torch.nn.Module, ...] = ()


def _real(ctx: Any, name: str) -> Any:
    """The real Python object behind local ``name`` of the frame being traced, or ``None``."""
    try:
        vt = ctx.get_local(name)._i_will_not_complain_if_bc_breaks_VariableTracker()
    except Exception:  # noqa: BLE001 - no such local / not a plain object
        return None
    if hasattr(vt, "value"):
        return vt.value
    try:
        return vt.as_python_constant()
    except Exception:  # noqa: BLE001 - a traced value
        return None


def _peek(vt: Any) -> Any:
    """The Python object a module-like variable tracker stands for, without realising a lazy one
    (realising would install guards on locals the trace never used)."""
    peek = getattr(vt, "peek_value", None)
    if peek is not None and not vt.is_realized():
        v = peek()
        return v if isinstance(v, torch.nn.Module) else None
    vt = vt.unwrap() if hasattr(vt, "unwrap") else vt
    if type(vt).__name__ in ("NNModuleVariable", "UnspecializedNNModuleVariable", "UnspecializedBuiltinNNModuleVariable",
                             "FSDPManagedNNModuleVariable"):
        return getattr(vt, "value", None)
    return None


def _frame_modules(ctx: Any) -> list[torch.nn.Module]:
    """The ``nn.Module`` locals of every frame of the trace (the compiled frame's ``self``, the
    model a compiled step function closes over, ...)."""
    out: list[torch.nn.Module] = []
    try:
        tx = ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator()
    except Exception:  # noqa: BLE001
        return out
    while tx is not None:
        for vt in list(getattr(tx, "symbolic_locals", {}).values()):
            v = _peek(vt)
            if isinstance(v, torch.nn.Module) and all(v is not o for o in out):
                out.append(v)
        tx = getattr(tx, "parent", None)
    return out


def keeping_fp8_initialized(m: Any, fp8: bool, init: Callable[[], Any]) -> Any:
    """``init()`` (TE code that runs ``m.init_fp8_metadata``), with ``m.fp8_initialized`` kept as it was when ``fp8``
    is off; returns what ``init`` returns. TE 2.20.2's ``init_fp8_metadata`` resets ``fp8_initialized`` on a call
    without fp8 so that the next fp8 call builds the recipe state again, which for the same recipe changes nothing
    (stateless quantizers; DelayedScaling's scale and amax history inherited), while a compiled fp8 graph guards
    on the flag: with the reset, fp8 and bf16 calls alternating recompiled every call. Used eagerly
    (:func:`prepare_te_module`) and traced (the ``prepare_forward`` polyfill)."""
    if fp8:
        return init()
    initialised = m.fp8_initialized
    out = init()
    m.fast_setattr("fp8_initialized", initialised)
    return out


def prepare_te_module(m: Any, dtype: torch.dtype, fp8: bool, recipe: Any,
                      args: tuple[int, bool] | None = None) -> bool:
    """Run TE's first-forward lazy initialisation of ``m`` eagerly (what ``prepare_forward`` does on the first
    call: ``is_fsdp2``, ``activation_dtype``, ``init_fp8_metadata`` with the ``num_gemms`` of its class)
    inside ``te.autocast(enabled=fp8, recipe=recipe)``; returns whether ``m`` is a TE module of a known
    class (see ``compat.te220.module_init.forward_prepare_args``). A module whose parameters are not ``dtype`` is
    left alone (TE raises on its first forward). ``args``: ``(num_gemms,
    allow_different_data_and_param_types)`` for a class not in that table (a hidden ``te.Linear``: ``(1,
    False)``)."""
    args = forward_prepare_args(m) if args is None else args
    if args is None:
        return False
    num_gemms, allow_mixed = args
    try:
        _ = m.is_fsdp2
        m.fast_setattr("allow_different_data_and_param_types", allow_mixed)
        m.set_activation_dtype(torch.empty(0, dtype=dtype))
        keeping_fp8_initialized(m, fp8, lambda: m.init_fp8_metadata(num_gemms=num_gemms))
    except TypeError:  # TE: parameters of another dtype than the activations
        return False
    return True


#: The patch-table row of :func:`run_eager`'s write (te_passes/compat/untouched/rows.py).
EAGER_ROW = "untouched.eager_is_compiling"


@contextlib.contextmanager
def run_eager() -> Any:
    """Run TE's eager code from inside a Dynamo compile session: ``torch.compiler.is_compiling()``
    answers ``False`` inside (Dynamo sets it for the whole session, and TE's eager-only paths,
    e.g. ``get_default_fp8_recipe``, assert on it). torch has no API for it: ``torch.compiler``'s
    ``_is_compiling_flag`` is set for the block only while patch-table row :data:`EAGER_ROW` is active
    (refused: the block runs with the flag as it is, and TE's assertion names the problem)."""
    if table.refusal(EAGER_ROW) is not None:
        yield
        return
    import torch.compiler as tc

    with table.scoped_attr(tc, "_is_compiling_flag", False):  # the scoped write of row EAGER_ROW
        yield


def prepare_all(mods: list[Any], dtype: torch.dtype | None, fp8: bool, recipe: Any, gemms: tuple[Any, ...] = (),
                skip: Callable[[Any], bool] = lambda m: False, gemm_args: tuple[int, bool] = (1, False)) -> None:
    """``prepare_te_module`` on ``gemms`` (with ``gemm_args``: ``(num_gemms, allow_different_data_and_param_types)``)
    and every TE module under ``mods`` (but those ``skip`` names), once per (dtype, fp8, recipe) and module;
    ``dtype`` ``None``: each module's parameter dtype."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import Recipe

    if fp8 and not isinstance(recipe, Recipe):
        return  # a recipe built inside the traced function: TE's own first forward initialises
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    todo = [(g, gemm_args) for g in gemms] + [(m, None) for root in mods for m in root.modules()]
    live = FP8GlobalStateManager.quantization_state.autocast_depth > 0  # fp8 off: not the live te.autocast's state
    # no_grad: an outermost te.autocast exit with grad enabled would run TE's DelayedScaling update
    with run_eager(), torch.no_grad(), (te.autocast(enabled=fp8, recipe=recipe) if recipe is not None or live
                                        else _null()):
        for m, args in todo:
            d = dtype or _param_dtype(m)
            key = (d, fp8, id(recipe) if recipe is not None and fp8 else None)  # fp8 off: TE reads no recipe
            if d is None or m.__dict__.get(PREPARED_KEY) == key or skip(m):
                continue
            if prepare_te_module(m, d, fp8, recipe, args):
                table.stamp(m, PREPARED_KEY, key)


def _already_initialised(m: Any) -> bool:
    """Whether TE's first forward (or ours) already ran on ``m``: ``set_activation_dtype`` set a dtype
    (TE 2.20.2 ``TransformerEngineBaseModule.__init__`` sets ``activation_dtype = None``)."""
    return m.__dict__.get("activation_dtype") is not None or PREPARED_KEY in m.__dict__


def _param_dtype(m: Any) -> torch.dtype | None:
    for p in m.parameters(recurse=False):
        if p.is_floating_point():
            return p.dtype
    return None


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


#: Context managers entered around building a module's hidden ``te.Linear``\ s (the CPU capture's
#: fake GPU adds one that lets TE's constructor find "CUDA").
BUILD_CONTEXTS: list[Callable[[], Any]] = []


def _built(build: Callable[[Any], UntouchedState], mod: Any) -> UntouchedState:
    with contextlib.ExitStack() as stack:
        for cm in BUILD_CONTEXTS:
            stack.enter_context(cm())
        return build(mod)


def _prepare(ctx: Any, build: Callable[[Any], UntouchedState]) -> None:
    """Comptime body of a polyfill: build ``self``'s :class:`UntouchedState` once, then run TE's
    lazy init (with the traced call's dtype / fp8 / recipe) on its hidden ``te.Linear``\\ s and on
    every TE module of the traced frames, so step 2 sees step 1's state (no recompile)."""
    mod = _real(ctx, "self")
    if not isinstance(mod, torch.nn.Module):
        return
    st = mod.__dict__.get(STATE_ATTR)
    if st is None:
        try:
            st = _built(build, mod)
        except Exception as e:  # noqa: BLE001 - a configuration the hidden te.Linear cannot take
            st = UntouchedState(f"building the hidden te.Linear failed: {type(e).__name__}: {e}")
        table.stamp(mod, STATE_ATTR, st)
    inp = ctx.get_local("inp").as_fake() if _has_local(ctx, "inp") else None
    fp8 = _real(ctx, "fp8")
    recipe = _real(ctx, "recipe")
    if inp is None or not isinstance(fp8, bool) or st.problem is not None:
        return
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled() else inp.dtype
    if fp8 and getattr(recipe, "delayed", lambda: False)():
        # the frame's modules were prepared at compile start (_prepare_delayed); the hidden
        # te.Linears only take the activation dtype (their quantizers are the module's). A module
        # not prepared stays an island (polyfills._delayed_problem): no state of their own made here
        if mod.__dict__.get(DELAYED_ATTR) == id(recipe):
            prepare_all([], dtype, fp8, recipe, st.gemms)
        return
    touched = _touched(ctx)
    prepare_all(_frame_modules(ctx), dtype, fp8, recipe, st.gemms, skip=lambda m: id(m) in touched)


def _touched(ctx: Any) -> set[int]:
    """Ids of the objects the trace has read so far (their attribute reads are guarded: changing
    them now would fail the guards of the frame being compiled)."""
    try:
        tx = ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator()
        cache = tx.output.variable_tracker_cache
    except Exception:  # noqa: BLE001
        return set()
    out = set()
    for vt in list(cache.values()):
        v = _peek(vt)
        if v is not None:
            out.add(id(v))
    return out


def _compile_frame() -> tuple[Any, dict, tuple, dict, Any, bool] | None:
    """``(compiler_fn, locals, closure, globals, code, recompile)`` of the frame Dynamo starts compiling (the
    arguments of ``torch._dynamo.convert_frame._compile``, found on the call stack; ``recompile``: Dynamo
    compiled ``code`` before and its guards failed), or ``None``."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "_compile" and f.f_globals.get("__name__") == "torch._dynamo.convert_frame":
            loc = f.f_locals
            return (loc.get("compiler_fn"), loc.get("locals") or {}, loc.get("closure") or (), loc.get("globals") or {},
                    loc.get("code"), loc.get("cache_entry") is not None)
        f = f.f_back
    return None


#: Per compiled code object: ``(recipe class, repr)`` -> a weak reference to the recipe object an fp8
#: compile of it started under (:func:`note_recipes`).
_RECIPES_SEEN: "weakref.WeakKeyDictionary[Any, dict[tuple[str, str], Any]]" = weakref.WeakKeyDictionary()


def note_recipes(code: Any, recipes: list[Any], recompile: bool = True) -> bool:
    """At a compile start of ``code``: remember each fp8 recipe in effect, and at a ``recompile`` warn once
    (:func:`te_passes.compat.untouched.gate.warn_new_recipe`) when one is a new object equal (same class
    and ``repr``, TE's autocast key) to the one an earlier compile of ``code`` started under — the
    recompile a new recipe object per step causes. Returns whether such a recipe was seen."""
    if code is None or not recipes:
        return False
    try:
        seen = _RECIPES_SEEN.setdefault(code, {})
    except TypeError:  # not weak-referenceable
        return False
    renewed = None
    for r in recipes:
        key = (type(r).__qualname__, repr(r))
        ref = seen.get(key)
        if recompile and ref is not None and ref() is not r:
            renewed = type(r).__name__
        try:
            seen[key] = weakref.ref(r)
        except TypeError:
            continue
    if renewed is not None:
        warn_new_recipe(renewed, getattr(code, "co_qualname", getattr(code, "co_name", "the compiled function")))
    return renewed is not None


def on_compile_start(_args: Any = None) -> None:
    """Dynamo start callback (registered once, outside traces: te_passes/compat/untouched/rows.py): for a
    frame compiled for te_inductor (or a backend registered at :mod:`te_passes.compat.gate`) with
    ``te_passes.untouched`` on, do TE's first-forward lazy init before the trace reads it — prime every TE recipe the frame reaches (its cached repr and
    TE's autocast key) and initialise every TE module it reaches (locals, closure cells, module
    globals; parameter dtype, the TE autocast state active now). Never raises."""
    try:
        found = _compile_frame()
        if found is None or "transformer_engine.pytorch" not in sys.modules:
            return
        compiler_fn, loc, closure, glob, code, recompile = found
        opts = frame_gate.options_for(compiler_fn)
        if opts is None or not opts.untouched:
            return
        from transformer_engine.common.recipe import Recipe
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        values = list(loc.values()) + _cell_values(closure)
        values += [v for v in glob.values() if isinstance(v, (Recipe, torch.nn.Module))]
        recipes = [v for v in values if isinstance(v, Recipe)]
        mods = [v for v in values if isinstance(v, torch.nn.Module)]
        for r in recipes:
            prime_recipe(r)
        q = FP8GlobalStateManager.quantization_state
        in_effect = recipes + ([q.fp8_recipe] if q.autocast_depth > 0 and q.fp8_enabled else [])
        note_recipes(code, [r for r in in_effect if isinstance(r, Recipe)], recompile)
        if mods:
            active = q.autocast_depth > 0
            # Dynamo pops the caller's dispatch modes around a compile: TE's lazy init allocates its state in
            # the fake mode of a model on fake tensors (else real CUDA tensors, or with no GPU an error)
            with model_fake_mode(*mods) or _null():
                # No te.autocast active now: the fp8 state inside the trace is unknown (te.autocast may be
                # inside the compiled function), so a module TE already initialised (an eager step ran)
                # keeps its state — re-initialising it with fp8 off made the trace guard on the wrong value.
                prepare_all(mods, None, bool(q.fp8_enabled) if active else False, q.fp8_recipe if active else None,
                            skip=(lambda m: False) if active else _already_initialised)
                _prepare_delayed(mods, recipes, q)
        mark_registered_state_static()  # the compiled update writes every registered module's state
    except Exception as e:  # noqa: BLE001 - a missed preparation costs one recompile, never the compile
        # said, not swallowed: session 20's DelayedScaling recompile hid here (TE's init raised outside the fake mode)
        log.info("te_passes: compile-start preparation of TE modules failed (%s: %s); the trace prepares them "
                 "itself, which may cost a recompile", type(e).__name__, e)
        return


def _prepare_delayed(mods: list[torch.nn.Module], recipes: list[Any], q: Any) -> None:
    """DelayedScaling's first-forward state (:func:`te_passes.compat.delayed_scaling.state.prepare_delayed_scaling`:
    fp8 metadata, TE's global amax buffers, quantizer tags, static state) for the frame's modules, with
    the recipe of the fp8 ``te.autocast`` active now or, with none active (``te.autocast`` inside the
    compiled function), the frame's one DelayedScaling recipe. Without it the first compiled steps
    grew TE's global buffers module by module: a recompile per module and an eager island (H200,
    2026-12-02: 5 graphs, 1 break, 4 recompiles for 4 te.Linear)."""
    from transformer_engine.common.recipe import DelayedScaling

    if q.autocast_depth > 0:
        recipe = q.fp8_recipe if q.fp8_enabled else None
    else:
        found = {id(r): r for r in recipes if isinstance(r, DelayedScaling)}
        recipe = next(iter(found.values())) if len(found) == 1 else None
    if not isinstance(recipe, DelayedScaling):
        return
    with run_eager(), contextlib.ExitStack() as stack:  # te.autocast refuses DelayedScaling while compiling
        for cm in BUILD_CONTEXTS:
            stack.enter_context(cm())
        for m in mods:
            if m.__dict__.get(DELAYED_ATTR) != id(recipe):
                prepare_delayed_scaling(m, recipe)
    if q.autocast_depth == 0:  # prepare_all above ran with fp8 off; the modules now hold the fp8 state: record it
        prepare_all(mods, None, True, recipe)  # (else forward_state restarts the trace to prepare them again)


def _cell_values(closure: Any, depth: int = 3) -> list[Any]:
    """The contents of ``closure``'s cells and, ``depth`` levels down, of the closures of the
    functions found there (a wrapper such as ``te_passes.compile_step``'s step closes over the
    user's step function, which closes over the recipe and the model)."""
    out: list[Any] = []
    seen: set[int] = set()
    todo = [(c, 0) for c in closure or ()]
    while todo:
        cell, d = todo.pop()
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if id(v) in seen:
            continue
        seen.add(id(v))
        out.append(v)
        inner = getattr(v, "__closure__", None)
        if d + 1 < depth and inner:
            todo += [(c, d + 1) for c in inner]
    return out


def prime_recipe(recipe: Any) -> None:
    """:func:`te_passes.compat.untouched.rewrite.te_state.prime_recipe` (``Recipe.__repr__``'s ``_cached_repr`` and
    the ``autocast_arguments`` entry keyed by it, ``pytorch/quantization.py``) under :func:`run_eager`."""
    with run_eager():
        prime_te_recipe(recipe)


def _has_local(ctx: Any, name: str) -> bool:
    try:
        ctx.get_local(name)
        return True
    except Exception:  # noqa: BLE001
        return False


def _build_layernorm_linear(mod: Any) -> UntouchedState:
    p = layernorm_linear_config_problem(mod)
    return UntouchedState(p) if p else UntouchedState(None, (layernorm_linear_gemm(mod),))


def _build_layernorm_mlp(mod: Any) -> UntouchedState:
    p = layernorm_mlp_config_problem(mod)
    return UntouchedState(p) if p else UntouchedState(None, layernorm_mlp_gemms(mod))


def prepare_layernorm_linear(ctx: Any) -> None:
    _prepare(ctx, _build_layernorm_linear)


def prepare_layernorm_mlp(ctx: Any) -> None:
    _prepare(ctx, _build_layernorm_mlp)


