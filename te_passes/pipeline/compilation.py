"""The one pipeline driver: :class:`Compilation` runs a stage of one compilation and collects
its stage reports and typed facts; :data:`STAGE_ORDER` / :func:`stage_graph_id` are the one stage
map and :func:`is_backward_graph` / :func:`post_grad_stage` the one backward-graph rule. Also the
pipeline uuid (Inductor FX-graph-cache key part) and ``mode``/options -> Inductor config patches.
Used by :mod:`te_passes.backend` (Dynamo stage and Inductor's custom-pass hooks),
:mod:`te_passes.debug.offline` (examples, replay) and :mod:`te_passes.testing` (CPU capture
helpers, the pass-test harness).
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any, Sequence

import torch
import torch.fx

from te_passes.config import TePassesOptions
from te_passes.pipeline import base
from te_passes.pipeline.base import PassContext, Stage
from te_passes.pipeline.manager import PassManager
from te_passes.report import CompileReport, StageReport
from te_passes.te.state import TEState


def pipeline_uuid(manager: PassManager, options: TePassesOptions, te_state: TEState,
                  ub_reads: Sequence[str] | None = None) -> dict[str, Any]:
    """What the pass pipeline's cache identity is built from, plus its hash under ``"uuid"``.

    Covers every pass's :meth:`~te_passes.pipeline.base.TEPass.uuid` (source + config), the
    te_passes package source (:func:`te_passes.pipeline.base.package_source_hash`), the option
    values that change what passes do, and the TE state fingerprint (:meth:`TEState.fingerprint`:
    TE version, fp8 autocast state and, for a graph that reads it, the UB snapshot). The UB snapshot is part of that fingerprint only when the
    graph reads UB state: ``ub_reads`` is :func:`te_passes.runtime.ub_graph_guard.ub_state_reads` of the
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


#: Stage order of a compilation (the order the backend runs them in).
STAGE_ORDER: tuple[Stage, ...] = (Stage.DYNAMO, Stage.JOINT, Stage.POST_GRAD_FWD, Stage.POST_GRAD_BWD)
#: The suffix a stage's graph id gets after the compilation's (``"g0"``, ``"g0.joint"``, ``"g0.fwd"``,
#: ``"g0.bwd"``): the names stage reports, dumps and records use.
STAGE_SUFFIX: dict[Stage, str] = {Stage.DYNAMO: "", Stage.JOINT: ".joint", Stage.POST_GRAD_FWD: ".fwd",
                                  Stage.POST_GRAD_BWD: ".bwd"}


def stage_graph_id(graph_id: str, stage: Stage | str) -> str:
    """The graph id of ``stage``'s graph of compilation ``graph_id`` (``"g0"`` + :data:`STAGE_SUFFIX`).

    Raises:
        ValueError: ``stage`` is not a :class:`Stage` value.
    """
    return graph_id + STAGE_SUFFIX[Stage(stage)]


def is_backward_graph(graph: torch.fx.Graph | torch.fx.GraphModule) -> bool:
    """Whether a partitioned post-grad graph is a backward graph: it has ``tangents_*``
    placeholders (AOTAutograd's naming of the incoming gradients, torch 2.14
    ``torch/_functorch/_aot_autograd``; forward graphs have ``primals_*`` only). The one
    backward-graph rule of the pipeline."""
    graph = graph.graph if isinstance(graph, torch.fx.GraphModule) else graph
    return any(str(n.target).startswith("tangents") for n in graph.find_nodes(op="placeholder"))


def post_grad_stage(graph: torch.fx.Graph | torch.fx.GraphModule) -> Stage:
    """``Stage.POST_GRAD_BWD`` for a backward graph (:func:`is_backward_graph`), else
    ``Stage.POST_GRAD_FWD``."""
    return Stage.POST_GRAD_BWD if is_backward_graph(graph) else Stage.POST_GRAD_FWD


class Compilation:
    """One compilation (one Dynamo graph) as the pipeline runs it, stage by stage.

    Args:
        manager: the :class:`PassManager` (its passes and observers).
        options: parsed options (:class:`te_passes.config.TePassesOptions`).
        te_state: the TE snapshot of this compilation (:class:`te_passes.te.state.TEState`).
        report: the :class:`CompileReport` stage reports are appended to (``report.graph_id``
            names the stages' graphs unless ``graph_id`` is given).
        graph_id: the compilation's graph id (default ``report.graph_id``).

    :meth:`run_stage` is what the backend's Dynamo stage, its Inductor hooks
    (``te_passes.backend._StagePass``), offline replay (:func:`te_passes.debug.offline.run_stages`)
    and the CPU capture helpers (:func:`te_passes.testing.capture.run_pipeline`) all call.
    """

    def __init__(self, manager: PassManager, options: TePassesOptions, te_state: TEState,
                 report: CompileReport, graph_id: str | None = None) -> None:
        self.manager, self.options, self.te_state, self.report = manager, options, te_state, report
        self.graph_id = report.graph_id if graph_id is None else graph_id

    def context(self, stage: Stage | str, example_inputs: Any = None, inputs: dict | None = None) -> PassContext:
        """The :class:`PassContext` the passes of ``stage`` get (graph id per :func:`stage_graph_id`)."""
        stage = Stage(stage)
        return PassContext(stage, self.options, self.te_state, example_inputs,
                           stage_graph_id(self.graph_id, stage), inputs={} if inputs is None else inputs)

    def run_stage(self, gm: torch.fx.GraphModule, stage: Stage | str, example_inputs: Any = None,
                  inputs: dict | None = None) -> StageReport:
        """Run ``stage``'s passes on ``gm`` (in place) through :func:`run_stage` (observers' stage
        hooks included), append the stage report to ``self.report``, add the time to
        ``report.time_ms_passes`` (ms) and return the stage report.

        ``inputs``: facts handed to the passes (:attr:`PassContext.inputs`).

        Raises:
            te_passes.pipeline.manager.TePassError: a pass failed under ``options.strict``.
        """
        ctx = self.context(stage, example_inputs, inputs)
        t0 = time.perf_counter()
        try:
            return run_stage(self.manager, gm, ctx, self.report)
        finally:
            self.report.time_ms_passes += (time.perf_counter() - t0) * 1e3

    def facts(self, kind: type | None = None) -> list[Any]:
        """The typed facts the passes of every stage run so far returned (in run order), only
        instances of ``kind`` when given."""
        return self.report.typed_facts(kind)


def inductor_config_patches(mode: str | None, inductor_options: dict[str, Any]) -> dict[str, Any]:
    """Map ``mode`` + Inductor ``options`` to config patches exactly as ``torch.compile`` does.

    Raises:
        RuntimeError: unknown mode, unknown Inductor option or wrong value type (Inductor's
            own messages).
    """
    wrapper = torch._TorchCompileInductorWrapper(mode, inductor_options, dynamic=None)
    return dict(wrapper.config)
