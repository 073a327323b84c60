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
    """Snapshot of TE state relevant to the passes.

    Fields:
        te_version: installed TE version string, or ``None`` when TE is not installed.
        ub: the Userbuffers snapshot (``te_passes.te.ub.UbSnapshot``) or ``None`` when UB is not
            initialised / not captured.
        extra: other JSON-able facts a pass recorded about TE's state (e.g. the active recipe).
        fp8: TE's fp8 autocast state (``te_passes.te.recipes.Fp8State``: enabled / calibration /
            fp8 parameters, the recipe, the amax-reduction group), or ``None`` when not captured
            (TE not loaded). ``fold_recipe_lookups`` folds ``FP8GlobalStateManager`` lookups to it.
    """

    te_version: str | None = None
    ub: Any = None
    extra: tuple[tuple[str, Any], ...] = ()
    fp8: Fp8State | None = None

    @classmethod
    def capture(cls, *, ub_snapshot: Any = None, fp8: Fp8State | None = None) -> "TEState":
        """Take the state from the live TE process (or ``ub_snapshot`` / ``fp8`` when given).

        ``ub_snapshot`` may be a ``UbSnapshot``, a dict, or a JSON file path (offline use). The fp8
        autocast state is :meth:`Fp8State.capture_if_loaded` (``None`` while TE is not imported).
        Without TE installed this returns a state with ``te_version=None``, no UB and no fp8 state.
        """
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
