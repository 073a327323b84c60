"""Which Transformer Engine and torch are installed, and whether te_passes knows them
(:data:`SUPPORTED_TE`: the ``major.minor`` series whose op layout and run-time reads the TE layer was
written against; :data:`SUPPORTED_TORCH`: the torch series it runs on, pyproject.toml's pin), and the
gate a torch-version-specific patch uses (:func:`torch_at_least`)."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import sys

#: TE release series (major, minor) whose op layout te_passes decodes.
SUPPORTED_TE: frozenset[tuple[int, int]] = frozenset({(2, 20)})

#: torch release series (major, minor) te_passes runs on with TE 2.20 (pyproject.toml pins
#: ``torch>=2.14,<2.16``; docs/install.md has the support matrix).
SUPPORTED_TORCH: frozenset[tuple[int, int]] = frozenset({(2, 14), (2, 15)})


@functools.lru_cache(maxsize=None)
def te_version() -> str | None:
    """The installed ``transformer_engine`` version string, or ``None`` (package metadata: no TE import)."""
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


def torch_series(v: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of torch version ``v`` (default: the imported torch's ``torch.__version__``):
    ``"2.15.0+cu132"`` -> ``(2, 15)``, ``"2.16.0a0+git1234"`` -> ``(2, 16)``. Raises ``ValueError`` on
    a string without integer major and minor parts."""
    v = torch_version_string() if v is None else v
    try:
        return parse_version(v)
    except (ValueError, IndexError):
        raise ValueError(f"torch version {v!r} is not of the form major.minor[.patch][+local]") from None


def torch_at_least(major: int, minor: int, v: str | None = None) -> bool:
    """Whether torch ``v`` (default: the imported one) is ``major.minor`` or later: the gate of a patch or
    workaround one torch range needs (kept next to the patch, with a comment naming the range)."""
    return torch_series(v) >= (major, minor)


def torch_version_string() -> str:
    """The imported torch's ``torch.__version__`` as a ``str`` (e.g. ``"2.15.0+cu132"``)."""
    import torch

    return str(torch.__version__)


def te_module(name: str, *, import_te: bool = False):
    """The loaded TE module ``name``, or ``None`` while TE has not imported it (``import_te``: import it)."""
    mod = sys.modules.get(name)
    if mod is None and import_te:
        import torch  # noqa: F401  (TE needs torch first)

        mod = importlib.import_module(name)
    return mod
