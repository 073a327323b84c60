"""fold_ub_predicates: UB snapshot, query folding on FX graphs, TE op UB checks on real te.Linear.

TE's UB registry (``transformer_engine.pytorch.module.base._ub_communicators``) is populated
with stand-in communicators (real ones need GPUs); every expectation below is either TE's own
live answer (eager run of the unfolded graph against the stand-ins) or written out by hand.
"""

from __future__ import annotations

import contextlib
import json
import operator
import sys
import types
from unittest import mock

import pytest
import torch
import torch.fx

pytest.importorskip("transformer_engine")
import transformer_engine.pytorch.module.base as te_base  # noqa: E402

from te_passes.config import TePassesOptions  # noqa: E402
from te_passes.pipeline.base import Stage  # noqa: E402
from te_passes.passes.fold_ub_predicates import FoldUbPredicates  # noqa: E402
from te_passes.pipeline.manager import TePassError  # noqa: E402
from te_passes.passes.order import pass_names  # noqa: E402
from te_passes.report import CompileReport, StageReport, PassRun  # noqa: E402
from te_passes.compat import table  # noqa: E402
from te_passes.compat.ub import guard as guards, rows as ub_rows  # noqa: E402
from te_passes.compat.ub import graph_guard as ub_graph_guard  # noqa: E402
from te_passes.te.state import TEState  # noqa: E402
from te_passes.compat.api import capture_te_state, capture_ub
from te_passes.testing.harness import pass_context  # noqa: E402
from te_passes.te.ub import TE_UB_MODULE, UbConfigError, UbSnapshot  # noqa: E402
from te_passes.te.ub_rules import check_linear_ub_config, linear_ub_buffer_uses  # noqa: E402
from te_passes.testing.ub import StandInCommunicator as C, ub_registry  # noqa: E402

pytestmark = pytest.mark.te

BUFFERS = {
    ("proj_fprop", "fp8"): C(fp8_ubuf=True, tp_size=2),
    ("proj_fprop", "none"): C(tp_size=2),
    ("qkv_fprop", "fp8"): C(fp8_ubuf=True, p2p_overlap=True, atomic_gemm=True, tp_size=2),
}


@pytest.fixture
def registry():
    with ub_registry(BUFFERS):
        yield


def consume(x, v):
    """A graph consumer of a folded value (numerics depend on it)."""
    return x + float(v)


def _pass_ctx(stage=Stage.DYNAMO, *, strict=False, snapshot=None, graph_id="gtest", on_change="recompile"):
    return pass_context(stage, te_state=capture_te_state(ub_snapshot=snapshot), graph_id=graph_id, strict=strict,
                        ub_on_change=on_change)


def run_pass(gm, **kw):
    ctx = _pass_ctx(**kw)
    res = FoldUbPredicates().run(gm, ctx)
    gm.graph.lint()
    gm.recompile()
    return res, dependence(res)


def dependence(res):
    """The UB dependence the pass returned as a typed fact (empty if none)."""
    return ub_graph_guard.UbDependence.merged(f for f in res.facts if isinstance(f, ub_graph_guard.UbDependence))


def records(res):
    return [r.to_json() for r in res.records]


def node_summary(gm):
    return [(n.op, getattr(n.target, "__name__", n.target), tuple(n.args)) for n in gm.graph.nodes]


# --------------------------------------------------------------------------- snapshot
def test_pass_is_the_first_rewrite():
    """First to change the graph (its pre-pass copy is the graph Dynamo traced); only analyses run before it."""
    from te_passes.passes.order import pass_classes

    classes = list(pass_classes())
    first = pass_names().index("fold_ub_predicates")
    assert [c.name for c in classes if not c.analysis_only][0] == "fold_ub_predicates"
    assert first > 0 and all(c.analysis_only for c in classes[:first])


def test_snapshot_capture_exact(registry):
    snap = capture_ub()
    assert snap.source == "live"
    assert snap.to_json() == {
        "initialized": True, "with_cublasmp": False, "fingerprint": snap.fingerprint(),
        "buffers": [
            {"name": "proj_fprop", "mode": "fp8", "is_fp8_ubuf": True, "with_cublasmp": False,
             "is_atomic_gemm": False, "is_p2p_overlap": False, "tp_size": 2},
            {"name": "proj_fprop", "mode": "none", "is_fp8_ubuf": False, "with_cublasmp": False,
             "is_atomic_gemm": False, "is_p2p_overlap": False, "tp_size": 2},
            {"name": "qkv_fprop", "mode": "fp8", "is_fp8_ubuf": True, "with_cublasmp": False,
             "is_atomic_gemm": True, "is_p2p_overlap": True, "tp_size": 2},
        ]}
    # TEState carries it (part of the pipeline uuid / FX graph cache key)
    assert capture_te_state().to_json()["ub"] == snap.to_json()


