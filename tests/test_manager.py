"""PassManager: disable switches, rollback, strict mode, lint, records, observers, logging."""

from __future__ import annotations

import logging
import operator
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.fx

from te_passes.config import TePassesOptions
from te_passes.passes import PassContext, PassRecord, PassSkipped, Stage, TEPass, TEPassResult
from te_passes.pipeline.manager import PassManager, TePassError, copy_graph, restore_graph
from te_passes.te.state import TEState
from te_passes.testing.harness import pass_context


def _gm():
    def f(x, y):
        a = x + y
        b = a * 2
        return torch.relu(b) - y
    return torch.fx.symbolic_trace(f)


class MulToAdd(TEPass):
    """Rewrites ``a * 2`` into ``a + a`` (a real rewrite, to test the manager)."""

    name = "mul_to_add"
    stages = frozenset({Stage.DYNAMO})
    description = "x * 2 -> x + x"

    def run(self, gm, ctx):
        recs = []
        for n in list(gm.graph.nodes):
            if n.op == "call_function" and n.target is operator.mul and n.args[1] == 2:
                with gm.graph.inserting_before(n):
                    new = gm.graph.call_function(operator.add, (n.args[0], n.args[0]))
                n.replace_all_uses_with(new)
                gm.graph.erase_node(n)
                recs.append(PassRecord("rewrote", new.name, {"from": n.name}))
        return TEPassResult(gm, bool(recs), recs)


class Explodes(TEPass):
    """Mutates the graph half-way, then raises: the manager must restore the graph."""

    name = "explodes"
    stages = frozenset({Stage.DYNAMO})
    description = "breaks mid-rewrite"

    def run(self, gm, ctx):
        for n in list(gm.graph.nodes):
            if n.op == "call_function" and n.target is torch.relu:
                n.replace_all_uses_with(n.args[0])
                gm.graph.erase_node(n)
                break
        raise ValueError("boom")


class Refuses(TEPass):
    name = "refuses"
    stages = frozenset({Stage.DYNAMO})
    description = "cannot prove safety"

    def run(self, gm, ctx):
        raise PassSkipped("operand observed elsewhere")


class LeavesBadGraph(TEPass):
    """Leaves a node using a value defined after it: graph.lint() must catch it."""

    name = "bad_graph"
    stages = frozenset({Stage.DYNAMO})
    description = "produces an invalid graph"

    def run(self, gm, ctx):
        nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
        first, last = nodes[0], nodes[-1]
        first.args = (last, first.args[1])
        return TEPassResult(gm, True)


def _code(gm):
    return gm.code


def test_rewrite_pass_runs_and_records():
    gm = _gm()
    x, y = torch.randn(4), torch.randn(4)
    ref = gm(x, y)
    rep = PassManager([MulToAdd()]).run(gm, pass_context(Stage.DYNAMO))
    (run,) = rep.runs
    assert (run.name, run.stage, run.status, run.changed) == ("mul_to_add", "dynamo", "ok", True)
    assert run.nodes_before == run.nodes_after == 7
    assert [(r.kind, r.node, r.data) for r in run.records] == [("rewrote", "add_1", {"from": "mul"})]
    assert run.time_ms > 0
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [
        operator.add, operator.add, torch.relu, operator.sub]
    torch.testing.assert_close(gm(x, y), ref)


def test_disabled_by_option_and_env(monkeypatch):
    gm = _gm()
    before = _code(gm)
    rep = PassManager([MulToAdd()]).run(gm, pass_context(Stage.DYNAMO, disable=("mul_to_add",)))
    assert rep.runs[0].status == "disabled" and _code(gm) == before

    monkeypatch.setenv("TE_PASSES_DISABLE", "mul_to_add, other")
    opts, rest = TePassesOptions.parse({"te_passes.strict": False, "max_autotune": True})
    assert opts.disable == ("mul_to_add", "other") and rest == {"max_autotune": True}
    opts, _ = TePassesOptions.parse({"te_passes.disable": ["x"]})
    assert opts.disable == ("x", "mul_to_add", "other")


def test_failing_pass_restores_graph_and_warns():
    gm = _gm()
    x, y = torch.randn(4), torch.randn(4)
    ref, before = gm(x, y), _code(gm)
    with pytest.warns(RuntimeWarning, match=r"pass 'explodes' failed on graph g0 at stage dynamo \(ValueError: boom\)"):
        rep = PassManager([Explodes(), MulToAdd()]).run(gm, pass_context(Stage.DYNAMO))
    assert [r.status for r in rep.runs] == ["failed", "ok"]
    assert rep.runs[0].error == "ValueError: boom"
    assert "relu" in _code(gm) and _code(gm) != before  # restored, then MulToAdd ran
    torch.testing.assert_close(gm(x, y), ref)


