"""Untouched TE models in one graph under ``te_inductor``: polyfills of TE's ``torch.compiler.disable``\\ d forwards.

:func:`install_untouched_polyfills` registers, with ``torch.compiler.substitute_in_graph``, a
polyfill for the function TE's ``no_torch_dynamo`` wrapper closes over (``disabled_f``) of
``LayerNormLinear.forward``, ``LayerNormMLP.forward`` and ``FusedAttention.forward``, and one for
``get_default_fp8_recipe``. Registration is process-wide and permanent, so every polyfill is gated
by the backend Dynamo traces for (read at trace time, folded as a constant; Dynamo's cache
entries are per backend): only ``te_inductor`` (option ``te_passes.untouched``, env
``TE_PASSES_UNTOUCHED``) takes the polyfill; any other backend runs a disabled copy of TE's
function, as without te_passes. Docs: docs/untouched.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import threading
import types
import warnings
from typing import Any, Callable

import torch
from torch._dynamo.comptime import comptime

from te_passes.config import OPTION_SPECS, PREFIX, TePassesOptionError, TePassesOptions
from te_passes.runtime.shared_linear import layernorm_linear_gemm, layernorm_mlp_gemms
from te_passes.te.module_init import forward_prepare_args
from te_passes.te.norm_act import activation, normalize
from te_passes.te.untouched_rules import (DELAYED_SCALING_FIX, layernorm_linear_config_problem,
                                          layernorm_mlp_config_problem, norm_call_problem)

#: The ``te_passes.*`` option (``torch.compile(..., options={OPTION: False})``) and its env var.
OPTION = PREFIX + "untouched"
ENV = "TE_PASSES_UNTOUCHED"
#: ``TE_PASSES_UNTOUCHED_NORM``: ``torch`` (default: LayerNorm / RMSNorm in torch ops, fused by
#: Inductor) or ``te`` (TE's own norm kernels as the ``te_passes::te_norm`` op; numerics of TE eager).
NORM_ENV = "TE_PASSES_UNTOUCHED_NORM"
NORM_CHOICES = ("torch", "te")
#: A backend callable (or anything it wraps) with this attribute set to ``True`` takes the
#: polyfills like ``te_inductor`` (the CPU capture's recording backends set it).
BACKEND_MARK = "_te_passes_untouched"
#: Module attribute holding a module's :class:`UntouchedState` (built during the first trace).
STATE_ATTR = "_te_passes_untouched_state"

#: ``disabled_f`` targets: TE function qualname -> (attribute path under ``transformer_engine.pytorch``, TE module).
TARGETS: dict[str, tuple[str, str, str]] = {
    "LayerNormLinear.forward": ("transformer_engine.pytorch.module.layernorm_linear", "LayerNormLinear",
                                "te.LayerNormLinear"),
    "LayerNormMLP.forward": ("transformer_engine.pytorch.module.layernorm_mlp", "LayerNormMLP", "te.LayerNormMLP"),
    "FusedAttention.forward": ("transformer_engine.pytorch.attention.dot_product_attention.backends",
                               "FusedAttention", "te.FusedAttention"),
    # no_torch_dynamo(when=_needs_eager_dpa): traced by TE itself; the polyfill replaces the inner
    # function with TE's fused attention op (no backend selection, no lazy state: no recompile)
    "DotProductAttention.forward": ("transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention",
                                    "DotProductAttention", "te.DotProductAttention"),
}


# --------------------------------------------------------------------------- the backend gate
def _backend_chain(fn: Any) -> list[Any]:
    """``fn`` and what it wraps: Dynamo's ``WrapBackendDebug``, ``torch.compile``'s
    ``_TorchCompileWrapper`` (``compiler_fn``), ``functools.partial`` (``func``), ``__wrapped__``."""
    out: list[Any] = []
    while fn is not None and len(out) < 16 and all(fn is not o for o in out):
        out.append(fn)
        nxt = None
        for attr in ("_torchdynamo_orig_backend", "_torchdynamo_orig_callable", "compiler_fn", "func", "__wrapped__"):
            v = getattr(fn, attr, None) if not isinstance(fn, types.ModuleType) else None
            if v is not None and v is not fn and callable(v):
                nxt = v
                break
        fn = nxt
    return out


def _options_of(chain: list[Any]) -> dict[str, Any] | None:
    for c in chain:
        kw = getattr(c, "kwargs", None) if not isinstance(c, functools.partial) else c.keywords
        if isinstance(kw, dict) and isinstance(kw.get("options"), dict):
            return kw["options"]
    return None


def untouched_enabled(options: dict[str, Any] | None = None, environ: Any = None) -> bool:
    """``te_passes.untouched`` from ``options`` (a ``torch.compile`` options dict), else
    ``TE_PASSES_UNTOUCHED``, else ``True``.

    Raises:
        TePassesOptionError: a value that is not a bool (option) / not a bool spelling (env).
    """
    ours = {OPTION: options[OPTION]} if options and OPTION in options else None
    parsed, _ = TePassesOptions.parse(ours, environ={ENV: (environ or os.environ).get(ENV, "")})
    return parsed.untouched


def backend_wants_polyfills(compiler_fn: Any) -> bool:
    """Whether Dynamo's ``compiler_fn`` (``OutputGraph.compiler_fn``) is ``te_inductor`` (or
    carries :data:`BACKEND_MARK`) with ``te_passes.untouched`` on."""
    chain = _backend_chain(compiler_fn)
    te_fn = getattr(sys.modules.get("te_passes.backend"), "te_inductor", None)
    if not any((te_fn is not None and c is te_fn) or getattr(c, BACKEND_MARK, False) is True for c in chain):
        return False
    return untouched_enabled(_options_of(chain))


@torch._dynamo.assume_constant_result
def _active() -> bool:
    """Trace time: whether the frame Dynamo traces now is compiled for a backend that takes the
    polyfills (folded as a constant; the cache entry is per backend). ``False`` outside a trace."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except Exception:  # noqa: BLE001 - not tracing
        return False
    on = tx is not None and backend_wants_polyfills(getattr(tx.output, "compiler_fn", None))
    if on:
        _register_start_callback()  # torch._dynamo.reset() cleared it: the next frames get their lazy init
    return on


