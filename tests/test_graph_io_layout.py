"""``.tegraph`` files saved by the package layout before issue 12 still load and replay.

The files under ``tests/data/tegraph_layout0/`` were written by te_passes at commit 18858f0 (the
last commit of the old layout): ``linear_fp8/g0`` is ``te-passes dump --example linear-fp8``'s
graph directory (every stage's ``input.tegraph`` and the ``report.json`` of that run), and
``ub_query.tegraph`` a hand-built graph whose pickle names moved modules
(``te_passes.te.guards.ub_query`` as a node target, ``te_passes.passes.base.Stage`` in its info).
``te_passes.debug.graph_io.RENAMED_MODULES`` maps those paths to the current ones.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch  # noqa: F401  (before transformer_engine)

from te_passes.debug import graph_io
from te_passes.pipeline.base import Stage
from te_passes.runtime import ub_guard

DATA = os.path.join(os.path.dirname(__file__), "data", "tegraph_layout0")


def test_renamed_modules_point_at_existing_modules():
    import importlib

    for old, new in graph_io.RENAMED_MODULES.items():
        assert old != new
        importlib.import_module(new)
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)


def test_old_layout_pickle_names_are_mapped():
    path = os.path.join(DATA, "ub_query.tegraph")
    with open(path, "rb") as f:
        data = f.read()
    assert b"te_passes.te.guards" in data and b"te_passes.passes.base" in data  # the old paths
    with pytest.raises(ModuleNotFoundError):  # a plain unpickler cannot load it any more
        pickle.loads(data)
    gm, payload = graph_io.load_graph(path)
    assert payload["stage_enum"] is Stage.POST_GRAD_BWD
    (q,) = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is ub_guard.ub_query]
    assert q.name == "ub_query" and q.args == ("proj_fprop", True)


@pytest.mark.te
def test_old_layout_dump_replays_to_the_saved_report(monkeypatch):
    pytest.importorskip("transformer_engine.pytorch")
    from te_passes.debug.offline import compare_reports, replay

    # passes added after the dump was written (call_te_impl_directly, 2026-12-01) are switched off,
    # so the replay runs the pipeline the dump recorded; the pass list then differs by that name only
    monkeypatch.setenv("TE_PASSES_DISABLE", "call_te_impl_directly")
    results = replay(os.path.join(DATA, "linear_fp8"))
    assert len(results) == 1
    new, saved = results[0]
    assert saved is not None and {s["stage"] for s in saved["stages"]} == {
        "dynamo", "joint", "post_grad_fwd", "post_grad_bwd"}
    diffs = compare_reports(new.to_json(), saved)
    for d in diffs:
        assert ": passes " in d, d
        before, after = d.split(": passes ", 1)[1].split(" -> ")
        assert before.replace("'call_te_impl_directly', ", "") == after.replace("'call_te_impl_directly', ", ""), d
