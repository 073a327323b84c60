"""The passes, one module each, in :mod:`.order`; their interface (:mod:`te_passes.pipeline.base`) re-exported."""

from te_passes.pipeline.base import PassContext, PassRecord, PassSkipped, Stage, TEPass, TEPassResult

__all__ = ["PassContext", "PassRecord", "PassSkipped", "Stage", "TEPass", "TEPassResult"]
