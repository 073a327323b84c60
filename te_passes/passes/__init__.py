"""The passes: one module per pass named for what it does, and their order (:mod:`.registry`).
The interface they implement is :mod:`te_passes.pipeline.base` (re-exported here)."""

from te_passes.pipeline.base import PassContext, PassRecord, PassSkipped, Stage, TEPass, TEPassResult

__all__ = ["PassContext", "PassRecord", "PassSkipped", "Stage", "TEPass", "TEPassResult"]
