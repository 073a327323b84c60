"""The one frame gate: is the frame Dynamo traces now compiled for ``te_inductor`` (or a backend marked as
one), and with which parsed ``te_passes.*`` options?

``te_inductor`` registers itself here when :mod:`te_passes.backend` loads (:func:`register_backend`); a
backend of your own joins with :func:`te_passes.mark_untouched_backend`. Dynamo's wrappers
(``torch._TorchCompileWrapper``, ``WrapBackendDebug``, ``functools.partial``, ``__wrapped__``) are walked to
the registered callable; the ``options`` dict found on the way (``torch.compile(..., options=...)`` or
``te_inductor_backend(options=...)``) is parsed once per wrapper object.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
import types
import weakref
from typing import Any

import torch

from te_passes.config import TePassesOptions

_LOCK = threading.Lock()


@dataclasses.dataclass
class _GateState:
    """The gate's process state (under ``_LOCK``): ``backends``, te_inductor and the backends marked as
    te_inductor (weakly held: a marked backend may be collected); ``parsed``, id(outermost wrapper) ->
    (weakref to it or None, parsed options): options parsed once per wrapper."""

    backends: "weakref.WeakSet[Any]" = dataclasses.field(default_factory=weakref.WeakSet)
    parsed: dict[int, tuple[Any, TePassesOptions | None]] = dataclasses.field(default_factory=dict)


_GATE = _GateState()
_WRAPPER_ATTRS = ("_torchdynamo_orig_backend", "_torchdynamo_orig_callable", "compiler_fn", "__wrapped__")


def register_backend(fn: Any) -> Any:
    """Count ``fn`` (a backend callable: function or ``functools.partial``) as te_inductor at this gate.

    Raises:
        TypeError: ``fn`` is not callable or cannot be weakly referenced (a bound method, a builtin: register
            its function or a ``functools.partial`` of it)."""
    if not callable(fn):
        raise TypeError(f"a te_passes backend must be callable, not {type(fn).__name__}")
    try:
        with _LOCK:
            _GATE.backends.add(fn)
            _GATE.parsed.clear()
    except TypeError as e:
        raise TypeError(f"cannot register {fn!r} as a te_passes backend ({e}); register a plain function or a "
                        "functools.partial of it") from None
    return fn


def backend_chain(fn: Any) -> list[Any]:
    """``fn`` and what it wraps, outermost first (at most 16 levels)."""
    out: list[Any] = []
    while fn is not None and len(out) < 16 and all(fn is not o for o in out):
        out.append(fn)
        nxt = fn.func if isinstance(fn, functools.partial) else None
        for attr in _WRAPPER_ATTRS:
            if nxt is not None:
                break
            v = getattr(fn, attr, None) if not isinstance(fn, types.ModuleType) else None
            nxt = v if v is not None and v is not fn and callable(v) else None
        fn = nxt
    return out


def _registered(c: Any) -> bool:
    try:
        return c in _GATE.backends
    except TypeError:  # unhashable callables are never registered
        return False


def _options_in(chain: list[Any]) -> dict[str, Any] | None:
    for c in chain:
        kw = c.keywords if isinstance(c, functools.partial) else getattr(c, "kwargs", None)
        if isinstance(kw, dict) and isinstance(kw.get("options"), dict):
            return kw["options"]
    return None


def options_for(compiler_fn: Any) -> TePassesOptions | None:
    """The parsed ``te_passes.*`` options when ``compiler_fn`` (Dynamo's ``OutputGraph.compiler_fn`` or any
    wrapper of a backend) is te_inductor or a registered backend; ``None`` for any other backend.

    Raises:
        TePassesOptionError: a bad ``te_passes.*`` option or ``TE_PASSES_*`` variable."""
    if compiler_fn is None:
        return None
    key = id(compiler_fn)
    with _LOCK:
        hit = _GATE.parsed.get(key)
    if hit is not None and (hit[0] is None or hit[0]() is compiler_fn):
        return hit[1]
    chain = backend_chain(compiler_fn)
    parsed = TePassesOptions.parse(_options_in(chain))[0] if any(_registered(c) for c in chain) else None
    try:
        ref = weakref.ref(compiler_fn)
    except TypeError:
        return parsed  # not cacheable by identity
    with _LOCK:
        if len(_GATE.parsed) > 256:
            _GATE.parsed.clear()
        _GATE.parsed[key] = (ref, parsed)
    return parsed


def tracing_backend() -> Any:
    """The ``compiler_fn`` of the frame Dynamo traces now: the current instruction translator's output
    graph, else ``torch._dynamo.convert_frame._compile``'s argument on the call stack (a compile-start
    callback runs before the translator exists); ``None`` outside a Dynamo compile."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except (ImportError, AttributeError):
        tx = None
    if tx is not None:
        return getattr(tx.output, "compiler_fn", None)
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "_compile" and f.f_globals.get("__name__") == "torch._dynamo.convert_frame":
            return f.f_locals.get("compiler_fn")
        f = f.f_back
    return None


def frame_options() -> TePassesOptions | None:
    """:func:`options_for` the frame Dynamo traces now (``None``: not a te_inductor frame, or no trace)."""
    return options_for(tracing_backend())


@torch._dynamo.assume_constant_result
def te_inductor_tracing() -> bool:
    """Inside a trace, a constant: ``True`` only while Dynamo traces a frame that te_inductor compiles."""
    return frame_options() is not None
