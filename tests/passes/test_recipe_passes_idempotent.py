"""The recipe passes (until issue 12 one pass, hoist_recipe_lookups) are idempotent at every stage (issue 16, item 9): a second run over its
own output, through the PassManager as the backend runs it (te_passes.testing.harness), reports
changed=False, hoists nothing again and leaves every constant object (and its name) as the first
run left it. On the real fp8 te.Linear graphs (te_passes.testing.capture)."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("transformer_engine.pytorch")

from te_passes.pipeline.base import Stage  # noqa: E402
from te_passes.passes.fold_recipe_lookups import FoldRecipeLookups  # noqa: E402
from te_passes.passes.hoist_te_constants import HoistTEConstants  # noqa: E402
from te_passes.passes.remove_quantizer_setattrs import RemoveQuantizerSetattrs  # noqa: E402
from te_passes.ops.constants import hoisted_name  # noqa: E402
from te_passes.te.graph_constants import TEConstKind, te_const_kind  # noqa: E402
from te_passes.testing.harness import run_passes  # noqa: E402


def _consts(gm):
    return [a for n in gm.graph.nodes for a in (n.args if n.op != "output" else n.args[0])
            if te_const_kind(a) in (TEConstKind.BUNDLE, TEConstKind.QUANTIZER)]


@pytest.mark.parametrize("precision", ["fp8-cs", "mxfp8"])
@pytest.mark.parametrize("graph, stage", [("forward", Stage.POST_GRAD_FWD), ("backward", Stage.POST_GRAD_BWD)])
def test_second_run_at_post_grad_changes_nothing(te_aot_graphs, precision, graph, stage):
    aot = te_aot_graphs(precision, 1)
    gm = getattr(aot, graph)
    first = run_passes(gm, HoistTEConstants(), stage, strict=True)
    (run,) = first.report.runs
    hoisted = first.records("hoisted_constant")
    assert run.status == "ok" and run.changed and hoisted
    assert first.diff() == {}  # only constant arguments change, no op
    objs = [(id(o), hoisted_name(o, gm)) for o in _consts(gm)]
    assert all(name is not None for _, name in objs)
    assert sorted({name for _, name in objs}) == sorted(r.data["name"] for r in hoisted)
    from te_passes.debug.printer import format_graph

    printed = format_graph(gm)  # the printer reads the names from the graph (gm.meta), not from a registry
    shown = set(re.findall(r"as (_te_const_\d+)", printed))
    assert shown and shown <= {r.data["name"] for r in hoisted}  # the config bundle (and quantizers where printed)
    code = gm.code
    second = run_passes(gm, HoistTEConstants(), stage, strict=True)
    (run2,) = second.report.runs
    assert (run2.status, run2.changed) == ("ok", False), run2
    assert second.records("hoisted_constant") == []
    assert [(id(o), hoisted_name(o, gm)) for o in _consts(gm)] == objs  # same objects, same names
    assert second.before_code == second.after_code == gm.code == code


def test_second_run_at_dynamo_changes_nothing(te_aot_graphs):
    from te_passes.testing.capture import cached_dynamo

    cap = cached_dynamo("fp8-cs", 1)
    first = run_passes(cap.gm, [FoldRecipeLookups(), RemoveQuantizerSetattrs()], Stage.DYNAMO, strict=True)
    assert any(r.changed for r in first.report.runs)
    assert first.before_code != first.after_code
    second = run_passes(cap.gm, [FoldRecipeLookups(), RemoveQuantizerSetattrs()], Stage.DYNAMO, strict=True)
    assert [(r.status, r.changed) for r in second.report.runs] == [("ok", False)] * 2
    assert second.diff() == {} and second.before_code == second.after_code
