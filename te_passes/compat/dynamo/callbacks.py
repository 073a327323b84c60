"""te_passes' one Dynamo start callback and its end callback (``torch._dynamo.callback_handler``).

:func:`on_compile_start` runs at the start of every Dynamo compile, before the frame is traced: it warns when
TE is in CUDA-graph-capture state (Dynamo then cannot trace TE modules and te_inductor is never called), and
for a frame compiled by te_inductor (:func:`te_passes.compat.gate.options_for`) it sets the Dynamo config
toggles of the patch table (:func:`te_passes.compat.table.apply_toggles`), makes the sweep rows' new changes
(TE objects defined since the last install) and runs TE's first-forward lazy init of the modules the frame
reaches (:func:`te_passes.compat.untouched.state.on_compile_start`). :func:`on_compile_end` (Dynamo runs it
in a ``finally``) restores the toggles. ``torch._dynamo.reset()`` clears Dynamo's callbacks; the patch-table
row ``dynamo.keep_callbacks`` registers these two again after each clear.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
from typing import Any, Callable, Iterator

import torch

from te_passes._logging import get_logger
from te_passes.compat import gate, table
from te_passes.compat.untouched.state import on_compile_start as untouched_compile_start
from te_passes.config import TePassesOptionError
from te_passes.compat.te220.capture_state import te_capture_state

log = get_logger()
_LOCK = threading.Lock()


@dataclasses.dataclass
class _CallbackState:
    """``restore``: the restore function of the toggles set for the te_inductor compile in progress (under
    ``_LOCK``); ``capture_warned``: whether the capture-state warning was given in the current capture
    episode; ``step.depth``: ``compile_step`` steps running in this thread (a ``threading.local``)."""

    restore: Callable[[], Any] | None = None
    capture_warned: bool = False
    step: threading.local = dataclasses.field(default_factory=threading.local)


_SCOPE = _CallbackState()


def warn_capture_state(where: str) -> bool:
    """Warn (log and ``RuntimeWarning``) when TE is in CUDA-graph-capture state; returns whether it did.
    ``where``: the place named in the message (``"te_inductor"``, ``"the start of a Dynamo compile"``)."""
    reasons = te_capture_state()
    if not reasons:
        return False
    msg = (f"te_passes: Transformer Engine is in CUDA-graph-capture state ({'; '.join(reasons)}) at {where}: "
           f"torch.compile cannot trace TE modules in this state and the frame falls back to eager (no "
           f"te_inductor graph). Finish or reset the capture (transformer_engine.pytorch.graph.set_capture_end())"
           f" before compiling")
    log.warning("%s", msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=2)
    return True


def is_te_inductor(compiler_fn: Any) -> bool:
    """Whether Dynamo's ``compiler_fn`` is te_inductor or a backend registered at the frame gate (however
    wrapped). A bad ``te_passes.*`` option still counts (te_inductor then raises it with its message)."""
    try:
        return gate.options_for(compiler_fn) is not None
    except TePassesOptionError:
        return True


@contextlib.contextmanager
def step_scope() -> Iterator[None]:
    """Frames Dynamo compiles in this thread inside the ``with`` block get the ``"step"`` toggles of the patch
    table (``te_passes.compile_step`` runs each step in one)."""
    _SCOPE.step.depth = getattr(_SCOPE.step, "depth", 0) + 1
    try:
        yield
    finally:
        _SCOPE.step.depth -= 1


def on_compile_start(args: Any = None) -> None:
    """Dynamo start callback (every compile, any backend); see the module docstring. Never raises for a
    frame that is not te_inductor's."""
    if not te_capture_state():
        _SCOPE.capture_warned = False
    elif not _SCOPE.capture_warned:
        _SCOPE.capture_warned = warn_capture_state("the start of a Dynamo compile")
    ours = is_te_inductor(gate.tracing_backend())
    scopes = (["te_inductor"] if ours else []) + (["step"] if getattr(_SCOPE.step, "depth", 0) else [])
    with _LOCK:
        if _SCOPE.restore is None and scopes:
            restores = [table.apply_toggles(sc) for sc in scopes]
            _SCOPE.restore = lambda: [r() for r in reversed(restores)]
    if not ours:
        return
    table.sweep()  # TE objects defined since the last install
    untouched_compile_start(args)


def on_compile_end(_args: Any = None) -> None:
    """Dynamo end callback: put back the Dynamo config values :func:`on_compile_start` changed."""
    with _LOCK:
        restore, _SCOPE.restore = _SCOPE.restore, None
    if restore is not None:
        restore()


def register_on(handler: Any) -> None:
    """Register :func:`on_compile_start` / :func:`on_compile_end` on Dynamo's ``handler`` if absent."""
    if on_compile_start not in handler.start_callbacks:
        handler.register_start_callback(on_compile_start)
    if on_compile_end not in handler.end_callbacks:
        handler.register_end_callback(on_compile_end)


def clear_then_register(clear: Callable[[Any], None]) -> Callable[[Any], None]:
    """``CallbackHandler.clear`` that then registers te_passes' callbacks again on Dynamo's handler (the
    replacement of row ``dynamo.keep_callbacks``); ``clear``: the method it wraps."""
    def clear_then_restore(self: Any) -> None:
        clear(self)
        if self is torch._dynamo.callback_handler:
            register_on(self)
    clear_then_restore.__wrapped__ = clear  # type: ignore[attr-defined]
    return clear_then_restore
