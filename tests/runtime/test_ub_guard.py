"""UB guards: changing the UB state recompiles exactly the graphs that depend on it.

Compiles count with our own counter (one :class:`~te_passes.report.CompileReport` per
``te_inductor`` call) and Dynamo's ``counters["stats"]["unique_graphs"]``. Models run on CPU;
TE's UB registry holds stand-in communicators (te_passes.testing.ub).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.fx
from torch._dynamo.utils import counters

pytest.importorskip("transformer_engine")
import transformer_engine.pytorch.module.base as te_base  # noqa: E402
from _ubgraphs import BF16_RS, FP8_RS, Plain, UbModel, fresh_ub_compiles, plain_graph, ub_graph  # noqa: E402
import transformer_engine.pytorch.module.linear as te_linear  # noqa: E402

from te_passes.backend import te_inductor  # noqa: E402
from te_passes.report import compile_reports  # noqa: E402
from te_passes.compat.ub import reinit as ub, guard as guards  # noqa: E402
from te_passes.compat.ub import graph_guard as ub_graph_guard  # noqa: E402
from te_passes.compat.ub.guard import UbStateChanged  # noqa: E402
from te_passes.compat.ub.graph_guard import UbCheckSpec, UbDependence, UbGuard, make_guarded  # noqa: E402
from te_passes.te.ub import UbConfigError
from te_passes.compat.api import capture_te_state, capture_ub
from te_passes.testing.ub import StandInCommunicator as C, set_ub_registry, ub_registry  # noqa: E402
from te_passes.compat import table  # noqa: E402
from te_passes.compat.ub import rows as ub_rows  # noqa: E402
import _rows  # noqa: E402

UB_ROWS = ("ub.initialize_ub", "ub.destroy_ub", "ub.get_ub_is_fp8")

pytestmark = pytest.mark.te



@pytest.fixture(autouse=True)
def fresh():
    with fresh_ub_compiles(FP8_RS):
        yield


class QueryModel(torch.nn.Module):
    """Asks a communicator property without a graph break (ub_query)."""

    def forward(self, x):
        tp = guards.ub_query("proj_fprop", False, "get_tp_size")
        return x * tp


def n_compiles():
    return len(compile_reports())


def test_hooks_installed_in_te_modules():
    assert [(r.name, table.refusal(r.name) is None) for r in ub_rows.ROWS] == [(n, True) for n in UB_ROWS]
    assert te_linear.get_ub_is_fp8 is te_base.get_ub_is_fp8
    assert te_base.get_ub_is_fp8.__te_passes_original__.__module__ == "transformer_engine.pytorch.module.base"
    assert te_base.destroy_ub.__te_passes_original__.__name__ == "destroy_ub"
    gen = guards.current_generation()
    with mock.patch.object(torch.compiler, "reset") as reset:
        te_base.destroy_ub()  # TE's own destroy_ub: still resets everything, but now also bumps the generation
    assert reset.call_count == 1 and guards.current_generation() == gen + 1
    assert capture_ub().initialized is False


def test_uninstall_restores_te_functions():
    hooked = te_base.get_ub_is_fp8
    orig = hooked.__te_passes_original__
    _rows.off(*UB_ROWS)
    try:
        assert te_base.get_ub_is_fp8 is orig and te_linear.get_ub_is_fp8 is orig
        assert getattr(orig, "_dynamo_marked_constant", False)  # TE's assume_constant_result
        assert not hasattr(te_base.destroy_ub, "__te_passes_original__")
    finally:
        assert all(_rows.on(n) for n in UB_ROWS)
    assert te_linear.get_ub_is_fp8 is not orig


def test_only_the_ub_model_recompiles():
    ub_model, plain = UbModel(), Plain()
    cu = torch.compile(ub_model, backend="te_inductor", fullgraph=True)
    cp = torch.compile(plain, backend="te_inductor", fullgraph=True)
    x = torch.randn(16)
    for _ in range(2):
        torch.testing.assert_close(cu(x), ub_model(x))
        torch.testing.assert_close(cp(x), plain(x))
    assert n_compiles() == 2 and counters["stats"]["unique_graphs"] == 2
    ub_report = compile_reports()[0]
    assert [r.to_json() for r in ub_report.records("folded")] == [
        {"kind": "folded", "node": None, "api": "get_ub_is_fp8", "args": ["proj_fprop", True], "value": True,
         "source": "dynamo_trace"}]

    set_ub_registry(BF16_RS)  # re-initialised: proj_fprop's FP8 buffer is no longer FP8
    for _ in range(2):
        torch.testing.assert_close(cu(x), ub_model(x))  # eager now takes the cos branch
        torch.testing.assert_close(cp(x), plain(x))
    torch.testing.assert_close(cu(x), torch.cos(x) - 1)
    assert n_compiles() == 3 and counters["stats"]["unique_graphs"] == 3
    assert compile_reports()[2].records("folded")[0].data["value"] is False

    # same UB state again (new communicator objects, equal answers): nothing recompiles
    set_ub_registry(BF16_RS)
    cu(x), cp(x)
    assert n_compiles() == 3
    # back to the first state: Dynamo's first cache entry matches again, still no compile
    set_ub_registry(FP8_RS)
    torch.testing.assert_close(cu(x), torch.sin(x) * 2)
    cp(x)
    assert n_compiles() == 3


def test_ub_query_is_folded_without_graph_break():
    m = QueryModel()
    c = torch.compile(m, backend="te_inductor", fullgraph=True)  # fullgraph: a pybind call would fail
    x = torch.randn(4)
    with ub_registry({("proj_fprop", "none"): C(tp_size=2)}):
        torch.testing.assert_close(c(x), x * 2)
        assert n_compiles() == 1
    with ub_registry({("proj_fprop", "none"): C(tp_size=4)}):
        torch.testing.assert_close(c(x), x * 4)
        torch.testing.assert_close(m(x), x * 4)
        assert n_compiles() == 2


def test_is_ub_initialized_is_guarded_by_dynamo_itself():
    class M(torch.nn.Module):
        def forward(self, x):
            return x + 1 if te_base.is_ub_initialized() else x - 1

    m = M()
    c = torch.compile(m, backend="te_inductor", fullgraph=True)
    x = torch.zeros(2)
    torch.testing.assert_close(c(x), x + 1)
    set_ub_registry(None)
    torch.testing.assert_close(c(x), x - 1)
    assert n_compiles() == 2


def test_error_mode_refuses_dynamo_retrace():
    c = torch.compile(UbModel(), backend="te_inductor", options={"te_passes.ub_on_change": "error"})
    x = torch.randn(3)
    c(x)
    set_ub_registry(BF16_RS)
    with pytest.raises(Exception, match=r"re-traced because the UB state changed .*ub_on_change='error'"):
        c(x)


# --------------------------------------------------------------------------- layer 2: FX graphs


def test_fx_graph_recompiles_only_itself():
    x = torch.randn(8)
    cu = te_inductor(ub_graph(), [x])
    cp = te_inductor(plain_graph(), [x])
    assert hasattr(cu, "te_ub_guard") and not hasattr(cp, "te_ub_guard")  # plain graphs are not wrapped
    eager_ub = ub_graph()
    torch.testing.assert_close(cu(x)[0], eager_ub(x)[0])
    assert n_compiles() == 2
    before = dict(guards.guard_stats)

    set_ub_registry(BF16_RS)
    out = cu(x)[0]
    torch.testing.assert_close(out, eager_ub(x)[0])  # eager re-queries TE live: 0.5 * x
    torch.testing.assert_close(out, x * 0.5)
    torch.testing.assert_close(cp(x)[0], torch.relu(x))
    assert n_compiles() == 3 and cu.te_ub_guard.recompiles == 1
    assert guards.guard_stats["recompiles"] == before["recompiles"] + 1
    cu(x)
    assert n_compiles() == 3  # fast path again

    # a change that does not touch what the graph folded: kept, no recompile
    set_ub_registry({**BF16_RS, ("fc1_fprop", "fp8"): C(fp8_ubuf=True)})
    torch.testing.assert_close(cu(x)[0], x * 0.5)
    assert n_compiles() == 3 and guards.guard_stats["kept"] == before["kept"] + 1


def test_fx_graph_error_mode():
    x = torch.randn(8)
    cu = te_inductor(ub_graph(), [x], options={"te_passes.ub_on_change": "error"})
    cu(x)
    set_ub_registry(BF16_RS)
    with pytest.raises(UbStateChanged, match=(r"graph g\d+ was compiled against UB state [0-9a-f]{16}, now [0-9a-f]{16}: "
                                             r"get_ub.is_fp8_ubuf\('proj_fprop', True\): True -> False "
                                             r"\(te_passes.ub_on_change='error'")):
        cu(x)
    assert n_compiles() == 1


def test_fx_graph_buffer_gone_is_a_clear_error():
    x = torch.randn(8)
    cu = te_inductor(ub_graph(), [x])
    set_ub_registry({("fc1_fprop", "fp8"): C()})
    with pytest.raises(UbConfigError, match=r"get_ub.is_fp8_ubuf\('proj_fprop', True\).*no UB buffer \('proj_fprop', fp8\)"):
        cu(x)


def test_a_folded_query_te_would_raise_for_is_a_ub_config_error():
    """A folded query whose buffer is gone after a UB change: TE's own query would raise, so the
    guard raises UbConfigError naming the query (it is not a changed value to recompile for)."""
    fold = guards.UbFold("get_ub_is_fp8", ("proj_fprop", True), True, "q", "fx")
    guard = UbGuard("gQ", lambda *a: "ran", UbDependence(folds=[fold]), capture_ub().fingerprint(),
                    "recompile", None)
    fn = make_guarded(guard)
    assert fn(1) == "ran"
    set_ub_registry({("qkv_fprop", "fp8"): C()})
    with pytest.raises(UbConfigError, match=r"(?s)UB state changed since graph gQ.*- get_ub_is_fp8\('proj_fprop', True\): "):
        fn(2)
    assert guard.recompiles == 0


def test_te_op_check_is_revalidated():
    """A graph whose only UB dependence is a checked te.Linear config (the op fetches communicators
    itself at run time): kept while consistent, a clear error once a buffer it needs is gone."""
    cfg = dict(ub_name="proj", fp8=False, tp_size=2, ub_overlap_rs_fprop=True, ub_overlap_ag_dgrad=False,
               is_grad_enabled=False, fp8_output=False, output_quantizer=None)
    calls = []
    guard = UbGuard("gX", lambda *a: calls.append(a) or "ran", UbDependence(checks=[UbCheckSpec("linear", cfg, "linear")]),
                    capture_ub().fingerprint(), "recompile", None)
    fn = make_guarded(guard)
    assert fn(1) == "ran"
    set_ub_registry({**FP8_RS, ("qkv_fprop", "fp8"): C()})
    assert fn(2) == "ran" and guard.recompiles == 0
    set_ub_registry({("proj_fprop", "fp8"): C(fp8_ubuf=True)})
    with pytest.raises(UbConfigError, match=(r"(?s)UB state changed since graph gX was compiled.*ub_overlap_rs_fprop needs UB "
                                             r"buffer 'proj_fprop' in mode 'none'")):
        fn(3)
    assert calls == [(1,), (2,)]


# --------------------------------------------------------------------------- re-initialising UB
def test_reinitialize_ub_keeps_unrelated_graphs(monkeypatch):
    ub_model, plain = UbModel(), Plain()
    cu = torch.compile(ub_model, backend="te_inductor")
    cp = torch.compile(plain, backend="te_inductor")
    x = torch.randn(8)
    cu(x), cp(x)
    assert n_compiles() == 2

    def fake_initialize_ub(shape, tp_size, quantization_modes=None, **kw):  # TE's needs GPUs
        comms = {}
        for m in quantization_modes:
            comms[("proj_fprop", m)] = C(fp8_ubuf=False, tp_size=tp_size)
        te_base._ub_communicators, te_base._ub_initialized = comms, True

    monkeypatch.setattr(te_base, "initialize_ub", guards.state_change_hook(fake_initialize_ub))
    with mock.patch.object(torch.compiler, "reset", wraps=torch.compiler.reset) as reset:
        snap = ub.reinitialize_ub([64, 32], 2, quantization_modes=[te_base.UserBufferQuantizationMode.FP8,
                                                                   te_base.UserBufferQuantizationMode.NONE])
    assert reset.call_count == 0
    assert [(b.name, b.mode, b.is_fp8_ubuf) for b in snap.buffers] == [("proj_fprop", "fp8", False),
                                                                        ("proj_fprop", "none", False)]
    torch.testing.assert_close(cu(x), ub_model(x))
    torch.testing.assert_close(cu(x), torch.cos(x) - 1)
    torch.testing.assert_close(cp(x), plain(x))
    assert n_compiles() == 3  # only the UB model recompiled


def test_te_destroy_ub_resets_everything_but_keep_compiled_graphs_does_not():
    plain = Plain()
    cp = torch.compile(plain, backend="te_inductor")
    x = torch.randn(4)
    cp(x)
    with ub.keep_compiled_graphs():
        te_base.destroy_ub()
    cp(x)
    assert n_compiles() == 1 and capture_ub().initialized is False
    set_ub_registry(FP8_RS)
    te_base.destroy_ub()  # TE's own: torch.compiler.reset() -> the unrelated graph recompiles
    cp(x)
    assert n_compiles() == 2


def test_te_inductor_fails_before_inductor_on_missing_buffer():
    """A query the UB state cannot answer fails the compilation with UbConfigError (not TE's
    KeyError from inside the graph)."""
    set_ub_registry({("fc1_fprop", "fp8"): C()})
    with mock.patch("torch._inductor.compile_fx.compile_fx") as inductor:
        with pytest.raises(UbConfigError, match=(r"graph g\d+: UB configuration does not match the UB state "
                                                 r"\(fold_ub_predicates\):\n  - node is_fp8_ubuf: get_ub\('proj_fprop', "
                                                 r"use_fp8=True\): no UB buffer \('proj_fprop', fp8\) is registered; "
                                                 r"registered: \['fc1_fprop\[fp8\]'\]")):
            te_inductor(ub_graph(), [torch.randn(2)])
    assert inductor.call_count == 0


LINEAR_CFG = dict(ub_name="proj", fp8=False, tp_size=2, ub_overlap_rs_fprop=True, ub_overlap_ag_dgrad=False,
                  is_grad_enabled=False, fp8_output=False, output_quantizer=None)


def _report(graph_id, *facts):
    """A compile report whose Dynamo stage returned ``facts`` (typed pass facts)."""
    from te_passes.report import CompileReport, PassRun, StageReport
    return CompileReport(graph_id, stages=[StageReport(graph_id, "dynamo", runs=[
        PassRun("fold_ub_predicates", "dynamo", facts=list(facts))])])


def test_trace_time_folds_only_need_no_runtime_wrapper():
    """Dynamo's token guard covers values folded while tracing: the compiled graph is returned as is."""
    from te_passes.config import TePassesOptions

    def compiled(*a):
        return a

    trace_only = UbDependence(folds=[guards.UbFold("get_ub_is_fp8", ("proj_fprop", True), True, None, "dynamo_trace")])
    assert ub_graph_guard.wrap_with_te_state_guard(compiled, _report("g900"), capture_te_state(), TePassesOptions(),
                                           dependence=trace_only) is compiled
    checked = UbDependence(checks=[UbCheckSpec("linear", LINEAR_CFG, "linear")])
    wrapped = ub_graph_guard.wrap_with_te_state_guard(compiled, _report("g901"), capture_te_state(), TePassesOptions(),
                                              dependence=checked)
    assert wrapped is not compiled and wrapped.te_ub_guard.dependence.checks[0].config == LINEAR_CFG
    # the dependence comes from the report's facts by default
    assert ub_graph_guard.wrap_with_te_state_guard(compiled, _report("g903", checked), capture_te_state(),
                                           TePassesOptions()).te_ub_guard.dependence.checks == checked.checks
    # an explicit offline snapshot is not guarded against the live registry
    assert ub_graph_guard.wrap_with_te_state_guard(compiled, _report("g902"), capture_te_state(),
                                           TePassesOptions(ub_snapshot={"initialized": False}),
                                           dependence=checked) is compiled


