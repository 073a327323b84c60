"""benchmarks/bench_prepare_forward_cpu.py (issue 38: the eager cost of row ``untouched.prepare_forward``) at a tiny
size: one row per recipe state, the module really switched to fp8 for the fp8 states (asserted inside
``measure``), every timing positive, and TE's global fp8 state left as a fresh process has it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformer_engine.pytorch")

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


def _mod():
    sys.path.insert(0, str(BENCH_DIR))
    name = "bench_prepare_forward_cpu"
    spec = importlib.util.spec_from_file_location(f"_{name}", BENCH_DIR / f"{name}.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def test_measures_te_and_the_row_side_by_side():
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    from te_passes.compat.untouched import forward_state

    rows = _mod().measure(calls=20, rounds=2)
    assert [r[0] for r in rows] == ["bf16", "fp8 current scaling", "fp8 delayed scaling"]
    for r in rows:
        te_us, row_us, floor_us, method_us = map(float, r[1:5])
        assert min(te_us, row_us, floor_us, method_us) > 0, r
    # the row stays installed (the benchmark measures it, never reverts it)
    assert TransformerEngineBaseModule.__dict__["prepare_forward"] is forward_state.prepare_forward
