"""te_passes' Dynamo start callbacks (``torch._dynamo.callback_handler``): install the runtime
hooks at the first Dynamo compile after Transformer Engine is imported, and warn when TE is in
CUDA-graph-capture state (Dynamo then cannot trace TE modules; the frame runs eagerly).
:func:`register` is called once, by the backend module. docs/design.md "The driver".
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from te_passes._logging import get_logger
from te_passes.compat.dynamo import scope as dynamo_scope
from te_passes.compat.dynamo.callbacks import drop_start_callback, keep_start_callback
from te_passes.compat import gate as frame_gate
from te_passes.compat.install import install
from te_passes.compat.untouched.gate import BACKEND_MARK
from te_passes.te.capture_state import te_capture_state

log = get_logger()
_capture_warned = [False]


def warn_capture_state(where: str) -> bool:
    """Warn (log and ``RuntimeWarning``) when TE is in CUDA-graph-capture state; returns whether it did."""
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


def on_compile_start_install(_args: Any) -> None:
    """Every Dynamo compile until the runtime hooks are in (TE imported after te_passes), then removed."""
    if install():
        drop_start_callback(on_compile_start_install)


def on_compile_start_capture(_args: Any) -> None:
    """Every Dynamo compile: warn once per capture-state episode (te_inductor is then never called)."""
    if not te_capture_state():
        _capture_warned[0] = False
    elif not _capture_warned[0]:
        _capture_warned[0] = warn_capture_state("the start of a Dynamo compile")


def register() -> None:
    """Install the runtime hooks now if TE is imported, else at a later Dynamo compile; register the
    capture-state warning (both kept over ``torch._dynamo.reset()``) and the activation-checkpointing
    scope of te_inductor compiles (:mod:`te_passes.compat.dynamo.scope`). Idempotent."""
    if not install():
        keep_start_callback(on_compile_start_install)
    keep_start_callback(on_compile_start_capture)
    dynamo_scope.register()


def mark_untouched_backend(fn: Any) -> Any:
    """Opt a backend callable of your own into the untouched-model polyfills, as ``te_inductor`` is:
    sets :data:`te_passes.compat.untouched.gate.BACKEND_MARK` on ``fn`` and runs :func:`register` (what
    loading ``te_passes.backend`` does: the polyfills, TE's ``SplitAlongDim`` rebinding, the compile-start
    callbacks; at a later compile start if TE is imported after this call), so frames compiled for ``fn``
    get the same graphs in a fresh process as after ``te_passes.te_inductor`` was loaded. Returns ``fn``.

    Raises:
        TypeError: ``fn`` is not callable, or takes no attributes (a builtin, a bound method: mark its
            function or a ``functools.partial`` of it).
    """
    if not callable(fn):
        raise TypeError(f"mark_untouched_backend takes a backend callable, not {type(fn).__name__}")
    frame_gate.register_backend(fn)
    try:
        setattr(fn, BACKEND_MARK, True)
    except (AttributeError, TypeError) as e:
        raise TypeError(f"mark_untouched_backend: cannot set {BACKEND_MARK} on {fn!r} ({e}); mark a plain "
                        "function or a functools.partial of it") from None
    register()
    return fn
