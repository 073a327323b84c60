"""``.tegraph`` files saved by the package layout before issue 12 still load and replay.

The files under ``tests/debug/data/tegraph_layout0/`` were written by te_passes at commit 18858f0 (the
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
from te_passes.runtime.ub import guard as ub_guard

DATA = os.path.join(os.path.dirname(__file__), "data", "tegraph_layout0")


def test_renamed_modules_point_at_existing_modules():
    import importlib

    for old, new in graph_io.RENAMED_MODULES.items():
        assert old != new
        importlib.import_module(new)
        assert graph_io.renamed_module(old) == new
        try:
            gone = importlib.import_module(old)
        except ModuleNotFoundError:
            continue
        # an old module whose name is now a feature folder (runtime/ub.py -> runtime/ub/reinit.py): the
        # package defines nothing an old pickle could name
        assert new.startswith(old + ".") and hasattr(gone, "__path__"), old
        assert not [n for n in vars(gone) if not n.startswith("__") and not hasattr(vars(gone)[n], "__path__")
                    and not isinstance(vars(gone)[n], type(gone))], old
    assert graph_io.renamed_module("te_passes.runtime.ub.guard") == "te_passes.runtime.ub.guard"


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


#: The pass the saved dump ran (issue 12) -> the passes it was split into.
SPLIT_PASSES = {"hoist_recipe_lookups": ("fold_recipe_lookups", "remove_quantizer_setattrs", "hoist_te_constants")}


def _as_old_pipeline(report: dict) -> dict:
    """``report`` as the pipeline of the saved dump would have written it: the runs of the passes
    ``hoist_recipe_lookups`` was split into (:data:`SPLIT_PASSES`) become one run of the old
    name at the same place — status / error of its runs (which must agree), changed if any
    changed, nodes before the first and after the last, records concatenated in run order."""
    out = dict(report, stages=[])
    for stage in report["stages"]:
        runs: list = []
        for r in stage["runs"]:
            old = next((o for o, news in SPLIT_PASSES.items() if r["name"] in news), None)
            if old is None:
                runs.append(r)
                continue
            if runs and runs[-1]["name"] == old:
                prev = runs[-1]
                assert (prev["status"], prev["error"]) == (r["status"], r["error"]), (prev, r)
                runs[-1] = dict(prev, changed=prev["changed"] or r["changed"], nodes_after=r["nodes_after"],
                                records=prev["records"] + r["records"])
            else:
                runs.append(dict(r, name=old))
        out["stages"].append(dict(stage, runs=runs))
    return out


def test_split_passes_are_mapped_back_to_the_old_run():
    new = {"stages": [{"graph_id": "g0", "stage": "dynamo", "runs": [
        {"name": "fold_ub_predicates", "status": "ok", "changed": False, "nodes_before": 9, "nodes_after": 9,
         "error": None, "records": []},
        {"name": "fold_recipe_lookups", "status": "ok", "changed": False, "nodes_before": 9, "nodes_after": 9,
         "error": None, "records": [{"kind": "kept", "node": "a"}]},
        {"name": "remove_quantizer_setattrs", "status": "ok", "changed": True, "nodes_before": 9,
         "nodes_after": 6, "error": None, "records": [{"kind": "folded_setattr", "node": "b"}]}]}]}
    (stage,) = _as_old_pipeline(new)["stages"]
    assert [r["name"] for r in stage["runs"]] == ["fold_ub_predicates", "hoist_recipe_lookups"]
    old = stage["runs"][1]
    assert (old["changed"], old["nodes_before"], old["nodes_after"]) == (True, 9, 6)
    assert old["records"] == [{"kind": "kept", "node": "a"}, {"kind": "folded_setattr", "node": "b"}]


@pytest.mark.te
def test_old_layout_dump_replays_to_the_saved_report(monkeypatch):
    pytest.importorskip("transformer_engine.pytorch")
    from te_passes.debug.offline import compare_reports, replay
    from te_passes.passes.order import configured_passes

    # passes added after the dump was written (call_te_impl_directly, 2026-12-01) are switched off,
    # so the replay runs the pipeline the dump recorded (their runs are dropped before comparing)
    monkeypatch.setenv("TE_PASSES_DISABLE", "call_te_impl_directly")
    results = replay(os.path.join(DATA, "linear_fp8"), configured_passes())
    assert len(results) == 1
    new, saved = results[0]
    assert saved is not None and {s["stage"] for s in saved["stages"]} == {
        "dynamo", "joint", "post_grad_fwd", "post_grad_bwd"}
    # hoist_recipe_lookups (in the saved report) is fold_recipe_lookups + remove_quantizer_setattrs
    # + hoist_te_constants now (issue 12); the new runs are mapped back to the old one. The
    # disabled call_te_impl_directly runs are dropped, so every stage is compared field by field.
    replayed = _as_old_pipeline(new.to_json())
    for stage in replayed["stages"]:
        assert [r["status"] for r in stage["runs"] if r["name"] == "call_te_impl_directly"] in ([], ["disabled"])
        stage["runs"] = [r for r in stage["runs"] if r["name"] != "call_te_impl_directly"]
    assert compare_reports(replayed, saved) == []
