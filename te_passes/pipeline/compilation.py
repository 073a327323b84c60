"""The compilation driver's shared pieces: the pipeline uuid (Inductor FX-graph-cache key part),
running one stage between the observers' stage hooks, and ``mode``/options -> Inductor config
patches. Used by :mod:`te_passes.backend`, :mod:`te_passes.debug.offline` and the examples.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Sequence

import torch
import torch.fx

from te_passes.config import TePassesOptions
from te_passes.pipeline import base
from te_passes.pipeline.base import PassContext
from te_passes.pipeline.manager import PassManager
from te_passes.report import CompileReport
from te_passes.te.state import TEState


def pipeline_uuid(manager: PassManager, options: TePassesOptions, te_state: TEState,
                  ub_reads: Sequence[str] | None = None) -> dict[str, Any]:
    """What the pass pipeline's cache identity is built from, plus its hash under ``"uuid"``.

    Covers every pass's :meth:`~te_passes.pipeline.base.TEPass.uuid` (source + config), the
    te_passes package source (:func:`te_passes.pipeline.base.package_source_hash`), the option
    values that change what passes do, and the TE state fingerprint (:meth:`TEState.fingerprint`:
    TE version, fp8 autocast state and, for a graph that reads it, the UB snapshot). The UB snapshot is part of that fingerprint only when the
    graph reads UB state: ``ub_reads`` is :func:`te_passes.runtime.ub_guard.ub_state_reads` of the
    graph (reasons; empty: it does not read UB state, so a UB change keeps its FX-graph-cache
    key), ``None`` when not known (the UB snapshot is then included, the safe default).

    Returns ``{"package", "passes", "options", "te_state", "reads_ub"}``, their sha256 under ``"uuid"``,
    and ``"ub_reads"`` (the reasons, or ``None``; not hashed: they name graph nodes).
    """
    reads_ub = ub_reads is None or bool(ub_reads)
    parts: dict[str, Any] = {
        "package": base.package_source_hash(base.PACKAGE_ROOT),
        "passes": {p.name: p.uuid() for p in manager.passes},
        "options": options.fingerprint_data(),
        "te_state": te_state.fingerprint(include_ub=reads_ub),
        "reads_ub": reads_ub,
    }
    parts["uuid"] = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    parts["ub_reads"] = list(ub_reads) if ub_reads is not None else None
    return parts


def run_stage(manager: PassManager, gm: torch.fx.GraphModule, ctx: PassContext, report: CompileReport):
    """``manager.run(gm, ctx)``, its stage report appended to ``report``, between the observers'
    optional ``before_stage(gm, ctx)`` / ``after_stage(gm, ctx, stage_report)`` hooks (the dump
    writer saves each stage's input and output graph there, also for stages with no pass)."""
    for obs in manager.observers:
        if hasattr(obs, "before_stage"):
            obs.before_stage(gm, ctx)
    stage_report = manager.run(gm, ctx)
    report.stages.append(stage_report)
    for obs in manager.observers:
        if hasattr(obs, "after_stage"):
            obs.after_stage(gm, ctx, stage_report)
    return stage_report


def inductor_config_patches(mode: str | None, inductor_options: dict[str, Any]) -> dict[str, Any]:
    """Map ``mode`` + Inductor ``options`` to config patches exactly as ``torch.compile`` does.

    Raises:
        RuntimeError: unknown mode, unknown Inductor option or wrong value type (Inductor's
            own messages).
    """
    wrapper = torch._TorchCompileInductorWrapper(mode, inductor_options, dynamic=None)
    return dict(wrapper.config)
