"""benchmarks/bench_host_profile.py's timers without a GPU: exclusive times, the calibrated
timer cost, collector pauses as their own layer."""

from __future__ import annotations

import gc
import importlib.util
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_host_profile.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_host_profile", SCRIPT)
    m = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = m  # its dataclasses look their module up
    try:
        spec.loader.exec_module(m)
        yield m
    finally:
        sys.modules.pop(spec.name, None)


def _spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_exclusive_time_and_timer_cost(bench):
    t = bench.Timers()
    assert t.calibrate(n=2000, rounds=3) > 0
    t.overhead_s = 1e-3  # a made-up cost, so the subtraction is visible against the spin times
    child = t.wrap(lambda: _spin(0.004), "child")
    parent = t.wrap(lambda: (_spin(0.010), child(), child()), "parent")
    t.on = True
    parent()
    t.on = False
    assert t.calls == {"parent": 1, "child": 2}
    assert t.incl["parent"] >= 0.018 and t.incl["child"] >= 0.008
    # parent's own 10 ms, minus 2 ms charged to the children's timers
    assert t.excl["parent"] == pytest.approx(t.incl["parent"] - t.incl["child"] - 2e-3)
    assert t.timer == {"parent": pytest.approx(2e-3), "child": 0.0}


def test_collector_pause_is_its_own_layer(bench):
    t = bench.Timers()

    def collects():
        _spin(0.002)
        gc.collect()

    f = t.wrap(collects, "f")
    t.on = True
    with t.gc_layer():
        f()
    t.on = False
    (label,) = [k for k in t.excl if k.startswith("python: gc")]
    assert label == "python: gc (generation 2)" and t.calls[label] == 1
    assert t.excl["f"] == pytest.approx(t.incl["f"] - t.excl[label])
    assert t._gc_callback not in gc.callbacks
