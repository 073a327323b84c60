"""benchmarks/bench_transformer_layer.py without a GPU: the task plan and the table."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

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