@pytest.mark.parametrize("cudagraphs", [False, True])
def test_ub_op_graph_rerecords_under_cudagraphs(cudagraphs):
    """Re-initialising UB with an *equal* configuration frees the old communicators' buffers: a graph
    with UB TE ops replayed as a CUDA graph must be recompiled (re-recorded); without CUDA graphs the
    op fetches the communicators at run time and the compiled code is kept."""
    pristine = plain_graph()
    recompiled = []

    def recompile(gm, args):
        recompiled.append(([n.op for n in gm.graph.nodes], args))
        return lambda *a: "new"

    guard = UbGuard("gY", lambda *a: "old", UbDependence(checks=[UbCheckSpec("linear", LINEAR_CFG, "linear")],
                                                          pristine=pristine),
                    capture_ub().fingerprint(), "recompile", recompile, cudagraphs=cudagraphs)
    fn = make_guarded(guard)
    assert fn(1) == "old"
    set_ub_registry(dict(FP8_RS))  # new communicator objects, same answers, same fingerprint
    assert fn(2) == ("new" if cudagraphs else "old")
    assert recompiled == ([(["placeholder", "call_function", "output"], [2])] if cudagraphs else [])
    err = UbGuard("gZ", lambda *a: "old", UbDependence(checks=[UbCheckSpec("linear", LINEAR_CFG, "linear")],
                                                        pristine=pristine),
                  capture_ub().fingerprint(), "error", recompile, cudagraphs=cudagraphs)
    fn = make_guarded(err)
    set_ub_registry(dict(FP8_RS))
    if cudagraphs:
        with pytest.raises(UbStateChanged, match="replays TE ops with UB overlap as a CUDA graph"):
            fn(3)
    else:
        assert fn(3) == "old"