# --------------------------------------------------------------------------- islands
@dataclasses.dataclass(frozen=True)
class Island:
    """A TE call the polyfill left to TE's eager code under ``te_inductor``: ``te_module``
    (``"te.LayerNormLinear"``), the module's TE ``name`` (``""`` if unnamed), TE's/our ``reason``
    and the ``fix`` that would let it compile."""

    te_module: str
    name: str
    reason: str
    fix: str

    def __str__(self) -> str:
        who = f"{self.te_module} {self.name!r}" if self.name else self.te_module
        return f"{who} runs eagerly (graph break): {self.reason}. Fix: {self.fix}"


_ISLANDS: dict[tuple[str, str, str], Island] = {}
_ISLAND_LIMIT = 256
_lock = threading.Lock()


def island_records() -> list[Island]:
    """The islands the polyfills left in this process (deduplicated, in order; at most 256)."""
    with _lock:
        return list(_ISLANDS.values())


def clear_island_records() -> None:
    """Forget :func:`island_records` (and re-arm the one-time DelayedScaling warning)."""
    with _lock:
        _ISLANDS.clear()
        _WARNED.clear()


_WARNED: set[str] = set()


@torch._dynamo.assume_constant_result
def _note_island(te_module: str, name: str, reason: str, fix: str) -> bool:
    """Trace time: record an island (and warn once for DelayedScaling). Returns ``True``."""
    with _lock:
        key = (te_module, name, reason)
        if key not in _ISLANDS and len(_ISLANDS) < _ISLAND_LIMIT:
            _ISLANDS[key] = Island(te_module, name, reason, fix)
        warn = "DelayedScaling" in reason and "DelayedScaling" not in _WARNED
        if warn:
            _WARNED.add("DelayedScaling")
    if warn:
        warnings.warn(f"te_passes: {Island(te_module, name, reason, fix)}", RuntimeWarning, stacklevel=2)
    return True


