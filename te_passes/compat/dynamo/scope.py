"""Dynamo config for te_inductor's compiles only (:data:`FLAGS`): set by a Dynamo start callback
for a te_inductor frame and restored by the matching end callback; other backends' compiles and the
user's own values are untouched.

Activation checkpointing: without ``skip_fwd_side_effects_in_bwd_under_checkpoint``,
``torch.utils.checkpoint.checkpoint(te_module, x, use_reentrant=False)`` stops Dynamo's checkpoint
higher-order op at TE's first ``fast_setattr`` (``module/base.py`` ``prepare_forward``: ``HOP:
Unsafe side effect``) and the region runs eagerly; why skipping the replay of those side effects in
the recompute is safe for TE: docs/usage.md "Training loop" (activation checkpointing). Dynamic
shapes: ``specialize_float`` and ``allow_ignore_mark_dynamic`` (see :data:`FLAGS`). Each value is
read only while Dynamo wraps and traces a frame (e.g. ``CheckpointHigherOrderVariable.__init__``,
torch/_dynamo/variables/higher_order_ops.py; ``variables/builder.py``), so a start/end callback pair
scopes it to one compile.
"""

from __future__ import annotations

import functools
import sys
import threading
import types
from typing import Any

import torch

from te_passes.compat.dynamo.callbacks import keep_start_callback

#: The Dynamo config flag te_inductor turns on for its own compiles (activation checkpointing).
FLAG = "skip_fwd_side_effects_in_bwd_under_checkpoint"
#: Every Dynamo config value te_inductor's compiles run with (each read while Dynamo wraps a frame's
#: inputs / traces it, so a start / end callback pair scopes it to one compile):
#: - :data:`FLAG`: TE's first-forward ``fast_setattr`` inside ``torch.utils.checkpoint`` regions;
#: - ``specialize_float``: ``dynamic=True`` (``assume_static_by_default`` off) makes the floats Dynamo
#:   reads symbolic — a quantizer's ``amax_epsilon``, a module's ``softmax_scale`` — which TE's custom
#:   ops must hold as constants in their ``OpaqueValueBundle`` (an internal Dynamo error otherwise);
#: - ``allow_ignore_mark_dynamic``: TE's fused-attention op holds ``max_seqlen`` as a constant, so a
#:   sequence length the user marked dynamic is specialised under a guard (one graph per length)
#:   instead of failing with ``ConstraintViolationError`` (docs/untouched.md "Sequence lengths").
FLAGS: dict[str, Any] = {FLAG: True, "specialize_float": True, "allow_ignore_mark_dynamic": True}
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
    """Dynamo start callback: for a te_inductor frame, set :data:`FLAGS` for this compile (the user's
    values are restored by :func:`on_compile_end`)."""
    if not is_te_inductor(compiling_backend()):
        return
    handler = torch._dynamo.callback_handler
    if on_compile_end not in handler.end_callbacks:  # torch._dynamo.reset() drops end callbacks
        handler.register_end_callback(on_compile_end)
    with _lock:
        if _scope["restore"] is not None:
            return
        cfg = torch._dynamo.config
        _scope["restore"] = {name: getattr(cfg, name) for name in FLAGS}
        for name, value in FLAGS.items():
            setattr(cfg, name, value)


def on_compile_end(_args: Any = None) -> None:
    """Dynamo end callback (runs in a ``finally``, torch/_dynamo/callback.py): restore :data:`FLAGS`."""
    with _lock:
        restore, _scope["restore"] = _scope["restore"], None
    for name, value in (restore or {}).items():
        setattr(torch._dynamo.config, name, value)


def register() -> None:
    """Keep :func:`on_compile_start` registered (over ``torch._dynamo.reset()``) and register
    :func:`on_compile_end` (idempotent)."""
    keep_start_callback(on_compile_start)
    handler = torch._dynamo.callback_handler
    if on_compile_end not in handler.end_callbacks:
        handler.register_end_callback(on_compile_end)
