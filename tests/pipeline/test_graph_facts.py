"""The Dynamo-graph analyses (issue 39 item 3): ``find_autocast_state``, ``check_cudagraph_hazard`` and
``find_ub_state_reads`` run inside the pass manager like every pass (records, timings, dumps) and hand
``Compilation`` typed facts; ``Compilation.finish`` wraps the compiled callable once. Real TE graphs captured
on fake CUDA (``te_passes.testing.capture``)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.fx

pytest.importorskip("transformer_engine")

from te_passes import backend  # noqa: E402,F401  (installs the compat rows: the autocast trace hook)
from te_passes.config import TePassesOptionError, TePassesOptions  # noqa: E402
from te_passes.compat.api import RecipeStateError  # noqa: E402
from te_passes.passes.order import configured_passes, pass_classes  # noqa: E402
from te_passes.pipeline.base import Stage  # noqa: E402
from te_passes.pipeline.compilation import Compilation, CompileSettings  # noqa: E402
from te_passes.pipeline.facts import AutocastState, UbStateReads  # noqa: E402
from te_passes.pipeline.manager import PassManager, PassObserver  # noqa: E402
from te_passes.report import CompileReport  # noqa: E402
from te_passes.compat.api import capture_te_state
from te_passes.testing.fake_gpu import fake_gpu, quiet  # noqa: E402

ANALYSES = ("find_autocast_state", "check_cudagraph_hazard", "find_ub_state_reads")
ROW_UB = dict(ub_name="proj", parallel_mode="row", sequence_parallel=True, tp_size=2, ub_overlap_rs=True,
              ub_overlap_ag=True)


class _Seen(PassObserver):
    def __init__(self) -> None:
        self.before: list[str] = []
        self.after: list[tuple[str, str]] = []

    def before_pass(self, gm, tepass, ctx) -> None:
        self.before.append(tepass.name)

    def after_pass(self, gm, tepass, ctx, run) -> None:
        self.after.append((tepass.name, run.status))


def _live(options: TePassesOptions | None = None, observers=()) -> Compilation:
    """A live Compilation as te_inductor builds it (the configured passes), on an unregistered report."""
    settings = CompileSettings(None, options or TePassesOptions(), {})
    return Compilation(PassManager(configured_passes(), observers), settings, capture_te_state(),
                       CompileReport(graph_id="g_facts"))


def test_the_analyses_are_registered_dynamo_stage_analyses():
    classes = {c.name: c for c in pass_classes()}
    names = list(classes)
    assert names[:2] == ["find_autocast_state", "check_cudagraph_hazard"] and names[-1] == "find_ub_state_reads"
    for n in ANALYSES:
        assert classes[n].analysis_only and classes[n].stages == frozenset({Stage.DYNAMO}) and classes[n].description


def test_the_analyses_run_in_the_manager_with_records_timings_and_dumps(te_dynamo_graph, tmp_path):
    from te_passes.debug.offline import run_stages

    g = te_dynamo_graph("fp8-cs", 1)
    seen = _Seen()
    with quiet(), fake_gpu("fp8-cs"):
        report = run_stages([(Stage.DYNAMO, g.gm, g.example_inputs)], configured_passes(), observers=[seen],
                            dump_dir=str(tmp_path / "d"), graph_id="g_an")
    (stage,) = report.stages
    runs = {r.name: r for r in stage.runs}
    for n in ANALYSES:
        run = runs[n]
        assert run.status == "ok" and not run.changed and run.time_ms > 0 and run.records, n
        assert (n, "ok") in seen.after and n in seen.before
        assert run.dump_dir is not None and os.path.isdir(tmp_path / "d" / run.dump_dir), n
    (state,) = [f for f in runs["find_autocast_state"].facts if isinstance(f, AutocastState)]
    assert state.refusal is None and state.state.fp8_enabled and type(state.state.fp8_recipe).__name__ == \
        "Float8CurrentScaling"
    assert runs["find_autocast_state"].records[0].data["source"] == "traced"
    hazard = runs["check_cudagraph_hazard"]
    assert hazard.facts == [] and hazard.records[0].data["reason"] is None
    assert runs["find_ub_state_reads"].facts == [UbStateReads(())]
    assert report.uuid["ub_reads"] == []  # the fact is what the pipeline uuid read
    # the JSON report (what `te-passes show` prints) holds them like any pass
    names = [r["name"] for r in report.to_json()["stages"][0]["runs"]]
    assert [n for n in names if n in ANALYSES] == list(ANALYSES)


def test_the_compiled_callable_is_wrapped_once_with_the_state_and_the_ub_guard(tmp_path):
    """A UB fp8 te.Linear graph under te.autocast: one wrapper holding both the UB guard and the state,
    around the compiled callable itself; the call sees the traced recipe, restored afterwards."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as M

    from te_passes.testing.capture import capture_dynamo
    from te_passes.testing.ub import StandInCommunicator as C, ub_registry

    fp8 = {("proj_fprop", "fp8"): C(), ("proj_fprop", "none"): C(), ("proj_dgrad", "fp8"): C(),
           ("proj_dgrad", "none"): C()}
    with ub_registry(fp8):
        g = capture_dynamo("linear", "fp8-cs", **ROW_UB)
    with ub_registry(fp8):  # afresh: the capture leaves its own UB state behind in the guard's live snapshot
        comp = _live()
        with quiet(), fake_gpu("fp8-cs"):
            comp.begin(g.gm, g.example_inputs)
        seen = []

        def compiled(*args):  # stands for Inductor's callable
            seen.append(M.quantization_state.fp8_recipe)
            return len(args)

        fn = comp.finish(compiled)
        before = M.quantization_state.fp8_recipe
        assert fn(1, 2) == 2
    assert fn.__wrapped__ is compiled  # one wrapper: around Inductor's callable, not around another wrapper
    assert fn.te_ub_guard.compiled is compiled and fn.te_autocast is comp.autocast.state
    assert comp.autocast.state.fp8_recipe is not None and seen == [comp.autocast.state.fp8_recipe]
    assert M.quantization_state.fp8_recipe is before
    reads = comp.report.uuid["ub_reads"]
    assert reads and reads == list(comp.facts(UbStateReads)[0].reasons)