def test_snapshot_fingerprint_stable_and_sensitive(registry, tmp_path):
    snap = capture_ub()
    fp = snap.fingerprint()
    assert len(fp) == 64 and int(fp, 16) >= 0
    assert capture_ub().fingerprint() == fp
    path = tmp_path / "ub.json"
    snap.save(path)
    loaded = UbSnapshot.load(str(path))
    assert loaded.source == f"file:{path}" and loaded.fingerprint() == fp and loaded.buffers == snap.buffers
    assert UbSnapshot.load(json.loads(path.read_text())).fingerprint() == fp
    assert UbSnapshot.load(snap) is snap
    with ub_registry({**BUFFERS, ("proj_fprop", "fp8"): C(fp8_ubuf=False, tp_size=2)}):
        assert capture_ub().fingerprint() != fp
    with ub_registry(BUFFERS, with_cublasmp=True):
        assert capture_ub().fingerprint() != fp
    with ub_registry(None):
        s = capture_ub()
        assert (s.initialized, s.buffers) == (False, ())


def test_snapshot_absent_when_te_not_loaded(monkeypatch):
    monkeypatch.delitem(sys.modules, TE_UB_MODULE)
    s = capture_ub()
    assert (s.source, s.initialized, s.buffers) == ("absent", False, ())


@pytest.mark.parametrize("data,match", [
    ({"initialized": True, "bufers": []}, r"unknown keys \['bufers'\]"),
    ({"buffers": [{"name": "a_fprop", "mode": "fp16"}]}, r"buffers\[0\] \('a_fprop'\): unknown UB quantization mode 'fp16'"),
    ({"buffers": [{"name": "a_fprop", "mode": "fp8", "is_fp8": True}]}, r"buffers\[0\] \('a_fprop'\) has unknown keys \['is_fp8'\]"),
    ({"buffers": [{"name": "a", "mode": "fp8"}, {"name": "a", "mode": "FP8"}]}, r"lists a \(name, mode\) twice"),
    ({"buffers": [{"mode": "fp8"}]}, r"buffers\[0\] must be an object with 'name' and 'mode'"),
    ([1, 2], r"must be a JSON object, got list"),
])
def test_snapshot_bad_json(data, match):
    with pytest.raises(UbConfigError, match=match):
        UbSnapshot.from_json(data)


def test_snapshot_bad_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UbConfigError, match=r"cannot read UB snapshot '.*bad.json'"):
        UbSnapshot.load(str(bad))
    with pytest.raises(UbConfigError, match="cannot read UB snapshot '.*missing.json'"):
        UbSnapshot.load(str(tmp_path / "missing.json"))
    with pytest.raises(TypeError, match="must be a UbSnapshot, dict or JSON path, got int"):
        UbSnapshot.load(3)


@pytest.mark.parametrize("api,args", [
    ("get_ub_is_fp8", ("proj_fprop", True)), ("get_ub_is_fp8", ("proj_fprop", False)),
    ("is_ub_initialized", ()), ("using_cublasmp_backend", ()),
    *[(f"get_ub.{m}", ("qkv_fprop", True)) for m in
      ("is_fp8_ubuf", "with_cublasmp", "is_atomic_gemm", "is_p2p_overlap", "get_tp_size")],
])
def test_snapshot_query_equals_te(registry, api, args):
    """The snapshot answers exactly what TE's live functions answer."""
    snap = capture_ub()
    if api.startswith("get_ub."):
        live = getattr(te_base.get_ub(*args), api.split(".")[1])()
    else:
        live = getattr(te_base, api)(*args)
    got = snap.query(api, args)
    assert got == live and type(got) is type(live)


def test_snapshot_query_errors_where_te_raises(registry):
    snap = capture_ub()
    with pytest.raises(KeyError):
        te_base.get_ub("qkv_fprop", False)
    with pytest.raises(UbConfigError, match=r"get_ub\('qkv_fprop', use_fp8=False\): no UB buffer \('qkv_fprop', none\) "
                                             r"is registered; registered: \['proj_fprop\[fp8\]', 'proj_fprop\[none\]', 'qkv_fprop\[fp8\]'\]"):
        snap.query("get_ub_is_fp8", ("qkv_fprop", False))
    with pytest.raises(UbConfigError, match="UB is not initialised"):
        UbSnapshot(initialized=False).query("get_ub.with_cublasmp", ("qkv_fprop", True))


# --------------------------------------------------------------------------- FX query forms
def _graph(build):
    g = torch.fx.Graph()
    x = g.placeholder("x")
    q = build(g)
    g.output(g.call_function(consume, (x, q)))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _te_original(name):
    fn = getattr(te_base, name)
    return getattr(fn, "__te_passes_original__", fn)


