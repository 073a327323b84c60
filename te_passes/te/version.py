"""Which Transformer Engine is installed, and whether te_passes knows it.

te_passes decodes TE's ``transformer_engine_compile::*`` custom ops by their schema slot names
and config-bundle fields, which are TE-version specific. :data:`SUPPORTED_TE` lists the
``major.minor`` series whose graphs the TE graph model was written against and tested on.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import sys

#: TE release series (major, minor) whose op layout te_passes decodes.
SUPPORTED_TE: frozenset[tuple[int, int]] = frozenset({(2, 20)})


@functools.lru_cache(maxsize=None)
def te_version() -> str | None:
    """The installed ``transformer_engine`` version string (e.g. ``"2.20.2"``), or ``None``.

    Read from package metadata (no import of TE, which needs torch first and is slow).
    """
    for dist in ("transformer_engine", "transformer-engine"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def parse_version(v: str) -> tuple[int, int]:
    """``"2.20.2"`` -> ``(2, 20)``; raises ``ValueError`` on anything else."""
    parts = v.split(".")
    return int(parts[0]), int(parts[1].split("+")[0])


def is_supported(v: str | None = None) -> bool:
    """Whether TE version ``v`` (default: installed) is one the graph model decodes."""
    v = te_version() if v is None else v
    if v is None:
        return False
    try:
        return parse_version(v) in SUPPORTED_TE
    except (ValueError, IndexError):
        return False


def te_module(name: str, *, import_te: bool = False):
    """The loaded TE module ``name`` (e.g. ``"transformer_engine.pytorch.module.linear"``), or
    ``None`` while TE has not imported it; with ``import_te`` it is imported (torch first, as TE
    needs). Used by the runtime hooks, which install lazily once TE is loaded."""
    mod = sys.modules.get(name)
    if mod is None and import_te:
        import torch  # noqa: F401  (TE needs torch first)

        mod = importlib.import_module(name)
    return mod
