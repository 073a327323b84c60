"""Analysis ``check_cudagraph_hazard``: a Dynamo graph that must not be CUDA-graphed under reduce-overhead.

See docs/passes/check_cudagraph_hazard.md."""

from __future__ import annotations

import torch.fx

from te_passes.compat.api import cudagraph_hazard
from te_passes.pipeline.base import PassContext, PassRecord, Stage, TEPass, TEPassResult
from te_passes.pipeline.facts import CudagraphHazard


class CheckCudagraphHazard(TEPass):
    """``compat.delayed_scaling.linear.cudagraph_hazard`` on the Dynamo graph as Dynamo traced it (first in
    the pipeline): a DelayedScaling op returning a CPU tensor. Returns a :class:`CudagraphHazard` fact when
    there is one; ``Compilation`` then compiles the graph without ``triton.cudagraphs`` (with a warning).
    Records: ``"cudagraph_hazard"`` (``reason``: the hazard or ``None``)."""

    name = CudagraphHazard.producer
    stages = frozenset({Stage.DYNAMO})
    description = "find what keeps a graph from CUDA graphs (reduce-overhead then compiles it without them)"
    analysis_only = True

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> TEPassResult:
        why = cudagraph_hazard(gm)
        return TEPassResult(gm, False, [PassRecord("cudagraph_hazard", None, {"reason": why})],
                            [] if why is None else [CudagraphHazard(why)])
