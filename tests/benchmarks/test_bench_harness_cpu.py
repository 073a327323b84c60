"""benchmarks/harness.py without a GPU: worker processes, budgets, hung workers, isolation, tables
with ratios, merging; and the GPU session plan (benchmarks/gpu_plan.py) fitting its device calls."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_plan  # noqa: E402
import harness  # noqa: E402

#: A benchmark script whose dry-run "measurements" act as their variant says: ``hang`` sleeps,
#: ``boom`` raises (``isolate`` set by the plan for ``iso-*``), others report the worker's pid.
TOY = '''
import os, sys, time
sys.path.insert(0, {bench_dir!r})
import harness

def plan(args):
    return [dict(cfg=c, variant=v, isolate=v.startswith("iso")) for c in ("a", "b") for v in args.variants]

def fake(task, i):
    if task["variant"] == "hang":
        open(os.path.join(os.environ["TOY_PID_DIR"], "hang.pid"), "w").write(str(os.getpid()))
        time.sleep(60)
    if task["variant"].endswith("boom"):
        raise RuntimeError("capture failed")
    return dict(median_ms={{"base": 4.0}}.get(task["variant"], 2.0), peak_mib=100.0, pid=os.getpid())

def add_args(ap):
    ap.add_argument("--variants", nargs="+")

BENCH = harness.Bench(name="toy", script=__file__, title="toy", group=("cfg",),
                      columns=[harness.Col("median ms", "median_ms", "{{:.3f}}"), harness.Col("peak MiB", "peak_mib")],
                      ratios={{"× base": "base"}}, mem_vs="base", plan=plan, measure=None, add_args=add_args,
                      fake=fake, worker_split={split!r}, grace_s=5.0, start_s=0.5)
sys.exit(harness.main(BENCH))
'''


def _toy(tmp_path, *args, split=(), timeout=60):
    script = tmp_path / "toy_bench.py"
    script.write_text(TOY.format(bench_dir=str(ROOT / "benchmarks"), split=split))
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, str(script), "--dry-run", "--out", str(out), *args],
                       capture_output=True, text=True, timeout=timeout, env=dict(os.environ, TOY_PID_DIR=str(tmp_path)))
    assert p.returncode == 0, p.stderr
    return json.loads((out / "toy.json").read_text())["rows"], (out / "toy.md").read_text()


def test_ratios_and_memory_side_by_side(tmp_path):
    rows, md = _toy(tmp_path, "--variants", "base", "fast")
    assert [(r["cfg"], r["variant"]) for r in rows] == [("a", "base"), ("a", "fast"), ("b", "base"), ("b", "fast")]
    fast = rows[1]
    assert fast["ratio:× base"] == pytest.approx(2.0) and fast["ratio:mem"] == pytest.approx(1.0)
    assert "| a | fast | 2.000 | 2.00× | 100.0 | 1.00 | ok |" in md and md.startswith("# DRY RUN")
    assert len({r["pid"] for r in rows}) == 1  # no worker_split: one worker for the whole plan


def test_worker_split_starts_a_worker_per_group(tmp_path):
    rows, _ = _toy(tmp_path, "--variants", "base", "fast", split=("cfg",))
    pids = {r["cfg"]: r["pid"] for r in rows}
    assert len({r["pid"] for r in rows}) == 2 and pids["a"] != pids["b"]


def test_failed_isolated_task_continues_in_a_fresh_worker(tmp_path):
    rows, md = _toy(tmp_path, "--variants", "base", "iso-boom", "fast")
    by = {(r["cfg"], r["variant"]): r for r in rows}
    assert len(rows) == 6
    assert by[("a", "iso-boom")]["error"].startswith("RuntimeError: capture failed")
    assert by[("a", "fast")]["pid"] != by[("a", "base")]["pid"]  # after the failed capture: a new process
    assert "| a | iso-boom | - | - | - | - | failed: RuntimeError: capture failed |" in md


def test_hung_worker_is_killed_and_the_rest_still_runs(tmp_path):
    rows, _ = _toy(tmp_path, "--variants", "base", "hang", "fast", "--worker-timeout-s", "4", "--budget-s", "60")
    by = {(r["cfg"], r["variant"]): r for r in rows}
    assert len(rows) == 6
    assert by[("a", "hang")]["error"].startswith("worker killed (task past")
    assert harness.ok(by[("a", "fast")]) and harness.ok(by[("b", "base")])


def test_an_interrupted_run_takes_its_worker_with_it(tmp_path):
    """SIGTERM to the parent (a device call's timeout) kills the worker in flight too: no process
    is left holding the GPU for the next run."""
    script = tmp_path / "toy_bench.py"
    script.write_text(TOY.format(bench_dir=str(ROOT / "benchmarks"), split=()))
    parent = subprocess.Popen([sys.executable, str(script), "--dry-run", "--out", str(tmp_path / "out"),
                               "--variants", "hang"], env=dict(os.environ, TOY_PID_DIR=str(tmp_path)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pid_file = tmp_path / "hang.pid"
    for _ in range(300):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.1)
    worker = int(pid_file.read_text())
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=30) == 143
    for _ in range(100):
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"worker {worker} still alive after its parent was terminated")


def test_budget_spent_writes_skipped_rows_never_drops_them(tmp_path, capsys):
    rows, md = _toy(tmp_path, "--variants", "base", "fast", "--budget-s", "0")
    assert [r.get("skipped") for r in rows] == ["budget 0s spent"] * 4
    assert md.count("| skipped: budget 0s spent |") == 4
    # a worker past the deadline writes what it did not start as skipped too
    tasks = [dict(cfg="a", variant="base")]
    ns = type("A", (), {"deadline": 0.0, "dry_run": True})()
    bench = harness.Bench(name="t", script="-", title="t", group=("cfg",), columns=[], ratios={}, plan=None,
                          measure=None, fake=lambda t, i: {"median_ms": 1.0})
    assert harness._worker(bench, tasks, ns) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line.removeprefix(harness.RESULT)) == dict(tasks[0], skipped="budget spent (worker)")


def test_merge_concatenates_chunks(tmp_path):
    bench = harness.Bench(name="m", script="-", title="m", group=("cfg",), columns=[harness.Col("ms", "median_ms")],
                          ratios={"× e": "eager"}, plan=None, measure=None)
    for name, v, ms in (("c1", "eager", 4.0), ("c2", "fast", 1.0)):
        harness.write(bench, tmp_path / name, {"dry_run": True}, [dict(cfg="x", variant=v, median_ms=ms)], True)
    md = harness.merge(bench, [str(tmp_path / "c1"), str(tmp_path / "c2")], tmp_path / "all")
    assert "| x | fast | 1.0 | 4.00× | ok |" in md
    with pytest.raises(SystemExit, match="does not exist"):
        harness.merge(bench, [str(tmp_path / "nope")], tmp_path / "all")


def test_parse_kv():
    assert harness.parse_kv(["a=1", "b=torch", 'c=["x"]']) == {"a": 1, "b": "torch", "c": ["x"]}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        harness.parse_kv(["novalue"])


def test_gpu_plan_chunks_fit_their_device_calls_and_the_md_is_current():
    """Every chunk's own --plan (the script's arguments, parsed by the script) ends within the
    call limit, its estimate too; the core is about the session's 20 minutes; gpu_plan.md is
    what --markdown prints now."""
    names = [c.name for c in gpu_plan.CHUNKS]
    assert len(set(names)) == len(names)
    core = 0.0
    for i, c in enumerate(gpu_plan.CHUNKS, 1):
        p = gpu_plan.dry_plan(c)
        assert p["tasks"] and max(p["estimate_s"], p["max_wall_s"]) < gpu_plan.CALL_LIMIT_S, c.name
        core += p["estimate_s"] if i <= gpu_plan.CORE else 0
    assert core < 25 * 60
    assert (ROOT / "benchmarks" / "gpu_plan.md").read_text() == gpu_plan.markdown()


def test_gpu_plan_covers_the_rounds_rows():
    """The issue-21/22/24/26 rows the session must measure are in the plan's first chunks."""
    want = {("bench_transformer_layer.py", "layer1", "fp8", "te_inductor-ro"),
            ("bench_transformer_layer.py", "stack4", "bf16", "mgc"),
            ("bench_gpu.py", 256, "fp8", "te_step-ro"), ("bench_gpu.py", 256, "bf16", "te_mgc-noclone"),
            ("bench_gpu.py", 256, "fp8", "mgc-noclone"), ("bench_gpu.py", 8192, "bf16", "te_step-ro"),
            ("bench_gpu.py", 256, "fp8-delayed", "te_inductor-ro"), ("bench_gpu.py", 8192, "fp8-block", "eager"),
            ("bench_transformer_layer.py", "layer1", "fp8-delayed", "te_inductor-ro"),
            ("bench_transformer_layer.py", "layer1", "fp8", "te_mgc")}
    seen = set()
    for c in gpu_plan.CHUNKS[:gpu_plan.CORE]:
        for t in gpu_plan.dry_plan(c)["tasks"]:
            seen.add((c.script, t.get("model", t.get("tokens")), t["precision"], t["variant"]))
    assert want <= seen, want - seen


def test_run_on_device_chunk_mode_resolves_every_chunk():
    text = (ROOT / "tests" / "gpu" / "run_on_device.sh").read_text()
    assert "chunk)" in text and "gpu_plan.py --command" in text
    for c in gpu_plan.CHUNKS:
        assert gpu_plan.main(["--command", c.name]) == 0
    with pytest.raises(SystemExit, match="unknown chunk"):
        gpu_plan.main(["--command", "nope"])


def test_harness_imports_without_torch():
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r})
        import harness, te_variants, gpu_plan
        assert 'torch' not in sys.modules, 'harness imported torch'
    """)
    subprocess.run([sys.executable, "-c", code], check=True)
