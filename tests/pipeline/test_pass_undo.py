"""The one rollback: the manager undoes a pass's edit journal (``ctx.journal``) when it fails or is
skipped — on real TE graphs, for every rewrite pass — no graph copy; and liveness shared between the
passes of a stage (``ctx.analyses``); and no pass edits a graph behind the journal's back."""

from __future__ import annotations

import operator
import re

import pytest
import torch
import torch.fx

from te_passes.passes import Stage, TEPass, TEPassResult
from te_passes.passes.hoist_te_constants import HoistTEConstants
from te_passes.passes.remove_quantizer_setattrs import RemoveQuantizerSetattrs
from te_passes.compat.api import capture_te_state
from te_passes.testing.harness import run_passes


def _snapshot(graph: torch.fx.Graph):
    """Everything rollback must restore: order, names, ops, targets, args (by name), meta keys."""
    def ref(a):
        return torch.fx.node.map_arg(a, lambda n: ("node", n.name))
    return [(n.name, n.op, n.target, repr(ref(n.args)), repr(ref(n.kwargs)), sorted(n.meta))
            for n in graph.nodes]


def _leaf_ids(node):
    """ids of the non-container values in a node's args (FX rebuilds the containers)."""
    out = []
    torch.fx.node.map_aggregate(node.args, lambda a: out.append(id(a)) or a)
    return out


class _FailAfter(TEPass):
    """Runs ``inner``, then raises: the manager must undo ``inner``'s rewrite."""

    name = "fail_after"
    stages = frozenset({Stage.DYNAMO, Stage.POST_GRAD_FWD})
    description = "test"

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def run(self, gm, ctx):
        res = self.inner.run(gm, ctx)
        assert res.modified, "the inner pass must rewrite something for this test to mean anything"
        raise RuntimeError("boom after rewriting")


def _run_failing(gm, stage, inner, monkeypatch):
    import te_passes.fx.graph as fx_graph

    copies, copy = [], fx_graph.copy_graph
    monkeypatch.setattr(fx_graph, "copy_graph", lambda g: copies.append(g) or copy(g))
    with pytest.warns(RuntimeWarning, match="boom after rewriting"):
        run = run_passes(gm, _FailAfter(inner), stage, te_state=capture_te_state())
    # undo-based rollback copies nothing; only fold_ub_predicates keeps its pristine Dynamo graph (UB recompiles)
    assert len(copies) == (1 if inner.name == "fold_ub_predicates" and stage is Stage.DYNAMO else 0)
    assert run.report.runs[0].status == "failed"
    assert run.before_code == run.after_code and run.diff() == {}


def test_hoist_dynamo_undo_restores_graph(te_dynamo_graph, monkeypatch):
    """fp8 Dynamo graph: the pass erases quantizer __setattr__ residue; undo re-creates it."""
    cap = te_dynamo_graph(precision="fp8-cs")
    gm = cap.gm
    before = _snapshot(gm.graph)
    assert any(n.op == "call_method" and n.target == "__setattr__" for n in gm.graph.nodes)
    _run_failing(gm, Stage.DYNAMO, RemoveQuantizerSetattrs(), monkeypatch)
    assert _snapshot(gm.graph) == before
    gm.graph.lint()


def test_hoist_post_grad_undo_restores_args(te_aot_graphs, monkeypatch):
    aot = te_aot_graphs(precision="fp8-cs")
    gm = aot.forward
    before = _snapshot(gm.graph)
    ids = [_leaf_ids(n) for n in gm.graph.nodes]
    _run_failing(gm, Stage.POST_GRAD_FWD, HoistTEConstants(), monkeypatch)
    assert _snapshot(gm.graph) == before
    assert [_leaf_ids(n) for n in gm.graph.nodes] == ids  # the original constant objects


def test_undo_recreates_erased_chain():
    """A chain erased tail-first (b uses a) plus an argument replacement comes back exactly."""
    from te_passes.fx.journal import GraphJournal

    g = torch.fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(operator.add, (x, 1))
    b = g.call_function(operator.mul, (a, 2))
    c = g.call_function(operator.sub, (x, b))
    g.output(c)
    before = _snapshot(g)
    log = GraphJournal()
    log.set_args(c, (x, 3), {})
    log.erase(b)
    log.erase(a)
    assert [n.name for n in g.nodes] == ["x", "sub", "output"]
    log.undo()
    assert _snapshot(g) == before
    g.lint()