def test_a_graph_that_needs_nothing_is_not_wrapped():
    gm = torch.fx.symbolic_trace(lambda t: t + 1)
    comp = _live()
    comp.begin(gm, [torch.ones(2)])
    assert comp.autocast == AutocastState(None) and comp.facts(UbStateReads) == [UbStateReads(())]
    assert comp.finish(len) is len


def test_the_refusal_is_raised_live_and_recorded_offline(te_dynamo_graph):
    from te_passes.compat.autocast import recipe_state as RS  # only to plant the unknown state
    from te_passes.testing.capture import run_pipeline

    g = te_dynamo_graph("fp8-cs", 1)
    for n in RS.te_op_nodes(g.gm):
        n.meta.pop(RS.META_KEY, None)
    (rep,) = run_pipeline(g, [Stage.DYNAMO], graph_id="g_off")  # offline: recorded, not raised
    (run,) = [r for r in rep.runs if r.name == "find_autocast_state"]
    assert run.status == "ok" and run.records[0].kind == "refused"
    assert "te.autocast state where Dynamo traced them is unknown" in run.records[0].data["reason"]
    comp = _live()
    with quiet(), fake_gpu("fp8-cs"), pytest.raises(RecipeStateError, match="where Dynamo traced them is unknown"):
        comp.begin(g.gm, g.example_inputs)


def test_find_autocast_state_cannot_be_disabled_live(te_dynamo_graph):
    g = te_dynamo_graph("fp8-cs", 1)
    comp = _live(TePassesOptions(disable=("find_autocast_state",)))
    with quiet(), fake_gpu("fp8-cs"), pytest.raises(TePassesOptionError, match="disable names find_autocast_state"):
        comp.begin(g.gm, g.example_inputs)


def test_a_failed_autocast_analysis_refuses_the_graph(monkeypatch):
    from te_passes.passes import find_autocast_state as F

    def broken(gm):
        raise ValueError("boom")

    monkeypatch.setattr(F, "autocast_for_graph", broken)
    comp = _live()
    with pytest.warns(RuntimeWarning, match="find_autocast_state"), \
            pytest.raises(RecipeStateError, match=r"analysis find_autocast_state failed: ValueError: boom"):
        comp.begin(torch.fx.symbolic_trace(lambda t: t + 1), [torch.ones(2)])
