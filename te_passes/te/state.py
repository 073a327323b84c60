"""The TE process state that passes read at compile time, captured once per compilation.

See docs/internals.md#te_passestestatepy."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from te_passes.te.recipes import Fp8State


@dataclasses.dataclass(frozen=True)
class TEState:
    """Snapshot of TE state relevant to the passes: the installed TE version, the Userbuffers
    :class:`~te_passes.te.ub.UbSnapshot`, ``extra`` JSON-able facts a pass recorded, and the fp8
    autocast :class:`~te_passes.te.recipes.Fp8State` (each ``None`` when absent / not captured). Taken from the
    live TE process by :func:`te_passes.compat.live_state.capture_te_state`."""

    te_version: str | None = None
    ub: Any = None
    extra: tuple[tuple[str, Any], ...] = ()
    fp8: Fp8State | None = None

    def to_json(self) -> dict[str, Any]:
        """JSON-able form (used in reports and in :meth:`fingerprint`)."""
        return {
            "te_version": self.te_version,
            "ub": self.ub.to_json() if self.ub is not None else None,
            "extra": dict(self.extra),
            "fp8": self.fp8.to_json() if self.fp8 is not None else None,
        }

    def fingerprint(self, *, include_ub: bool = True) -> str:
        """sha256 over :meth:`to_json` (stable across processes)."""
        data = self.to_json()
        if not include_ub:
            data["ub"] = None
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=repr).encode()).hexdigest()