FORMS = [
    ("get_ub_is_fp8", lambda g: g.call_function(te_base.get_ub_is_fp8, ("proj_fprop", True)),
     "get_ub_is_fp8", ["proj_fprop", True], True),
    ("get_ub_is_fp8 (TE's unhooked function, kwargs)",
     lambda g: g.call_function(_te_original("get_ub_is_fp8"), ("proj_fprop",), {"use_fp8": False}),
     "get_ub_is_fp8", ["proj_fprop", False], False),
    ("is_ub_initialized", lambda g: g.call_function(te_base.is_ub_initialized, ()), "is_ub_initialized", [], True),
    ("using_cublasmp_backend", lambda g: g.call_function(te_base.using_cublasmp_backend, ()),
     "using_cublasmp_backend", [], False),
    *[(f"get_ub().{m}()",
       (lambda m: lambda g: g.call_method(m, (g.call_function(te_base.get_ub, ("qkv_fprop", True)),)))(m),
       f"get_ub.{m}", ["qkv_fprop", True], v)
      for m, v in (("is_fp8_ubuf", True), ("with_cublasmp", False), ("is_atomic_gemm", True),
                   ("is_p2p_overlap", True), ("get_tp_size", 2))],
    ("ub_query", lambda g: g.call_function(guards.ub_query, ("qkv_fprop", True, "is_p2p_overlap")),
     "get_ub.is_p2p_overlap", ["qkv_fprop", True], True),
]


@pytest.mark.parametrize("label,build,api,args,value", FORMS, ids=[f[0] for f in FORMS])
def test_fold_query_form(registry, label, build, api, args, value):
    gm = _graph(build)
    query_nodes = [n.name for n in gm.graph.nodes if n.op in ("call_function", "call_method") and n.target is not consume]
    x = torch.randn(5)
    eager = gm(x)  # runs TE's functions against the stand-in communicators
    res, dep = run_pass(gm)
    assert res.modified
    assert node_summary(gm) == [("placeholder", "x", ()), ("call_function", "consume", (gm.graph.find_nodes(op="placeholder")[0], value)),
                                ("output", "output", (list(gm.graph.nodes)[1],))]
    folded_node = query_nodes[-1]
    assert records(res) == [
        {"kind": "folded", "node": folded_node, "api": api, "args": args, "value": value, "source": "fx"},
        {"kind": "removed", "node": None, "nodes": list(reversed(query_nodes))},
    ]
    torch.testing.assert_close(gm(x), eager, rtol=0, atol=0)
    assert [(f.api, list(f.args), f.value, f.source) for f in dep.folds] == [(api, args, value, "fx")]
    assert [n.name for n in dep.pristine.graph.nodes if n.op != "placeholder" and n.op != "output"] == query_nodes + ["consume"]


def test_fold_propagates_through_operators(registry):
    g = torch.fx.Graph()
    x = g.placeholder("x")
    c = g.call_function(te_base.get_ub, ("qkv_fprop", True))
    fp8 = g.call_method("is_fp8_ubuf", (c,))
    mp = g.call_method("with_cublasmp", (c,))
    not_mp = g.call_function(operator.not_, (mp,))
    both = g.call_function(operator.and_, (fp8, not_mp))
    tp = g.call_method("get_tp_size", (c,))
    y = g.call_function(consume, (x, both))
    g.output(g.call_function(consume, (y, tp)))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    x_ = torch.randn(3)
    eager = gm(x_)
    res, _ = run_pass(gm)
    assert [(n.op, getattr(n.target, "__name__", n.target), n.args[1:] if n.op == "call_function" else ())
            for n in gm.graph.nodes] == [("placeholder", "x", ()), ("call_function", "consume", (True,)),
                                         ("call_function", "consume", (2,)), ("output", "output", ())]
    recs = records(res)
    assert [r for r in recs if r["kind"] == "const_folded"] == [
        {"kind": "const_folded", "node": "not_", "target": "not_", "args": [False], "value": True},
        {"kind": "const_folded", "node": "and_", "target": "and_", "args": [True, True], "value": True},
    ]
    assert sorted(next(r for r in recs if r["kind"] == "removed")["nodes"]) == sorted(
        ["get_ub", "is_fp8_ubuf", "with_cublasmp", "not_", "and_", "get_tp_size"])
    torch.testing.assert_close(gm(x_), eager, rtol=0, atol=0)


def test_non_constant_argument_is_left_alone(registry):
    g = torch.fx.Graph()
    x = g.placeholder("x")
    name = g.placeholder("name")
    q = g.call_function(te_base.get_ub_is_fp8, (name, True))
    g.output(g.call_function(consume, (x, q)))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    before = node_summary(gm)
    res, dep = run_pass(gm)
    assert not res.modified and node_summary(gm) == before and not dep
    assert records(res) == [{"kind": "skipped", "node": "get_ub_is_fp8",
                             "reason": "UB query not folded: argument name=name is not a compile-time constant"}]


