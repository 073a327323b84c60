"""The pass manager: applies every pass the same way.

For each pass registered for the stage, in registry order (Inductor ``fx_passes`` /
vLLM ``PostGradPassManager`` style):

1. disabled (``te_passes.disable`` / ``TE_PASSES_DISABLE``)? record ``status="disabled"``;
2. time it; rewrite passes get a backup copy of the graph (``Graph.graph_copy``) before they
   mutate — up front, or lazily at ``ctx.checkpoint()`` for passes that call it
   (``checkpoints_itself``); ``ctx.checkpoint(undo)`` registers the pass's own undo instead
   of a copy; analyses shared between passes (``ctx.analyses``) are dropped whenever a pass
   changes the graph;
3. ``graph.lint()`` after each pass that changed the graph; one ``gm.recompile()`` at the end
   of the stage if any did;
4. on :class:`PassSkipped`: ``status="skipped"`` with the reason, graph untouched;
   on any other exception: restore the backup, warn with the reason (``te_passes.strict``:
   re-raise);
5. log through ``torch._logging`` (``TORCH_LOGS=+te_passes``), emit tlparse artifacts
   (``TORCH_TRACE``), and notify observers (the dump writer) with the graph before/after.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Iterable, Protocol, Sequence

import torch.fx

from te_passes._logging import get_logger, trace_artifact
from te_passes.fx.graph import copy_graph
from te_passes.pipeline.base import PassContext, PassRecord, PassSkipped, TEPass, TEPassResult
from te_passes.pipeline.registry import default_passes
from te_passes.report import PassRun, StageReport

log = get_logger()


class TePassError(RuntimeError):
    """A pass failed under ``te_passes.strict`` (message names the pass, stage and graph)."""


class PassObserver(Protocol):
    """Receives every pass run; the dump writer is one. Both hooks are optional to implement."""

    def before_pass(self, gm: torch.fx.GraphModule, tepass: TEPass, ctx: PassContext) -> None: ...

    def after_pass(self, gm: torch.fx.GraphModule, tepass: TEPass, ctx: PassContext, run: PassRun) -> None: ...


def restore_graph(graph: torch.fx.Graph, backup: torch.fx.Graph) -> None:
    """Make ``graph`` (in place: Inductor holds the object) equal to ``backup``."""
    nodes = list(graph.nodes)
    for node in nodes:  # drop all edges first: the broken graph may hold cycles
        node.args, node.kwargs = (), {}
    for node in reversed(nodes):
        graph.erase_node(node)
    # Erased names stay reserved in the graph's namespace; start a fresh one so the restored
    # nodes keep their original names (records and dumps refer to nodes by name).
    graph._graph_namespace = torch.fx.graph._Namespace()
    val_map: dict[torch.fx.Node, torch.fx.Node] = {}
    out = graph.graph_copy(backup, val_map, return_output_node=True)
    if out is not None:
        graph.output(out[0] if isinstance(out, tuple) else out)


class PassManager:
    """Applies an ordered list of :class:`TEPass`\\ es to graphs, stage by stage.

    Args:
        passes: pass instances in pipeline order (default: the registry's).
        observers: :class:`PassObserver`\\ s notified before/after each pass.
    """

    def __init__(self, passes: Sequence[TEPass] | None = None,
                 observers: Iterable[PassObserver] = ()) -> None:
        if passes is None:
            passes = default_passes()
        self.passes = list(passes)
        self.observers = list(observers)

    def passes_for(self, stage) -> list[TEPass]:
        """The passes registered for ``stage``, in order."""
        return [p for p in self.passes if stage in p.stages]

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> StageReport:
        """Run every pass of ``ctx.stage`` on ``gm`` (in place); return the stage report.

        Raises:
            TePassError: a pass raised and ``ctx.options.strict`` is set.
        """
        report = StageReport(graph_id=ctx.graph_id, stage=ctx.stage.value)
        ctx.analyses.clear()  # a reused context may hold analyses of another graph
        try:
            for tepass in self.passes_for(ctx.stage):
                report.runs.append(self._run_one(gm, tepass, ctx))
        finally:
            ctx.analyses.clear()
        if any(r.changed for r in report.runs):
            gm.recompile()
        return report

    def _run_one(self, gm: torch.fx.GraphModule, tepass: TEPass, ctx: PassContext) -> PassRun:
        graph = gm.graph
        run = PassRun(name=tepass.name, stage=ctx.stage.value, nodes_before=len(graph.nodes))
        if tepass.name in ctx.options.disable:
            run.status = "disabled"
            run.nodes_after = run.nodes_before
            log.debug("%s[%s] %s: disabled", ctx.graph_id, ctx.stage.value, tepass.name)
            return run
        for obs in self.observers:
            if hasattr(obs, "before_pass"):
                obs.before_pass(gm, tepass, ctx)
        backup: list[torch.fx.Graph] = []
        undos: list = []

        def checkpoint(undo=None) -> None:
            if backup or undos:
                return
            if undo is not None:
                undos.append(undo)
            else:
                backup.append(copy_graph(graph))

        def rollback() -> None:
            ctx.analyses.clear()
            if undos:
                undos[0]()
            elif backup:
                restore_graph(gm.graph, backup[0])
            else:
                return
            gm.recompile()

        t0 = time.perf_counter()
        if not tepass.analysis_only and not tepass.checkpoints_itself:
            checkpoint()
        try:
            # ``analyses`` is shared (same dict) between the passes of this stage.
            result = tepass.run(gm, dataclasses.replace(ctx, checkpoint=checkpoint))
            if not isinstance(result, TEPassResult):
                raise TypeError(f"pass {tepass.name} returned {type(result).__name__}, not TEPassResult")
            if result.modified:
                ctx.analyses.clear()
                gm.graph.lint()
            run.changed = bool(result.modified)
            run.records = result.records
            run.facts = result.facts
        except PassSkipped as e:
            run.status = "skipped"
            run.records = [PassRecord("skipped", None, {"reason": str(e)})]
            if undos or (backup and _graph_changed(gm.graph, backup[0])):
                rollback()
        except Exception as e:  # noqa: BLE001 - any pass failure must leave the graph intact
            run.status = "failed"
            run.error = f"{type(e).__name__}: {e}"
            rollback()
            msg = (f"te_passes: pass {tepass.name!r} failed on graph {ctx.graph_id} at stage "
                   f"{ctx.stage.value} ({run.error}); the graph was left as it was")
            if ctx.options.strict:
                raise TePassError(msg) from e
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
        run.time_ms = (time.perf_counter() - t0) * 1e3
        run.nodes_after = len(gm.graph.nodes)
        log.debug("%s[%s] %s: %s changed=%s %.2f ms nodes %d -> %d records=%d", ctx.graph_id,
                  ctx.stage.value, tepass.name, run.status, run.changed, run.time_ms,
                  run.nodes_before, run.nodes_after, len(run.records))
        if run.changed:
            trace_artifact(f"te_passes_{ctx.graph_id}_{ctx.stage.value}_{tepass.name}",
                           lambda: gm.print_readable(print_output=False))
        for obs in self.observers:
            if hasattr(obs, "after_pass"):
                obs.after_pass(gm, tepass, ctx, run)
        return run


def _graph_changed(graph: torch.fx.Graph, backup: torch.fx.Graph) -> bool:
    if len(graph.nodes) != len(backup.nodes):
        return True
    return any((a.op, a.target, str(a.args)) != (b.op, b.target, str(b.args))
               for a, b in zip(graph.nodes, backup.nodes))
