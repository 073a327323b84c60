"""Activation checkpointing around TE modules under te_inductor: Dynamo's
``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint`` turned on for the compiles of
te_inductor frames only, by a Dynamo start callback, and restored by the matching end callback.

Without it, ``torch.utils.checkpoint.checkpoint(te_module, x, use_reentrant=False)`` stops Dynamo's
checkpoint higher-order op at TE's first ``fast_setattr`` (``module/base.py`` ``prepare_forward``:
``HOP: Unsafe side effect``) and the region runs eagerly. Why skipping the replay of those side
effects in the recompute is safe for TE: docs/usage.md "Training loop" (activation checkpointing).
The flag is read only while Dynamo traces a frame (``CheckpointHigherOrderVariable.__init__``,
torch/_dynamo/variables/higher_order_ops.py), so a start/end callback pair scopes it to one compile.
"""

from __future__ import annotations

import functools
import sys
import threading
import types
from typing import Any

import torch

from te_passes.runtime.dynamo_callbacks import keep_start_callback

#: The Dynamo config flag te_inductor turns on for its own compiles.
FLAG = "skip_fwd_side_effects_in_bwd_under_checkpoint"
#: A backend callable (or anything it wraps) with this attribute set to ``True`` counts as te_inductor
#: (the CPU captures' recording backends; the untouched-model polyfills' mark, runtime/untouched/gate.py).
BACKEND_MARK = "_te_passes_untouched"
_BACKEND_MODULE = "te_passes.backend"

_lock = threading.Lock()
_scope: dict[str, Any] = {"restore": None}


def _chain(fn: Any) -> list[Any]:
    """``fn`` and what it wraps (Dynamo's backend wrappers, ``functools.partial``, ``__wrapped__``)."""
    out: list[Any] = []
    while fn is not None and len(out) < 16 and all(fn is not o for o in out):
        out.append(fn)
        nxt = fn.func if isinstance(fn, functools.partial) else None
        for attr in ("_torchdynamo_orig_backend", "_torchdynamo_orig_callable", "compiler_fn", "__wrapped__"):
            if nxt is not None:
                break
            v = getattr(fn, attr, None) if not isinstance(fn, types.ModuleType) else None
            nxt = v if v is not None and v is not fn and callable(v) else None
        fn = nxt
    return out


def is_te_inductor(compiler_fn: Any) -> bool:
    """Whether Dynamo's ``compiler_fn`` is ``te_passes.backend.te_inductor`` (any wrapping) or carries
    :data:`BACKEND_MARK`."""
    te_fn = getattr(sys.modules.get(_BACKEND_MODULE), "te_inductor", None)
    return any((te_fn is not None and c is te_fn) or getattr(c, BACKEND_MARK, False) is True
               for c in _chain(compiler_fn))


def compiling_backend() -> Any:
    """The ``compiler_fn`` of the frame Dynamo is starting to compile (an argument of
    ``torch._dynamo.convert_frame._compile``, found on the call stack), or ``None`` outside one."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "_compile" and f.f_globals.get("__name__") == "torch._dynamo.convert_frame":
            return f.f_locals.get("compiler_fn")
        f = f.f_back
    return None


def on_compile_start(_args: Any = None) -> None:
    """Dynamo start callback: for a te_inductor frame, set :data:`FLAG` for this compile (the user's
    value is restored by :func:`on_compile_end`)."""
    if not is_te_inductor(compiling_backend()):
        return
    handler = torch._dynamo.callback_handler
    if on_compile_end not in handler.end_callbacks:  # torch._dynamo.reset() drops end callbacks
        handler.register_end_callback(on_compile_end)
    with _lock:
        if _scope["restore"] is not None:
            return
        cfg = torch._dynamo.config
        _scope["restore"] = (getattr(cfg, FLAG),)
        setattr(cfg, FLAG, True)


def on_compile_end(_args: Any = None) -> None:
    """Dynamo end callback (runs in a ``finally``, torch/_dynamo/callback.py): restore :data:`FLAG`."""
    with _lock:
        restore, _scope["restore"] = _scope["restore"], None
    if restore is not None:
        setattr(torch._dynamo.config, FLAG, restore[0])


def register() -> None:
    """Keep :func:`on_compile_start` registered (over ``torch._dynamo.reset()``) and register
    :func:`on_compile_end` (idempotent)."""
    keep_start_callback(on_compile_start)
    handler = torch._dynamo.callback_handler
    if on_compile_end not in handler.end_callbacks:
        handler.register_end_callback(on_compile_end)