def _fix_for(reason: str) -> str:
    if "DelayedScaling" in reason:
        return DELAYED_SCALING_FIX
    return ("none inside te_passes for this configuration; the rest of the model still compiles "
            "(see docs/untouched.md for what the polyfills express)")


# --------------------------------------------------------------------------- shared forwards
def norm_impl(environ: Any = None) -> str:
    """``TE_PASSES_UNTOUCHED_NORM`` (``torch`` default, or ``te``); raises ``TePassesOptionError``."""
    v = (environ or os.environ).get(NORM_ENV, "torch").strip().lower() or "torch"
    if v not in NORM_CHOICES:
        raise TePassesOptionError(f"environment variable {NORM_ENV}={v!r}: must be one of {list(NORM_CHOICES)}")
    return v


@torch._dynamo.assume_constant_result
def _norm_choice() -> str:
    return norm_impl()


def _norm(mod: Any, inp: torch.Tensor) -> torch.Tensor:
    if (_norm_choice() if torch.compiler.is_compiling() else norm_impl()) == "te":
        from te_passes.runtime.te_norm_op import te_norm

        return te_norm(inp, mod.layer_norm_weight, mod.layer_norm_bias, mod.eps, mod.normalization,
                       mod.zero_centered_gamma)
    return normalize(inp, mod.layer_norm_weight, mod.layer_norm_bias, mod.eps, mod.normalization,
                     mod.zero_centered_gamma)


def layernorm_linear_forward(mod: Any, gemm: torch.nn.Module, inp: torch.Tensor, is_first_microbatch: Any = None,
                             fp8_output: bool = False, fp8_grad: bool = False) -> Any:
    """``te.LayerNormLinear`` ``mod``'s forward as norm + ``gemm`` (its hidden ``te.Linear``):
    ``inp`` [..., in_features] -> [..., out_features] (or ``(out, bias)`` with ``return_bias``).
    The one implementation behind the polyfill and ``compile_friendly``."""
    return gemm(_norm(mod, inp), is_first_microbatch=is_first_microbatch, fp8_output=fp8_output, fp8_grad=fp8_grad)


def layernorm_mlp_forward(mod: Any, fc1: torch.nn.Module, fc2: torch.nn.Module, inp: torch.Tensor,
                          is_first_microbatch: Any = None) -> Any:
    """``te.LayerNormMLP`` ``mod``'s forward as norm + ``fc1`` + activation + ``fc2``:
    ``inp`` [..., hidden] -> [..., hidden] (or ``(out, fc2_bias)`` with ``return_bias``)."""
    h = fc1(_norm(mod, inp), is_first_microbatch=is_first_microbatch)
    return fc2(activation(h, mod.activation, mod.activation_params), is_first_microbatch=is_first_microbatch)


# --------------------------------------------------------------------------- trace-time preparation
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


def prepare_te_module(m: Any, dtype: torch.dtype, fp8: bool, recipe: Any,
                      args: tuple[int, bool] | None = None) -> bool:
    """Run TE's first-forward lazy initialisation of ``m`` eagerly (what ``prepare_forward``
    does on the first call: ``is_fsdp2``, ``activation_dtype``, ``init_fp8_metadata`` with the
    ``num_gemms`` of its class) inside ``te.autocast(enabled=fp8, recipe=recipe)``; returns
    whether ``m`` is a TE module of a known class (see ``te.module_init.forward_prepare_args``).
    A module whose parameters are not ``dtype`` is left alone (TE raises on its first forward).
    ``args``: ``(num_gemms, allow_different_data_and_param_types)`` for a class not in that table
    (a hidden ``te.Linear``: ``(1, False)``)."""
    args = forward_prepare_args(m) if args is None else args
    if args is None:
        return False
    num_gemms, allow_mixed = args
    try:
        _ = m.is_fsdp2
        m.fast_setattr("allow_different_data_and_param_types", allow_mixed)
        m.set_activation_dtype(torch.empty(0, dtype=dtype))
        m.init_fp8_metadata(num_gemms=num_gemms)
    except TypeError:  # TE: parameters of another dtype than the activations
        return False
    return True


