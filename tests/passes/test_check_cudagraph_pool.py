"""check_cudagraph_pool: planted leaks are named by node and TE role; clean real graphs pass."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.fx

from te_passes.pipeline.base import Stage
from te_passes.passes.check_cudagraph_pool import (CheckCudagraphPool, CudagraphPoolLeakError,
                                                   CudagraphPoolWarning, pool_findings)
from te_passes.analyses.liveness import analyze
from te_passes.pipeline.manager import PassManager, TePassError
from te_passes.testing.harness import pass_context

from _qgraphs import F8, QGEMM, real_aot, record_vals

aten = torch.ops.aten


def _planted():
    """x -> FP8 cast (a quantized temporary) -> opaque gemm; the cast is also set_ into the
    graph input ``stash`` (a buffer the caller keeps), so it outlives the graph."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    w = g.placeholder("w")
    stash = g.placeholder("stash")
    q = g.call_function(aten._to_copy.default, (x,), {"dtype": F8})
    s = g.call_function(aten.set_.source_Tensor, (stash, q))
    ones = g.call_function(aten.ones.default, ([1],))
    y = g.call_function(QGEMM, (q, ones, w))
    g.output((y,))
    gm = torch.fx.GraphModule({}, g)
    record_vals(gm, torch.randn(4, 4), torch.randn(4, 4), torch.empty(0, dtype=F8))
    return gm, q, s


def test_planted_leak_is_flagged_by_node_and_role():
    gm, q, s = _planted()
    with pytest.warns(CudagraphPoolWarning) as rec:
        res = CheckCudagraphPool().run(gm, pass_context(Stage.POST_GRAD_FWD))
    assert not res.modified
    leaks = [r for r in res.records if r.kind == "pool_leak"]
    assert [(r.node, r.data["role"], r.data["bytes"], r.data["at"]) for r in leaks] == \
        [(q.name, "rowwise_data", 16, s.name)]
    assert leaks[0].data["how"] == "set_ into graph input stash"
    msg = str(rec[0].message)
    assert f"node {q.name!r} (quantized rowwise_data, 16 B) escapes at node {s.name!r}" in msg
    assert "Detected 1 tensor(s) in the cudagraph pool not tracked as outputs" in msg
    (summary,) = [r for r in res.records if r.kind == "pool_check"]
    assert summary.data["findings"] == 1


def test_strict_mode_raises_through_the_manager():
    gm, q, _ = _planted()
    with pytest.raises(CudagraphPoolLeakError, match=q.name):
        CheckCudagraphPool().run(gm, pass_context(Stage.POST_GRAD_FWD, strict=True))
    with pytest.raises(TePassError, match="check_cudagraph_pool"):
        PassManager([CheckCudagraphPool()]).run(gm, pass_context(Stage.POST_GRAD_FWD, strict=True))


def test_returning_the_value_or_copying_it_is_clean():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    stash = g.placeholder("stash")
    q = g.call_function(aten._to_copy.default, (x,), {"dtype": F8})
    g.call_function(aten.copy_.default, (stash, q))        # copies data: no alias
    tmp = g.call_function(aten.empty.memory_format, ([0],), {"dtype": F8})
    g.call_function(aten.set_.source_Tensor, (tmp, q))     # internal alias, returned below
    g.output((tmp,))
    gm = torch.fx.GraphModule({}, g)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CudagraphPoolWarning)
        res = CheckCudagraphPool().run(gm, pass_context(Stage.POST_GRAD_FWD))
    assert [r.kind for r in res.records] == ["pool_check"]
    assert res.records[0].data["findings"] == 0


def test_dynamo_level_stores_are_findings():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    obj = g.placeholder("self_module")
    q = g.call_method("to", (x, F8))
    g.call_function(setattr, (obj, "_fp8_cache", q))
    g.output((x,))
    lv = analyze(torch.fx.GraphModule({}, g), stage="dynamo")
    assert [(f["node"], f["how"]) for f in pool_findings(lv)] == [("to", "stored into a Python object by setattr")]


# --------------------------------------------------------------------------- real TE graphs
@pytest.mark.te
@pytest.mark.parametrize("layers", [1, 4])
@pytest.mark.parametrize("precision", ["bf16", "fp8-cs", "mxfp8"])
def test_clean_real_graphs_report_nothing(precision, layers):
    c = real_aot(precision, layers)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CudagraphPoolWarning)
        for gm, stage in ((c.forward, Stage.POST_GRAD_FWD), (c.backward, Stage.POST_GRAD_BWD)):
            rep = PassManager([CheckCudagraphPool()]).run(gm, pass_context(stage, strict=True))
            (run,) = rep.runs
            assert run.status == "ok"
            assert [r.kind for r in run.records] == ["pool_check"]
            assert run.records[0].data["findings"] == 0
            assert run.records[0].data["conservative_alias_nodes"] == []


@pytest.mark.te
@pytest.mark.parametrize("precision", ["fp8-cs", "mxfp8"])
def test_planted_leak_in_a_real_forward_graph(precision):
    """Two planted leaks in the real TE forward: a new FP8 cast of the input stashed into an
    extra graph input, and the saved input transpose (``getitem_2``) dropped from the outputs
    but still stashed — exactly "a quantized temporary kept alive past the graph end"."""
    c = real_aot(precision, 1)
    gm = c.forward
    g = gm.graph
    inp = next(n for n in g.nodes if n.name == "primals_3")
    saved = next(n for n in g.nodes if n.name == "getitem_2")
    out = next(n for n in g.nodes if n.op == "output")
    with g.inserting_after(inp):
        stash1 = g.placeholder("stash_q")
        stash2 = g.placeholder("stash_saved")
    with g.inserting_before(out):
        q = g.call_function(aten._to_copy.default, (inp,), {"dtype": F8})
        q.meta["val"] = inp.meta["val"].to(F8)
        g.call_function(aten.set_.source_Tensor, (stash1, q))
        g.call_function(aten.set_.source_Tensor, (stash2, saved))
    out.args = (tuple(a for a in out.args[0] if a is not saved),)
    gm.recompile()
    # stage-local: the saved buffer is known to be quantized (a TE forward op's saved output)
    with pytest.warns(CudagraphPoolWarning):
        res = CheckCudagraphPool().run(gm, pass_context(Stage.POST_GRAD_FWD))
    leaks = {r.node: r.data for r in res.records if r.kind == "pool_leak"}
    assert set(leaks) == {"getitem_2", q.name}
    assert leaks[q.name]["role"] == "rowwise_data" and leaks[q.name]["how"] == "set_ into graph input stash_q"
    assert leaks["getitem_2"]["role"] == "unknown" and leaks["getitem_2"]["source"] == "te_forward_output"
    # the joint stage of the same compile names that buffer's TE role
    from te_passes.te.quantized import joint_saved_roles

    assert joint_saved_roles(c.joint.graph)["getitem_2"].role == "columnwise_data"
