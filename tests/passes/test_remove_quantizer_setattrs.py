"""Pass ``remove_quantizer_setattrs``: the ``__setattr__`` residue Dynamo leaves on TE quantizers
removed where no op observes it. Hand-built graphs run through ``torch.fx.Interpreter`` (in-memory
objects) before and after; real Dynamo graphs from ``te_passes.testing.capture`` (Float8CurrentScaling
and MXFP8 te.Linear, 1 and 4 layers)."""

from __future__ import annotations


import pytest

torch = pytest.importorskip("torch")
te_recipe = pytest.importorskip("transformer_engine.common.recipe")
te = pytest.importorskip("transformer_engine.pytorch")

import torch.fx  # noqa: E402

from te_passes.pipeline.base import Stage  # noqa: E402
from te_passes.te.graph_scan import find_recipe_and_pg_objects, object_occurrences  # noqa: E402
from te_passes.te import recipes  # noqa: E402
from te_passes.te.graph_constants import TEConstKind, bundle_dict, te_const_kind  # noqa: E402

from _recipe_passes import (_runtime, X, consume, gm_of, kinds, new_graph, ops, run_pass,  # noqa: E402,F401 (_runtime: autouse fixture)
                            use_quantizer)


# --------------------------------------------------------------------------- 2. __setattr__ residue
def _cs_quantizer(**fields):
    q = te.Float8CurrentScalingQuantizer(te.DType.kFloat8E4M3 if hasattr(te, "DType") else 7, device=torch.device("cpu"))
    for k, v in fields.items():
        setattr(q, k, v)
    return q


def _setattr_graph(recv, field, value, observer=None):
    g, x = new_graph()
    g.call_method("__setattr__", (recv, field, value))
    y = g.call_function(use_quantizer, (x, observer)) if observer is not None else x
    g.output(y)
    return gm_of(g)


def _interp(gm):
    return torch.fx.Interpreter(gm).run(X)


def test_setattr_on_unobserved_receiver_is_removed_even_if_it_changes_a_field():
    q = _cs_quantizer(columnwise_usage=True)
    gm = _setattr_graph(q, "columnwise_usage", False)
    res = run_pass(gm, recipes.Fp8State())
    assert ops(gm) == [("placeholder", "x"), ("output", "output")]
    (rec,) = res.records
    assert rec.kind == "folded_setattr" and rec.data["reason"] == "receiver is not observed by any other node"
    assert q.columnwise_usage is True  # the constant object itself is not mutated


def test_noop_setattr_on_observed_receiver_is_removed():
    q = _cs_quantizer(columnwise_usage=False, internal=True)
    gm = _setattr_graph(q, "columnwise_usage", False, observer=q)
    expected = _interp(gm)
    res = run_pass(gm, recipes.Fp8State())
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "call_function", "output"]
    assert torch.equal(_interp(gm), expected)
    assert res.records[0].data["reason"].startswith("no-op: writes the value the constant already holds")


@pytest.mark.parametrize("value, change, factor", [(False, "from True to False", 3.0),
                                                   (1, "from True to 1, equal but of type int", 2.0)],  # True == 1
                         ids=["value", "type-only"])
def test_changing_setattr_on_observed_receiver_is_kept(value, change, factor):
    q = _cs_quantizer(columnwise_usage=True)
    gm = _setattr_graph(q, "columnwise_usage", value, observer=q)
    before = gm.code
    res = run_pass(gm, recipes.Fp8State())
    assert gm.code == before and res.modified is False
    (rec,) = res.records
    assert rec.kind == "kept" and "also used by use_quantizer" in rec.data["reason"]
    assert rec.data["reason"].endswith(f"changes columnwise_usage {change}")
    # In-memory semantics are what they were: the observer sees the written value.
    assert torch.equal(_interp(gm), X * factor)


def test_equal_but_distinct_observer_does_not_block_removal_and_is_untouched():
    q_recv = _cs_quantizer(columnwise_usage=True)
    q_obs = _cs_quantizer(columnwise_usage=True)
    assert q_recv == q_obs and q_recv is not q_obs  # value-equal, distinct objects
    gm = _setattr_graph(q_recv, "columnwise_usage", False, observer=q_obs)
    expected = _interp(gm)  # mutates q_recv only
    key_before = q_obs._value_key()
    res = run_pass(gm, recipes.Fp8State())
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "call_function", "output"]
    assert res.records[0].data["reason"] == "receiver is not observed by any other node"
    assert q_obs._value_key() == key_before and torch.equal(_interp(gm), expected)


