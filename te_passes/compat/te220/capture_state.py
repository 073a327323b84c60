"""Whether Transformer Engine believes a CUDA graph capture is under way.

See docs/internals.md#te_passescompatte220capture_statepy."""

from __future__ import annotations

import sys


def te_capture_state() -> list[str]:
    """Why TE is in CUDA-graph-capture state, one sentence per flag set (``[]``: it is not, or TE
    is not imported). Reads the flags named in docs/internals.md; imports nothing."""
    out = []
    graph = sys.modules.get("transformer_engine.pytorch.graph")
    if graph is not None and getattr(graph, "_IS_GRAPH_CAPTURING", False):
        out.append("transformer_engine.pytorch.graph.is_graph_capturing() is True (te.make_graphed_callables "
                   "started a capture and did not finish)")
    quant = sys.modules.get("transformer_engine.pytorch.quantization")
    mgr = getattr(quant, "FP8GlobalStateManager", None) if quant is not None else None
    qstate = getattr(mgr, "quantization_state", None) if mgr is not None else None
    if qstate is not None and getattr(qstate, "fp8_graph_capturing", False):
        out.append("FP8GlobalStateManager.quantization_state.fp8_graph_capturing is True (an "
                   "autocast(_graph=True) region, e.g. of te.make_graphed_callables, was left open)")
    return out
