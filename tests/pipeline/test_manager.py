"""PassManager: disable switches, the edit journal and its undo (the one rollback), strict mode,
lint, records, observers (the PassObserver base), provenance, logging."""

from __future__ import annotations

import dataclasses
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
from te_passes.pipeline.base import PassConfig
from te_passes.pipeline.manager import PassManager, PassObserver, TePassError
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
                new = ctx.journal.call_function(operator.add, (n.args[0], n.args[0]), before=n)
                ctx.journal.replace_uses(n, new)
                ctx.journal.erase(n)
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
                ctx.journal.replace_uses(n, n.args[0])
                ctx.journal.erase(n)
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
        ctx.journal.set_args(first, (last, first.args[1]))
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

    class Obs(PassObserver):  # the base's other hooks are no-ops
        def before_pass(self, gm, p, ctx):
            seen.append(("before", p.name, _has_mul(gm)))

        def after_pass(self, gm, p, ctx, run):
            seen.append(("after", p.name, _has_mul(gm), run.changed))

        def after_stage(self, gm, ctx, report):
            seen.append(("stage", ctx.stage.value, len(report.runs)))

    PassManager([MulToAdd()], observers=[Obs()]).run(_gm(), pass_context(Stage.DYNAMO))
    assert seen == [("before", "mul_to_add", True), ("after", "mul_to_add", False, True), ("stage", "dynamo", 1)]


def _exact(graph):
    """Everything an undo must restore: order, names, ops, targets, args/kwargs (by name), meta."""
    ref = lambda a: torch.fx.node.map_arg(a, lambda n: ("node", n.name))  # noqa: E731
    return [(n.name, n.op, n.target, repr(ref(n.args)), repr(ref(n.kwargs)), dict(n.meta)) for n in graph.nodes]


class EditsEverything(TEPass):
    """Every kind of journal edit, then ``then`` (raise, skip or return)."""

    name = "edits_everything"
    stages = frozenset({Stage.DYNAMO})

    def __init__(self, then):
        super().__init__()
        self.then = then

    def run(self, gm, ctx):
        j = ctx.journal
        nodes = {n.name: n for n in gm.graph.nodes}
        add, mul, relu, sub = nodes["add"], nodes["mul"], nodes["relu"], nodes["sub"]
        new = j.call_function(operator.neg, (add,), after=add, meta={"tag": 1})
        j.set_args(mul, (new, 3))
        j.set_target(sub, operator.add)
        j.set_meta(relu, "k", "v")
        j.set_meta(add, "stack_trace", None)
        j.replace_uses(relu, mul)
        j.erase(relu)
        j.erase(j.call_function(operator.pos, (new,), before=mul))  # created, then erased
        gm.graph.lint()
        if self.then == "raise":
            raise RuntimeError("after editing")
        if self.then == "skip":
            raise PassSkipped("changed its mind")
        return TEPassResult(gm, True)


@pytest.mark.parametrize("then, status", [("raise", "failed"), ("skip", "skipped")])
def test_journal_undo_is_exact(then, status, recwarn):
    gm = _gm()
    before, code = _exact(gm.graph), gm.code
    x, y = torch.randn(4), torch.randn(4)
    ref = gm(x, y)
    rep = PassManager([EditsEverything(then)]).run(gm, pass_context(Stage.DYNAMO))
    assert rep.runs[0].status == status and not rep.runs[0].changed
    assert _exact(gm.graph) == before and gm.code == code
    gm.graph.lint()
    torch.testing.assert_close(gm(x, y), ref)
    # names stay free for the next pass: a rewrite after the undo gets the names it would have had
    rep = PassManager([MulToAdd()]).run(gm, pass_context(Stage.DYNAMO))
    assert rep.runs[0].records[0].node == "add_1"


