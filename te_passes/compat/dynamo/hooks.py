"""The one install moment (:func:`register`, called when :mod:`te_passes.backend` loads) and
:func:`mark_untouched_backend` (a backend of your own compiles like te_inductor). docs/design.md "The compat fence".
"""

from __future__ import annotations

from typing import Any

import torch

from te_passes.compat import gate as frame_gate
from te_passes.compat.dynamo.callbacks import register_on
from te_passes.compat.install import install


def register() -> bool:
    """Import Transformer Engine (``transformer_engine.pytorch``, after torch), install the patch table and the
    other runtime hooks, and register te_passes' Dynamo callbacks. Idempotent; returns what
    :func:`te_passes.compat.install.install` returns. An installed TE that fails to import is left to fail
    where TE is used (the rows then read ``ImportError`` in ``te-passes doctor``)."""
    try:
        import transformer_engine.pytorch  # noqa: F401 - TE's modules must exist before the rows rebind them
    except ImportError:
        pass
    settled = install()
    register_on(torch._dynamo.callback_handler)
    return settled


def mark_untouched_backend(fn: Any) -> Any:
    """Make a backend callable of your own compile TE modules as ``te_inductor`` does (the untouched-model
    polyfills, the Dynamo config scope, TE's first-forward lazy init): registers ``fn`` at the frame gate
    (:func:`te_passes.compat.gate.register_backend`) and runs :func:`register`. Returns ``fn``.

    Raises:
        TypeError: ``fn`` is not callable, or cannot be weakly referenced (a builtin, a bound method: mark its
            function or a ``functools.partial`` of it).
    """
    if not callable(fn):
        raise TypeError(f"mark_untouched_backend takes a backend callable, not {type(fn).__name__}")
    frame_gate.register_backend(fn)
    register()
    return fn
