"""The UB snapshot is part of a graph's pipeline uuid (Inductor FX-graph-cache key) only when
the graph reads UB state (te_passes.compat.ub.graph_guard.ub_state_reads, te_passes.backend.pipeline_uuid):
after a UB change, graphs that never look at UB state keep their uuid and hit the FX graph
cache; graphs that do still change their key. Also: the backward TE op's ``ub_overlap_ag``
flag (TE 2.20.2 ``LinearBwdArgs``) counts as UB use (graph_model.UB_CONFIG_KEYS).

CPU only: hand-built FX graphs and real te.Linear graphs captured with fake CUDA tensors; TE's
UB registry holds stand-in communicators (te_passes.testing.ub).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.fx
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config
from torch._inductor.utils import fresh_cache

pytest.importorskip("transformer_engine")
import transformer_engine.pytorch.module.base as te_base  # noqa: E402
from _ubgraphs import BF16_RS, FP8_RS, Plain, UbModel, fresh_ub_compiles, plain_graph, ub_graph  # noqa: E402

from te_passes.backend import te_inductor  # noqa: E402
from te_passes.report import compile_reports  # noqa: E402
from te_passes.te import graph_model as gmod  # noqa: E402
from te_passes.compat.ub import guard as guards  # noqa: E402
from te_passes.compat.ub import graph_guard as ub_graph_guard  # noqa: E402
from te_passes.compat.api import capture_te_state
from te_passes.testing.ub import StandInCommunicator as C, set_ub_registry, ub_registry  # noqa: E402

pytestmark = pytest.mark.te

#: FP8_RS plus a buffer no graph here uses: a UB change that keeps every folded answer.
FP8_RS_PLUS = {**FP8_RS, ("fc1_fprop", "fp8"): C(fp8_ubuf=True)}


@pytest.fixture(autouse=True)
def fresh():
    with fresh_ub_compiles(FP8_RS):
        yield




def _uuid(build):
    x = torch.randn(8)
    te_inductor(build(), [x])
    return compile_reports()[-1].uuid


def test_non_ub_graph_keeps_its_uuid_across_a_ub_change_ub_graph_does_not():
    plain_a, ub_a = _uuid(plain_graph), _uuid(ub_graph)
    assert plain_a["reads_ub"] is False and plain_a["ub_reads"] == []
    assert ub_a["reads_ub"] is True
    assert ub_a["ub_reads"] == ["fold_ub_predicates folded UB queries: get_ub.is_fp8_ubuf('proj_fprop', True)"]
    state = capture_te_state()
    assert plain_a["te_state"] == state.fingerprint(include_ub=False) != state.fingerprint()
    assert ub_a["te_state"] == state.fingerprint()

    for registry in (BF16_RS, FP8_RS_PLUS):  # the folded answer changes / stays the same
        set_ub_registry(registry)
        plain_b, ub_b = _uuid(plain_graph), _uuid(ub_graph)
        assert plain_b["uuid"] == plain_a["uuid"]
        assert ub_b["uuid"] != ub_a["uuid"]  # safe: any UB change re-keys a graph that reads UB state
        assert ub_b["te_state"] == capture_te_state().fingerprint()


def test_unknown_ub_use_keeps_the_ub_snapshot_in_the_uuid():
    """pipeline_uuid without ub_reads (offline, not determined) includes the UB snapshot."""
    from te_passes.pipeline.compilation import pipeline_uuid
    from te_passes.config import TePassesOptions
    from te_passes.passes.order import default_passes

    m, opts = default_passes(), TePassesOptions()
    a = pipeline_uuid(m, opts, capture_te_state())
    set_ub_registry(BF16_RS)
    b = pipeline_uuid(m, opts, capture_te_state())
    assert a["reads_ub"] is True and a["ub_reads"] is None and a["uuid"] != b["uuid"]
    assert pipeline_uuid(m, opts, capture_te_state(), ub_reads=[])["uuid"] == \
        pipeline_uuid(m, opts, capture_te_state(), ub_reads=[])["uuid"]


def _hits_misses():
    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


def test_fx_graph_cache_hit_for_non_ub_graph_after_ub_change():
    """End to end through torch.compile and Inductor's FX graph cache: after a UB change that
    keeps UbModel's folded answer (so its graph is the same), a recompiled plain model hits
    the cache, UbModel misses (its key covers the UB snapshot)."""
    x = torch.randn(8)
    with fresh_cache(), inductor_config.patch(fx_graph_cache=True, fx_graph_remote_cache=False):
        def compile_both():
            torch._dynamo.reset()
            with torch.no_grad():
                torch.testing.assert_close(torch.compile(Plain(), backend="te_inductor")(x), torch.relu(x) + 1)
                torch.testing.assert_close(torch.compile(UbModel(), backend="te_inductor")(x), torch.sin(x) * 2)

        compile_both()
        assert _hits_misses() == (0, 2)
        plain, ub = compile_reports()
        assert plain.uuid["reads_ub"] is False
        assert ub.uuid["ub_reads"] == ["fold_ub_predicates folded UB queries: get_ub_is_fp8('proj_fprop', True)"]
        set_ub_registry(FP8_RS_PLUS)
        compile_both()
        assert _hits_misses() == (1, 3)
        plain2, ub2 = compile_reports()[2:]
        assert plain2.uuid["uuid"] == plain.uuid["uuid"] and ub2.uuid["uuid"] != ub.uuid["uuid"]
        assert [s.stage for s in plain2.stages] == ["dynamo"]  # cache hit: no post-grad stage ran
        assert "post_grad_fwd" in [s.stage for s in ub2.stages]


# --------------------------------------------------------------------------- real te.Linear graphs
ROW_UB = dict(ub_name="proj", parallel_mode="row", sequence_parallel=True, tp_size=2, ub_overlap_rs=True,
              ub_overlap_ag=True)
ROW_BUFFERS = {("proj_fprop", "none"): C(), ("proj_dgrad", "none"): C()}


@pytest.fixture(scope="module")
def ub_linear_aot():
    from te_passes.testing.capture import capture_aot

    with ub_registry(ROW_BUFFERS):
        return capture_aot("linear", "bf16", **ROW_UB)


def test_backward_ub_overlap_ag_is_a_ub_config_key(ub_linear_aot):
    """TE 2.20.2 LinearBwdArgs.ub_overlap_ag (= the forward's ub_overlap_ag_dgrad) is the only UB
    flag set on the backward op of a row-parallel te.Linear(ub_overlap_rs=True, ub_overlap_ag=True)."""
    assert "ub_overlap_ag" in gmod.UB_CONFIG_KEYS
    assert len(set(gmod.UB_CONFIG_KEYS)) == len(gmod.UB_CONFIG_KEYS)
    assert gmod.CONFIG_FIELD_GROUPS["userbuffers"] == ("ub_name", *gmod.UB_CONFIG_KEYS)
    (fwd,) = gmod.te_op_calls(ub_linear_aot.forward.graph)
    (bwd,) = gmod.te_op_calls(ub_linear_aot.backward.graph)
    assert (fwd.op, bwd.op) == ("linear", "linear_backward")
    assert fwd.ub_config() == {"ub_name": "proj", "ub_overlap_ag_fprop": False, "ub_overlap_rs_fprop": True,
                               "ub_overlap_ag_dgrad": True, "ub_overlap_rs_dgrad": False, "ub_bulk_dgrad": False,
                               "ub_bulk_wgrad": False}
    assert bwd.ub_config() == {"ub_name": "proj", "ub_overlap_rs_dgrad": False, "ub_bulk_dgrad": False,
                               "ub_bulk_wgrad": False, "ub_overlap_ag": True}
    assert bwd.uses_ub()
    assert ub_graph_guard.ub_state_reads(ub_linear_aot.backward) == [
        f"TE op {bwd.node.name} (linear_backward) sets ub_overlap_ag"]
    assert {k: v for k, v in bwd.ub_config().items() if v} == {"ub_name": "proj", "ub_overlap_ag": True}


def test_real_te_linear_dynamo_graphs(ub_linear_aot):
    """The Dynamo graph of a UB te.Linear reads UB state (its op sets UB flags); a plain one does not."""
    from te_passes.testing.capture import capture_dynamo

    gm = ub_linear_aot.dynamo.gm
    (call,) = gmod.te_op_calls(gm.graph)
    assert ub_graph_guard.ub_state_reads(gm) == [
        f"TE op {call.node.name} (linear) sets ub_overlap_rs_fprop, ub_overlap_ag_dgrad"]
    plain = capture_dynamo("linear", "bf16")
    assert ub_graph_guard.ub_state_reads(plain.gm) == []


def _dependence(rep):
    """The UB dependence fold_ub_predicates returned (a typed fact of its run)."""
    return ub_graph_guard.UbDependence.merged(f for r in rep.runs for f in r.facts
                                              if isinstance(f, ub_graph_guard.UbDependence))


@pytest.mark.parametrize("disable", [(), ("fold_ub_predicates",)], ids=["all_passes", "fold_disabled"])
def test_ub_reads_seen_after_the_dynamo_stage_passes(disable):
    """What te_inductor sees: the fp8 Dynamo graph after the Dynamo-stage passes (constants
    hoisted, UB config checked) still reads UB state — also with fold_ub_predicates disabled
    (the TE op's UB flags alone count); the plain fp8 te.Linear's graph does not."""
    from te_passes.config import TePassesOptions
    from te_passes.pipeline.base import Stage
    from te_passes.testing.capture import capture_dynamo, run_pipeline

    fp8 = {("proj_fprop", "fp8"): C(fp8_ubuf=True), ("proj_fprop", "none"): C(), ("proj_dgrad", "fp8"): C(),
           ("proj_dgrad", "none"): C()}
    opts = TePassesOptions(disable=tuple(disable))
    with ub_registry(fp8):
        ub_cap = capture_dynamo("linear", "fp8-cs", **ROW_UB)
        (rep,) = run_pipeline(ub_cap, [Stage.DYNAMO], options=opts, graph_id="g_ubdyn")
        (plain_rep,) = run_pipeline(capture_dynamo("linear", "fp8-cs"), [Stage.DYNAMO], options=opts,
                                    graph_id="g_plaindyn")
    assert [r.name for r in rep.runs if r.status == "ok"] == \
        [n for n in ("find_autocast_state", "check_cudagraph_hazard", "fold_ub_predicates", "fold_recipe_lookups",
                     "remove_quantizer_setattrs", "find_ub_state_reads") if n not in disable]
    (call,) = gmod.te_op_calls(rep.gm.graph)
    reasons = ub_graph_guard.ub_state_reads(rep.gm, _dependence(rep))
    flags = f"TE op {call.node.name} (linear) sets ub_overlap_rs_fprop, ub_overlap_ag_dgrad"
    if disable:
        assert reasons == [flags]
    else:
        assert reasons[-1] == flags
        assert f"fold_ub_predicates checked the UB configuration of TE ops {call.node.name}" in reasons
    assert ub_graph_guard.ub_state_reads(plain_rep.gm, _dependence(plain_rep)) == []
    # what the pipeline reads: the find_ub_state_reads analysis' fact, the same sentences
    from te_passes.pipeline.facts import UbStateReads

    assert [f.reasons for r in rep.runs for f in r.facts if isinstance(f, UbStateReads)] == [tuple(reasons)]
    assert [f.reasons for r in plain_rep.runs for f in r.facts if isinstance(f, UbStateReads)] == [()]


def test_index_md_says_which_graphs_read_ub_state(tmp_path):
    from te_passes.debug.dump_sessions import session_id

    x = torch.randn(8)
    te_inductor(plain_graph(), [x], options={"te_passes.dump_dir": str(tmp_path)})
    te_inductor(ub_graph(), [x], options={"te_passes.dump_dir": str(tmp_path)})
    plain, ub = compile_reports()
    index = (tmp_path / session_id() / "index.md").read_text()
    rows = {ln.split("|")[1].strip(): ln.split("|")[-2].strip() for ln in index.splitlines()
            if ln.startswith(f"| {plain.graph_id} |") or ln.startswith(f"| {ub.graph_id} |")}
    assert rows[plain.graph_id] == "no" and rows[ub.graph_id] == "yes"
    assert (f"- {ub.graph_id}: fold_ub_predicates folded UB queries: get_ub.is_fp8_ubuf('proj_fprop', True)"
            in index.splitlines())
    assert f"- {plain.graph_id}:" not in index


def test_query_nodes_left_unfolded_count_as_ub_reads():
    """fold_ub_predicates disabled everywhere: the query nodes stay in the graph, and the graph
    still reads UB state (its uuid changes with it)."""
    off = {"te_passes.disable": ["fold_ub_predicates"]}
    gm = ub_graph()
    reasons = ub_graph_guard.ub_state_reads(gm)
    assert reasons == ["UB query node get_ub (get_ub)", "UB query node is_fp8_ubuf (get_ub.is_fp8_ubuf)"]
    x = torch.randn(8)
    te_inductor(ub_graph(), [x], options=off)
    a = compile_reports()[-1].uuid
    set_ub_registry(FP8_RS_PLUS)
    te_inductor(ub_graph(), [x], options=off)
    b = compile_reports()[-1].uuid
    assert a["ub_reads"] == reasons and a["uuid"] != b["uuid"]