def test_strict_raises():
    gm = _gm()
    with pytest.raises(TePassError, match="explodes"):
        PassManager([Explodes()]).run(gm, pass_context(Stage.DYNAMO, strict=True))
    assert "relu" in _code(gm)


def test_skipped_is_recorded_not_warned(recwarn):
    gm = _gm()
    rep = PassManager([Refuses()]).run(gm, pass_context(Stage.DYNAMO))
    (run,) = rep.runs
    assert run.status == "skipped" and run.records[0].to_json() == {
        "kind": "skipped", "node": None, "reason": "operand observed elsewhere"}
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_lint_failure_rolls_back():
    gm = _gm()
    before = _code(gm)
    with pytest.warns(RuntimeWarning, match="bad_graph"):
        rep = PassManager([LeavesBadGraph()]).run(gm, pass_context(Stage.DYNAMO))
    assert rep.runs[0].status == "failed"
    assert _code(gm) == before
    gm.graph.lint()


def _has_mul(gm):
    return any(n.target is operator.mul for n in gm.graph.nodes)


def test_observers_see_before_and_after():
    seen = []

    class Obs:
        def before_pass(self, gm, p, ctx):
            seen.append(("before", p.name, _has_mul(gm)))

        def after_pass(self, gm, p, ctx, run):
            seen.append(("after", p.name, _has_mul(gm), run.changed))

    PassManager([MulToAdd()], observers=[Obs()]).run(_gm(), pass_context(Stage.DYNAMO))
    assert seen == [("before", "mul_to_add", True), ("after", "mul_to_add", False, True)]


def test_copy_and_restore_graph_roundtrip():
    gm = _gm()
    backup = copy_graph(gm.graph)
    for n in reversed([n for n in gm.graph.nodes if n.op == "call_function"]):
        n.replace_all_uses_with(list(gm.graph.nodes)[0])
        gm.graph.erase_node(n)
    restore_graph(gm.graph, backup)
    gm.recompile()
    x, y = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(gm(x, y), torch.relu((x + y) * 2) - y)


def test_uuid_covers_source_and_config():
    a, b = MulToAdd(), MulToAdd(threshold=1)
    assert a.uuid() == MulToAdd().uuid() != b.uuid()
    assert len(a.uuid()) == 64


def test_torch_logs_enables_debug_log():
    code = textwrap.dedent("""
        import torch, torch.fx
        from te_passes.config import TePassesOptions
        from te_passes.passes import PassContext, Stage
        from te_passes.pipeline.manager import PassManager
        from te_passes.te.state import TEState
        from tests.test_manager import MulToAdd, _gm
        PassManager([MulToAdd()]).run(_gm(), PassContext(Stage.DYNAMO, TePassesOptions(), TEState()))
    """)
    env = dict(os.environ, TORCH_LOGS="+te_passes")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "g0[dynamo] mul_to_add: ok changed=True" in proc.stderr


def test_trace_structured_artifact_written(tmp_path):
    code = textwrap.dedent("""
        import torch
        from tests.test_manager import MulToAdd
        import te_passes.pipeline.registry as reg
        reg.default_passes = lambda: [MulToAdd()]
        reg.pass_names = lambda: ["mul_to_add"]
        import te_passes.backend as b
        b.pass_names = reg.pass_names
        f = torch.compile(lambda x: torch.relu(x * 2), backend=b.te_inductor)
        with torch.no_grad():
            f(torch.ones(3))
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TORCH_TRACE=str(tmp_path), PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = "".join(p.read_text() for p in tmp_path.iterdir())
    assert "te_passes_g0_dynamo_mul_to_add" in text


class LazyRewrite(MulToAdd):
    """Checkpoints only when it has something to rewrite."""

    name = "lazy_rewrite"
    checkpoints_itself = True

    def run(self, gm, ctx):
        if any(n.target is operator.mul for n in gm.graph.nodes):
            ctx.checkpoint()
            return super().run(gm, ctx)
        return TEPassResult(gm, False)


def test_lazy_checkpoint_copies_only_when_rewriting(monkeypatch):
    import te_passes.pipeline.manager as mgr

    copies = []
    real = mgr.copy_graph
    monkeypatch.setattr(mgr, "copy_graph", lambda g: copies.append(1) or real(g))
    gm = _gm()
    PassManager([LazyRewrite(), LazyRewrite()]).run(gm, pass_context(Stage.DYNAMO))  # 2nd run finds nothing
    assert len(copies) == 1
    PassManager([MulToAdd()]).run(_gm(), pass_context(Stage.DYNAMO))  # not self-checkpointing: copies up front
    assert len(copies) == 2
