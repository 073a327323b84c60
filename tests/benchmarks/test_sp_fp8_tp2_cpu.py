"""CPU checks of benchmarks/sp_fp8_tp2.py (issue 8's 2-GPU scenario script) before device time is spent.

The script itself needs two GPUs, TE and NCCL. What is checked here, with a torch-only stand-in for
the column/row pair (``torch.nn.Linear``, ``backend="eager"`` or a hand-made backend) and a
``fake`` process group: its per-mode judge (:func:`run_mode`) passes when compiled == eager and
names each failure it exists for (a first call that raises, numerics, graph breaks and extra
frames, recompiles, a quantizer left holding a ProcessGroup); the amax-reduction verdict; the
group scan; and that loading its GPU harness does not import te_passes (the ``inductor``
scenario's premise).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


@pytest.fixture(scope="module")
def sp():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("sp_fp8_tp2_under_test", BENCH / "sp_fp8_tp2.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def fake_group(fake_tp_group):
    return fake_tp_group


class _Q:
    """Stands in for a TE quantizer: only ``amax_reduction_group`` is read."""

    def __init__(self, group=None):
        self.amax_reduction_group = group


def _pair(sp, *, col_scale_when_compiling: float = 1.0, row_break: bool = False):
    """A torch-only Pair: ``col`` Linear(8, 16), ``row`` Linear(16, 8), no bias, fp32 on CPU."""
    pair = sp.Pair.__new__(sp.Pair)
    torch.manual_seed(0)
    pair.col = torch.nn.Linear(8, 16, bias=False)
    pair.row = torch.nn.Linear(16, 8, bias=False)
    pair.mods = {"col": pair.col, "row": pair.row}
    pair.reduction_refs = None
    col, row = pair.col, pair.row

    def col_fwd(x):
        y = col(x)
        if torch.compiler.is_compiling():
            y = y * col_scale_when_compiling
        return y

    def row_fwd(h):
        if row_break:
            torch._dynamo.graph_break()
        return row(h)

    pair.col_fwd, pair.row_fwd = col_fwd, row_fwd
    return pair


def _args(**kw):
    base = dict(alt_steps=2, pure_steps=3, scale=1.0, max_compiles_per_fn=1)
    base.update(kw)
    return argparse.Namespace(**base)


def _inputs(n=2):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(n)], g


def _run(sp, pair, backend="eager", **kw):
    inputs, gen = _inputs()
    torch._dynamo.reset()
    try:
        return sp.run_mode(pair, _args(**kw), sp.load_gpu_harness(), backend, "default", inputs, gen, 0, True)
    finally:
        torch._dynamo.reset()


def test_run_mode_passes_when_compiled_equals_eager(sp):
    rec = _run(sp, _pair(sp))
    assert rec["failures"] == []
    assert rec["first_call"]["raised"] is None
    assert rec["compiled_steps_ok"] == 1 + 2 + 3 and rec["all_bitwise_equal"] and rec["max_abs_diff"] == 0.0
    assert rec["compile"]["compiles_per_frame"] == {"0": 1, "1": 1}  # one frame per function, no recompile
    assert rec["compile"]["recompiles"] == 0 and rec["compile"]["graph_breaks"] == 0
    assert [s["step"] for s in rec["steps"]] == ["first", "alt0", "alt1", "pure0", "pure1", "pure2"]
    assert set(rec["steps"][0]["max_abs"]) == set(sp.TENSORS)
    assert rec["alternation"] == {"alternations": 2, "compiled_steps_compared": 2, "recompiles": 0,
                                  "bitwise_equal": True, "ok": True}
    line = sp.summary_line("te_inductor", 0, rec)
    assert line.startswith("SUMMARY te_inductor rank=0 mode=default first_call=ok") and line.endswith("-> PASS")
    assert "alternation[n=2 recompiles=0 bitwise=True ok=True]" in line


def test_run_mode_flags_numerics(sp):
    rec = _run(sp, _pair(sp, col_scale_when_compiling=1.5))
    assert not rec["all_bitwise_equal"] and rec["max_abs_diff"] > 0
    assert [f for f in rec["failures"] if f.startswith("numerics:")], rec["failures"]
    assert sp.summary_line("te_inductor", 0, rec).endswith("-> FAIL")


def test_run_mode_flags_graph_break_and_extra_frame(sp):
    rec = _run(sp, _pair(sp, row_break=True))
    assert any(f.startswith("graph breaks:") for f in rec["failures"]), rec["failures"]
    assert any(f.startswith("compiles:") for f in rec["failures"]), rec["failures"]  # the resume frame


def test_run_mode_records_first_call_error_and_retries(sp):
    calls = []

    def flaky_backend(gm, example_inputs):
        calls.append(gm)
        if len(calls) == 1:
            raise TypeError("Float8CurrentScalingQuantizer cannot be used as a torch.compile value object: "
                            "'amax_reduction_group' holds a torch.distributed.ProcessGroup")
        return gm.forward

    rec = _run(sp, _pair(sp), backend=flaky_backend)
    assert rec["first_call"]["raised"] and rec["first_call"]["issue8_error"]
    assert rec["first_call"]["retry"] == "ok"
    assert rec["errors"][0]["where"] == "first call"
    assert any(f.startswith("first compiled call raised") for f in rec["failures"])
    assert rec["compiled_steps_ok"] == 6 and rec["all_bitwise_equal"]  # the run went on after the retry
    assert "first_call=issue8-TypeError retry=ok" in sp.summary_line("te_inductor", 0, rec)


def test_run_mode_flags_recompiles(sp):
    pair = _pair(sp)
    flip = {"n": 0}
    col = pair.col

    def col_fwd(x):  # reads a global that the eager steps change: a guard failure per alt step
        return col(x) * (1.0 if flip["n"] % 2 == 0 else 1.0)

    orig_step = pair.step

    def step(fc, fr, x, dy, mark):
        if fc is pair.col_fwd:  # an eager step
            flip["n"] += 1
        return orig_step(fc, fr, x, dy, mark)

    pair.col_fwd, pair.step = col_fwd, step
    rec = _run(sp, pair)
    assert rec["compile"]["recompiles"] >= 1
    assert any(f.startswith("compiles:") for f in rec["failures"]), rec["failures"]
    assert rec["all_bitwise_equal"]
    # the alternation check (issue 17): a recompile per alternating step fails it
    assert rec["alternation"]["recompiles"] >= 1 and not rec["alternation"]["ok"]
    assert rec["alternation"]["bitwise_equal"]
    assert any(f.startswith("alternation:") for f in rec["failures"]), rec["failures"]
    assert "ok=False]" in sp.summary_line("te_inductor", 0, rec)


def test_group_scan_and_run_mode_flag_a_left_group(sp, fake_group):
    pair = _pair(sp)
    pair.col.quantizers = {"scaling_fwd": [_Q(fake_group), _Q()], "scaling_bwd": [None]}
    pair.row.quantizers = {"scaling_fwd": [], "scaling_bwd": [argparse.Namespace(parent_quantizer=_Q(fake_group))]}
    found = sp.quantizers_holding_group(pair.mods)
    assert found == ["col.quantizers['scaling_fwd'][0] _Q", "row.quantizers['scaling_bwd'][0] _Q"]
    rec = _run(sp, pair)
    assert rec["groups_after_compile_call"] == found and rec["groups_after_run"] == found
    assert any(f.startswith("groups_after_run:") for f in rec["failures"])
    assert any(f.startswith("groups_after_compile_call:") for f in rec["failures"])
    assert any(f.startswith("eager steps left groups") for f in rec["failures"])


def test_reduction_check_verdicts(sp):
    g = torch.Generator().manual_seed(2)
    a = torch.randn(6, 4, generator=g)
    local = a + 0.25
    refs = {k: {"global": a.clone(), "local": local.clone()} for k in ("h", "h.grad")}
    eager = {"h": a.clone(), "h.grad": a.clone()}
    ok = sp.reduction_check({"h": a.clone(), "h.grad": a.clone()}, eager, refs)
    assert ok["ok"] and ok["h"]["compiled_vs_global_amax"] == 0.0
    assert ok["h"]["compiled_vs_local_amax"] == pytest.approx(0.25)
    # compiled computed without the reduction (= the local-amax reference): not ok
    bad = sp.reduction_check({"h": local.clone(), "h.grad": a.clone()}, eager, refs)
    assert not bad["ok"] and not bad["h"]["ok"] and bad["h.grad"]["ok"]
    # references that do not differ cannot show the reduction: not ok either
    same = {k: {"global": a.clone(), "local": a.clone()} for k in ("h", "h.grad")}
    assert not sp.reduction_check({"h": a.clone(), "h.grad": a.clone()}, eager, same)["ok"]


def test_max_abs_nan_and_shape(sp):
    n = torch.tensor([float("nan"), 1.0])
    assert sp.max_abs(n, n) != sp.max_abs(n, n)  # nan
    assert sp.max_abs(torch.zeros(2), torch.zeros(3)) == float("inf")


def test_harness_load_does_not_import_te_passes():
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import sp_fp8_tp2 as s; h = s.load_gpu_harness(); "
            "assert hasattr(h, 'CompileWatch'); "
            "bad = [m for m in sys.modules if m.split('.')[0] == 'te_passes']; assert not bad, bad; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_cli_help_and_bad_modes():
    out = subprocess.run([sys.executable, str(BENCH / "sp_fp8_tp2.py"), "--help"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "--scenario {inductor,te_inductor,te_inductor_ub}" in out.stdout
    bad = subprocess.run([sys.executable, str(BENCH / "sp_fp8_tp2.py"), "--scenario", "te_inductor", "--modes",
                          "max-autotune"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--modes: ['max-autotune']" in bad.stderr
