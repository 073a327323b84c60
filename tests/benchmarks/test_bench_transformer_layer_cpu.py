"""benchmarks/bench_transformer_layer.py and bench_gpu.py without a GPU: plans, dry runs through
the workers and tables, goal logic on hand-made rows, and the new variants' API calls (stubbed
te_passes.compile_step / make_graphed on a CPU module)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = ROOT / "benchmarks"


def _mod(name):
    sys.path.insert(0, str(BENCH_DIR))
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH_DIR / f"{name}.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def _plan(script, *args):
    out = subprocess.run([sys.executable, str(BENCH_DIR / script), *args, "--plan"], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    return json.loads(out.stdout)["tasks"]


def test_tl_plan_puts_captures_last_per_model_and_precision():
    tasks = _plan("bench_transformer_layer.py", "--models", "layer1", "stack4", "--precisions", "fp8", "fp8-delayed",
                  "--variants", "mgc", "eager", "te_mgc", "te_inductor-ro", "cf-mgc-noclone")
    assert len(tasks) == 2 * 2 * 5
    for i in range(0, len(tasks), 5):
        g = tasks[i:i + 5]
        assert len({(t["model"], t["precision"]) for t in g}) == 1
        assert [t["isolate"] for t in g] == [False, False, True, True, True]
        assert [t["variant"] for t in g][:2] == ["eager", "te_inductor-ro"]


def test_tl_tag_marks_only_te_passes_variants():
    tasks = _plan("bench_transformer_layer.py", "--models", "layer1", "--precisions", "bf16", "--variants", "eager",
                  "te_inductor", "cf-te_inductor-ro", "mgc", "--tag", "norm", "--te-option", "te_passes.x=1")
    assert [t["variant"] for t in tasks] == ["eager", "te_inductor+norm", "cf-te_inductor-ro+norm", "mgc"]


def test_split_variant():
    m = _mod("bench_transformer_layer")
    assert m.split_variant("cf-fused-te_inductor-ro") == ("te_fused", "te_inductor-ro")
    assert m.split_variant("cf-mgc") == ("sdpa", "mgc") and m.split_variant("eager") == (None, "eager")


def test_dry_runs_write_every_planned_row(tmp_path):
    for script, args, name in (
            ("bench_gpu.py", ["--configs", "256:fp8", "8192:fp8-block", "--variants", "eager", "te_step-ro", "mgc"],
             "bench_gpu"),
            ("bench_transformer_layer.py", ["--models", "layer1", "--precisions", "fp8-delayed"],
             "bench_transformer_layer")):
        p = subprocess.run([sys.executable, str(BENCH_DIR / script), "--dry-run", "--out", str(tmp_path / name), *args],
                           capture_output=True, text=True, check=True, cwd=ROOT)
        rows = json.loads((tmp_path / name / f"{name}.json").read_text())["rows"]
        assert len(rows) == len(_plan(script, *args)) and "DRY RUN" in p.stdout
        assert (tmp_path / name / f"{name}.md").read_text().startswith("# DRY RUN (made-up numbers)")
        assert all(r.get("median_ms") or r.get("unavailable") for r in rows)


def test_bad_config_is_refused():
    p = subprocess.run([sys.executable, str(BENCH_DIR / "bench_gpu.py"), "--configs", "256:fp9", "--plan"],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode != 0 and "bad --configs entry '256:fp9'" in p.stderr


def _row(variant, ms, **kw):
    return dict(dict(variant=variant, median_ms=ms, peak_mib=100.0, kernel_ms=0.4, graphs=1, graph_breaks=0,
                     recompiles=0, recompiles_after_first=0, cudagraph_skips=0, max_rel_err=0.0, worst="y"), **kw)


def test_tl_goals():
    m = _mod("bench_transformer_layer")
    g = dict(model="layer1", precision="fp8")
    rows = [dict(g, **_row("eager", 6.0)), dict(g, **_row("mgc", 1.4)), dict(g, **_row("te_inductor", 4.0)),
            dict(g, **_row("te_inductor-ro", 1.3, graphs=2, peak_mib=106.0)), dict(g, **_row("te_mgc", 1.2)),
            dict(g, variant="te_step-ro", unavailable="te_passes.compile_step missing")]
    goals = {k: (v, msr) for k, v, msr in m.goals(rows)}
    assert goals["issue 21: untouched te_inductor-ro ≥ 1.0× mgc, layer1/fp8"][0] == "MET"
    assert goals["issue 21: untouched te_inductor ≥ 1.2× TE eager, layer1/fp8"][0] == "MET"
    assert goals["issue 22: te_mgc ≥ 1.1× mgc, layer1/fp8"][0] == "MET"
    assert goals["issue 22: te_inductor-ro ≥ 1.1× mgc, layer1/fp8"][0] == "NOT MET"
    assert goals["issue 22: te_step-ro ≥ 1.1× mgc, layer1/fp8"][0] == "NOT MEASURED"
    assert goals["issue 21: te_inductor-ro peak memory ≤ TE eager + 5%, layer1/fp8"][0] == "NOT MET"
    assert goals["issue 21: untouched te_inductor-ro: 1 graph, 0 breaks, 0 recompiles after step 1, layer1/fp8"] \
        == ("NOT MET", "2 / 0 / 0")


def test_gpu_goals():
    m = _mod("bench_gpu")
    g = dict(tokens=256, precision="bf16")
    rows = [dict(g, **_row("eager", 2.0)), dict(g, **_row("mgc-noclone", 0.5)), dict(g, **_row("mgc", 0.45)),
            dict(g, **_row("te_step-ro", 0.48, kernel_ms=0.4)), dict(g, **_row("te_mgc-noclone", 0.6, kernel_ms=0.4)),
            dict(g, **_row("te_inductor", 2.5, peak_mib=90.0, passes_ms=10.0, te_compile_ms=1000.0)),
            dict(g, **_row("te_inductor-ro", 0.8, peak_mib=120.0, graph_breaks=1)),
            dict(g, **_row("te_inductor-ro-lean", 0.9)), dict(g, **_row("te_inductor-ro-trees", 0.8)),
            dict(tokens=8192, precision="fp8-block", **_row("te_inductor", 3.0, max_rel_err=1.5e-3, worst="x",
                                                            bit_identical="8/9")),
            dict(tokens=8192, precision="fp8-block", **_row("te_inductor-ro", 2.0)),
            dict(tokens=8192, precision="fp8-block", variant="te_step-ro", error="RuntimeError: x")]
    goals = {k: (v, msr) for k, v, msr in m.goals(rows)}
    assert goals["issue 22: te_step-ro ≥ 1.0× mgc-noclone, 256/bf16"][0] == "MET"
    assert goals["issue 22: te_step-ro within 1.3× of the kernel-time sum, 256/bf16"] == ("MET", "1.20× the kernel sum")
    assert goals["issue 22: te_mgc-noclone within 1.3× of the kernel-time sum, 256/bf16"][0] == "NOT MET"
    assert goals["issue 22: te_mgc-noclone ≥ 1.0× mgc-noclone, 256/bf16"][0] == "NOT MET"
    assert goals["issue 26: te_inductor numerics vs TE eager, 8192/fp8-block"] == ("INFO", "max rel err 1.50e-03 (x), 8/9 tensors bit-identical")
    assert goals["te_inductor default ≥ 1.0× TE eager, 256/bf16"] == (
        "NOT MET", "eager 2.000 ms / te_inductor 2.500 ms = 0.80×")
    assert goals["te_inductor-ro ≥ 1.0× mgc, 256/bf16"][0] == "NOT MET"
    assert goals["te_inductor-ro ≥ 0.8× mgc-noclone, 256/bf16"][0] == "NOT MET"
    assert goals["lean ≥ 1.0× trees, 256/bf16"][0] == "NOT MET"
    assert goals["te_inductor peak memory ≤ TE eager, 256/bf16"] == ("MET", "90 vs 100 MiB")
    assert goals["te_inductor-ro peak memory ≤ TE eager, 256/bf16"][0] == "NOT MET"
    assert goals["te_passes passes ≤ 5% of te_inductor compile time"] == ("MET", "max 1.00% over 1 compiles")
    assert goals["compiled rows: 0 graph breaks, 0 cudagraph skips"] == (
        "NOT MET", "256/bf16/te_inductor-ro: 1 breaks, 0 skips")
    assert goals["issue 22: te_step-ro not slower than te_inductor-ro, 8192/fp8-block"][0] == "NOT MEASURED"
    assert not any("mgc" in k and "8192/fp8-block" in k for k in goals)  # not in the run: no goal line


def test_kernel_sum_and_trace_tables_on_cpu(tmp_path):
    """--trace's tables (by device, by host time) from harness.kernel_sum_ms on a CPU step; no
    device events there, so the kernel sum is 0."""
    import torch

    sys.path.insert(0, str(BENCH_DIR))
    import harness

    lin = torch.nn.Linear(4, 4)
    x = torch.randn(4, 4)
    assert harness.kernel_sum_ms(lambda: lin(x).sum().backward(), 2, tmp_path / "t.txt") == 0.0
    text = (tmp_path / "t.txt").read_text()
    assert "## by device time" in text and "## by host time" in text and "aten::addmm" in text


def test_new_variants_call_the_agreed_api(monkeypatch):
    """te_step-ro calls ``te_passes.compile_step(step_fn, mode="reduce-overhead", options=...)`` and
    runs forward + backward inside it; te_mgc calls ``te_passes.make_graphed(module, (x,),
    options=..., **make_graphed_callables kwargs)``; a missing API makes the row unavailable."""
    pytest.importorskip("transformer_engine.pytorch")
    import torch

    import te_passes

    tv = _mod("te_variants")
    model = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    dy = torch.randn(2, 4)
    calls = {}

    def compile_step(fn, *, mode="reduce-overhead", options=None):
        calls["step"] = (mode, options)
        return fn

    def make_graphed(module, sample_args, *, options=None, **kw):
        calls["mgc"] = (sample_args[0] is x, options, kw)
        return module

    monkeypatch.setattr(te_passes, "compile_step", compile_step, raising=False)
    monkeypatch.setattr(te_passes, "make_graphed", make_graphed, raising=False)
    step, info = tv.build_step("te_step-ro", model, None, x, dy, {"te_passes.k": 1}, False)
    assert info == {} and step() is None and model.weight.grad is not None and x.grad is not None
    assert calls["step"] == ("reduce-overhead", {"te_passes.k": 1})
    step, info = tv.build_step("te_mgc-noclone", model, None, x, dy, {}, False)
    step()
    assert calls["mgc"] == (True, None, dict(num_warmup_iters=3, enabled=False, recipe=None,
                                             clone_param_grads_on_return=False))
    monkeypatch.setattr(te_passes, "compile_step", None)
    monkeypatch.setattr(te_passes, "make_graphed", None)
    assert tv.build_step("te_step-ro", model, None, x, dy, {}, False)[1] == {"unavailable": "te_passes.compile_step missing"}
    assert tv.build_step("te_mgc", model, None, x, dy, {}, False)[1] == {"unavailable": "te_passes.make_graphed missing"}
    with pytest.raises(ValueError, match="unknown variant"):
        tv.build_step("te_inductor-bogus", model, None, x, dy, {}, False)


class _Event:
    """torch.cuda.Event stand-in: host clock (the measurement code path on CPU, not a timing)."""

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        import time

        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3

    def query(self):
        return True


def test_measure_row_on_cpu_with_cuda_timing_stood_in(monkeypatch, tmp_path):
    """te_variants.measure end to end on a CPU module (eager and te_inductor), torch.cuda's
    events / memory counters replaced by host stand-ins: every column is filled, numerics are
    against the eager reference, te_passes' compile report is read for te_inductor."""
    pytest.importorskip("transformer_engine.pytorch")
    import argparse

    import torch

    tv = _mod("te_variants")
    for name, val in (("Event", _Event), ("synchronize", lambda: None), ("memory_allocated", lambda: 0),
                      ("max_memory_allocated", lambda: 2**20), ("reset_peak_memory_stats", lambda: None),
                      ("_sleep", lambda n: None)):
        monkeypatch.setattr(torch.cuda, name, val)
    from te_passes.testing.gpu import ensure_te_inductor_backend

    ensure_te_inductor_backend()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    dy = torch.randn(4, 8)
    ref = tv.reference(model, None, x, dy)
    assert set(ref) == {"y", "x", "0.weight", "0.bias", "2.weight", "2.bias"}
    args = argparse.Namespace(warmup=1, iters=3, kernel_steps=1, split_steps=2, te_option=None, profile=["p"],
                              trace=["p"], out=str(tmp_path))
    rows = {}
    for v in ("eager", "te_inductor"):
        torch._dynamo.reset()
        rows[v] = tv.measure(dict(precision="bf16", variant=v), args, model, x, dy, ref, prepare=False, tag="p")
    for r in rows.values():
        assert r["median_ms"] > 0 and r["host_ms"] > 0 and r["kernel_ms"] == 0.0 and r["split_gpu_ms"] >= 0
        assert r["peak_mib"] == 1.0 and r["iters"] == 3 and r["max_rel_err"] < 1e-5, r
    assert rows["eager"]["bit_identical"] == "6/6"  # the same eager code on the same inputs
    assert rows["eager"]["graphs"] == 0 and rows["te_inductor"]["graphs"] == 1
    assert rows["te_inductor"]["te_compile_ms"] > 0 and "passes_ms" in rows["te_inductor"]
    assert (tmp_path / "profile_p.txt").is_file() and (tmp_path / "trace_p.txt").is_file()
    torch._dynamo.reset()
