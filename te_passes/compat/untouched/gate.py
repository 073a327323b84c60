"""The untouched-model polyfills' view of the frame gate (:mod:`te_passes.compat.gate`): whether the frame
Dynamo traces now takes the polyfills (``te_inductor`` or a backend registered there, with
``te_passes.untouched`` on) and its ``te_passes.untouched_norm`` / ``te_passes.fused_attn`` options; and the
island records of the calls the polyfills leave to TE's eager code. Docs: docs/untouched.md."""

from __future__ import annotations

import dataclasses
import threading
import warnings

import torch

from te_passes.compat import gate as frame_gate
from te_passes.config import PREFIX, TePassesOptionError, TePassesOptions, env_aliases, unwrapped
from te_passes.compat.te220.untouched_rules import DELAYED_SCALING_FIX

#: The ``te_passes.*`` option (``torch.compile(..., options={OPTION: False})``) and its env var.
OPTION = PREFIX + "untouched"
ENV = "TE_PASSES_UNTOUCHED"


def frame_untouched_options() -> TePassesOptions | None:
    """The parsed options of the frame Dynamo traces (or starts compiling) now when it takes the polyfills:
    compiled for ``te_inductor`` or a backend registered at :mod:`te_passes.compat.gate`, with
    ``te_passes.untouched`` on; ``None`` otherwise (other backends, no compile).

    Raises:
        TePassesOptionError: a bad ``te_passes.*`` option or ``TE_PASSES_*`` variable, as an instance Dynamo
            re-raises unwrapped (:func:`te_passes.config.unwrapped`: this runs while Dynamo traces)."""
    try:
        opts = frame_gate.frame_options()
    except TePassesOptionError as e:
        raise unwrapped(e) from None
    return opts if opts is not None and opts.untouched else None


def environment_options() -> TePassesOptions:
    """The options of the environment alone (``TE_PASSES_UNTOUCHED_NORM``, ``TE_PASSES_FUSED_ATTN``, ...;
    defaults where unset): what eager calls and other backends' frames read.

    Raises:
        TePassesOptionError: a bad ``TE_PASSES_*`` value (unwrapped, as :func:`frame_untouched_options`)."""
    try:
        return TePassesOptions.parse(None)[0]
    except TePassesOptionError as e:
        raise unwrapped(e) from None


def options_now() -> TePassesOptions:
    """:func:`frame_untouched_options`, else :func:`environment_options`."""
    return frame_untouched_options() or environment_options()


@torch._dynamo.assume_constant_result
def norm_choice() -> str:
    """Trace time, a constant: ``te_passes.untouched_norm`` of the frame traced now (``"te"``: TE's kernels,
    ``"torch"``: torch ops); outside a te_inductor frame the ``TE_PASSES_UNTOUCHED_NORM`` value."""
    return options_now().untouched_norm


#: How :func:`fused_attn_off`'s reason names the user's switch (``island_fix_for`` reads the switch back).
_SWITCHED_OFF = "switched off ("


def fused_attn_off(opts: TePassesOptions) -> str:
    """Why ``opts`` keep the untouched attention off TE's fused-attention op (``""``: they do not):
    ``"switched off (TE_PASSES_FUSED_ATTN='0')"`` / ``"switched off (te_passes.fused_attn=False)"``."""
    if opts.fused_attn:
        return ""
    if "fused_attn" in opts.from_env:
        return _SWITCHED_OFF + "{0}={1!r})".format(*next(iter(env_aliases("fused_attn").items()), ("TE_PASSES_FUSED_ATTN", "")))
    return f"{_SWITCHED_OFF}{PREFIX}fused_attn=False)"


@torch._dynamo.assume_constant_result
def fused_attn_switched_off() -> str:
    """Trace time, a constant: :func:`fused_attn_off` of the frame traced now (eagerly: of the environment)."""
    return fused_attn_off(options_now())


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