@contextlib.contextmanager
def _eager() -> Any:
    """Run TE's eager code from inside a Dynamo compile session: ``torch.compiler.is_compiling()``
    answers ``False`` inside (Dynamo sets it for the whole session, and TE's eager-only paths,
    e.g. ``get_default_fp8_recipe``, assert on it)."""
    import torch.compiler as tc

    old = getattr(tc, "_is_compiling_flag", False)
    tc._is_compiling_flag = False
    try:
        yield
    finally:
        tc._is_compiling_flag = old


def _prepare_all(mods: list[Any], dtype: torch.dtype | None, fp8: bool, recipe: Any, gemms: tuple[Any, ...] = (),
                 skip: Callable[[Any], bool] = lambda m: False) -> None:
    """``prepare_te_module`` on ``gemms`` and every TE module under ``mods`` (but those ``skip``
    names), once per (dtype, fp8, recipe) and module; ``dtype`` ``None``: each module's parameter dtype."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import Recipe

    if fp8 and not isinstance(recipe, Recipe):
        return  # a recipe built inside the traced function: TE's own first forward initialises
    todo = [(g, (1, False)) for g in gemms] + [(m, None) for root in mods for m in root.modules()]
    with _eager(), (te.autocast(enabled=fp8, recipe=recipe) if recipe is not None else _null()):
        for m, args in todo:
            d = dtype or _param_dtype(m)
            key = (d, fp8, id(recipe) if recipe is not None else None)
            if d is None or m.__dict__.get("_te_passes_prepared_key") == key or skip(m):
                continue
            if prepare_te_module(m, d, fp8, recipe, args):
                m.__dict__["_te_passes_prepared_key"] = key


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
    import contextlib

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
        mod.__dict__[STATE_ATTR] = st
    inp = ctx.get_local("inp").as_fake() if _has_local(ctx, "inp") else None
    fp8 = _real(ctx, "fp8")
    recipe = _real(ctx, "recipe")
    if inp is None or not isinstance(fp8, bool) or st.problem is not None:
        return
    if fp8 and getattr(recipe, "delayed", lambda: False)():
        return  # an island (norm_call_problem): TE's eager forward initialises its own state
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled() else inp.dtype
    touched = _touched(ctx)
    _prepare_all(_frame_modules(ctx), dtype, fp8, recipe, st.gemms, skip=lambda m: id(m) in touched)


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


def _compile_frame() -> tuple[Any, dict, tuple, dict] | None:
    """``(compiler_fn, locals, closure, globals)`` of the frame Dynamo starts compiling (the
    arguments of ``torch._dynamo.convert_frame._compile``, found on the call stack), or ``None``."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "_compile" and f.f_globals.get("__name__") == "torch._dynamo.convert_frame":
            loc = f.f_locals
            return loc.get("compiler_fn"), loc.get("locals") or {}, loc.get("closure") or (), loc.get("globals") or {}
        f = f.f_back
    return None


def on_compile_start(_args: Any = None) -> None:
    """Dynamo start callback: for a frame compiled for te_inductor, do TE's first-forward lazy
    init before the trace reads it — prime every TE recipe the frame reaches (its cached repr and
    TE's autocast key) and initialise every TE module it reaches (locals, closure cells, module
    globals; parameter dtype, the TE autocast state active now). Never raises."""
    try:
        found = _compile_frame()
        if found is None or "transformer_engine.pytorch" not in sys.modules:
            return
        compiler_fn, loc, closure, glob = found
        if not backend_wants_polyfills(compiler_fn):
            return
        from transformer_engine.common.recipe import Recipe
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        values = list(loc.values())
        for c in closure or ():
            try:
                values.append(c.cell_contents)
            except ValueError:  # an empty cell
                pass
        values += [v for v in glob.values() if isinstance(v, (Recipe, torch.nn.Module))]
        recipes = [v for v in values if isinstance(v, Recipe)]
        mods = [v for v in values if isinstance(v, torch.nn.Module)]
        for r in recipes:
            prime_recipe(r)
        if mods:
            q = FP8GlobalStateManager.quantization_state
            active = q.autocast_depth > 0
            _prepare_all(mods, None, bool(q.fp8_enabled) if active else False, q.fp8_recipe if active else None)
    except Exception:  # noqa: BLE001 - a missed preparation costs one recompile, never the compile
        return


