"""``te_passes.cudagraphs="lean"``: the ``CUDAGraphPolicy`` that wraps te_inductor graphs in
:class:`te_passes.cudagraphs.lean.LeanCUDAGraph`, and the hazards it falls back on.

See docs/internals.md#te_passescudagraphspolicypy."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch._inductor.cudagraph_utils import CUDAGraphPolicy

from te_passes.cudagraphs.engine import SAVED_BY_DATAFLOW, CudaGraphEngine, CudagraphRecorder
from te_passes.cudagraphs.lean import LeanCUDAGraph


def forward_user_output_count() -> int | None:
    """How many leading outputs of the forward graph being compiled go back to the caller (AOTAutograd's
    ``ViewAndMutationMeta.num_forward``, torch/_functorch/_aot_autograd/schemas.py); the rest are saved
    tensors. ``None`` when no AOTAutograd metadata is in the tracing context."""
    ctx = torch._guards.TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
    n = getattr(meta, "num_forward", None)
    return int(n) if isinstance(n, int) else None


def static_hazard(example_inputs: Sequence[Any], static_input_idxs: Sequence[int], *,
                  mutated_input_idxs: Sequence[int] = (), kernel_free: bool = False,
                  device_type: str = "cuda") -> str | None:
    """Why a graph cannot be replayed by :class:`LeanCUDAGraph`, or ``None``."""
    if kernel_free:
        return "kernel-free graph (nothing to capture)"
    for i, x in enumerate(example_inputs):
        if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return f"dynamic shapes: input {i} is a symbolic scalar"
        if isinstance(x, torch.Tensor):
            if any(isinstance(s, torch.SymInt) for s in (*x.shape, *x.stride())):
                return f"dynamic shapes: input {i} has a symbolic size or stride"
            if x.device.type != device_type:
                return f"input {i} is on {x.device}, not {device_type}"
    bad = sorted(set(mutated_input_idxs) - set(static_input_idxs))
    if bad:
        return f"mutates non-static input(s) {bad}"
    return None


class LeanCUDAGraphPolicy(CUDAGraphPolicy):
    """``CUDAGraphPolicy`` (torch/_inductor/cudagraph_utils.py) of one te_inductor call: wraps its
    forward and backward graphs in :class:`LeanCUDAGraph`, or falls back.

    Args:
        graph_id: the compile report's graph id (records name ``"<graph_id>.fwd"`` / ``.bwd`` /
            ``.inference``).
        recorder: where decisions go (the backend passes one writing ``CompileReport.cudagraphs``).
        static_hazards: reasons found by the backend (e.g. the graph reads UB state); any makes
            every graph of this call fall back to cudagraph trees.
        engine: capture/replay engine (default :class:`CudaGraphEngine`).
        device_type: device of the graphs' inputs (``"cuda"``; tests with a fake engine: ``"cpu"``).
        warmup_calls: passed to :class:`LeanCUDAGraph`.
    """

    def __init__(self, *, graph_id: str = "g?", recorder: CudagraphRecorder | None = None,
                 static_hazards: Sequence[str] = (), engine: Any = None, device_type: str = "cuda",
                 warmup_calls: int = 1) -> None:
        self.graph_id = graph_id
        self.recorder = recorder if recorder is not None else CudagraphRecorder()
        self.static_hazards = tuple(static_hazards)
        self.engine = engine if engine is not None else CudaGraphEngine()
        self.device_type = device_type
        self.warmup_calls = warmup_calls
        self.forward_mode: str | None = None  # "lean" / "trees" once the forward was wrapped
        self.runners: list[LeanCUDAGraph] = []

    def _name(self, is_backward: bool, is_inference: bool) -> str:
        return f"{self.graph_id}.{'bwd' if is_backward else 'inference' if is_inference else 'fwd'}"

    def should_wrap(self, compiled_graph: Any) -> bool:
        """``False`` (no CUDA graph for this graph, recorded) when Inductor split it into several
        partitions: with a policy set, Inductor hands the whole graph to :meth:`cudagraphify`
        (cudagraph_utils.py), and what lies between partitions must not be captured."""
        pm = getattr(compiled_graph, "partition_maps", None)
        if pm and len(pm) > 1:
            fx = getattr(compiled_graph, "fx_kwargs", None) or {}
            name = self._name(bool(fx.get("is_backward")), bool(fx.get("is_inference")))
            self.recorder.event(name, "not_captured", f"{len(pm)} Inductor graph partitions (cudagraph-unsafe "
                                "ops between them): no CUDA graph for this graph; te_passes.cudagraphs='trees' "
                                "wraps each partition in cudagraph trees")
            return False
        return True

    def cudagraphify(self, model: Callable[..., Any], example_inputs: Sequence[Any], static_input_idxs: Sequence[int],
                     *, device_index: int, is_backward: bool, is_inference: bool, **kwargs: Any) -> Callable[..., Any]:
        name = self._name(is_backward, is_inference)
        mutated = tuple(kwargs.get("mutated_input_idxs", ()) or ())
        reason = self.static_hazards[0] if self.static_hazards else None
        reason = reason or static_hazard(example_inputs, static_input_idxs, mutated_input_idxs=mutated,
                                         kernel_free=bool(kwargs.get("kernel_free_cudagraph")),
                                         device_type=self.device_type)
        n_clone: int | None = 0 if is_backward else None
        if reason is None and not is_backward and not is_inference:
            n_clone = forward_user_output_count()
            if n_clone is None:  # e.g. an AOTAutograd cache hit: no metadata in the tracing context
                n_clone = SAVED_BY_DATAFLOW
                self.recorder.event(name, "dataflow", "AOTAutograd forward metadata not available: saved tensors "
                                    "are the outputs its backward reads before capture; the others are cloned")
        if reason is None and is_backward and self.forward_mode == "trees":
            reason = "its forward graph uses cudagraph trees"
        if reason is not None:
            if is_backward and self.forward_mode == "lean":
                self.recorder.event(name, "no_cudagraph", f"{reason}; its forward is lean, so this graph runs "
                                    "without a CUDA graph")
                return model
            if not is_backward:
                self.forward_mode = "trees"
            self.recorder.event(name, "trees", reason)
            return super().cudagraphify(model, example_inputs, static_input_idxs, device_index=device_index,
                                        is_backward=is_backward, is_inference=is_inference, **kwargs)
        if not is_backward:
            self.forward_mode = "lean"
            ensure = getattr(self.engine, "ensure_tree_manager", None)
            if ensure is not None:
                ensure(device_index)
        runner = LeanCUDAGraph(model, static_input_idxs, name=name, device_index=device_index,
                               is_backward=is_backward, is_inference=is_inference, mutated_input_idxs=mutated,
                               num_clone_outputs=n_clone, constants=kwargs.get("constants", ()) or (),
                               engine=self.engine, recorder=self.recorder, warmup_calls=self.warmup_calls)
        self.runners.append(runner)
        self.recorder.event(name, "lean", "wrapped for lean replay", static_inputs=len(runner._static_idx),
                            cloned_outputs="all" if n_clone is None else "by data flow" if n_clone < 0 else n_clone)
        return runner