def test_missing_buffer_is_a_compile_time_error(registry):
    gm = _graph(lambda g: g.call_method("is_fp8_ubuf", (g.call_function(te_base.get_ub, ("fc2_fprop", True)),)))
    before = node_summary(gm)
    res, _ = run_pass(gm)
    assert node_summary(gm) == before and not res.modified
    assert records(res) == [{
        "kind": "ub_mismatch", "node": "is_fp8_ubuf", "ub_name": None, "buffer": "fc2_fprop",
        "message": ("node is_fp8_ubuf: get_ub('fc2_fprop', use_fp8=True): no UB buffer ('fc2_fprop', fp8) is "
                    "registered; registered: ['proj_fprop[fp8]', 'proj_fprop[none]', 'qkv_fprop[fp8]']")}]
    with pytest.raises(UbConfigError, match=r"get_ub\('fc2_fprop', use_fp8=True\): no UB buffer"):
        run_pass(_graph(lambda g: g.call_function(te_base.get_ub_is_fp8, ("fc2_fprop", True))), strict=True)


def test_offline_snapshot_file(registry, tmp_path):
    """te_passes.ub_snapshot: fold against a saved state, not the live registry."""
    path = tmp_path / "ub.json"
    UbSnapshot(initialized=True, with_cublasmp=True, buffers=(
        __import__("te_passes.te.ub", fromlist=["UbBufferState"]).UbBufferState(
            "proj_fprop", "fp8", is_fp8_ubuf=False, with_cublasmp=True, is_atomic_gemm=False,
            is_p2p_overlap=True, tp_size=8),)).save(path)
    gm = _graph(lambda g: g.call_method("get_tp_size", (g.call_function(te_base.get_ub, ("proj_fprop", True)),)))
    res, _ = run_pass(gm, snapshot=str(path))
    assert [n.args[1] for n in gm.graph.nodes if n.op == "call_function"] == [8]
    gm2 = _graph(lambda g: g.call_function(te_base.using_cublasmp_backend, ()))
    run_pass(gm2, snapshot=str(path))
    assert [n.args[1] for n in gm2.graph.nodes if n.op == "call_function"] == [True]


# --------------------------------------------------------------------------- real te.Linear
class _NeverRun(Exception):
    pass


