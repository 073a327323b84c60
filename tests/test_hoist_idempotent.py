"""The recipe passes (until issue 12 one pass, hoist_recipe_lookups) are idempotent at every stage (issue 16, item 9): a second run over its
own output, through the PassManager as the backend runs it, reports changed=False, hoists
nothing again and leaves every constant object (and its name) as the first run left it.
On the real fp8 te.Linear graphs (te_passes.testing.capture)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformer_engine.pytorch")

from te_passes.config import TePassesOptions  # noqa: E402
from te_passes.pipeline.base import PassContext, Stage  # noqa: E402
from te_passes.passes.fold_recipe_lookups import FoldRecipeLookups  # noqa: E402
from te_passes.passes.hoist_te_constants import HoistTEConstants  # noqa: E402
from te_passes.passes.remove_quantizer_setattrs import RemoveQuantizerSetattrs  # noqa: E402
from te_passes.runtime.constants import hoisted_name, hoisted_owner  # noqa: E402
from te_passes.pipeline.manager import PassManager  # noqa: E402
from te_passes.te.graph_constants import TEConstKind, te_const_kind  # noqa: E402
from te_passes.te.state import TEState  # noqa: E402


def _consts(gm):
    return [a for n in gm.graph.nodes for a in (n.args if n.op != "output" else n.args[0])
            if te_const_kind(a) in (TEConstKind.BUNDLE, TEConstKind.QUANTIZER)]


@pytest.mark.parametrize("precision", ["fp8-cs", "mxfp8"])
@pytest.mark.parametrize("graph, stage", [("forward", Stage.POST_GRAD_FWD), ("backward", Stage.POST_GRAD_BWD)])
def test_second_run_at_post_grad_changes_nothing(te_aot_graphs, precision, graph, stage):
    aot = te_aot_graphs(precision, 1)
    gm = getattr(aot, graph)
    ctx = PassContext(stage, TePassesOptions(strict=True), TEState(), None, "g0")
    first = PassManager([HoistTEConstants()]).run(gm, ctx)
    (run,) = first.runs
    assert run.status == "ok" and run.changed and any(r.kind == "hoisted_constant" for r in run.records)
    objs = [(id(o), hoisted_name(o)) for o in _consts(gm)]
    assert all(name is not None for _, name in objs)
    code = gm.code
    second = PassManager([HoistTEConstants()]).run(gm, ctx)
    (run2,) = second.runs
    assert (run2.status, run2.changed) == ("ok", False), run2
    assert [r for r in run2.records if r.kind == "hoisted_constant"] == []
    assert [(id(o), hoisted_name(o)) for o in _consts(gm)] == objs  # same objects, same names
    assert all(hoisted_owner(o) is gm for o in _consts(gm))
    assert gm.code == code


def test_second_run_at_dynamo_changes_nothing(te_aot_graphs):
    from te_passes.testing.capture import cached_dynamo

    cap = cached_dynamo("fp8-cs", 1)
    ctx = PassContext(Stage.DYNAMO, TePassesOptions(strict=True), TEState(), None, "g0")
    first = PassManager([FoldRecipeLookups(), RemoveQuantizerSetattrs()]).run(cap.gm, ctx)
    assert any(r.changed for r in first.runs)
    second = PassManager([FoldRecipeLookups(), RemoveQuantizerSetattrs()]).run(cap.gm, ctx)
    assert [(r.status, r.changed) for r in second.runs] == [("ok", False)] * 2
