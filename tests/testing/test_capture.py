"""Real TE graphs captured without a GPU (te_passes.testing.capture), checked exactly.

Expected values were read off real captures (TE 2.20.2, torch 2.14.1) and agree with the
reference graphs in ../shared/reference/te-2.20.2-linear-graphs (bf16 and Float8CurrentScaling
te.Linear(64 -> 128), 32 tokens). Captures are cached per session (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from te_passes.te import graph_model as gmod
from te_passes.te import graph_constants as gconst
from te_passes.testing.captured import node_value, te_op_names
from te_passes.testing.fake_gpu import PRECISIONS

pytestmark = pytest.mark.te

TE_NS = "transformer_engine_compile"

LINEAR_SLOTS = [
    ("weight", "tensor"), ("weight__tensors", "tq_tensors"), ("weight__meta", "tq_meta"),
    ("inp", "tensor"), ("bias", "tensor"), ("weight_workspace", "tensor"),
    ("weight_workspace__tensors", "tq_tensors"), ("weight_workspace__meta", "tq_meta"),
    ("_simple_meta", "config"),
]
LINEAR_BWD_SLOTS = [
    ("grad_output", "tensor"), ("inputmat", "tensor"), ("inputmat__tensors", "tq_tensors"),
    ("inputmat__meta", "tq_meta"), ("weight_fp8", "tensor"), ("weight_fp8__tensors", "tq_tensors"),
    ("weight_fp8__meta", "tq_meta"), ("saved_weight", "tensor"), ("saved_weight__tensors", "tq_tensors"),
    ("saved_weight__meta", "tq_meta"), ("bias", "tensor"), ("_simple_meta", "config"),
]

#: Quantizer class of input/weight/grad_output per precision (None: no quantizers).
QUANTIZER = {"bf16": None, "fp8-cs": "Float8CurrentScalingQuantizer", "mxfp8": "MXFP8Quantizer"}

#: te.Linear(64 -> 128), 32 tokens: the backward op's storage fields
#: {field: (storage class, [(inner name, role, dtype, shape)], quantizer usage (rowwise, columnwise))}
#: bf16 has plain tensors there instead.
BWD_STORAGE = {
    "fp8-cs": {
        "inputmat": ("Float8TensorStorage", [
            ("_transpose", "columnwise_data", torch.uint8, (64, 32)),
            ("_scale_inv", "scale_inv", torch.float32, (1,))], (False, True)),
        "weight_fp8": ("Float8TensorStorage", [
            ("_data", "rowwise_data", torch.uint8, (128, 64)),
            ("_transpose", "columnwise_data", torch.uint8, (64, 128)),
            ("_scale_inv", "scale_inv", torch.float32, (1,))], (True, True)),
    },
    "mxfp8": {
        "inputmat": ("MXFP8TensorStorage", [
            ("_columnwise_data", "columnwise_data", torch.uint8, (32, 64)),
            ("_columnwise_scale_inv", "columnwise_scale_inv", torch.uint8, (4, 128))], (False, True)),
        "weight_fp8": ("MXFP8TensorStorage", [
            ("_rowwise_data", "rowwise_data", torch.uint8, (128, 64)),
            ("_rowwise_scale_inv", "rowwise_scale_inv", torch.uint8, (128, 4)),
            ("_columnwise_data", "columnwise_data", torch.uint8, (128, 64)),
            ("_columnwise_scale_inv", "columnwise_scale_inv", torch.uint8, (4, 128))], (True, True)),
    },
}

#: AOT forward outputs (dtype, shape) or quantizer class name, te.Linear(64 -> 128), 32 tokens.
FWD_OUTPUTS = {
    "bf16": [(torch.bfloat16, (32, 128)), (torch.bfloat16, (128, 64)), (torch.bfloat16, (128,)),
             (torch.bfloat16, (32, 64))],
    "fp8-cs": [(torch.bfloat16, (32, 128)),
               (torch.bfloat16, (128, 64)), (torch.bfloat16, (128,)), (torch.uint8, (64, 32)),
               (torch.float32, (1,)), (torch.uint8, (128, 64)), (torch.uint8, (64, 128)), (torch.float32, (1,))],
    "mxfp8": [(torch.bfloat16, (32, 128)), (torch.bfloat16, (128, 64)),
              (torch.bfloat16, (128,)), (torch.uint8, (32, 64)), (torch.uint8, (4, 128)),
              (torch.uint8, (128, 64)), (torch.uint8, (128, 4)), (torch.uint8, (128, 64)), (torch.uint8, (4, 128))],
}

#: Side-effect-only ``quantizer.__setattr__`` call_method nodes in the 1-layer Dynamo graph
#: (traced after TE's lazy init at compile start, as under te_inductor: the capture loads what the backend loads;
#: the reference fp8-cs graph, traced without it, has 23; AOT graphs drop them). The forward then hands no
#: quantizer object to the backward (it did, 5 per layer, without the lazy init); the saved tensors are the same.
#: after TE's lazy init: 17 on the module's quantizers + 6 on the op's per-call copies (autocast.traced_quantizer_copies)
DYNAMO_SETATTRS = {"bf16": 0, "fp8-cs": 23, "mxfp8": 23}


def _desc(v):
    if isinstance(v, torch.fx.Node):
        v = node_value(v)
    if isinstance(v, torch.Tensor):
        return (v.dtype, tuple(v.shape))
    return type(v).__name__


def _te_calls(gm):
    return [gmod.decode(n) for n in gm.graph.nodes if gmod.is_te_op_node(n)]


@pytest.mark.parametrize("layers", [1, 4])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_dynamo_graph_te_ops(te_dynamo_graph, precision, layers):
    cap = te_dynamo_graph(precision, layers)
    assert (cap.precision, cap.layers, cap.model) == (precision, layers, "linear" if layers == 1 else "stack")
    nodes = cap.te_nodes()
    assert te_op_names(cap.gm) == ["linear"] * layers
    for n in nodes:  # Dynamo graphs call the OpOverloadPacket
        assert isinstance(n.target, torch._ops.OpOverloadPacket)
        assert n.target._qualified_op_name == f"{TE_NS}::linear"
    # weight + bias per layer, then the input; fake tensors on cuda, as a real compile sees them
    assert len(cap.example_inputs) == 2 * layers + 1
    assert all(isinstance(t, torch._subclasses.FakeTensor) and t.device.type == "cuda"
               for t in cap.example_inputs)
    out = 128 if layers == 1 else 64
    assert sorted(tuple(t.shape) for t in cap.example_inputs) == sorted(
        [(out if i == layers - 1 else 64, 64) for i in range(layers)]
        + [(out if i == layers - 1 else 64,) for i in range(layers)] + [(32, 64)])
    if layers == 1:
        setattrs = [n for n in cap.gm.graph.nodes if n.op == "call_method" and n.target == "__setattr__"]
        assert len(setattrs) == DYNAMO_SETATTRS[precision]
    gelus = [n for n in cap.gm.graph.nodes if n.op == "call_function" and n.target is torch.nn.functional.gelu]
    assert len(gelus) == layers - 1


@pytest.mark.parametrize("layers", [1, 4])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_aot_graphs_te_ops(te_aot_graphs, precision, layers):
    cap = te_aot_graphs(precision, layers)
    assert te_op_names(cap.forward) == ["linear"] * layers
    assert te_op_names(cap.backward) == ["linear_backward"] * layers
    assert sorted(te_op_names(cap.joint)) == ["linear"] * layers + ["linear_backward"] * layers
    for gm, op in ((cap.forward, "linear"), (cap.backward, "linear_backward")):
        for n in gm.graph.nodes:
            if gmod.is_te_op_node(n):
                assert n.target is getattr(torch.ops.transformer_engine_compile, op).default
    # every value is a fake cuda tensor (the joint trace ran on meta; see capture.py)
    for gm in cap.graphs().values():
        devices = {node_value(n).device.type for n in gm.graph.nodes
                   if isinstance(node_value(n), torch.Tensor)}
        assert devices == {"cuda"}, gm
    assert [p.name.split("_")[0] for p in cap.backward.graph.find_nodes(op="placeholder")][-1] == "tangents"
    # backward returns dW, dbias of every layer and dx of the input
    bw_out = cap.backward.graph.find_nodes(op="output")[0].args[0]
    assert len(bw_out) == 2 * layers + 1  # the input gradient of the first layer only


@pytest.mark.parametrize("precision", PRECISIONS)
def test_decoded_structure_linear(te_aot_graphs, precision):
    """te.Linear(64 -> 128), 32 tokens: every decoded field, in all three graphs."""
    cap = te_aot_graphs(precision, 1)
    fp8 = precision != "bf16"
    qcls = QUANTIZER[precision]
    expected_qs = ({} if qcls is None else
                   {"input_quantizer": qcls, "weight_quantizer": qcls, "grad_output_quantizer": qcls})

    for gm in (cap.dynamo.gm, cap.forward):
        (fwd,) = _te_calls(gm)
        assert fwd.op == "linear" and not fwd.is_backward and fwd.module_kind == "linear"
        assert [(s.name, s.kind.value) for s in fwd.slots] == LINEAR_SLOTS
        assert {k: _desc(v) for k, v in fwd.tensors.items()} == {
            "inp": (torch.bfloat16, (32, 64)), "bias": (torch.bfloat16, (128,))}
        assert {k: f.kind for k, f in fwd.tq_fields.items()} == {"weight": "tensor", "weight_workspace": "none"}
        assert _desc(fwd.tq_fields["weight"].tensor) == (torch.bfloat16, (128, 64))
        assert fwd.quantized_buffers() == []
        assert (fwd.config["fp8"], fwd.config["dgrad_use_split_accumulator"],
                fwd.config["wgrad_use_split_accumulator"]) == (fp8, True, True)
        assert fwd.config["activation_dtype"] is torch.bfloat16
        assert {k: type(v).__name__ for k, v in fwd.quantizers().items()} == expected_qs
        assert fwd.config["output_quantizer"] is None and fwd.config["grad_input_quantizer"] is None
        assert not fwd.uses_ub() and fwd.ub_config()["ub_name"] is None
        assert (fwd.config["tp_size"], fwd.config["parallel_mode"], fwd.config["sequence_parallel"]) == (1, None, False)

    (bwd,) = _te_calls(cap.backward)
    assert bwd.op == "linear_backward" and bwd.is_backward and bwd.module_kind == "linear"
    assert [(s.name, s.kind.value) for s in bwd.slots] == LINEAR_BWD_SLOTS
    assert {k: _desc(v) for k, v in bwd.tensors.items()} == {
        "grad_output": (torch.bfloat16, (32, 128)), "bias": (torch.bfloat16, (128,))}
    assert bwd.tensors["grad_output"].name == "tangents_1"
    assert (bwd.config["fp8"], bwd.config["dgrad_use_split_accumulator"],
            bwd.config["wgrad_use_split_accumulator"]) == (fp8, True, True)
    assert {k: type(v).__name__ for k, v in bwd.quantizers().items()} == expected_qs
    assert bwd.config["owns_input"] is fp8  # the quantized input copy belongs to the op

    assert bwd.tq_fields["saved_weight"].kind == "tensor"
    assert _desc(bwd.tq_fields["saved_weight"].tensor) == (torch.bfloat16, (128, 64))
    if not fp8:
        assert {k: f.kind for k, f in bwd.tq_fields.items()} == {
            "inputmat": "tensor", "weight_fp8": "tensor", "saved_weight": "tensor"}
        assert _desc(bwd.tq_fields["inputmat"].tensor) == (torch.bfloat16, (32, 64))
        assert bwd.quantized_buffers() == []
        return
    placeholders = set(cap.backward.graph.find_nodes(op="placeholder"))
    for field, (cls, bufs, usage) in BWD_STORAGE[precision].items():
        f = bwd.tq_fields[field]
        assert (f.kind, f.storage_cls) == ("storage", cls)
        assert f.meta["_inner_names"] == [b[0] for b in bufs]
        assert [(b.inner_name, b.role.value, *_desc(b.node)) for b in f.buffers] == [
            (n, r, dt, sh) for n, r, dt, sh in bufs]
        assert all(b.field == field and b.storage_cls == cls for b in f.buffers)
        # saved by the forward: every buffer is a backward input
        assert all(b.node in placeholders for b in f.buffers)
        assert type(f.quantizer).__name__ == qcls
        qf = gconst.quantizer_fields(f.quantizer)
        assert (qf["rowwise_usage"], qf["columnwise_usage"], qf["internal"]) == (*usage, True)
        assert f.meta["nontensor_kwargs"]["fake_dtype"] is torch.bfloat16
    assert len(bwd.quantized_buffers()) == sum(len(b) for _, b, _ in BWD_STORAGE[precision].values())


@pytest.mark.parametrize("precision", PRECISIONS)
def test_aot_forward_outputs(te_aot_graphs, precision):
    cap = te_aot_graphs(precision, 1)
    outs = cap.forward.graph.find_nodes(op="output")[0].args[0]
    assert [_desc(o) for o in outs] == FWD_OUTPUTS[precision]
    # the backward's saved-tensor placeholders are exactly the forward's tensor outputs after
    # the user output (the partitioner's contract), with the same dtypes/shapes
    saved = [p for p in cap.backward.graph.find_nodes(op="placeholder") if not p.name.startswith("tangents")]
    fw_saved = [o for o in outs[1:] if isinstance(o, torch.fx.Node)]
    assert [_desc(p) for p in saved] == [_desc(o) for o in fw_saved]


def test_describe_lists_te_ops(te_aot_graphs, te_dynamo_graph):
    text = te_aot_graphs("fp8-cs", 1).describe()
    assert "backward:" in text and "joint:" in text
    assert ("inputmat=Float8TensorStorage[_transpose:u8[64, 32], _scale_inv:f32[1]]" in text)
    assert "weight_fp8=Float8TensorStorage[_data:u8[128, 64], _transpose:u8[64, 128], _scale_inv:f32[1]]" in text
    dtext = te_dynamo_graph("mxfp8", 4).describe()
    assert dtext.count(f"{TE_NS}.linear(") == 4 and "quantizers=MXFP8Quantizer" in dtext


def test_cached_captures_are_independent_copies(te_aot_graphs):
    a, b = te_aot_graphs("bf16", 1), te_aot_graphs("bf16", 1)
    assert a.forward is not b.forward and a.forward.graph is not b.forward.graph
    n_before = len(b.backward.graph.nodes)
    for n in list(a.backward.graph.nodes):
        if n.op == "call_function" and not n.users:
            a.backward.graph.erase_node(n)
    assert len(b.backward.graph.nodes) == n_before
    assert len(te_aot_graphs("bf16", 1).backward.graph.nodes) == n_before


def test_run_pipeline_runs_each_stage_on_its_graph(te_aot_graphs):
    from te_passes.pipeline.base import Stage, TEPass, TEPassResult, PassRecord
    from te_passes.testing.capture import run_pipeline

    class CountTEOps(TEPass):
        name = "count_te_ops"
        stages = frozenset(Stage)
        analysis_only = True

        def run(self, gm, ctx):
            return TEPassResult(gm, False, [PassRecord("te_ops", None, {"ops": te_op_names(gm),
                                                                        "n_inputs": len(ctx.example_inputs)})])

    cap = te_aot_graphs("fp8-cs", 4)
    reports = run_pipeline(cap, passes=[CountTEOps()])
    assert [r.stage for r in reports] == ["dynamo", "joint", "post_grad_fwd", "post_grad_bwd"]
    assert [r.graph_id for r in reports] == ["g0", "g0.joint", "g0.fwd", "g0.bwd"]
    ops = [r.runs[0].records[0].data["ops"] for r in reports]
    assert ops == [["linear"] * 4, ["linear"] * 4 + ["linear_backward"] * 4,
                   ["linear"] * 4, ["linear_backward"] * 4]
    assert {run.status for r in reports for run in r.runs} == {"ok"}
    n_inputs = [r.runs[0].records[0].data["n_inputs"] for r in reports]
    assert n_inputs[0] == 9 and n_inputs[2] == len(cap.forward.graph.find_nodes(op="placeholder"))

    only = run_pipeline(cap.dynamo, stages=["dynamo"], passes=[CountTEOps()])
    assert [r.stage for r in only] == ["dynamo"]
    relowered = run_pipeline(cap, passes=[CountTEOps()], relower=True)
    assert [r.runs[0].records[0].data["ops"] for r in relowered] == ops


def test_run_pipeline_relower_carries_rewrites_forward(te_aot_graphs):
    """As in the backend: a JOINT-stage rewrite reaches the partitioned forward/backward graphs
    (the joint hook runs before partitioning), and the cached capture is untouched."""
    from te_passes.pipeline.base import Stage, TEPass, TEPassResult, PassRecord
    from te_passes.testing.capture import run_pipeline

    class MarkJoint(TEPass):
        name = "mark_joint"
        stages = frozenset({Stage.JOINT})

        def run(self, gm, ctx):
            for n in gm.graph.nodes:
                if gmod.is_te_op_node(n):
                    n.meta["marked_at_joint"] = True
            return TEPassResult(gm, True)

    class SeeMark(TEPass):
        name = "see_mark"
        stages = frozenset({Stage.POST_GRAD_FWD, Stage.POST_GRAD_BWD})
        analysis_only = True

        def run(self, gm, ctx):
            marks = [bool(n.meta.get("marked_at_joint")) for n in gm.graph.nodes if gmod.is_te_op_node(n)]
            return TEPassResult(gm, False, [PassRecord("marks", None, {"marks": marks})])

    cap = te_aot_graphs("mxfp8", 1)
    reports = run_pipeline(cap, passes=[MarkJoint(), SeeMark()], relower=True)
    # independently, the captured forward/backward never saw the joint rewrite
    independent = run_pipeline(cap, passes=[MarkJoint(), SeeMark()])
    assert [r.runs[0].records[0].data["marks"] for r in independent[2:]] == [[False], [False]]
    assert [r.stage for r in reports] == ["dynamo", "joint", "post_grad_fwd", "post_grad_bwd"]
    assert [r.runs[0].records[0].data["marks"] for r in reports[2:]] == [[True], [True]]
    assert not any(n.meta.get("marked_at_joint") for g in cap.graphs().values() for n in g.graph.nodes)


def test_run_pipeline_with_registry_passes(te_aot_graphs, monkeypatch):
    """The default pipeline (whatever the registry holds, maybe nothing) runs on real graphs
    without failing a pass, and leaves the cached capture untouched."""
    import itertools
    import sys

    from te_passes.testing.capture import run_pipeline

    # hoist_te_constants names constants from a process-global counter; keep this test from
    # shifting the names later tests (test_cli) compare against a fresh subprocess's.
    from te_passes.passes.order import pass_classes

    pass_classes()  # imports every registered pass module
    hoist = sys.modules.get("te_passes.passes.hoist_te_constants")
    if hoist is not None and hasattr(hoist, "_CONST_COUNTER"):
        monkeypatch.setattr(hoist, "_CONST_COUNTER", itertools.count(10_000))

    cap = te_aot_graphs("fp8-cs", 1)
    before = [len(g.graph.nodes) for g in cap.graphs().values()]
    for relower in (False, True):
        reports = run_pipeline(cap, relower=relower)
        assert [r.stage for r in reports] == ["dynamo", "joint", "post_grad_fwd", "post_grad_bwd"]
        failed = [(r.stage, run.name, run.error) for r in reports for run in r.runs if run.status == "failed"]
    assert failed == []
    assert [len(g.graph.nodes) for g in cap.graphs().values()] == before
    assert all(hasattr(r, "gm") for r in reports)


UB_COLUMN = dict(parallel_mode="column", sequence_parallel=True, tp_size=2, ub_overlap_ag=True,
                 ub_bulk_dgrad=True, ub_bulk_wgrad=True, ub_name="qkv")
UB_ROW = dict(parallel_mode="row", sequence_parallel=True, tp_size=2, ub_overlap_rs=True,
              ub_overlap_ag=True, ub_name="proj")


@pytest.mark.parametrize("kw,expected", [
    (UB_COLUMN, {"ub_name": "qkv", "ub_overlap_ag_fprop": True, "ub_overlap_rs_fprop": False,
                 "ub_overlap_ag_dgrad": False, "ub_overlap_rs_dgrad": False, "ub_bulk_dgrad": True,
                 "ub_bulk_wgrad": True}),
    (UB_ROW, {"ub_name": "proj", "ub_overlap_ag_fprop": False, "ub_overlap_rs_fprop": True,
              "ub_overlap_ag_dgrad": True, "ub_overlap_rs_dgrad": False, "ub_bulk_dgrad": False,
              "ub_bulk_wgrad": False}),
], ids=["column-ag", "row-rs"])
def test_userbuffers_kwargs_reach_the_graph(te_dynamo_graph, kw, expected):
    cap = te_dynamo_graph("fp8-cs", 1, **kw)
    (call,) = _te_calls(cap.gm)
    assert call.ub_config() == expected and call.uses_ub()
    assert (call.config["tp_size"], call.config["tensor_parallel"], call.config["sequence_parallel"],
            call.config["parallel_mode"], call.config["tp_group"]) == (2, True, True, kw["parallel_mode"], None)
    # row-parallel input is the shard [tokens, hidden / tp]; column-parallel weight is [out / tp, in]
    shapes = [tuple(t.shape) for t in cap.example_inputs]
    assert shapes == ([(64, 64), (64,), (32, 64)] if kw is UB_COLUMN else [(128, 32), (128,), (32, 32)])


def test_eager_fallback_is_reported():
    from te_passes.testing.capture import CaptureError, capture_dynamo, capture_skip_reason

    if capture_skip_reason():
        pytest.skip(capture_skip_reason())
    with pytest.raises(CaptureError, match="falling back to eager: fuse_wgrad_accumulation"):
        capture_dynamo(precision="bf16", fuse_wgrad_accumulation=True)
    with pytest.raises(CaptureError, match="unknown precision"):
        capture_dynamo(precision="fp4")


def test_inference_capture(te_aot_graphs):
    cap = te_aot_graphs("bf16", 1, training=False)
    assert cap.backward is None and cap.joint is None
    assert te_op_names(cap.forward) == ["linear"]
    (call,) = _te_calls(cap.forward)
    assert call.config["is_grad_enabled"] is False


def test_run_pipeline_strict_failure_propagates(te_aot_graphs):
    from te_passes.config import TePassesOptions
    from te_passes.pipeline.base import Stage, TEPass
    from te_passes.pipeline.manager import TePassError
    from te_passes.testing.capture import run_pipeline

    class Boom(TEPass):
        name = "boom"
        stages = frozenset({Stage.POST_GRAD_BWD})

        def run(self, gm, ctx):
            raise ValueError("boom at bwd")

    for relower in (False, True):
        with pytest.raises(TePassError, match="boom.*post_grad_bwd"):
            run_pipeline(te_aot_graphs("bf16", 1), passes=[Boom()], options=TePassesOptions(strict=True),
                         relower=relower)
    with pytest.warns(RuntimeWarning, match="boom at bwd"):
        reports = run_pipeline(te_aot_graphs("bf16", 1), passes=[Boom()])
    assert [(r.stage, [run.status for run in r.runs]) for r in reports] == [
        ("dynamo", []), ("joint", []), ("post_grad_fwd", []), ("post_grad_bwd", ["failed"])]


@pytest.mark.parametrize("precision,default,mxfp8", [("bf16", "DelayedScaling", False),
                                                     ("fp8-cs", "DelayedScaling", False),
                                                     ("mxfp8", "MXFP8BlockScaling", True)])
def test_the_fake_gpu_answers_te_s_support_checks_as_its_capability(precision, default, mxfp8):
    """The fake Hopper (sm_90) is TE's Hopper: DelayedScaling is TE's default recipe, MXFP8 / NVFP4 are refused with
    TE's message; the fake Blackwell (sm_100) has both (session 22's user trial: every fake GPU reported MXFP8)."""
    pytest.importorskip("transformer_engine.pytorch")
    import transformer_engine.pytorch.quantization as q

    from te_passes.testing.fake_gpu import fake_gpu

    with fake_gpu(precision):
        assert type(q.get_default_fp8_recipe()).__name__ == default
        assert q.check_mxfp8_support()[0] is mxfp8 and q.check_nvfp4_support()[0] is mxfp8
        assert q.check_fp8_support() == (True, "")
        if not mxfp8:
            assert q.check_nvfp4_support()[1] == "Device compute capability 10.0 or higher required for NVFP4 execution."