# --------------------------------------------------------------------------- real te.Linear
@pytest.mark.parametrize("hooked", [True, False], ids=["te_passes_hooks", "te_unguarded"])
def test_real_te_linear_recompiles_only_when_its_ub_answer_changes(hooked):
    """Two real te.Linear (fake CUDA tensors, CPU): a row-parallel one with reduce-scatter UB
    overlap (its forward asks get_ub_is_fp8) and a plain one. Changing the UB state re-traces only
    the UB one; TE's answer baked into it (fp8_output) follows the new state. Control: with TE's
    own unguarded get_ub_is_fp8 the stale answer stays compiled in."""
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode

    import transformer_engine.pytorch as te
    from te_passes.te import graph_model as gmod
    from te_passes.testing.fake_gpu import fake_gpu, make_recipe

    class NeverRun(Exception):
        pass

    recipe = make_recipe("fp8-cs")
    seen: dict[str, list] = {"ub": [], "plain": []}

    def backend_for(key):
        def backend(gm, example_inputs):
            call = gmod.decode(next(n for n in gm.graph.nodes if gmod.is_te_op_node(n)))
            seen[key].append((call.config["fp8_output"], guards.drain_trace_folds()))

            def never_run(*a):
                raise NeverRun()
            return never_run
        return backend

    fp8_rs = {("proj_fprop", "fp8"): C(fp8_ubuf=True), ("proj_dgrad", "fp8"): C(fp8_ubuf=True)}
    if not hooked:
        _rows.off(*UB_ROWS)
    with contextlib.ExitStack() as restore:
        restore.callback(lambda: [_rows.on(n) for n in UB_ROWS])
        restore.enter_context(fake_gpu("fp8-cs"))
        restore.enter_context(ub_registry(fp8_rs))
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode, mock.patch.object(torch.cuda, "is_available", lambda: True):
            ub_lin = te.Linear(64, 128, params_dtype=torch.bfloat16, device="cuda", bias=False, ub_name="proj",
                               parallel_mode="row", sequence_parallel=True, tp_size=2, ub_overlap_rs=True)
            ub_lin.set_tensor_parallel_group(None)
            plain_lin = te.Linear(64, 128, params_dtype=torch.bfloat16, device="cuda", bias=False)
            x_ub = torch.randn(32, 32, dtype=torch.bfloat16, device="cuda")
            x = torch.randn(32, 64, dtype=torch.bfloat16, device="cuda")

        def run_ub(inp):
            with te.autocast(enabled=True, recipe=recipe):
                return ub_lin(inp)

        def run_plain(inp):
            with te.autocast(enabled=True, recipe=recipe):
                return plain_lin(inp)

        c_ub = torch.compile(run_ub, backend=backend_for("ub"), fullgraph=True, dynamic=False)
        c_plain = torch.compile(run_plain, backend=backend_for("plain"), fullgraph=True, dynamic=False)

        def call_both():
            with mode, torch.no_grad():
                for fn, inp in ((c_ub, x_ub), (c_plain, x)):
                    with pytest.raises(NeverRun):
                        fn(inp)

        call_both()
        call_both()
        set_ub_registry({("proj_fprop", "fp8"): C(fp8_ubuf=False), ("proj_dgrad", "fp8"): C(fp8_ubuf=False)})
        call_both()
        call_both()
    assert len(seen["plain"]) == 1  # the plain te.Linear keeps its graph
    if not hooked:  # TE 2.20.2 alone: no guard, the stale fp8_output=True graph keeps running
        assert [s[0] for s in seen["ub"]] == [True]
        return
    assert [s[0] for s in seen["ub"]] == [True, False]  # fp8_output follows get_ub_is_fp8
    assert [[(f.api, f.args, f.value) for f in s[1]] for s in seen["ub"]] == [
        [("get_ub_is_fp8", ("proj_fprop", True), True)], [("get_ub_is_fp8", ("proj_fprop", True), False)]]


