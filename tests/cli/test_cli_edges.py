"""CLI edges of issue 43: ``replay --check`` of a dynamic-shape dump whose post-grad ShapeEnv holds a
symbol its graph no longer uses, ``te-passes --help`` without torch (< 1 s), ``list`` / ``show``
without a leading blank line, graph-level records without ``None`` in the nodes column, the dump
target where ``insert_early_frees`` acts, and the untouched examples saying what they capture."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from _cli import ROOT, run_cli

# x.shape[1] compared with a constant: Dynamo keeps the symbol in its ShapeEnv (with its hint) but the
# post-grad graphs use 8 in its place, so a saved graph file restores only the other symbol (before the
# fix the memory record listed both and replay --check failed: "records differ (1 saved, 1 replayed)").
_DYN_SPECIALIZED = """
import torch

def f(x, w):
    n = x.shape[0]
    if x.shape[1] == 8:
        x = x * 2
    return (x @ w).relu() * (n % 3 + 1)

def main():
    c = torch.compile(f, backend="te_inductor", dynamic=True)
    w = torch.randn(8, 7, requires_grad=True)
    for n in (6, 10):
        x = torch.randn(n, 8, requires_grad=True)
        c(x, w).sum().backward()
"""


def test_replay_check_of_a_dynamic_dump_with_a_specialized_symbol_reproduces(tmp_path):
    (tmp_path / "dyn.py").write_text(_DYN_SPECIALIZED)
    proc = run_cli("dump", "dyn.py:main", "--out", "D", cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "D" / "g0" / "report.json").read_text())
    mem = [r for s in report["stages"] for run in s["runs"] for r in run["records"] if r["kind"] == "memory"]
    assert mem and all(r["symbolic"] for r in mem), mem
    import sympy

    for r in mem:  # only the symbols the byte counts use, each with its hint
        used = {str(s) for s in sympy.sympify(r["peak_before"]).free_symbols}
        assert set(r["symbols"]) == used and len(used) == 2, r
        assert all(isinstance(v, int) for v in r["symbols"].values()), r
    proc = run_cli("replay", "D", "--check", cwd=str(tmp_path))
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "reproduces the saved report" in proc.stdout


def test_records_differ_names_the_first_differing_field():
    from te_passes.debug.offline import compare_reports

    def rep(symbols):
        return {"stages": [{"graph_id": "g0.fwd", "stage": "post_grad_fwd", "runs": [
            {"name": "insert_early_frees", "status": "ok", "changed": False, "nodes_before": 3, "nodes_after": 3,
             "records": [{"kind": "memory", "node": None, "symbols": symbols}]}]}]}

    assert compare_reports(rep({"s85": 4}), rep({"s85": 4, "s48": 16})) == [
        "g0.fwd:post_grad_fwd:insert_early_frees: records differ (1 saved, 1 replayed): memory record 0: "
        "symbols {'s85': 4, 's48': 16} -> {'s85': 4}"]


def _env():
    e = dict(os.environ, PYTHONPATH=ROOT)
    for k in ("TE_PASSES_DISABLE", "TE_PASSES_DUMP_DIR", "TORCH_TRACE"):
        e.pop(k, None)
    return e


def test_help_imports_no_torch_and_takes_under_a_second(tmp_path):
    code = ("import sys\nfrom te_passes.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('TORCH', 'torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage: te-passes" in proc.stdout and proc.stdout.strip().endswith("TORCH False"), proc.stdout[-500:]
    best = float("inf")
    for _ in range(3):  # the best of 3: this machine's 2 cores are shared
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "te_passes.cli", "--help"], cwd=str(tmp_path), env=_env(),
                              capture_output=True, text=True, timeout=120)
        best = min(best, time.perf_counter() - t0)
        assert proc.returncode == 0, proc.stderr
    assert best < 1.0, f"te-passes --help took {best:.2f} s"


def test_list_and_show_start_with_their_first_line(tmp_path):
    proc = run_cli("list", "--plain", cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("te_passes pipeline ("), proc.stdout[:200]
    (tmp_path / "t.py").write_text("import torch\n\ndef main():\n    torch.compile(lambda x: x + 1, "
                                   "backend='te_inductor')(torch.ones(2))\n")
    proc = run_cli("dump", "t.py:main", "--out", "d", cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = run_cli("show", "d", "--plain", cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("== te_passes dump =="), proc.stdout[:200]
    # a skipped pass's graph-level record: an empty nodes cell, not "None"
    refused = proc.stdout.split("Rewrites refused")[1].split("\n\n")[0]
    assert "call_te_impl_directly  skipped  no TE op nodes" in refused, refused
    assert "None" not in refused, refused


def test_keeps_quantized_example_is_where_insert_early_frees_acts(tmp_path):
    proc = run_cli("dump", "te_passes.examples.keeps_quantized:main", "--out", "kq", "--plain", cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "keeps_quantized: the 4096-byte FP8 buffer keep_and_gemm kept was freed after its last use" in proc.stdout
    assert "Early frees (1)" in proc.stdout
    report = json.loads((tmp_path / "kq" / "report.json").read_text())
    (free,) = report["frees"]
    assert (free["pass"], free["role"], free["bytes"], free["after"]) == (
        "insert_early_frees", "rowwise_data", 4096, "keep_and_gemm"), free


@pytest.mark.te
@pytest.mark.parametrize("example", ["transformer-layer-bf16"])
def test_untouched_examples_say_what_they_capture(example, tmp_path):
    pytest.importorskip("transformer_engine.pytorch")
    proc = run_cli("dump", "--example", example, "--out", "d", "--plain", cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert f"» capturing the Dynamo graph of {example} (bf16) on fake CUDA tensors" in out, out[:2000]
    assert "AOTAutograd graphs of" not in out and "forward + backward" not in out.split("\n== ")[0], out[:2000]
    assert "» running the Dynamo-stage passes on 1 graph" in out, out[:2000]
    assert "1 stages" not in out and "FakeTensorDeviceMismatchError" not in out, out
    report = json.loads((tmp_path / "d" / "report.json").read_text())
    assert "FakeTensorDeviceMismatchError" not in report["note"] and "AOTAutograd" in report["note"], report["note"]