def test_liveness_shared_within_stage(te_aot_graphs, monkeypatch):
    """insert_early_frees and check_cudagraph_pool analyse an unchanged graph once."""
    import te_passes.analyses.liveness as liveness

    calls = []
    real = liveness.analyze
    monkeypatch.setattr(liveness, "analyze", lambda *a, **k: calls.append(1) or real(*a, **k))
    aot = te_aot_graphs(precision="fp8-cs")
    run = run_passes(aot.forward, None, Stage.POST_GRAD_FWD, te_state=capture_te_state())  # the configured pipeline
    by = {r.name: r for r in run.report.runs}
    assert {"insert_early_frees", "check_cudagraph_pool"} <= set(by)
    assert by["insert_early_frees"].status == by["check_cudagraph_pool"].status == "ok"
    assert not by["insert_early_frees"].changed  # nothing qualifies on TE 2.20.2 te.Linear graphs
    assert len(calls) == 1
    assert run.ctx.analyses == {}  # dropped when the stage ends


def test_analyses_dropped_after_a_change():
    """A pass that changes the graph invalidates shared analyses."""
    seen = []

    class Put(TEPass):
        name = "put"
        stages = frozenset({Stage.DYNAMO})
        analysis_only = True

        def run(self, gm, ctx):
            ctx.analyses["k"] = 1
            return TEPassResult(gm, False)

    class Change(TEPass):
        name = "change"
        stages = frozenset({Stage.DYNAMO})

        def run(self, gm, ctx):
            seen.append(dict(ctx.analyses))
            n = next(n for n in gm.graph.nodes if n.op == "call_function")
            ctx.journal.set_args(n, (n.args[0], n.args[0]))
            return TEPassResult(gm, True)

    class Read(TEPass):
        name = "read"
        stages = frozenset({Stage.DYNAMO})
        analysis_only = True

        def run(self, gm, ctx):
            seen.append(dict(ctx.analyses))
            return TEPassResult(gm, False)

    gm = torch.fx.symbolic_trace(lambda x, y: x + y)
    run = run_passes(gm, [Put(), Change(), Read()], Stage.DYNAMO)
    assert seen == [{"k": 1}, {}]
    assert [(r.name, r.changed) for r in run.report.runs] == [("put", False), ("change", True), ("read", False)]


def test_fold_ub_undo_restores_the_query_nodes(monkeypatch):
    """fold_ub_predicates folds UB query nodes (argument replacements, erasures of the queries and
    of get_ub); the manager's undo of its journal brings every node back exactly."""
    pytest.importorskip("transformer_engine.pytorch")
    import transformer_engine.pytorch.module.base as te_base

    from te_passes.passes.fold_ub_predicates import FoldUbPredicates
    from te_passes.testing.ub import StandInCommunicator, ub_registry

    g = torch.fx.Graph()
    x = g.placeholder("x")
    ub = g.call_function(te_base.get_ub, ("proj_fprop", True))
    q = g.call_method("is_fp8_ubuf", (ub,))
    nq = g.call_function(operator.not_, (q,))
    g.output((g.call_function(operator.add, (x, nq)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    before = _snapshot(gm.graph)
    with ub_registry({("proj_fprop", "fp8"): StandInCommunicator(fp8_ubuf=True, tp_size=2)}):
        _run_failing(gm, Stage.DYNAMO, FoldUbPredicates(), monkeypatch)
    assert _snapshot(gm.graph) == before
    gm.graph.lint()


#: Direct graph edits a pass must make through ``ctx.journal`` instead (what the manager undoes).
DIRECT_EDITS = re.compile(
    r"\.(args|kwargs|target|meta)\s*=[^=]|\.meta\[[^\]]+\]\s*=[^=]|\.meta\.(pop|update|setdefault|clear)\("
    r"|\berase_node\(|\binserting_(before|after)\(|\bgraph\.(call_function|call_method|call_module|create_node"
    r"|placeholder|get_attr|output)\(|\.replace_all_uses_with\(|\.replace_input_with\(|\._remove_from_list\(")


def test_passes_edit_graphs_only_through_the_journal():
    """No module of te_passes/passes/ assigns ``node.args`` / ``kwargs`` / ``target`` / ``meta``,
    erases or inserts nodes itself: every edit goes through ``ctx.journal`` (te_passes.fx.journal),
    so the manager can undo it exactly."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "te_passes" / "passes"
    found = [f"{p.name}:{i}: {line.strip()}" for p in sorted(root.glob("*.py"))
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if DIRECT_EDITS.search(line.split("#")[0]) and not line.lstrip().startswith(("#", "``", "%"))]
    assert found == [], f"edit graphs through ctx.journal: {found}"
    # the check sees what it looks for
    for bad in ("node.args = (a,)", "n.target = t", "n.meta['k'] = 1", "graph.erase_node(n)",
                "with graph.inserting_after(n):", "graph.call_function(f, ())", "n.replace_all_uses_with(m)",
                "n.meta.pop('k')"):
        assert DIRECT_EDITS.search(bad), bad
    for ok in ("ctx.journal.set_args(n, a)", "x == n.target", "if n.args == b:", "n.meta.get('val')"):
        assert not DIRECT_EDITS.search(ok), ok
