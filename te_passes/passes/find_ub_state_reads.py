"""Analysis ``find_ub_state_reads``: why compiling a Dynamo graph reads TE's Userbuffers (UB) state.

See docs/passes/find_ub_state_reads.md."""

from __future__ import annotations

import torch.fx

from te_passes.compat.api import UbDependence, ub_state_reads
from te_passes.pipeline.base import PassContext, PassRecord, Stage, TEPass, TEPassResult
from te_passes.pipeline.facts import UbStateReads


class FindUbStateReads(TEPass):
    """``compat.ub.graph_guard.ub_state_reads`` on the Dynamo graph after the Dynamo-stage passes (last in the
    pipeline), with the :class:`~te_passes.compat.api.UbDependence` facts ``fold_ub_predicates`` returned
    earlier in the stage (``ctx.stage_facts``) and Dynamo's trace-time folds (``ctx.inputs["ub_trace_folds"]``).
    Returns one :class:`UbStateReads` fact: the pipeline uuid keys on the UB snapshot only when it is not
    empty. Records: ``"ub_reads"`` (``reasons``)."""

    name = UbStateReads.producer
    stages = frozenset({Stage.DYNAMO})
    description = "find why a graph reads the UB state (only those graphs' cache keys hold the UB snapshot)"
    analysis_only = True

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> TEPassResult:
        dep = UbDependence.merged(f for f in ctx.stage_facts if isinstance(f, UbDependence))
        reasons = tuple(ub_state_reads(gm, dep, trace_folds=ctx.inputs.get("ub_trace_folds", ())))
        return TEPassResult(gm, False, [PassRecord("ub_reads", None, {"reasons": list(reasons)})],
                            [UbStateReads(reasons)])