def prime_recipe(recipe: Any) -> None:
    """What TE's first ``te.autocast(recipe=recipe)`` caches: ``Recipe.__repr__``'s
    ``_cached_repr`` and the ``autocast_arguments`` entry keyed by it (``pytorch/quantization.py``)."""
    import transformer_engine.pytorch as te

    with _eager():
        str(recipe)
        with te.autocast(enabled=False, recipe=recipe):
            pass


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


def _prepare_layernorm_linear(ctx: Any) -> None:
    _prepare(ctx, _build_layernorm_linear)


def _prepare_layernorm_mlp(ctx: Any) -> None:
    _prepare(ctx, _build_layernorm_mlp)


def _prepare_attention(ctx: Any) -> None:
    mod = _real(ctx, "self")
    if isinstance(mod, torch.nn.Module) and STATE_ATTR not in mod.__dict__:
        mod.__dict__[STATE_ATTR] = UntouchedState(None)


# --------------------------------------------------------------------------- the polyfills
_COPIES: dict[str, Callable[..., Any]] = {}   # TE's function, disabled: the other backends' path
_ISLAND_FNS: dict[str, Callable[..., Any]] = {}  # TE's function, disabled, named: te_inductor's islands


def _disabled(f: Callable[..., Any], label: str | None) -> Callable[..., Any]:
    if label is None:
        return torch._dynamo.disable(f, recursive=True)

    @functools.wraps(f)
    def island(*args: Any, **kwargs: Any) -> Any:
        return f(*args, **kwargs)

    island.__name__ = island.__qualname__ = f"te_passes_untouched_island[{label}]"
    return torch._dynamo.disable(island, recursive=True)


def _layernorm_linear(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False):
    if not _active():
        return _COPIES["LayerNormLinear.forward"](self, inp, is_first_microbatch, fp8_output, fp8_grad)
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    qstate = FP8GlobalStateManager.quantization_state
    fp8, recipe = qstate.fp8_enabled, qstate.fp8_recipe  # noqa: F841 - read by _prepare (comptime)
    comptime(_prepare_layernorm_linear)
    st = getattr(self, STATE_ATTR)
    problem = st.problem or norm_call_problem()
    if problem is not None:
        _note_island("te.LayerNormLinear", self.name or "", problem, _fix_for(problem))
        return _ISLAND_FNS["LayerNormLinear.forward"](self, inp, is_first_microbatch, fp8_output, fp8_grad)
    (gemm,) = st.gemms
    gemm.training = self.training
    return layernorm_linear_forward(self, gemm, inp, is_first_microbatch, fp8_output, fp8_grad)


def _layernorm_mlp(self, inp, is_first_microbatch=None):
    if not _active():
        return _COPIES["LayerNormMLP.forward"](self, inp, is_first_microbatch)
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    qstate = FP8GlobalStateManager.quantization_state
    fp8, recipe = qstate.fp8_enabled, qstate.fp8_recipe  # noqa: F841 - read by _prepare (comptime)
    comptime(_prepare_layernorm_mlp)
    st = getattr(self, STATE_ATTR)
    problem = st.problem or norm_call_problem()
    if problem is not None:
        _note_island("te.LayerNormMLP", self.name or "", problem, _fix_for(problem))
        return _ISLAND_FNS["LayerNormMLP.forward"](self, inp, is_first_microbatch)
    fc1, fc2 = st.gemms
    fc1.training = self.training
    fc2.training = self.training
    return layernorm_mlp_forward(self, fc1, fc2, inp, is_first_microbatch)


