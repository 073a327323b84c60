"""The backend gate of the untouched-model polyfills (:mod:`te_passes.compat.untouched.polyfills`): which
backend Dynamo compiles a frame for (``te_inductor``, or a callable marked :data:`BACKEND_MARK`),
the ``te_passes.untouched`` option / ``TE_PASSES_UNTOUCHED``, and the island records of the calls
the polyfills leave to TE's eager code. Docs: docs/untouched.md."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import threading
import types
import warnings
from typing import Any

import torch

from te_passes.config import PREFIX, TePassesOptions
from te_passes.te.untouched_rules import DELAYED_SCALING_FIX

#: The ``te_passes.*`` option (``torch.compile(..., options={OPTION: False})``) and its env var.
OPTION = PREFIX + "untouched"
ENV = "TE_PASSES_UNTOUCHED"
#: A backend callable (or anything it wraps) with this attribute set to ``True`` takes the
#: polyfills like ``te_inductor`` (the CPU capture's recording backends set it).
BACKEND_MARK = "_te_passes_untouched"


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
def note_island(te_module: str, name: str, reason: str, fix: str) -> bool:
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
        if "new recipe" in _WARNED:
            return False
        _WARNED.add("new recipe")
    warnings.warn(f"te_passes: {where} is compiled again because te.autocast got a new {recipe_cls} object equal "
                  f"to the one an earlier compile ran under; te_inductor's graphs are guarded on the recipe object "
                  f"(TE's ops read it at run time), so every new recipe object recompiles, and after "
                  f"torch._dynamo.config.recompile_limit ({torch._dynamo.config.recompile_limit}) recompiles "
                  f"Dynamo runs {where} eagerly, uncompiled. Fix: {NEW_RECIPE_FIX}", RuntimeWarning, stacklevel=2)
    return True


#: The fix named for a module whose DelayedScaling state the compile-start callback did not register.
PREPARE_FIX = "call te_passes.prepare_delayed_scaling(model, recipe) before the first compiled step"


def island_fix_for(reason: str) -> str:
    if "prepare_delayed_scaling" in reason:
        return PREPARE_FIX
    if "DelayedScaling" in reason:
        return DELAYED_SCALING_FIX
    return ("none inside te_passes for this configuration; the rest of the model still compiles "
            "(see docs/untouched.md for what the polyfills express)")


