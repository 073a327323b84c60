"""Pass ``check_cudagraph_pool``: find values that would stay in the CUDA-graph pool after a step.

See docs/passes/check_cudagraph_pool.md."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.fx

from te_passes.analyses.buffers import BufferOrigin, Liveness
from te_passes.analyses.liveness import analyze_shared
from te_passes.pipeline.base import PassContext, PassRecord, Stage, TEPass, TEPassResult


class CudagraphPoolLeakError(RuntimeError):
    """A graph leaves values allocated in it referenced, not returned (under ``strict``; names every node)."""


class CudagraphPoolWarning(UserWarning):
    """Warning category of ``check_cudagraph_pool`` findings (filter it with ``warnings``)."""


def pool_findings(lv: Liveness) -> list[dict[str, Any]]:
    """Values allocated in the graph, referenced when it returns, not outputs: ``[{"node", "role",
    "bytes", "at", "how", "source"}]``."""
    return [{"node": buf.name, "role": buf.quantized.role if buf.quantized else None,
             "bytes": buf.nbytes(), "at": esc[0].node.name, "how": esc[0].how,
             "source": buf.quantized.source if buf.quantized else None}
            for buf in lv.buffers
            if buf.origin is BufferOrigin.ALLOCATED and not lv.is_output(buf) and (esc := lv.escaped(buf))]


def _cudagraphs_enabled() -> bool:
    try:
        from torch._inductor import config as inductor_config

        return bool(inductor_config.triton.cudagraphs)
    except Exception:  # noqa: BLE001
        return False


def format_findings(graph_id: str, findings: list[dict[str, Any]]) -> str:
    """One message naming every finding's node, role, size and escape point."""
    lines = [f"te_passes check_cudagraph_pool: graph {graph_id}: {len(findings)} value(s) allocated inside "
             f"the graph stay referenced after it returns without being graph outputs. Under "
             f"mode='reduce-overhead' CUDA graph trees would fail with \"Detected {len(findings)} "
             f"tensor(s) in the cudagraph pool not tracked as outputs\":"]
    for f in findings:
        role = f"quantized {f['role']}" if f["role"] else "not quantized"
        size = f"{f['bytes']} B" if f["bytes"] is not None else "size unknown"
        lines.append(f"  - node {f['node']!r} ({role}, {size}) escapes at node {f['at']!r}: {f['how']}")
    lines.append("  Return the value from the graph, copy it instead of aliasing it, or free it before the "
                 "graph ends (docs/passes/check_cudagraph_pool.md).")
    return "\n".join(lines)


class CheckCudagraphPool(TEPass):
    """Static CUDA-graph pool check (analysis only). Records: ``"pool_leak"`` per finding,
    ``"pool_check"`` (``findings``, ``allocated_values``, ...); warns (``strict``: raises) on findings."""

    name = "check_cudagraph_pool"
    stages = frozenset({Stage.POST_GRAD_FWD, Stage.POST_GRAD_BWD})
    description = "find values allocated in the graph that outlive it without being outputs (cudagraph pool leaks)"
    analysis_only = True

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> TEPassResult:
        lv = analyze_shared(gm.graph, ctx.stage, ctx.analyses)
        findings = pool_findings(lv)
        cudagraphs = _cudagraphs_enabled()
        records = [PassRecord("pool_leak", f["node"], {**f, "cudagraphs": cudagraphs}) for f in findings]
        records.append(PassRecord("pool_check", None, {
            "findings": len(findings), "cudagraphs": cudagraphs,
            "allocated_values": sum(1 for b in lv.buffers if b.origin is BufferOrigin.ALLOCATED),
            "conservative_alias_nodes": [n.name for n in lv.unknown_alias_nodes]}))
        if findings:
            msg = format_findings(ctx.graph_id, findings)
            if ctx.options.strict:
                raise CudagraphPoolLeakError(msg)
            warnings.warn(msg, CudagraphPoolWarning, stacklevel=2)
        return TEPassResult(gm, False, records)
