"""The pass manager: every pass of a stage run the same way (disable switch, one edit journal undone on
:class:`PassSkipped` or any exception, torch's ``GraphTransformObserver``, lint, :class:`PassObserver`\\ s).
docs/design.md "The manager".
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Iterable, Sequence

import torch.fx
from torch.fx.passes.graph_transform_observer import GraphTransformObserver

from te_passes._logging import get_logger, trace_artifact
from te_passes.fx.journal import GraphJournal
from te_passes.pipeline.base import PassContext, PassRecord, PassSkipped, TEPass, TEPassResult
from te_passes.report import CompileReport, PassRun, StageReport

log = get_logger()


class TePassError(RuntimeError):
    """A pass failed under ``te_passes.strict`` (message names the pass, stage and graph)."""


class PassObserver:
    """Base class of everything that watches a compilation (the dump writer is one); every hook is a
    no-op. ``before_stage`` / ``after_stage``: around a stage's passes (also a stage with none);
    ``before_pass`` / ``after_pass``: around an enabled pass (``run`` says whether it was skipped or
    failed and undone); ``finish``: the compilation is done (again when a lazy backward ran later)."""

    def before_stage(self, gm: torch.fx.GraphModule, ctx: PassContext) -> None:
        pass

    def after_stage(self, gm: torch.fx.GraphModule, ctx: PassContext, report: StageReport) -> None:
        pass

    def before_pass(self, gm: torch.fx.GraphModule, tepass: TEPass, ctx: PassContext) -> None:
        pass

    def after_pass(self, gm: torch.fx.GraphModule, tepass: TEPass, ctx: PassContext, run: PassRun) -> None:
        pass

    def finish(self, report: CompileReport) -> None:
        pass


class PassManager:
    """Applies ``passes`` (in pipeline order: ``te_passes.passes.order``) to graphs stage by stage,
    notifying ``observers`` around each stage and pass."""

    def __init__(self, passes: Sequence[TEPass], observers: Iterable[PassObserver] = ()) -> None:
        self.passes = list(passes)
        self.observers = list(observers)

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext, into: CompileReport | None = None) -> StageReport:
        """Run every pass of ``ctx.stage`` on ``gm`` in place (one ``gm.recompile()`` if any changed it);
        the stage report is appended to ``into``. Raises ``TePassError``: a pass raised under ``strict``."""
        for obs in self.observers:
            obs.before_stage(gm, ctx)
        report = StageReport(graph_id=ctx.graph_id, stage=ctx.stage.value)
        ctx.analyses.clear()  # a reused context may hold analyses (and facts) of another graph
        ctx.stage_facts.clear()
        try:
            for tepass in (p for p in self.passes if ctx.stage in p.stages):
                report.runs.append(self._run_one(gm, tepass, ctx))
                ctx.stage_facts.extend(report.runs[-1].facts)
        finally:
            ctx.analyses.clear()
            if any(r.changed for r in report.runs):
                gm.recompile()
        if into is not None:
            into.stages.append(report)
        for obs in self.observers:
            obs.after_stage(gm, ctx, report)
        return report

    def _run_one(self, gm: torch.fx.GraphModule, tepass: TEPass, ctx: PassContext) -> PassRun:
        run = PassRun(name=tepass.name, stage=ctx.stage.value, nodes_before=len(gm.graph.nodes))
        if tepass.name in ctx.options.disable:
            run.status, run.nodes_after = "disabled", run.nodes_before
            return run
        for obs in self.observers:
            obs.before_pass(gm, tepass, ctx)
        journal = GraphJournal()
        t0 = time.perf_counter()
        try:
            with GraphTransformObserver(gm, tepass.name, subsystem="te_passes"):
                result = tepass.run(gm, dataclasses.replace(ctx, journal=journal))
            if not isinstance(result, TEPassResult):
                raise TypeError(f"pass {tepass.name} returned {type(result).__name__}, not TEPassResult")
            if result.modified and not journal:
                raise RuntimeError(f"pass {tepass.name} reported a change but made no edit through ctx.journal")
            if tepass.analysis_only and journal:
                raise RuntimeError(f"analysis {tepass.name} (analysis_only) edited the graph")
            if journal:
                ctx.analyses.clear()
                gm.graph.lint()
            run.changed, run.records, run.facts = bool(journal), result.records, result.facts
        except PassSkipped as e:
            self._undo(gm, journal, ctx)
            run.status, run.records = "skipped", [PassRecord("skipped", None, {"reason": str(e)})]
        except Exception as e:  # noqa: BLE001 - any pass failure must leave the graph intact
            self._undo(gm, journal, ctx)
            run.status, run.error = "failed", f"{type(e).__name__}: {e}"
            msg = (f"te_passes: pass {tepass.name!r} failed on graph {ctx.graph_id} at stage "
                   f"{ctx.stage.value} ({run.error}); the graph was left as it was")
            if ctx.options.strict:
                raise TePassError(msg) from e
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
        run.time_ms = (time.perf_counter() - t0) * 1e3
        run.nodes_after = len(gm.graph.nodes)
        log.debug("%s[%s] %s: %s changed=%s %.2f ms nodes %d -> %d records=%d", ctx.graph_id, ctx.stage.value,
                  tepass.name, run.status, run.changed, run.time_ms, run.nodes_before, run.nodes_after,
                  len(run.records))
        if run.changed:
            trace_artifact(f"te_passes_{ctx.graph_id}_{ctx.stage.value}_{tepass.name}",
                           lambda: gm.print_readable(print_output=False))
        for obs in self.observers:
            obs.after_pass(gm, tepass, ctx, run)
        return run

    @staticmethod
    def _undo(gm: torch.fx.GraphModule, journal: GraphJournal, ctx: PassContext) -> None:
        ctx.analyses.clear()
        if journal:
            journal.undo()
            gm.recompile()
