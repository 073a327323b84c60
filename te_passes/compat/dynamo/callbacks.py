"""Dynamo compile-start callbacks that survive ``torch._dynamo.reset()``, whose
``callback_handler.clear()`` (``torch/_dynamo/callback.py``) drops every start callback:
:func:`keep_start_callback` registers one and re-registers it after each ``clear()``."""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

_KEPT: list[Callable[[Any], None]] = []
_LOCK = threading.Lock()
_WRAPPED_ATTR = "_te_passes_keeps_callbacks"


def _wrap_clear(handler: Any) -> None:
    clear = type(handler).clear
    if getattr(clear, _WRAPPED_ATTR, False):
        return

    def clear_then_restore(self: Any) -> None:
        clear(self)
        if self is torch._dynamo.callback_handler:
            for fn in list(_KEPT):
                if fn not in self.start_callbacks:
                    self.register_start_callback(fn)

    setattr(clear_then_restore, _WRAPPED_ATTR, True)
    clear_then_restore.__wrapped__ = clear  # type: ignore[attr-defined]
    type(handler).clear = clear_then_restore


def keep_start_callback(fn: Callable[[Any], None]) -> None:
    """Register ``fn`` as a Dynamo start callback now and again after every ``torch._dynamo.reset()``
    (idempotent)."""
    handler = torch._dynamo.callback_handler
    with _LOCK:
        _wrap_clear(handler)
        if fn not in _KEPT:
            _KEPT.append(fn)
    if fn not in handler.start_callbacks:
        handler.register_start_callback(fn)


def drop_start_callback(fn: Callable[[Any], None]) -> None:
    """Stop keeping ``fn`` and remove it from Dynamo's start callbacks (no error if absent)."""
    with _LOCK:
        if fn in _KEPT:
            _KEPT.remove(fn)
    handler = torch._dynamo.callback_handler
    if fn in handler.start_callbacks:
        handler.remove_start_callback(fn)