def test_registry_replaced_without_notify_is_seen_at_trace_time():
    """Code that assigns TE's registry directly (no initialize_ub): the next trace re-captures it."""
    modes = te_base.UserBufferQuantizationMode
    te_base._ub_communicators = {("proj_fprop", modes.FP8): C(fp8_ubuf=False)}  # no notify_ub_changed()
    m = UbModel()
    c = torch.compile(m, backend="te_inductor", fullgraph=True)
    x = torch.randn(4)
    torch.testing.assert_close(c(x), torch.cos(x) - 1)
    assert compile_reports()[-1].records("folded")[0].data["value"] is False
    assert compile_reports()[-1].records("ub_mismatch") == []


# --------------------------------------------------------------------------- CUDA graph trees (H200)
gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _cudagraph_stats():
    return {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}


@pytest.mark.gpu
@gpu_only
def test_gpu_dynamo_layer_under_cudagraph_trees():
    """reduce-overhead: the UB model is re-traced (new cudagraph-tree function) after a UB change
    and never replays its stale recording; the plain model keeps replaying its own."""
    from te_passes.testing.gpu import ensure_te_inductor_backend

    ensure_te_inductor_backend()
    ub_model, plain = UbModel(), Plain()
    cu = torch.compile(ub_model, backend="te_inductor", mode="reduce-overhead")
    cp = torch.compile(plain, backend="te_inductor", mode="reduce-overhead")
    x = torch.randn(4096, device="cuda")
    for _ in range(4):  # warm-up, record, replay
        torch.testing.assert_close(cu(x).clone(), torch.sin(x) * 2)
        torch.testing.assert_close(cp(x).clone(), torch.relu(x) + 1)
    assert n_compiles() == 2
    set_ub_registry(BF16_RS)
    for _ in range(4):
        torch.testing.assert_close(cu(x).clone(), torch.cos(x) - 1)
        torch.testing.assert_close(cp(x).clone(), torch.relu(x) + 1)
    assert n_compiles() == 3
    assert counters["inductor"]["cudagraph_skips"] == 0, _cudagraph_stats()


