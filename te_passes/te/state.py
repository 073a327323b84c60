"""The TE process state that passes read at compile time, captured once per compilation.

See docs/internals.md#te_passestestatepy."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from te_passes.te.recipes import Fp8State
from te_passes.te.ub import UbSnapshot
from te_passes.te.version import te_version


@dataclasses.dataclass(frozen=True)
class TEState:
    """Snapshot of TE state relevant to the passes: the installed TE version, the Userbuffers
    :class:`~te_passes.te.ub.UbSnapshot`, ``extra`` JSON-able facts a pass recorded, and the fp8
    autocast :class:`~te_passes.te.recipes.Fp8State` (each ``None`` when absent / not captured)."""

    te_version: str | None = None
    ub: Any = None
    extra: tuple[tuple[str, Any], ...] = ()
    fp8: Fp8State | None = None

    @classmethod
    def capture(cls, *, ub_snapshot: Any = None, fp8: Fp8State | None = None) -> "TEState":
        """Take the state from the live TE process, or from ``ub_snapshot`` (a ``UbSnapshot``, dict
        or JSON path) / ``fp8`` when given; without TE: ``te_version=None``, no fp8 state."""
        ub = UbSnapshot.load(ub_snapshot) if ub_snapshot is not None else UbSnapshot.capture()
        return cls(te_version=te_version(), ub=ub, fp8=fp8 if fp8 is not None else Fp8State.capture_if_loaded())

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