def _fused_attention(self, query_layer, key_layer, value_layer, qkv_layout="sbh3d", cu_seqlens_q=None,
                     cu_seqlens_kv=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, max_seqlen_q=None,
                     max_seqlen_kv=None, attn_mask_type="causal", attention_mask=None, window_size=None,
                     bottom_right_diagonal=None, fused_attention_backend=None, core_attention_bias_type="no_bias",
                     core_attention_bias=None, fast_zero_fill=True, cp_group=None, cp_global_ranks=None,
                     cp_stream=None, cp_comm_type="p2p", fp8=False, fp8_meta=None, quantizers=None,
                     pad_between_seqs=False, inference_params=None, softmax_offset=None, fp8_output=False,
                     score_mod=None, score_mod_bprop=None, score_mod_tensors=None, score_mod_bprop_tensors=None,
                     packed_qkv=None, packed_kv=None, bf16_backward=False, load_balancing_strategy=None):
    # TE's FusedAttention.forward signature (attention/dot_product_attention/backends.py); the
    # None defaults of fused_attention_backend / load_balancing_strategy are never passed by DPA.
    call = dict(qkv_layout=qkv_layout, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_kv_padded,
                max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv, attn_mask_type=attn_mask_type,
                attention_mask=attention_mask, window_size=window_size, bottom_right_diagonal=bottom_right_diagonal,
                fused_attention_backend=fused_attention_backend, core_attention_bias_type=core_attention_bias_type,
                core_attention_bias=core_attention_bias, fast_zero_fill=fast_zero_fill, cp_group=cp_group,
                cp_global_ranks=cp_global_ranks, cp_stream=cp_stream, cp_comm_type=cp_comm_type, fp8=fp8,
                fp8_meta=fp8_meta, quantizers=quantizers, pad_between_seqs=pad_between_seqs,
                inference_params=inference_params, softmax_offset=softmax_offset, fp8_output=fp8_output,
                score_mod=score_mod, score_mod_bprop=score_mod_bprop, score_mod_tensors=score_mod_tensors,
                score_mod_bprop_tensors=score_mod_bprop_tensors, packed_qkv=packed_qkv, packed_kv=packed_kv,
                bf16_backward=bf16_backward)
    if load_balancing_strategy is not None:
        call["load_balancing_strategy"] = load_balancing_strategy
    if fused_attention_backend is None:
        del call["fused_attention_backend"]
    if not _active():
        return _COPIES["FusedAttention.forward"](self, query_layer, key_layer, value_layer, **call)
    from te_passes.runtime.untouched_attention import fused_attention_call_problem, fused_attention_forward

    problem = fused_attention_call_problem(self, query_layer, key_layer, value_layer, call)
    if problem is not None:
        _note_island("te.FusedAttention", f"layer_number={self.layer_number}", problem, _fix_for(problem))
        return _ISLAND_FNS["FusedAttention.forward"](self, query_layer, key_layer, value_layer, **call)
    return fused_attention_forward(self, query_layer, key_layer, value_layer, call)


def _dot_product_attention(self, query_layer=None, key_layer=None, value_layer=None, attention_mask=None,
                           qkv_format=None, *args, **kwargs):
    te_forward = _COPIES["DotProductAttention.forward"]
    if args or not _active():
        return te_forward(self, query_layer, key_layer, value_layer, attention_mask, qkv_format, *args, **kwargs)
    from transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention import _unpack_packed_qkv

    from te_passes.runtime.untouched_attention import dpa_fused_forward, dpa_problem

    kw = dict(kwargs)
    mask = kw.pop("attn_mask_type", None) or self.attn_mask_type
    qkv_layer, kv_layer = kw.pop("qkv_layer", None), kw.pop("kv_layer", None)
    interleave = kw.pop("qkv_interleave_dim", -3)
    fmt = qkv_format or self.qkv_format
    if fmt in ("sbhd", "bshd"):
        q, k, v, _ = _unpack_packed_qkv(qkv_layer, kv_layer, query_layer, key_layer, value_layer, fmt, interleave,
                                        kw.get("inference_params"))
        if dpa_problem(self, fmt, mask, attention_mask, q, k, v, kw) is None:
            return dpa_fused_forward(self, fmt, mask, q, k, v, kw)
    # TE's own (traced) forward: its backend choice; FusedAttention.forward then meets its polyfill
    return te_forward(self, query_layer, key_layer, value_layer, attention_mask, qkv_format, *args, **kwargs)


