"""CPU checks of the GPU harness (te_passes/testing/gpu.py) and the GPU benchmark's reporting.

The GPU suite and benchmark only run on the H200; what they count and how they judge the goals
must be right before device time is spent, so it is tested here on CPU with ``backend="eager"``
graphs and hand-made benchmark rows.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from te_passes.testing.gpu import CompileWatch, forward_fn, gpu_skip_reason, make_recipe, rel_err


def _f(x, n):
    y = x.sin()
    if n > 0:
        torch._dynamo.graph_break()
    return y.cos() * n


def test_compile_watch_counts_graphs_breaks_and_recompiles():
    torch._dynamo.reset()
    cf = torch.compile(_f, backend="eager")
    with CompileWatch() as w:
        cf(torch.randn(3), 1)
        mid = w.snapshot()
        cf(torch.randn(3), 2)  # int specialisation fails its guard: both frames recompile (n dynamic)
        cf(torch.randn(3), 3)  # dynamic now: no further compile
    torch._dynamo.reset()
    assert (mid.graphs, mid.graph_breaks, mid.recompiles) == (2, 1, 0)
    assert (w.stats.graphs, w.stats.graph_breaks, w.stats.recompiles) == (4, 2, 2)
    assert w.stats.compile_ids == ["0/0", "1/0", "0/1", "1/1"]
    assert len(w.stats.recompile_reasons) == 2 and all("n == 1" in r for r in w.stats.recompile_reasons), \
        w.stats.recompile_reasons
    assert all("graph_break()" in k for k in w.stats.break_reasons)
    assert w.stats.cudagraph_skips == 0


def test_compile_watch_survives_dynamo_reset_inside_region():
    with CompileWatch() as w:
        torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))
        torch._dynamo.reset()  # clears Dynamo's callbacks: exit must not raise
    assert w.stats.graphs == 1


def test_rel_err_and_shape_check():
    e = torch.tensor([3.0, 4.0])
    assert rel_err(e, e) == 0.0
    assert rel_err(torch.tensor([3.0, 4.5]), e) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="shape"):
        rel_err(torch.zeros(3), e)


def test_precision_arguments_are_checked():
    with pytest.raises(ValueError, match="precision"):
        make_recipe("fp16")
    with pytest.raises(ValueError, match="needs a recipe"):
        forward_fn(torch.nn.Identity(), "fp8", None)
    assert make_recipe("bf16") is None


def test_gpu_skip_reason_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("this check is about machines without a GPU")
    assert "no CUDA device" in gpu_skip_reason()


def _bench():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_gpu", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def test_bench_goal_checks_judge_measured_rows():
    b = _bench()
    R = b.Row
    rows = [R(256, "fp8", "eager", median_ms=4.0, peak_mib=500, start_mib=300),
            R(256, "fp8", "te_inductor", median_ms=5.0, peak_mib=490, start_mib=300, passes_ms=10.0,
              te_compile_ms=1000.0, graphs=2, graph_breaks=0, cudagraph_skips=0),
            R(256, "fp8", "te_inductor-ro", median_ms=1.0, peak_mib=600, start_mib=300, graphs=2, graph_breaks=0,
              cudagraph_skips=0),
            R(256, "fp8", "inductor-ro", median_ms=1.2, peak_mib=650, start_mib=300, graphs=2, graph_breaks=1,
              cudagraph_skips=0),
            R(256, "fp8", "mgc", median_ms=0.8, peak_mib=520, start_mib=300)]
    b._fill_speedups(rows)
    assert rows[1].speedup_vs_eager == pytest.approx(0.8)
    goals = {g: (v, m) for g, v, m in b.goal_checks(rows)}
    assert goals["te_inductor default ≥ 1.0× TE eager on every row"][0] == "NOT MET"
    assert goals["te_inductor reduce-overhead ≥ 3.5× TE eager, 256-token fp8 stack"] == ("MET", "4.00×")
    assert goals["te_inductor reduce-overhead ≥ 1.3× TE eager, 8192-token fp8 stack"][0] == "NOT MEASURED"
    assert goals["te_inductor-ro at least as fast as make_graphed_callables, 256/fp8"][0] == "NOT MET"
    assert goals["te_inductor peak memory ≤ TE eager, 256/fp8"][0] == "MET"
    assert goals["te_inductor-ro peak memory ≤ TE eager, 256/fp8"][0] == "NOT MET"
    assert goals["te_inductor-ro peak memory ≤ inductor-ro, 256/fp8"][0] == "MET"
    assert goals["te_passes passes ≤ 5% of te_inductor compile time"][0] == "MET"
    assert goals["compiled rows: 0 graph breaks, 0 cudagraph skips"][0] == "NOT MET"
    table = b.markdown_table(rows)
    assert "| 256 | fp8 | te_inductor | 5.00 | 0.80× |" in table
    assert "10.0 / 1000 (1.00%)" in table


def test_bench_dry_run_writes_json_and_markdown(tmp_path):
    b = _bench()
    assert b.main(["--dry-run", "--out", str(tmp_path), "--configs", "256:fp8", "--iters", "3"]) == 0
    md = (tmp_path / "bench_gpu.md").read_text()
    assert md.startswith("# DRY RUN (made-up numbers)")
    import json

    doc = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert doc["meta"]["dry_run"] is True and len(doc["rows"]) == len(b.DEFAULT_VARIANTS)
    with pytest.raises(SystemExit):
        b.main(["--dry-run", "--out", str(tmp_path), "--configs", "256:fp16"])


def test_bench_lean_against_trees_goals_and_memory_bound():
    """Issue 14: lean (opt-in) is judged against trees (the default) on speed, with the host / GPU
    split next to it, and on its documented memory bound (trees' excess + held saved tensors)."""
    b = _bench()
    R = b.Row
    rows = [R(256, "fp8", "eager", median_ms=3.0, peak_mib=600, start_mib=424),
            R(256, "fp8", b.LEAN, median_ms=1.84, peak_mib=704, start_mib=424, host_ms=1.7, gpu_ms=0.5,
              host_waited=False, lean_saved_mib=100.0),
            R(256, "fp8", "te_inductor-ro-trees", median_ms=1.05, peak_mib=602, start_mib=424, host_ms=1.0,
              gpu_ms=0.5, host_waited=False),
            R(256, "fp8", "mgc-noclone", median_ms=0.44, peak_mib=558, start_mib=424)]
    b._fill_speedups(rows)
    goals = {g: (v, m) for g, v, m in b.goal_checks(rows)}
    v, m = goals["lean ≥ 1.0× trees (te_inductor-ro-lean vs te_inductor-ro-trees), 256/fp8"]
    assert v == "NOT MET" and "0.57×" in m and "host ms lean 1.70 / trees 1.00" in m and "GPU ms lean 0.50" in m
    assert goals["lean ≥ 0.8× mgc-noclone, 256/fp8"][0] == "NOT MET"
    # 280 <= 178 * 1.05 + 100 + 8 = 294.9
    assert goals["lean peak excess ≤ trees' + held saved tensors (+5%, +8 MiB), 256/fp8"][0] == "MET"
    rows[1].lean_saved_mib = 50.0
    goals = {g: (v, m) for g, v, m in b.goal_checks(rows)}
    assert goals["lean peak excess ≤ trees' + held saved tensors (+5%, +8 MiB), 256/fp8"][0] == "NOT MET"
    assert "| 1.70 | 0.50 | False |" in b.markdown_table(rows)


def test_bench_profile_flag(tmp_path, monkeypatch):
    """``--profile`` without a value means the default list (the first GPU run passed it bare and
    profiled nothing); ``none`` switches it off; a bad entry is refused."""
    b = _bench()
    seen = []
    monkeypatch.setattr(b, "_fake_rows", lambda args: seen.append(list(args.profile)) or [])
    for argv, want in (([], list(b.DEFAULT_PROFILE)), (["--profile"], list(b.DEFAULT_PROFILE)),
                       (["--profile", "none"], []),
                       (["--profile", "256:fp8:te_inductor-ro-lean"], ["256:fp8:te_inductor-ro-lean"])):
        assert b.main(["--dry-run", "--out", str(tmp_path), "--configs", "256:fp8", *argv]) == 0
        assert seen[-1] == want, argv
    assert "256:fp8:te_inductor-ro-lean" in b.DEFAULT_PROFILE and "256:fp8:te_inductor-ro-trees" in b.DEFAULT_PROFILE
    with pytest.raises(SystemExit):
        b.main(["--dry-run", "--out", str(tmp_path), "--profile", "256:fp8:lean"])


def test_bench_trace_writes_profiler_tables(tmp_path):
    """``--trace`` (torch.profiler per variant) on a CPU function: the file and both tables."""
    b = _bench()
    x = torch.randn(4, 4, requires_grad=True)
    dy = torch.randn(4, 4)
    lin = torch.nn.Linear(4, 4)
    text = b._trace(lin, x, dy, list(lin.parameters()), False, "256:bf16:eager", tmp_path, steps=2)
    assert (tmp_path / "trace_256_bf16_eager.txt").read_text() == text
    assert "## by device time" in text and "## by host time" in text and "aten::addmm" in text