def test_journal_edits_kept_when_the_pass_succeeds():
    gm = _gm()
    rep = PassManager([EditsEverything("return")]).run(gm, pass_context(Stage.DYNAMO))
    assert rep.runs[0].changed and "relu" not in gm.code and "neg" in gm.code
    assert next(n for n in gm.graph.nodes if n.target is operator.neg).meta["tag"] == 1


def test_changed_comes_from_the_journal():
    class SaysNothing(MulToAdd):  # edits, but reports modified=False
        name = "says_nothing"

        def run(self, gm, ctx):
            return TEPassResult(gm, False, super().run(gm, ctx).records)

    class EditsBehindTheJournal(TEPass):  # reports a change it made outside ctx.journal
        name = "behind"
        stages = frozenset({Stage.DYNAMO})

        def run(self, gm, ctx):
            return TEPassResult(gm, True)

    gm = _gm()
    rep = PassManager([SaysNothing()]).run(gm, pass_context(Stage.DYNAMO))
    assert rep.runs[0].changed and "mul" not in gm.code  # and recompiled
    with pytest.warns(RuntimeWarning, match="reported a change but made no edit through ctx.journal"):
        rep = PassManager([EditsBehindTheJournal()]).run(_gm(), pass_context(Stage.DYNAMO))
    assert rep.runs[0].status == "failed"


def test_provenance_through_graph_transform_observer():
    """Under Inductor's provenance tracking, torch's GraphTransformObserver (the manager wraps every
    pass in one) stamps the nodes a pass created with ``from_node`` naming the pass."""
    from torch._inductor import config as inductor_config

    gm = _gm()
    with inductor_config.patch({"trace.provenance_tracking_level": 1}):
        PassManager([MulToAdd()]).run(gm, pass_context(Stage.DYNAMO))
    (new,) = [n for n in gm.graph.nodes if n.name == "add_1"]
    assert [s.pass_name for s in new.meta["from_node"]] == ["mul_to_add"]
    gm2 = _gm()
    PassManager([MulToAdd()]).run(gm2, pass_context(Stage.DYNAMO))  # off: no meta written
    assert all("from_node" not in n.meta for n in gm2.graph.nodes)


class Scaled(MulToAdd):
    name = "scaled"

    @dataclasses.dataclass(frozen=True)
    class Config(PassConfig):
        threshold: int = 0


def test_uuid_covers_source_and_config():
    a, b = Scaled(), Scaled(threshold=1)
    assert a.uuid() == Scaled().uuid() != b.uuid() != MulToAdd().uuid()
    assert len(a.uuid()) == 64 and b.config() == {"threshold": 1}
    with pytest.raises(TypeError, match="threshold must be int, got '1'"):
        Scaled(threshold="1")


def test_torch_logs_enables_debug_log():
    code = textwrap.dedent("""
        import torch, torch.fx
        from te_passes.config import TePassesOptions
        from te_passes.passes import PassContext, Stage
        from te_passes.pipeline.manager import PassManager
        from te_passes.te.state import TEState
        from tests.pipeline.test_manager import MulToAdd, _gm
        PassManager([MulToAdd()]).run(_gm(), PassContext(Stage.DYNAMO, TePassesOptions(), TEState()))
    """)
    env = dict(os.environ, TORCH_LOGS="+te_passes")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "g0[dynamo] mul_to_add: ok changed=True" in proc.stderr


def test_trace_structured_artifact_written(tmp_path):
    code = textwrap.dedent("""
        import torch
        from tests.pipeline.test_manager import MulToAdd
        import te_passes.passes.order as order
        order.default_passes = lambda: [order.FindAutocastState(), MulToAdd()]  # te_inductor needs the state fact
        import te_passes.backend as b
        b.pass_names = lambda: ["mul_to_add"]
        f = torch.compile(lambda x: torch.relu(x * 2), backend=b.te_inductor)
        with torch.no_grad():
            f(torch.ones(3))
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TORCH_TRACE=str(tmp_path), PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = "".join(p.read_text() for p in tmp_path.iterdir())
    assert "te_passes_g0_dynamo_mul_to_add" in text
