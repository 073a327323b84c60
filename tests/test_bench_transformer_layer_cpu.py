"""benchmarks/bench_transformer_layer.py without a GPU: the task plan and the table."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_transformer_layer.py"


def _mod():
    spec = importlib.util.spec_from_file_location("bench_tl", SCRIPT)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def test_plan_isolates_mgc_and_orders_key_variants_first():
    out = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], capture_output=True, text=True, check=True,
                         cwd=ROOT)
    groups = json.loads(out.stdout)["groups"]
    m = _mod()
    assert sum(map(len, groups)) == len(m.MODELS) * len(m.PRECISIONS) * len(m.DEFAULT_VARIANTS)
    for g in groups:  # a worker never mixes make_graphed_callables with compiled variants
        assert len({m.is_mgc(t["variant"]) for t in g}) == 1
        assert len({(t["model"], t["precision"]) for t in g}) == 1
    first = [t["variant"] for g in groups[:8] for t in g]
    assert set(first) == set(m.QUICK_VARIANTS)


def test_table_ratios():
    m = _mod()
    row = dict(median_ms=2.0, host_ms=1.0, graphs=1, graph_breaks=0, recompiles=0, recompiles_after_first=0,
               cudagraph_skips=0, peak_mib=10, first_s=3.0, rel_err_vs_eager=1e-3)
    rows = [dict(row, model="layer1", precision="bf16", variant="eager", median_ms=4.0),
            dict(row, model="layer1", precision="bf16", variant="mgc", median_ms=1.0),
            dict(row, model="layer1", precision="bf16", variant="cf-te_inductor-ro"),
            dict(model="layer1", precision="bf16", variant="cf-mgc", skipped="budget 420s spent")]
    t = m._table(rows)
    assert "| layer1 | bf16 | cf-te_inductor-ro | 2.000 | 1.000 | 2.00x | 0.50x | 1 / 0 / 0 (0) |" in t
    assert "| cf-mgc | budget 420s spent |" in t


def test_fused_attention_variants():
    m = _mod()
    assert m.split_variant("cf-fused-te_inductor-ro") == ("te_fused", "te_inductor-ro")
    assert m.split_variant("cf-mgc") == ("sdpa", "mgc") and m.split_variant("eager") == (None, "eager")
    assert not m.is_mgc("cf-fused-te_inductor") and m.is_mgc("cf-mgc-nc")
    out = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--models", "layer1", "--variants", "eager",
                          "cf-te_inductor-ro", "cf-fused-te_inductor-ro", "cf-fused-eager", "mgc"],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    groups = json.loads(out.stdout)["groups"]
    variants = [t["variant"] for g in groups for t in g]
    assert sorted(variants) == sorted(["eager", "cf-te_inductor-ro", "cf-fused-te_inductor-ro", "cf-fused-eager",
                                       "mgc"] * 2)


def test_issue_chunks_cover_the_table_each_under_500_s():
    """The chunk commands, parsed by the bench's own dry-run, plan every (model, precision,
    variant) of the issue-15 table exactly once, and each call ends within 500 s."""
    import shlex

    m = _mod()
    cmds = m.chunk_commands("/tmp/x")
    assert cmds[-1].split()[-len(m.ISSUE_CHUNKS):] == [f"/tmp/x/{c[0]}" for c in m.ISSUE_CHUNKS]
    seen = []
    for cmd in cmds[:-1]:
        argv = shlex.split(cmd.split("bench_transformer_layer.py", 1)[1])
        out = subprocess.run([sys.executable, str(SCRIPT), *argv, "--dry-run"], capture_output=True, text=True,
                             check=True, cwd=ROOT)
        plan = json.loads(out.stdout)
        assert plan["max_wall_s"] < 500, cmd
        seen += [(t["model"], t["precision"], t["variant"]) for g in plan["groups"] for t in g]
    want = {(mo, p, v) for mo in ("layer1", "stack4") for p in ("bf16", "fp8")
            for v in ("eager", "te_inductor", "te_inductor-ro", "inductor-ro", "cf-te_inductor-ro", "mgc", "mgc-nc",
                      "cf-fused-te_inductor-ro")}
    assert len(seen) == len(set(seen)) and set(seen) == want


def test_quick_dry_run_still_plans_layer1_key_variants():
    out = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--dry-run"], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    m = _mod()
    tasks = [t for g in json.loads(out.stdout)["groups"] for t in g]
    assert {t["model"] for t in tasks} == {"layer1"} and {t["variant"] for t in tasks} == set(m.QUICK_VARIANTS)


def test_merge_concatenates_chunks(tmp_path):
    m = _mod()
    row = dict(median_ms=2.0, host_ms=1.0, graphs=1, graph_breaks=0, recompiles=0, recompiles_after_first=0,
               cudagraph_skips=0, peak_mib=10, first_s=3.0, rel_err_vs_eager=1e-3, model="stack4", precision="fp8")
    for name, variant in (("a", "eager"), ("b", "mgc")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "bench_transformer_layer.json").write_text(
            json.dumps({"meta": {"chunk": name}, "rows": [dict(row, variant=variant)]}))
    assert m.main(["--out", str(tmp_path / "all"), "--merge", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    data = json.loads((tmp_path / "all" / "bench_transformer_layer.json").read_text())
    assert [r["variant"] for r in data["rows"]] == ["eager", "mgc"]
    assert "| stack4 | fp8 | mgc | 2.000 |" in (tmp_path / "all" / "bench_transformer_layer.md").read_text()
    with pytest.raises(SystemExit, match="does not exist"):
        m.main(["--out", str(tmp_path / "all"), "--merge", str(tmp_path / "missing")])


def test_worker_skips_tasks_after_the_deadline(capsys):
    pytest.importorskip("transformer_engine.pytorch")
    m = _mod()
    tasks = [dict(model="stack4", precision="fp8", variant=v) for v in ("eager", "mgc")]
    assert m._worker(tasks, 1, 1, True, deadline=0.0) == 0
    rows = [json.loads(ln[len("RESULT "):]) for ln in capsys.readouterr().out.splitlines() if ln.startswith("RESULT ")]
    assert rows == [dict(t, skipped="budget spent") for t in tasks]
