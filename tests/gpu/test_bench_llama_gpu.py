"""benchmarks/bench_llama.py on the GPU, small (~1-2 min), before its two ~9-minute commands: every
row measured without error, the kernel lists diffed, and the competitor is TE's layer (the plain-torch
block with TE's weights within 5e-2 of TE eager in bf16, with and without RoPE; torchao rows run when
torchao is on PYTHONPATH: ``$PWD/.whl/site``, docs/benchmarks.md "Llama-class sizes (issue 41)")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from te_passes.testing.gpu import REL_TOL

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path, *args):
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_llama.py"), "--out", str(tmp_path),
                        "--warmup", "1", "--iters", "3", "--kernel-steps", "2", "--split-steps", "2",
                        "--budget-s", "240", *args], capture_output=True, text=True, timeout=400, cwd=ROOT)
    print(p.stdout[-4000:])
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads((tmp_path / "bench_llama.json").read_text())["rows"], (tmp_path / "bench_llama.md").read_text()


@pytest.mark.gpu
def test_bench_llama_smoke(tmp_path):
    rows, md = _run(tmp_path, "--rows", "llama1b-256", "--recipes", "bf16,fp8", "--variants",
                    "eager,te_inductor,torch-inductor,torchao-tw-inductor,mgc")
    got = {(r["precision"], r["variant"]): r for r in rows}
    assert set(got) == {("bf16", v) for v in ("eager", "te_inductor", "torch-inductor", "mgc")} | {
        ("fp8", v) for v in ("eager", "te_inductor", "torchao-tw-inductor", "mgc")}
    for (p, v), r in got.items():
        if v.startswith("torchao") and "torchao not importable" in str(r.get("unavailable")):
            continue
        assert "error" not in r and not r.get("unavailable"), r
        assert r["median_ms"] > 0 and r["kernel_ms"] > 0 and r["kernels"], r
        if v.startswith(("te_", "mgc")):
            assert r["max_rel_err"] < REL_TOL[p], r
    assert got[("bf16", "torch-inductor")]["max_rel_err"] < 5e-2, got[("bf16", "torch-inductor")]
    assert "## Kernels against TE eager" in md and "llama1b-256/fp8: te_inductor vs eager" in md


@pytest.mark.gpu
def test_torch_block_with_rope_is_te_layer(tmp_path):
    rows, _ = _run(tmp_path, "--rows", "llama8b-x2-128", "--recipes", "bf16", "--variants", "eager,torch-eager",
                   "--rope", "--kernel-steps", "0", "--split-steps", "0")
    assert [r["variant"] for r in rows] == ["eager", "torch-eager"] and all("error" not in r for r in rows), rows
    assert rows[1]["max_rel_err"] < 5e-2 and rows[1]["rope"] is True, rows[1]
