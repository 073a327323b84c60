"""The shared pass-test harness (te_passes.testing.harness) and the one pipeline driver
(te_passes.pipeline.compilation.Compilation): stage map, backward-graph rule, facts."""

import pytest
import torch
import torch.fx

from te_passes.pipeline.base import Stage, TEPassResult
from te_passes.pipeline.compilation import (STAGE_ORDER, Compilation, is_backward_graph, post_grad_stage,
                                            stage_graph_id)
from te_passes.pipeline.manager import PassManager
from te_passes.report import CompileReport
from te_passes.te.state import TEState
import test_manager  # noqa: E402 - the manager tests' rewrite pass
from te_passes.testing.harness import count_ops, diff, pass_context, run_passes


class MulToAdd(test_manager.MulToAdd):
    """test_manager's rewrite, also at post-grad fwd, returning a typed fact."""

    stages = frozenset({Stage.DYNAMO, Stage.POST_GRAD_FWD})

    def run(self, gm, ctx):
        res = super().run(gm, ctx)
        return TEPassResult(gm, res.modified, res.records, facts=[("rewrote", len(res.records), ctx.graph_id)])


def _gm():
    return torch.fx.symbolic_trace(lambda x: torch.relu(x * 2) * 2)


def test_run_passes_snapshots_counts_and_numerics():
    gm = _gm()
    x = torch.randn(5)
    want = gm(x)
    run = run_passes(gm, MulToAdd())
    assert run.before_ops == {"_operator.mul": 2, "torch.relu": 1}
    assert run.after_ops == count_ops(gm) == {"_operator.add": 2, "torch.relu": 1}
    assert run.diff() == {"_operator.add": 2, "_operator.mul": -2}
    assert "mul" in run.before_code and "mul" not in run.after_code
    assert run.changed and [r.kind for r in run.records()] == ["rewrote", "rewrote"]
    assert run.facts == [("rewrote", 2, "g0")]
    assert run.ctx.graph_id == "g0" and run.ctx.stage is Stage.DYNAMO and run.ctx.analyses == {}
    torch.testing.assert_close(gm(x), want)


def test_run_passes_goes_through_the_manager():
    gm = _gm()
    run = run_passes(gm, MulToAdd(), disable=("mul_to_add",))  # the manager's disable list
    assert run.report.runs[0].status == "disabled" and run.diff() == {}
    run = run_passes(_gm(), MulToAdd(), Stage.JOINT)  # not registered for the stage: no run
    assert run.report.runs == [] and run.report.stage == "joint"


def test_diff_and_pass_context():
    assert diff({"a": 1, "b": 2}, {"b": 2, "c": 1}) == {"a": -1, "c": 1}
    ctx = pass_context(Stage.POST_GRAD_BWD, strict=True, graph_id="t3")
    assert (ctx.stage, ctx.graph_id, ctx.options.strict) == (Stage.POST_GRAD_BWD, "t3.bwd", True)
    with pytest.raises(TypeError, match="not both"):
        pass_context(options=ctx.options, strict=True)


def test_stage_map_and_backward_rule():
    assert [stage_graph_id("g4", s) for s in STAGE_ORDER] == ["g4", "g4.joint", "g4.fwd", "g4.bwd"]
    fwd = torch.fx.Graph()
    fwd.output(fwd.placeholder("primals_1"))
    bwd = torch.fx.Graph()
    bwd.output((bwd.placeholder("mm"), bwd.placeholder("tangents_1")))
    assert not is_backward_graph(fwd) and is_backward_graph(bwd)
    assert (post_grad_stage(fwd), post_grad_stage(bwd)) == (Stage.POST_GRAD_FWD, Stage.POST_GRAD_BWD)


def test_compilation_collects_stage_reports_and_facts():
    report = CompileReport(graph_id="g7")
    comp = Compilation(PassManager([MulToAdd()]), pass_context().options, TEState(), report)
    comp.run_stage(_gm(), Stage.DYNAMO)
    comp.run_stage(_gm(), "post_grad_fwd")
    assert [(s.graph_id, s.stage) for s in report.stages] == [("g7", "dynamo"), ("g7.fwd", "post_grad_fwd")]
    assert comp.facts() == [("rewrote", 2, "g7"), ("rewrote", 2, "g7.fwd")]
    assert comp.facts(int) == [] and report.time_ms_passes > 0


#: Test files that may build a ``PassContext`` by hand: tests of the manager proper (it takes one).
#: Every other test goes through the harness (``run_passes`` / ``pass_context``), the backend's path.
HAND_BUILT_CONTEXT_ALLOWED = {"test_manager.py"}


def test_no_test_builds_a_pass_context_by_hand():
    """A new hand-built ``PassContext`` call in tests/ (outside the allow-list) fails here: use
    ``te_passes.testing.harness`` (issue 12 item 6)."""
    import pathlib
    import re

    tests = pathlib.Path(__file__).resolve().parents[1]
    needle = re.compile(r"\bPassContext" + r"\(")
    found = [f"{p.relative_to(tests)}:{i}" for p in sorted(tests.rglob("*.py"))
             if p.name not in HAND_BUILT_CONTEXT_ALLOWED
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if needle.search(line)]
    assert found == [], f"build contexts through te_passes.testing.harness, not by hand: {found}"
    # the check sees what it looks for
    assert needle.search("ctx = Pass" + "Context(Stage.DYNAMO, opts, TEState())")