def _noop_cat(tensors, dim=0):
    if not _active():
        return _COPIES["noop_cat"](tensors, dim)
    # TE's _NoopCatFunc compares storages / data_ptrs (not traceable); torch.cat gives the same
    # values (a copy of the weight splits per call, as compile_friendly's hidden te.Linear)
    if len(tensors) == 1:
        return tensors[0]
    return torch.cat(tensors, dim=dim)


def _default_recipe_polyfill():
    if not _active():
        return _COPIES["get_default_fp8_recipe"]()
    comptime(_build_default_recipe)
    return _DEFAULT_RECIPE[0]


_DEFAULT_RECIPE: list[Any] = []


def _build_default_recipe(ctx: Any) -> None:
    """Comptime: TE's default recipe, built once eagerly (TE asserts it is not built while compiling)
    and primed (cached repr, autocast key)."""
    if _DEFAULT_RECIPE:
        return
    with _eager():
        r = _COPIES["get_default_fp8_recipe"]()
    prime_recipe(r)
    _DEFAULT_RECIPE.append(r)


_POLYFILLS: dict[str, Callable[..., Any]] = {
    "LayerNormLinear.forward": _layernorm_linear,
    "LayerNormMLP.forward": _layernorm_mlp,
    "FusedAttention.forward": _fused_attention,
    "DotProductAttention.forward": _dot_product_attention,
}


@dataclasses.dataclass(frozen=True)
class PolyfillStatus:
    """One polyfill target: ``installed`` or not, and why not (``reason``)."""

    target: str
    installed: bool
    reason: str | None = None


_STATUS: dict[str, PolyfillStatus] = {}


def polyfill_status() -> dict[str, PolyfillStatus]:
    """What :func:`install_untouched_polyfills` did, per target (empty before it ran with TE)."""
    return dict(_STATUS)


def closure_layout(fn: Any) -> tuple[Callable[..., Any], Callable[..., Any]] | str:
    """``(target, f)`` from TE's ``no_torch_dynamo`` wrapper ``fn`` (``transformer_engine/pytorch/
    jit.py``), or why ``fn`` has another layout. Plain (``co_freevars == ('disabled_f', 'f')``):
    the target is ``disabled_f`` (``torch.compiler.disable``\\ d ``f``); conditional (``when=``:
    ``disabled_report_and_run``, ``f``, ``parameter_names``, ``when``): the target is ``f``, which
    the wrapper calls when TE's ``when`` finds nothing against tracing."""
    code = getattr(fn, "__code__", None)
    if code is None or fn.__closure__ is None:
        return f"{getattr(fn, '__qualname__', fn)!r} is not a closure (TE made it traceable or wraps it otherwise)"
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__)))
    if set(cells) == {"disabled_f", "f"}:
        if not getattr(cells["disabled_f"], "_torchdynamo_disable", False):
            return f"{fn.__qualname__}'s disabled_f is not torch.compiler.disable'd"
        return cells["disabled_f"], cells["f"]
    if set(cells) == {"disabled_report_and_run", "f", "parameter_names", "when"}:
        return cells["f"], cells["f"]
    return f"{fn.__qualname__} closes over {code.co_freevars}, not TE's no_torch_dynamo layout"