def test_used_setattr_result_is_kept():
    q = _cs_quantizer()
    g, x = new_graph()
    s = g.call_method("__setattr__", (q, "internal", True))
    g.output(g.call_function(consume, (x, s)))
    gm = gm_of(g)
    before = gm.code
    res = run_pass(gm, recipes.Fp8State())
    assert gm.code == before and res.records[0].kind == "kept"
    assert "not side-effect-only" in res.records[0].data["reason"]


# --------------------------------------------------------------------------- real Dynamo graphs
def _bundle_quantizer_snapshot(gm):
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and "transformer_engine_compile" in str(n.target):
            for i, a in enumerate(n.args):
                if te_const_kind(a) is TEConstKind.BUNDLE:
                    for k, v in bundle_dict(a).items():
                        if te_const_kind(v) is TEConstKind.QUANTIZER:
                            out.append((n.name, i, k, id(v), v._value_key()))
    return out


@pytest.mark.parametrize("precision,layers,n_setattr,n_noop", [
    ("fp8-cs", 1, 23, 10), ("mxfp8", 1, 23, 10), ("fp8-cs", 4, None, None), ("mxfp8", 4, None, None)])
def test_real_dynamo_graph_setattr_chains_gone_bundles_unchanged(te_dynamo_graph, precision, layers, n_setattr, n_noop):
    cap = te_dynamo_graph(precision, layers)
    gm = cap.gm
    setattrs = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "__setattr__"]
    if n_setattr is not None:  # after TE's lazy init at compile start (the capture loads what the backend
        # loads, session 19): 17 on the module's quantizers, + 6 of the per-call copies the op gets (row
        # autocast.traced_quantizer_copies, session 20: copy() writes internal / optimize_for_gemm; the 10 no-ops
        # are the copies' writes); a trace without either (shared/reference/.../linear_fp8_cs_dynamo.txt) has 23
        assert len(setattrs) == n_setattr
    assert setattrs and all(te_const_kind(n.args[0]) is TEConstKind.QUANTIZER for n in setattrs)
    # The receivers: some are the very objects in the op bundles / outputs (identity), others
    # only equal to them. Both occur in real graphs.
    occ = object_occurrences(gm.graph)
    shared = [n for n in setattrs if any(u.op != "call_method" for u, _ in occ[id(n.args[0])])]
    assert 0 < len(shared) < len(setattrs)
    rest = [(n.op, str(n.target), n.name) for n in gm.graph.nodes if n not in setattrs]
    bundles = _bundle_quantizer_snapshot(gm)
    assert bundles
    res = run_pass(gm)
    assert [(n.op, str(n.target), n.name) for n in gm.graph.nodes] == rest
    assert _bundle_quantizer_snapshot(gm) == bundles  # same objects, same values
    folded = [r for r in res.records if r.kind == "folded_setattr"]
    assert len(folded) == len(setattrs) and kinds(res) == {"folded_setattr": len(setattrs)}
    noop = [r for r in folded if r.data["reason"].startswith("no-op")]
    assert len(noop) == len(shared)
    if n_noop is not None:
        assert len(noop) == n_noop
    assert find_recipe_and_pg_objects(gm) == []
    assert "__setattr__" not in gm.code


def test_pass_runs_in_the_pipeline_on_real_graphs(te_dynamo_graph):
    from te_passes.testing.capture import run_pipeline

    cap = te_dynamo_graph("fp8-cs", 1)
    reports = run_pipeline(cap, [Stage.DYNAMO])
    runs = {r.name: r for rep in reports for r in rep.runs}
    fold, setattrs = runs["fold_recipe_lookups"], runs["remove_quantizer_setattrs"]
    assert fold.status == "ok" and not fold.changed and fold.records == []  # Dynamo inlined the lookups
    assert setattrs.status == "ok" and setattrs.changed
    assert len(setattrs.records) == 23  # TE's lazy init ran at compile start, as under te_inductor (17), + 6 on
    # the per-call quantizer copies (row autocast.traced_quantizer_copies)
    assert "hoist_te_constants" not in runs  # post-grad only


