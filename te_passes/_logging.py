"""te_passes logging through ``torch._logging``.

``TORCH_LOGS=+te_passes`` (or ``torch._logging.set_logs(te_passes=logging.DEBUG)``) turns on
our logger ``te_passes``; ``TORCH_TRACE=dir`` makes :func:`trace_artifact` emit tlparse
artifacts (``torch._logging.trace_structured("artifact", ...)``).
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import torch._logging
import torch._logging._internal as _internal

LOG_NAME = "te_passes"
_registered = False


def get_logger() -> logging.Logger:
    """The ``te_passes`` logger, registered with torch._logging on first use.

    ``TORCH_LOGS`` was parsed at torch import, before our name existed: only our own logger's
    level and its one torch-style stderr handler are set from it (torch's ``_init_logs`` is not
    run again, so torch's loggers keep their single handlers).
    """
    global _registered
    log = logging.getLogger(LOG_NAME)
    if not _registered:
        _registered = True
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
                    _internal._setup_handlers(_internal._StderrHandler, log)
    return log


def trace_artifact(name: str, payload_fn: Callable[[], str], encoding: str = "string") -> None:
    """Emit one tlparse artifact named ``name`` (no-op unless ``TORCH_TRACE`` is set).

    Mirrors how Inductor emits ``fx_graph_runnable`` etc. (``torch._logging.trace_structured``,
    torch 2.14). ``payload_fn`` is only called when tracing is on.
    """
    torch._logging.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": encoding},
        payload_fn=payload_fn,
    )