def _copy(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` with another identity (same code, globals, defaults, closure): Dynamo traces it as TE's
    own function, never as the polyfill registered for ``f``."""
    g = types.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    g.__kwdefaults__ = dict(f.__kwdefaults__ or {}) or None
    g.__qualname__, g.__doc__, g.__module__ = f.__qualname__, f.__doc__, f.__module__
    return g


def _te_ships_op(qualname: str) -> str | None:
    """Why TE's own compiled op makes the polyfill unnecessary (TE#3534 / TE#3472), or ``None``."""
    from torch._library.custom_ops import OPDEFS

    names = {"LayerNormLinear.forward": ("layernorm_linear",), "LayerNormMLP.forward": ("layernorm_mlp",),
             "FusedAttention.forward": ("fused_attention", "dot_product_attention"),
             "DotProductAttention.forward": ("fused_attention", "dot_product_attention")}[qualname]
    for op in OPDEFS:
        ns, _, name = op.partition("::")
        if ns == "transformer_engine_compile" and name in names:
            return f"TE ships its own op {op}: stepping aside"
    return None


def install_untouched_polyfills() -> bool:
    """Register the polyfills once (idempotent, thread-safe); ``False`` while TE's modules are not
    imported. Per target, :func:`polyfill_status` says whether it went in and why not (another
    closure layout, TE ships its own op, TE < 2.20 / not supported). Never raises."""
    if "transformer_engine.pytorch" not in sys.modules:
        return False
    with _lock:
        if _STATUS:
            _register_start_callback()  # torch._dynamo.reset() clears Dynamo's callbacks
            return any(s.installed for s in _STATUS.values())
        import importlib

        from te_passes.te.version import is_supported, te_version

        for qualname, (modname, cls_name, _te_module) in TARGETS.items():
            if not is_supported():
                _STATUS[qualname] = PolyfillStatus(qualname, False, f"TE {te_version()} is not a version te_passes "
                                                                    "mirrors")
                continue
            try:
                cls = getattr(importlib.import_module(modname), cls_name)
            except Exception as e:  # noqa: BLE001
                _STATUS[qualname] = PolyfillStatus(qualname, False, f"{modname}.{cls_name}: {type(e).__name__}: {e}")
                continue
            why = _te_ships_op(qualname)
            layout = closure_layout(cls.forward) if why is None else why
            if isinstance(layout, str):
                _STATUS[qualname] = PolyfillStatus(qualname, False, layout)
                continue
            disabled_f, f = layout
            if disabled_f is f:  # conditional wrapper: TE traces f itself; the fallback is a copy of f
                _COPIES[qualname] = _copy(f)
            else:
                _COPIES[qualname] = _disabled(f, None)
                _ISLAND_FNS[qualname] = _disabled(f, qualname)
            try:
                torch.compiler.substitute_in_graph(disabled_f, skip_signature_check=True)(_POLYFILLS[qualname])
            except (TypeError, ValueError) as e:  # someone else registered one
                _STATUS[qualname] = PolyfillStatus(qualname, False, f"substitute_in_graph: {e}")
                continue
            _STATUS[qualname] = PolyfillStatus(qualname, True)
        _install_default_recipe()
        from te_passes.runtime.fused_attn_op import install_fused_attention_op

        install_fused_attention_op(import_te=True)  # the FusedAttention polyfill's op (refusal: refused_reason())
        _register_start_callback()
        return any(s.installed for s in _STATUS.values())


def _register_start_callback() -> None:
    handler = torch._dynamo.callback_handler
    if on_compile_start not in handler.start_callbacks:
        handler.register_start_callback(on_compile_start)


def _install_default_recipe() -> None:
    """The plain-function polyfills: ``quantization.get_default_fp8_recipe`` and
    ``module/_common.noop_cat`` (te.Linear's weight splits, e.g. ``MultiheadAttention.qkv``)."""
    import importlib

    for modname, name, poly in (("transformer_engine.pytorch.quantization", "get_default_fp8_recipe",
                                 _default_recipe_polyfill),
                                ("transformer_engine.pytorch.module._common", "noop_cat", _noop_cat)):
        orig = getattr(importlib.import_module(modname), name, None)
        if not isinstance(orig, types.FunctionType):
            _STATUS[name] = PolyfillStatus(name, False, f"{modname} has no {name} function")
            continue
        # a copy with another identity: Dynamo traces it as TE's own (no re-entry into the polyfill)
        _COPIES[name] = _copy(orig)
        try:
            torch.compiler.substitute_in_graph(orig, skip_signature_check=True)(poly)
        except (TypeError, ValueError) as e:
            _STATUS[name] = PolyfillStatus(name, False, f"substitute_in_graph: {e}")
            continue
        _STATUS[name] = PolyfillStatus(name, True)


__all__ = [
    "OPTION", "ENV", "NORM_ENV", "BACKEND_MARK", "Island", "PolyfillStatus", "UntouchedState",
    "install_untouched_polyfills", "polyfill_status", "island_records", "clear_island_records",
    "backend_wants_polyfills", "untouched_enabled", "layernorm_linear_forward", "layernorm_mlp_forward",
    "closure_layout", "norm_impl", "prepare_te_module",
]