def capture_ub_linear(precision="bf16", *, training=True, in_features=64, out_features=128, tokens=32, **kwargs):
    """Dynamo graph of one real te.Linear with tensor/sequence parallel + UB flags, on CPU.

    Like te_passes.testing.capture.capture_dynamo, plus ``set_tensor_parallel_group(None)``
    after construction (TE requires an initialised TP group for tp_size > 1; sequence
    parallelism, which every UB flag needs, requires tp_size > 1).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    import transformer_engine.pytorch as te
    from te_passes.testing.fake_gpu import fake_gpu, make_recipe

    recipe = make_recipe(precision)
    recorded = []
    with fake_gpu(precision):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode, mock.patch.object(torch.cuda, "is_available", lambda: True):
            lin = te.Linear(in_features, out_features, params_dtype=torch.bfloat16, device="cuda", **kwargs)
            lin.set_tensor_parallel_group(None)
            x = torch.randn(tokens, lin.in_features, dtype=torch.bfloat16, device="cuda", requires_grad=True)

        def step(inp):
            with (te.autocast(enabled=True, recipe=recipe) if recipe is not None else contextlib.nullcontext()):
                return lin(inp)

        def backend(gm, example_inputs):
            _LAST_EXAMPLE_INPUTS[:] = [list(example_inputs)]
            recorded.append(gm)
            # what te_inductor runs first: the Dynamo-stage passes (inside the same compile id)
            ctx = _pass_ctx(graph_id="gcap")
            ctx.inputs.update(guards.dynamo_stage_inputs())  # as te_inductor does before the stage
            recorded.append(FoldUbPredicates().run(gm, ctx))
            recorded.append(dependence(recorded[-1]))

            def never_run(*a):
                raise _NeverRun()
            return never_run

        code = step.__code__.replace(co_name=f"ub_capture_{len(_CAPTURES)}")
        _CAPTURES.append(code)
        fn = torch.compile(types.FunctionType(code, step.__globals__, code.co_name, None, step.__closure__),
                           backend=backend, fullgraph=True, dynamic=False)
        with mode, (contextlib.nullcontext() if training else torch.no_grad()):
            with pytest.raises(_NeverRun):
                fn(x)
    gm, res, dep = recorded
    return gm, res, dep


_CAPTURES: list = []
_LAST_EXAMPLE_INPUTS: list = []

QKV = {("qkv_fprop", "fp8"): C(fp8_ubuf=True), ("qkv_dgrad", "fp8"): C(fp8_ubuf=True),
       ("qkv_wgrad", "fp8"): C(fp8_ubuf=False)}
COLUMN = dict(ub_name="qkv", parallel_mode="column", sequence_parallel=True, tp_size=2,
              ub_overlap_ag=True, ub_bulk_dgrad=True, ub_bulk_wgrad=True)
ROW = dict(ub_name="proj", parallel_mode="row", sequence_parallel=True, tp_size=2, ub_overlap_rs=True, ub_overlap_ag=True)


def _buf(buffer, mode, phase, overlap, flag, source_bwd, *, fp8ubuf, registered=True):
    from te_passes.te.ub_rules import LINEAR_SOURCE_BWD, LINEAR_SOURCE_FWD
    return {"buffer": buffer, "use_fp8": mode == "fp8", "phase": phase, "overlap": overlap, "flag": flag,
            "source": LINEAR_SOURCE_BWD if source_bwd else LINEAR_SOURCE_FWD, "mode": mode,
            "registered": registered, "is_fp8_ubuf": fp8ubuf if registered else None,
            "with_cublasmp": False if registered else None, "tp_size": 2 if registered else None}


def test_real_linear_column_parallel_fp8_ok():
    with ub_registry(QKV):
        gm, res, dep = capture_ub_linear("fp8-cs", **COLUMN)
    te_node = next(n for n in gm.graph.nodes if n.op == "call_function" and "transformer_engine" in str(n.target))
    assert not res.modified
    assert records(res) == [{
        "kind": "ub_check", "node": te_node.name, "op": "linear", "ub_name": "qkv",
        "flags": ["ub_overlap_ag_fprop", "ub_bulk_dgrad", "ub_bulk_wgrad"],
        "buffers": [_buf("qkv_fprop", "fp8", "fprop", "AG", "ub_overlap_ag_fprop", False, fp8ubuf=True),
                    _buf("qkv_dgrad", "fp8", "dgrad", "bulk AG", "ub_bulk_dgrad", True, fp8ubuf=True),
                    _buf("qkv_wgrad", "fp8", "wgrad", "bulk RS", "ub_bulk_wgrad", True, fp8ubuf=False)],
        "status": "ok"}]
    assert [c.op for c in dep.checks] == ["linear"] and dep.folds == []
    # a pre-pass copy is kept: under CUDA graphs a UB re-initialisation recompiles this graph
    assert [n.name for n in dep.pristine.graph.nodes] == [n.name for n in gm.graph.nodes]
    assert dep.pristine.graph is not gm.graph


def test_real_linear_missing_wgrad_buffer_is_an_error():
    with ub_registry({k: v for k, v in QKV.items() if k[0] != "qkv_wgrad"}):
        gm, res, _ = capture_ub_linear("fp8-cs", **COLUMN)
    te_node = next(n.name for n in gm.graph.nodes if n.op == "call_function" and "transformer_engine" in str(n.target))
    msg = ("TE linear op with ub_name='qkv': ub_bulk_wgrad needs UB buffer 'qkv_wgrad' in mode 'fp8' (wgrad bulk RS) "
           "but it is not registered; registered: ['qkv_dgrad[fp8]', 'qkv_fprop[fp8]']")
    recs = records(res)
    assert recs[0]["status"] == "mismatch"
    assert recs[0]["buffers"][2] == _buf("qkv_wgrad", "fp8", "wgrad", "bulk RS", "ub_bulk_wgrad", True,
                                         fp8ubuf=None, registered=False)
    assert recs[1:] == [{"kind": "ub_mismatch", "node": te_node, "ub_name": "qkv", "buffer": "qkv_wgrad", "message": msg}]
    # te_inductor raises it before returning the compiled graph
    report = CompileReport("g99", stages=[StageReport("g99", "dynamo", runs=[PassRun("fold_ub_predicates", "dynamo",
                                                                                    records=res.records,
                                                                                    facts=res.facts)])])
    with pytest.raises(UbConfigError, match="graph g99: UB configuration does not match the UB state") as ei:
        ub_graph_guard.wrap_with_te_state_guard(lambda *a: None, report, capture_te_state(), TePassesOptions())
    assert msg in str(ei.value)


def test_real_linear_row_parallel_bf16_ok():
    with ub_registry({("proj_fprop", "none"): C(), ("proj_dgrad", "none"): C()}):
        gm, res, dep = capture_ub_linear("bf16", in_features=64, **ROW)
    assert [r["kind"] for r in records(res)] == ["folded", "ub_check"]
    assert records(res)[1]["flags"] == ["ub_overlap_rs_fprop", "ub_overlap_ag_dgrad"]
    assert records(res)[1]["buffers"] == [
        _buf("proj_fprop", "none", "fprop", "RS", "ub_overlap_rs_fprop", False, fp8ubuf=False),
        _buf("proj_dgrad", "none", "dgrad", "AG", "ub_overlap_ag_dgrad", True, fp8ubuf=False)]
    # bf16: Linear.forward's get_ub_is_fp8(ub_name + "_fprop", False) is folded at trace time (guarded)
    assert [r for r in records(res) if r["kind"] == "folded"] == [
        {"kind": "folded", "node": None, "api": "get_ub_is_fp8", "args": ["proj_fprop", False], "value": False,
         "source": "dynamo_trace"}]
    assert [(f.api, f.source) for f in dep.folds] == [("get_ub_is_fp8", "dynamo_trace")]
    assert all(r["kind"] != "ub_mismatch" for r in records(res))


def test_real_linear_fp8_reduce_scatter_fp8_output():
    """FP8 RS fprop buffer -> TE sets fp8_output=True (inference: with grad TE falls back to eager
    for a differentiable fp8_output; no bias: TE adds a row-parallel bias after the GEMM, which an
    FP8 output cannot take)."""
    fp8_rs = {("proj_fprop", "fp8"): C(fp8_ubuf=True), ("proj_dgrad", "fp8"): C(fp8_ubuf=True)}
    with ub_registry(fp8_rs):
        gm, res, _ = capture_ub_linear("fp8-cs", training=False, bias=False, **ROW)
    from te_passes.te import graph_model as gmod
    call = gmod.decode(next(n for n in gm.graph.nodes if gmod.is_te_op_node(n)))
    assert call.config["fp8_output"] is True and call.config["output_quantizer"] is not None
    recs = records(res)
    assert [r for r in recs if r["kind"] == "folded"] == [
        {"kind": "folded", "node": None, "api": "get_ub_is_fp8", "args": ["proj_fprop", True], "value": True,
         "source": "dynamo_trace"}]
    assert [r["kind"] for r in recs] == ["folded", "ub_check"] and recs[1]["status"] == "ok"
    assert recs[1]["flags"] == ["ub_overlap_rs_fprop", "ub_overlap_ag_dgrad"]
    assert [b["buffer"] for b in recs[1]["buffers"]] == ["proj_fprop"]  # no backward under no_grad


def test_real_linear_traced_against_other_ub_state_is_an_error():
    """Traced with a non-FP8 RS buffer (fp8_output=False), compiled against an FP8 one."""
    with ub_registry({("proj_fprop", "fp8"): C(fp8_ubuf=False), ("proj_dgrad", "fp8"): C(fp8_ubuf=False)}):
        gm, _, _ = capture_ub_linear("fp8-cs", training=False, bias=False, **ROW)
    with ub_registry({("proj_fprop", "fp8"): C(fp8_ubuf=True), ("proj_dgrad", "fp8"): C(fp8_ubuf=True)}):
        res, _ = run_pass(gm)
    te_node = next(n.name for n in gm.graph.nodes if n.op == "call_function" and "transformer_engine" in str(n.target))
    assert [r for r in records(res) if r["kind"] == "ub_mismatch"] == [{
        "kind": "ub_mismatch", "node": te_node, "ub_name": "proj", "buffer": "proj_fprop",
        "message": ("TE linear op with ub_name='proj': UB buffer 'proj_fprop' is an FP8 reduce-scatter buffer "
                    "(is_fp8_ubuf()=True), so TE's Linear.forward sets fp8_output=True, but the op was traced "
                    "with fp8_output=False and output_quantizer=None (traced against another UB state)")}]


def _linear_config(gm):
    from te_passes.te import graph_model as gmod
    return gmod.decode(next(n for n in gm.graph.nodes if gmod.is_te_op_node(n))).config


def test_real_linear_tp_size_cublasmp_and_uninitialised():
    with ub_registry(QKV):
        gm, _, _ = capture_ub_linear("fp8-cs", **COLUMN)
    cfg = _linear_config(gm)
    assert cfg["tp_size"] == 2
    with ub_registry({k: C(fp8_ubuf=v.fp8_ubuf, tp_size=4) for k, v in QKV.items()}):
        probs = check_linear_ub_config("linear", cfg, capture_ub()).problems
    assert probs == [(b, f"TE linear op with ub_name='qkv': UB buffer '{b}' was initialised for tp_size=4 but "
                         "the op runs with tp_size=2") for b in ("qkv_fprop", "qkv_dgrad", "qkv_wgrad")]
    with ub_registry(QKV, with_cublasmp=True):
        probs = check_linear_ub_config("linear", cfg, capture_ub()).problems
    assert probs == [("qkv_dgrad", "TE linear op with ub_name='qkv': ['ub_bulk_dgrad', 'ub_bulk_wgrad'] set but UB "
                                   "uses the cuBLASMp backend, which has no bulk overlap (the module was built before UB "
                                   "was re-initialised with with_cublasmp=True; rebuild it)")]
    probs = check_linear_ub_config("linear", cfg, UbSnapshot(initialized=False)).problems
    assert probs == [("", "TE linear op with ub_name='qkv' uses UB overlap (ub_overlap_ag_fprop, ub_bulk_dgrad, "
                          "ub_bulk_wgrad) but UB is not initialised in the UB state compiled against (call "
                          "initialize_ub() before compiling)")]


def test_plain_linear_has_no_ub_records():
    from te_passes.testing.capture import capture_dynamo
    cap = capture_dynamo("linear", "bf16")
    res, dep = run_pass(cap.gm)
    assert records(res) == [] and not res.modified and not dep


# --------------------------------------------------------------------------- TE rules (unit)
def test_backward_rules_mirror_te():
    """linear_backward configs (LinearBwdArgs): the elif chain of _linear_backward_impl."""
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer
    import transformer_engine_torch as tex

    base = dict(ub_name="fc1", fp8=True, requires_wgrad=True, requires_dgrad=True, grad_output_quantizer=None)
    uses = lambda **kw: [(u.buffer, u.overlap) for u in linear_ub_buffer_uses("linear_backward", {**base, **kw})]  # noqa: E731
    assert uses(ub_overlap_ag=True, ub_overlap_rs_dgrad=True, ub_bulk_wgrad=True) == [("fc1_dgrad", "AG")]
    assert uses(ub_overlap_rs_dgrad=True, ub_bulk_dgrad=True) == [("fc1_dgrad", "RS")]
    assert uses(ub_bulk_dgrad=True, ub_bulk_wgrad=True) == [("fc1_dgrad", "bulk AG"), ("fc1_wgrad", "bulk RS")]
    mx = MXFP8Quantizer(tex.DType.kFloat8E4M3)
    assert uses(ub_overlap_ag=True, grad_output_quantizer=mx) == [("fc1_dgrad", "AG"), ("fc1_wgrad", "AG (MXFP8 wgrad)")]
    assert uses(ub_overlap_ag=True, grad_output_quantizer=mx, requires_wgrad=False) == [("fc1_dgrad", "AG")]
    mp = UbSnapshot(initialized=True, buffers=(__import__("te_passes.te.ub", fromlist=["x"]).UbBufferState(
        "fc1_dgrad", "fp8", is_fp8_ubuf=True, with_cublasmp=True),))
    assert [u.buffer for u in linear_ub_buffer_uses("linear_backward", {**base, "ub_overlap_ag": True,
                                                                        "grad_output_quantizer": mx}, mp)] == ["fc1_dgrad"]
    # forward config: backward_override turns every backward UB fetch off (_linear_setup_backward)
    fwd = dict(ub_name="fc1", fp8=False, ub_overlap_ag_fprop=True, ub_bulk_dgrad=True, is_grad_enabled=True,
               input_requires_grad=True, weight_requires_grad=True)
    assert [u.buffer for u in linear_ub_buffer_uses("linear", fwd)] == ["fc1_fprop", "fc1_dgrad"]
    assert [u.buffer for u in linear_ub_buffer_uses("linear", {**fwd, "backward_override": "high_precision"})] == ["fc1_fprop"]
    assert [u.buffer for u in linear_ub_buffer_uses("linear", {**fwd, "is_grad_enabled": False})] == ["fc1_fprop"]
    with pytest.raises(ValueError, match="no UB buffer-use rules for TE op 'grouped_linear'"):
        linear_ub_buffer_uses("grouped_linear", {})


def test_strict_mode_raises_through_manager():
    from te_passes.pipeline.manager import PassManager
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(consume, (x, g.call_function(te_base.get_ub_is_fp8, ("nope_fprop", True)))))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    with ub_registry(BUFFERS):
        with pytest.raises(TePassError, match=r"fold_ub_predicates.*no UB buffer \('nope_fprop', fp8\)"):
            PassManager([FoldUbPredicates()]).run(gm, _pass_ctx(strict=True))


def test_real_linear_aot_graphs_checked_at_post_grad():
    """The same te.Linear lowered by AOTAutograd: the post-grad forward's linear.default and the
    backward's linear_backward.default (LinearBwdArgs: ub_overlap_ag, ub_bulk_*) are checked."""
    from te_passes.testing.capture import CapturedGraph, capture_aot

    with ub_registry(QKV):
        gm, _, _ = capture_ub_linear("fp8-cs", **COLUMN)
        cg = CapturedGraph(gm=gm, example_inputs=_LAST_EXAMPLE_INPUTS[0], precision="fp8-cs", model="linear",
                           layers=1, tokens=32, hidden=64, out_features=64, linear_kwargs=dict(COLUMN))
        aot = capture_aot(dynamo=cg)
        fwd, _ = run_pass(aot.forward, stage=Stage.POST_GRAD_FWD)
        bwd, dep = run_pass(aot.backward, stage=Stage.POST_GRAD_BWD)
    assert [(r["kind"], r["node"], r["op"], r["flags"], [b["buffer"] for b in r["buffers"]], r["status"])
            for r in records(fwd)] == [
        ("ub_check", "linear", "linear", ["ub_overlap_ag_fprop", "ub_bulk_dgrad", "ub_bulk_wgrad"],
         ["qkv_fprop", "qkv_dgrad", "qkv_wgrad"], "ok")]
    assert records(bwd) == [{
        "kind": "ub_check", "node": "linear_backward", "op": "linear_backward", "ub_name": "qkv",
        "flags": ["ub_bulk_dgrad", "ub_bulk_wgrad"],
        "buffers": [_buf("qkv_dgrad", "fp8", "dgrad", "bulk AG", "ub_bulk_dgrad", True, fp8ubuf=True),
                    _buf("qkv_wgrad", "fp8", "wgrad", "bulk RS", "ub_bulk_wgrad", True, fp8ubuf=False)],
        "status": "ok"}]
    assert [c.op for c in dep.checks] == ["linear_backward"]
    # and against a UB state without the wgrad buffer
    with ub_registry({k: v for k, v in QKV.items() if k[0] != "qkv_wgrad"}):
        bad, _ = run_pass(aot.backward, stage=Stage.POST_GRAD_BWD)
    assert [r["message"] for r in records(bad) if r["kind"] == "ub_mismatch"] == [
        "TE linear_backward op with ub_name='qkv': ub_bulk_wgrad needs UB buffer 'qkv_wgrad' in mode 'fp8' "
        "(wgrad bulk RS) but it is not registered; registered: ['qkv_dgrad[fp8]', 'qkv_fprop[fp8]']"]


