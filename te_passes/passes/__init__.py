"""Passes: the interface (:mod:`.base`), the ordered registry (:mod:`.registry`), the manager
(:mod:`.manager`), and one module per pass named for what it does."""

from te_passes.pipeline.base import PassContext, PassRecord, PassSkipped, Stage, TEPass, TEPassResult

__all__ = ["PassContext", "PassRecord", "PassSkipped", "Stage", "TEPass", "TEPassResult"]
