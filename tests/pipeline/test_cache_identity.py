"""The cache identity covers what passes read (issue 12): the whole te_passes source, pass
configs, options and one TE snapshot (TE version, UB, fp8 autocast state).

* editing any te_passes source file — here an analysis rule in ``analyses/liveness.py``, which
  ``insert_early_frees`` and ``check_cudagraph_pool`` depend on but whose module is neither pass's
  own — changes every pass's ``uuid()`` and the pipeline uuid (before: only the pass's own module
  and ``passes/base.py`` were hashed, so Inductor's FX graph cache kept serving graphs compiled
  with the old rule);
* a different fp8 autocast state changes the uuid, and ``fold_recipe_lookups`` folds
  ``FP8GlobalStateManager`` lookups to the snapshot in ``ctx.te_state`` (before: TE's live
  globals, read by the pass and in no fingerprint);
* an identical rerun in a fresh process hits the FX graph cache (the identity is stable across
  processes).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.fx

from te_passes.config import TePassesOptions
from te_passes.pipeline import base
from te_passes.pipeline.base import Stage
from te_passes.pipeline.compilation import pipeline_uuid
from te_passes.passes.order import default_passes
from te_passes.te import recipes
from te_passes.te import recipe_table
from te_passes.te.state import TEState
from te_passes.compat.api import capture_te_state
from te_passes.testing.harness import run_passes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _uuids():
    passes = default_passes()
    return {p.name: p.uuid() for p in passes}, pipeline_uuid(passes, TePassesOptions(), TEState())["uuid"]


def test_editing_an_analysis_rule_changes_every_pass_uuid_and_the_pipeline_uuid(tmp_path, monkeypatch):
    copy = tmp_path / "te_passes"
    shutil.copytree(base.PACKAGE_ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert base.package_source_hash(str(copy)) == base.package_source_hash(base.PACKAGE_ROOT)  # content, not place
    before_passes, before = _uuids()

    monkeypatch.setattr(base, "PACKAGE_ROOT", str(copy))
    assert _uuids() == (before_passes, before)  # the unedited copy: same identity
    rule = copy / "analyses" / "liveness.py"
    src = rule.read_text()
    assert "def analyze(" in src
    rule.write_text(src.replace("def analyze(", "def analyze(  # an edited alias rule\n        ", 1))
    base.package_source_hash.cache_clear()  # computed once per process: a new process sees the edit
    after_passes, after = _uuids()
    assert after != before
    assert set(after_passes) == set(before_passes)
    assert all(after_passes[n] != before_passes[n] for n in before_passes)  # also passes not in liveness.py


def test_package_hash_covers_every_source_file():
    files = base.package_source_files(base.PACKAGE_ROOT)
    assert "analyses/liveness.py" in files and "te/graph_model.py" in files and "ops/free.py" in files
    on_disk = sum(1 for d, _, fs in os.walk(base.PACKAGE_ROOT) if "__pycache__" not in d for f in fs if f.endswith(".py"))
    assert len(files) == on_disk


_FP8 = {"te_version": "2.20.2"}


@pytest.mark.parametrize("change", [
    {"fp8_enabled": True},
    {"fp8_calibration": True},
    {"fp8_parameters": True},
    {"recipe": "Float8CurrentScaling"},
])
def test_a_different_fp8_state_changes_the_uuid(change):
    pytest.importorskip("transformer_engine.common.recipe")
    m = default_passes()
    kw = {k: (recipe_table.default_recipe(v) if k == "recipe" else v) for k, v in change.items()}
    plain = TEState(fp8=recipes.Fp8State(), **_FP8)
    other = TEState(fp8=recipes.Fp8State(**kw), **_FP8)
    same = TEState(fp8=recipes.Fp8State(), **_FP8)
    u = lambda s: pipeline_uuid(m, TePassesOptions(), s, ub_reads=[])["uuid"]  # noqa: E731
    assert u(plain) == u(same)
    assert u(other) != u(plain)
    assert other.fingerprint(include_ub=False) != plain.fingerprint(include_ub=False)


def test_te_snapshot_captures_the_autocast_state():
    te = pytest.importorskip("transformer_engine.pytorch")
    from te_passes.testing.fake_gpu import fake_gpu

    outside = capture_te_state()
    assert outside.fp8 is not None and outside.fp8.fp8_enabled is False
    recipe = recipe_table.default_recipe("Float8CurrentScaling")
    with fake_gpu("fp8-cs"), te.autocast(enabled=True, recipe=recipe):
        inside = capture_te_state()
    assert inside.fp8.fp8_enabled is True and inside.fp8.recipe is recipe
    assert inside.to_json()["fp8"]["recipe"] == repr(recipe)
    assert inside.fingerprint() != outside.fingerprint()


def test_hoist_folds_lookups_to_the_snapshot_not_to_te_globals():
    pytest.importorskip("transformer_engine.pytorch")
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as FGSM

    g = torch.fx.Graph()
    x = g.placeholder("x")
    en = g.call_function(FGSM.is_fp8_enabled)
    g.output(g.call_function(torch.mul, (x, en)))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert FGSM.is_fp8_enabled() is False  # TE's live state
    snap = TEState(fp8=recipes.Fp8State(fp8_enabled=True), **_FP8)
    fold = [p for p in default_passes() if p.name == "fold_recipe_lookups"]
    run = run_passes(gm, fold, Stage.DYNAMO, te_state=snap, strict=True, graph_id="t0")
    (hoisted,) = run.records("hoisted")
    assert hoisted.data["value"] is True  # the snapshot's value, not TE's live False
    (mul,) = [n for n in gm.graph.nodes if n.target is torch.mul]
    assert mul.args[1] is True

    # No fp8 state in the snapshot: the lookup is kept, with the reason.
    g2 = torch.fx.Graph()
    x2 = g2.placeholder("x")
    g2.output(g2.call_function(torch.mul, (x2, g2.call_function(FGSM.is_fp8_enabled))))
    gm2 = torch.fx.GraphModule(torch.nn.Module(), g2)
    run = run_passes(gm2, fold, Stage.DYNAMO, te_state=TEState(**_FP8), strict=True, graph_id="t1")
    kept = run.records("kept")
    assert any("no fp8 autocast state" in r.data.get("reason", "") for r in kept)
    assert any(n.target == FGSM.is_fp8_enabled for n in gm2.graph.nodes)  # left in place


_RERUN = r"""
import json, sys
import torch
import transformer_engine.pytorch  # noqa: F401  (the TE snapshot then holds an fp8 state)
from torch._dynamo.utils import counters
from torch._inductor import config
from te_passes.report import compile_reports

with config.patch(fx_graph_cache=True, fx_graph_remote_cache=False), torch.no_grad():
    out = torch.compile(lambda x: torch.sin(x) * 3, backend="te_inductor")(torch.arange(4.0))
assert torch.allclose(out, torch.sin(torch.arange(4.0)) * 3)
rep = compile_reports()[-1]
print(json.dumps({"hit": counters["inductor"]["fxgraph_cache_hit"], "miss": counters["inductor"]["fxgraph_cache_miss"],
                  "uuid": rep.uuid["uuid"], "fp8": rep.te_state["fp8"]}))
"""


@pytest.mark.slow
def test_identical_rerun_in_a_fresh_process_hits_the_fx_graph_cache(tmp_path):
    pytest.importorskip("transformer_engine.pytorch")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)

    def run():
        p = subprocess.run([sys.executable, "-c", _RERUN], env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert (first["hit"], first["miss"]) == (0, 1)
    assert (second["hit"], second["miss"]) == (1, 0)
    assert second["uuid"] == first["uuid"] and first["fp8"] is not None