@dataclasses.dataclass
class _IslandLog:
    """The islands recorded in this process (``(te_module, name, reason)`` -> :class:`Island`, at most
    ``_ISLAND_LIMIT``) and the one-time warnings given (``"DelayedScaling"``, ``"new recipe"``); under ``_lock``."""

    islands: dict[tuple[str, str, str], Island] = dataclasses.field(default_factory=dict)
    warned: set[str] = dataclasses.field(default_factory=set)


_LOG = _IslandLog()
_ISLAND_LIMIT = 256
_lock = threading.Lock()


def island_records() -> list[Island]:
    """The islands the polyfills left in this process (deduplicated, in order; at most 256)."""
    with _lock:
        return list(_LOG.islands.values())


def clear_island_records() -> None:
    """Forget :func:`island_records` (and re-arm the one-time DelayedScaling warning)."""
    with _lock:
        _LOG.islands.clear()
        _LOG.warned.clear()


@torch._dynamo.assume_constant_result
def note_island(te_module: str, name: str, reason: str, fix: str) -> bool:
    """Trace time: record an island (and warn once for DelayedScaling). Returns ``True``."""
    with _lock:
        key = (te_module, name, reason)
        if key not in _LOG.islands and len(_LOG.islands) < _ISLAND_LIMIT:
            _LOG.islands[key] = Island(te_module, name, reason, fix)
        warn = "DelayedScaling" in reason and "DelayedScaling" not in _LOG.warned
        if warn:
            _LOG.warned.add("DelayedScaling")
    if warn:
        warnings.warn(f"te_passes: {Island(te_module, name, reason, fix)}", RuntimeWarning, stacklevel=2)
    return True


#: The one-time warning for a new (equal) recipe object per step: Dynamo's guard on the recipe's identity.
NEW_RECIPE_FIX = ("build the recipe once, outside the training loop, and pass that same object to te.autocast "
                  "every step (te.autocast(enabled=True) without recipe= builds a new default recipe per call: "
                  "pass recipe=...)")


def warn_new_recipe(recipe_cls: str, where: str) -> bool:
    """Warn once per process (``RuntimeWarning``; :func:`clear_island_records` re-arms it) that a compile of
    ``where`` (a function's qualname) started under a new ``recipe_cls`` object equal to the one an earlier
    compile of it ran under: each new object recompiles, and past ``torch._dynamo.config.recompile_limit``
    Dynamo runs the frame eagerly for good. Returns whether it warned now."""
    with _lock:
        if "new recipe" in _LOG.warned:
            return False
        _LOG.warned.add("new recipe")
    warnings.warn(f"te_passes: {where} is compiled again because te.autocast got a new {recipe_cls} object equal "
                  f"to the one an earlier compile ran under; te_inductor's graphs are guarded on the recipe object "
                  f"(TE's ops read it at run time), so every new recipe object recompiles, and after "
                  f"torch._dynamo.config.recompile_limit ({torch._dynamo.config.recompile_limit}) recompiles "
                  f"Dynamo runs {where} eagerly, uncompiled. Fix: {NEW_RECIPE_FIX}", RuntimeWarning, stacklevel=2)
    return True


#: The fix named for a module whose DelayedScaling state the compile-start callback did not register.
PREPARE_FIX = "call te_passes.prepare_delayed_scaling(model, recipe) before the first compiled step"


def island_fix_for(reason: str) -> str:
    """The fix named beside an island's ``reason`` (``island_records()``, the dump report, the warning)."""
    if _SWITCHED_OFF in reason:  # fused_attn_off: the user's own switch
        switch = reason.split(_SWITCHED_OFF, 1)[1].split(")")[0]
        return f"drop {switch}: it switches TE's fused-attention op off in te_inductor frames"
    if "prepare_delayed_scaling" in reason:
        return PREPARE_FIX
    if "DelayedScaling" in reason:
        return DELAYED_SCALING_FIX
    return ("none inside te_passes for this configuration; the rest of the model still compiles "
            "(see docs/untouched.md for what the polyfills express)")