def test_warns_when_traced_before_hooks_were_installed():
    with ub_registry(QKV):
        gm, _, _ = capture_ub_linear("fp8-cs", **COLUMN)
        table.revert(["ub.get_ub_is_fp8"])
        try:
            with pytest.warns(RuntimeWarning, match=r"UB hooks were not installed when Dynamo traced this graph "
                                                    r"\(patch ub.get_ub_is_fp8: pending: reverted;"):
                res, _ = run_pass(gm)
            # A pass changes no process state (issue 12): te_inductor's compat.install() hooks later traces.
            assert table.refusal("ub.get_ub_is_fp8") is not None
        finally:
            table.install(ub_rows.ROWS)
        assert table.refusal("ub.get_ub_is_fp8") is None
    assert [r["kind"] for r in records(res)] == ["ub_check", "skipped"]


# --------------------------------------------------------------------------- property: snapshot == TE
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_NAMES = ["qkv_fprop", "qkv_dgrad", "proj_fprop", "fc1_wgrad"]
_registries = st.dictionaries(
    st.tuples(st.sampled_from(_NAMES), st.sampled_from(["none", "fp8"])),
    st.builds(C, fp8_ubuf=st.booleans(), cublasmp=st.booleans(), atomic_gemm=st.booleans(),
              p2p_overlap=st.booleans(), tp_size=st.sampled_from([1, 2, 4, 8])),
    max_size=6)