@pytest.mark.gpu
@gpu_only
def test_gpu_graph_guard_recompiles_under_cudagraph_trees():
    """Layer 2 under reduce-overhead: a graph with a folded query is recompiled (re-recorded)
    from its pre-pass copy after a UB change; a graph with UB TE-op checks re-records on an
    equal-answer re-initialisation; the plain graph keeps its recording."""
    x = torch.randn(4096, device="cuda")
    cu = te_inductor(ub_graph(), [x], mode="reduce-overhead")
    cp = te_inductor(plain_graph(), [x], mode="reduce-overhead")
    assert cu.te_ub_guard.cudagraphs is True
    for _ in range(4):
        torch.testing.assert_close(cu(x)[0].clone(), x * 3.0)
        torch.testing.assert_close(cp(x)[0].clone(), torch.relu(x))
    set_ub_registry(BF16_RS)
    for _ in range(4):
        torch.testing.assert_close(cu(x)[0].clone(), x * 0.5)
        torch.testing.assert_close(cp(x)[0].clone(), torch.relu(x))
    assert cu.te_ub_guard.recompiles == 1 and n_compiles() == 3

    # a graph with a UB TE-op check (stand-in: the plain graph + the linear config) re-records on
    # an equal-answer re-initialisation
    dep = UbDependence(checks=[UbCheckSpec("linear", LINEAR_CFG, "linear")],
                       pristine=ub_graph_guard.pristine_copy(plain_graph()))
    from te_passes.config import TePassesOptions

    inner = te_inductor(plain_graph(), [x], mode="reduce-overhead")
    fn = ub_graph_guard.wrap_with_te_state_guard(inner, _report("g_cg", dep), capture_te_state(), TePassesOptions(),
                                         recompile=lambda g, a: te_inductor(g, a, mode="reduce-overhead"),
                                         cudagraphs=True)
    for _ in range(3):
        torch.testing.assert_close(fn(x)[0].clone(), torch.relu(x))
    set_ub_registry(dict(BF16_RS))  # same answers, new communicators
    for _ in range(3):
        torch.testing.assert_close(fn(x)[0].clone(), torch.relu(x))
    assert fn.te_ub_guard.recompiles == 1
    assert counters["inductor"]["cudagraph_skips"] == 0, _cudagraph_stats()
