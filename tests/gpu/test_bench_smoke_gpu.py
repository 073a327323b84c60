"""The benchmark harness on the GPU, small (~1 min): every timing column filled, numerics against
TE eager within the suite's tolerances, before device time goes to benchmarks/gpu_plan.md's chunks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from te_passes.testing.gpu import REL_TOL

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path, script, name, *args):
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--out", str(tmp_path), "--warmup", "1",
                        "--iters", "3", "--kernel-steps", "2", "--split-steps", "2", "--budget-s", "200", *args],
                       capture_output=True, text=True, timeout=400, cwd=ROOT)
    print(p.stdout[-4000:])
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads((tmp_path / f"{name}.json").read_text())["rows"]


@pytest.mark.gpu
def test_bench_gpu_smoke(tmp_path):
    rows = _run(tmp_path, "bench_gpu.py", "bench_gpu", "--configs", "256:fp8", "--hidden", "1024", "--layers", "2",
                "--variants", "eager", "te_inductor-ro", "te_step-ro", "mgc-noclone")
    assert [r["variant"] for r in rows] == ["eager", "te_inductor-ro", "te_step-ro", "mgc-noclone"]
    for r in rows:
        if r.get("unavailable"):
            continue
        assert "error" not in r, r
        assert r["median_ms"] > 0 and 0 < r["kernel_ms"] and r["split_gpu_ms"] > 0, r
        assert r["max_rel_err"] < REL_TOL["fp8"], r
    assert rows[1]["ratio:× eager"] is not None and rows[1]["graph_breaks"] == 0


@pytest.mark.gpu
def test_bench_transformer_layer_smoke(tmp_path):
    rows = _run(tmp_path, "bench_transformer_layer.py", "bench_transformer_layer", "--models", "layer1",
                "--precisions", "bf16", "--variants", "eager", "te_inductor")
    for r in rows:
        assert "error" not in r and r["median_ms"] > 0 and r["max_rel_err"] < REL_TOL["bf16"], r