_queries = st.one_of(
    st.tuples(st.just("get_ub_is_fp8"), st.tuples(st.sampled_from(_NAMES), st.booleans())),
    st.tuples(st.sampled_from([f"get_ub.{m}" for m in ("is_fp8_ubuf", "with_cublasmp", "is_atomic_gemm",
                                                      "is_p2p_overlap", "get_tp_size")]),
              st.tuples(st.sampled_from(_NAMES), st.booleans())),
    st.tuples(st.sampled_from(["is_ub_initialized", "using_cublasmp_backend"]), st.just(())))


def _te_live(api, args):
    if api.startswith("get_ub."):
        return getattr(te_base.get_ub(*args), api.split(".")[1])()
    if api == "get_ub_is_fp8":
        return _te_original("get_ub_is_fp8")(*args)
    return getattr(te_base, api)(*args)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(registry=st.one_of(st.none(), _registries), cublasmp=st.booleans(), queries=st.lists(_queries, max_size=6))
def test_snapshot_answers_like_te_for_any_registry(registry, cublasmp, queries):
    """For any registry (or none), every query on the snapshot — also after a JSON round trip —
    equals TE's live answer, or raises UbConfigError exactly where TE raises."""
    with ub_registry(registry, with_cublasmp=cublasmp):
        snap = capture_ub()
        again = UbSnapshot.from_json(json.loads(json.dumps(snap.to_json())))
        assert again.fingerprint() == snap.fingerprint()
        for api, args in queries:
            try:
                live = _te_live(api, args)
            except (RuntimeError, KeyError):
                for s in (snap, again):
                    with pytest.raises(UbConfigError):
                        s.query(api, args)
                continue
            for s in (snap, again):
                got = s.query(api, args)
                assert got == live and type(got) is type(live), (api, args)
