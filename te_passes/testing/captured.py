"""What a CPU capture returns: :class:`CapturedGraph` (a Dynamo graph of a TE model, as a
``torch.compile`` backend receives it) and :class:`CapturedAOT` (its AOTAutograd joint / forward /
backward graphs, as Inductor's custom-pass hooks receive them), with node helpers.

See docs/internals.md#te_passestestingcapturedpy."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx

from te_passes.debug.printer import format_tensor_type, node_value
from te_passes.fx.graph import copy_graph_module
from te_passes.pipeline.base import Stage
from te_passes.te import graph_model as gmod


def _te_node_summary(gm: torch.fx.GraphModule) -> list[str]:
    out = []
    for node in gm.graph.nodes:
        op = gmod.te_op_name(node)
        if op is None:
            continue
        line = f"{node.name}: {gmod.TE_OP_NAMESPACE}.{op}"
        try:
            call = gmod.decode(node)
        except gmod.UnknownTEOp as e:
            out.append(f"{line}  <undecodable: {e}>")
            continue
        parts = [f"{k}={_val_str(v)}" for k, v in call.tensors.items() if v is not None]
        for name, f in call.tq_fields.items():
            if f.kind == "storage":
                bufs = ", ".join(f"{b.inner_name}:{_val_str(b.node)}" for b in f.buffers)
                parts.append(f"{name}={f.storage_cls}[{bufs}]")
            elif f.kind == "tensor":
                parts.append(f"{name}={_val_str(f.tensor)}")
        if "fp8" in call.config:
            parts.append(f"fp8={call.config['fp8']}")
        qs = {type(q).__name__ for q in call.quantizers().values()}
        if qs:
            parts.append("quantizers=" + "/".join(sorted(qs)))
        out.append(f"{line}({', '.join(parts)})")
    return out


def _val_str(node: Any) -> str:
    v = node_value(node) if isinstance(node, torch.fx.Node) else None
    return format_tensor_type(v) or getattr(node, "name", repr(node))


def te_op_names(gm: torch.fx.GraphModule) -> list[str]:
    """Names (``"linear"``, ``"linear_backward"``, ...) of the TE op nodes of ``gm``, in order."""
    return [op for op in (gmod.te_op_name(n) for n in gm.graph.nodes) if op is not None]


@dataclasses.dataclass
class CapturedGraph:
    """A Dynamo graph of a TE model, as a ``torch.compile`` backend receives it."""

    gm: torch.fx.GraphModule
    example_inputs: list[Any]
    precision: str
    model: str
    layers: int
    tokens: int
    hidden: int
    out_features: int
    linear_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    training: bool = True
    te_version: str | None = None
    torch_version: str = torch.__version__

    def te_nodes(self) -> list[torch.fx.Node]:
        """The ``transformer_engine_compile`` op nodes of :attr:`gm`, in order."""
        return [n for n in self.gm.graph.nodes if gmod.is_te_op_node(n)]

    def describe(self) -> str:
        """A few lines: what was captured and every TE op node with its decoded fields."""
        head = (f"dynamo graph: {self.model} x{self.layers} {self.precision} tokens={self.tokens} "
                f"hidden={self.hidden} out={self.out_features} (TE {self.te_version}, torch "
                f"{self.torch_version}), {len(self.gm.graph.nodes)} nodes")
        return "\n".join([head, *("  " + s for s in _te_node_summary(self.gm))])

    def copy(self) -> "CapturedGraph":
        """A copy whose graph can be rewritten without touching this one (TE constant objects
        and fake ``meta`` values are shared; passes replace them, never mutate them)."""
        return dataclasses.replace(self, gm=copy_graph_module(self.gm), example_inputs=list(self.example_inputs),
                                   linear_kwargs=dict(self.linear_kwargs))

    def stage_jobs(self) -> list[tuple[Stage, torch.fx.GraphModule, list[Any]]]:
        """``[(Stage.DYNAMO, gm, example_inputs)]``: the jobs ``run_stages`` / ``run_pipeline`` run."""
        return [(Stage.DYNAMO, self.gm, self.example_inputs)]


@dataclasses.dataclass
class CapturedAOT:
    """The AOTAutograd graphs of a TE model, as Inductor's custom-pass hooks receive them.

    ``forward``: partitioned forward (``primals_*`` placeholders, one ``linear.default`` per layer;
    returns the output, fp8 quantizer constants and the saved tensors: for fp8-cs the input
    transpose u8[K, M], weight data u8[N, K], weight transpose u8[K, N], f32[1] ``scale_inv``\\ s).
    ``backward``: partitioned backward (saved tensors then ``tangents_*``; per layer one
    ``linear_backward.default`` returning dW, dbias, dx). ``joint``: the joint graph
    (``joint_custom_pre_pass``). Both ``None`` for ``training=False``. ``*_inputs``: fake ``cuda``
    tensors matching the placeholders (the joint's: ``[primals, tangents]`` flattened).
    ``dynamo``: the :class:`CapturedGraph` they came from; ``partitioner``: ``"min_cut"``
    (Inductor's) or ``"default"``.
    """

    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule | None
    joint: torch.fx.GraphModule | None
    forward_inputs: list[Any]
    backward_inputs: list[Any]
    joint_inputs: list[Any]
    dynamo: CapturedGraph
    partitioner: str = "min_cut"

    precision = property(lambda self: self.dynamo.precision)
    model = property(lambda self: self.dynamo.model)
    layers = property(lambda self: self.dynamo.layers)
    te_version = property(lambda self: self.dynamo.te_version)
    example_inputs = property(lambda self: self.forward_inputs)

    def graphs(self) -> dict[str, torch.fx.GraphModule]:
        """``{"joint": ..., "forward": ..., "backward": ...}`` (graphs that exist)."""
        out = {"joint": self.joint, "forward": self.forward, "backward": self.backward}
        return {k: v for k, v in out.items() if v is not None}

    def stage_jobs(self) -> list[tuple[Stage, torch.fx.GraphModule, list[Any]]]:
        """``(stage, gm, example_inputs)`` of the Dynamo, joint, post-grad forward and backward graphs
        that exist, in stage order."""
        jobs = [*self.dynamo.stage_jobs(), (Stage.JOINT, self.joint, self.joint_inputs),
                (Stage.POST_GRAD_FWD, self.forward, self.forward_inputs),
                (Stage.POST_GRAD_BWD, self.backward, self.backward_inputs)]
        return [job for job in jobs if job[1] is not None]

    def describe(self) -> str:
        """What was captured and the TE op nodes of each AOT graph with their decoded fields."""
        d = self.dynamo
        lines = [f"aot graphs: {d.model} x{d.layers} {d.precision} tokens={d.tokens} hidden={d.hidden} "
                 f"out={d.out_features} partitioner={self.partitioner} (TE {d.te_version}, torch "
                 f"{d.torch_version})"]
        for name, gm in self.graphs().items():
            lines.append(f" {name}: {len(gm.graph.nodes)} nodes")
            lines.extend("  " + s for s in _te_node_summary(gm))
        return "\n".join(lines)

    def copy(self) -> "CapturedAOT":
        """A copy whose graphs can be rewritten independently (see :meth:`CapturedGraph.copy`)."""
        return dataclasses.replace(
            self, forward=copy_graph_module(self.forward),
            backward=copy_graph_module(self.backward) if self.backward is not None else None,
            joint=copy_graph_module(self.joint) if self.joint is not None else None,
            forward_inputs=list(self.forward_inputs), backward_inputs=list(self.backward_inputs),
            joint_inputs=list(self.joint_inputs), dynamo=self.dynamo.copy())
