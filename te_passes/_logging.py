"""te_passes logging through ``torch._logging``: ``TORCH_LOGS=+te_passes`` (or
``torch._logging.set_logs(te_passes=logging.DEBUG)``) turns on the ``te_passes`` logger;
``TORCH_TRACE=dir`` makes :func:`trace_artifact` emit tlparse artifacts."""

from __future__ import annotations

import functools
import logging
import os
from typing import Callable

import torch._logging
import torch._logging._internal as _internal

LOG_NAME = "te_passes"


def get_logger() -> logging.Logger:
    """The ``te_passes`` logger, registered with torch._logging on first use; a ``TORCH_LOGS`` torch parsed
    before then sets only its level and a :class:`_StandInHandler` (torch's ``_init_logs`` is not rerun)."""
    log = logging.getLogger(LOG_NAME)
    _register(log)
    return log


@functools.lru_cache(maxsize=None)
def _register(log: logging.Logger) -> None:
    """Register ``log`` with torch._logging (once per process: the result is cached)."""
    _internal.register_log(LOG_NAME, LOG_NAME)
    setting = os.environ.get("TORCH_LOGS", "")
    if LOG_NAME in setting:
        try:
            level = _internal._parse_log_settings(setting).log_qname_to_level.get(LOG_NAME)
        except ValueError:  # torch already said what is wrong with TORCH_LOGS
            level = None
        if level is not None:
            log.setLevel(level)
            log.propagate = False
            if not any(_internal._is_torch_handler(h) for h in log.handlers):
                _internal._setup_handlers(lambda: _StandInHandler(log), log)


class _StandInHandler(_internal._StderrHandler):
    """torch's stderr handler for our logger, standing in until torch configures the logger
    itself: when torch's ``_init_logs`` runs after us (te_passes imported while torch parses
    ``TORCH_LOGS``) and adds its own handler, this one prints nothing, so each line prints once."""

    def __init__(self, log: logging.Logger) -> None:
        super().__init__()
        self._log = log

    def filter(self, record: logging.LogRecord) -> bool:
        others = [h for h in self._log.handlers if h is not self and _internal._is_torch_handler(h)]
        return not others and bool(super().filter(record))


def trace_artifact(name: str, payload_fn: Callable[[], str], encoding: str = "string") -> None:
    """Emit one tlparse artifact named ``name`` as Inductor emits ``fx_graph_runnable``
    (``torch._logging.trace_structured``); ``payload_fn`` is only called when ``TORCH_TRACE`` is set."""
    torch._logging.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": encoding},
        payload_fn=payload_fn,
    )
