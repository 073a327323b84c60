"""benchmarks/bench_llama.py without a GPU: row names, the plan (order, competitor groups, presets,
the two device commands fitting their calls), the dry run's tables and kernel diffs, the torch
competitor against TE's own formulas (RoPE, SwiGLU halves, parameter names), the CPU check of the
real-size models on fake CUDA, and te_variants' accumulate / kernel-list options."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))
if (ROOT / ".whl" / "site").is_dir():  # torchao for the benchmark (an ignored folder; see docs/benchmarks.md)
    sys.path.append(str(ROOT / ".whl" / "site"))

import bench_llama as bl  # noqa: E402
import kernel_diff as kd  # noqa: E402


def _cli(*args, check=True):
    return subprocess.run([sys.executable, str(BENCH_DIR / "bench_llama.py"), *args], capture_output=True, text=True,
                          check=check, cwd=ROOT)


def _plan(*args):
    return json.loads(_cli(*args, "--plan").stdout)["tasks"]


def _ns(**kw):
    return argparse.Namespace(**dict(dict(rows=None, recipes=None, variants=None, preset=None, tag=""), **kw))


def test_row_names():
    assert bl.parse_row("llama8b-8192") == ("llama8b", 1, 8192, 1)
    assert bl.parse_row("llama8b-x2-4096") == ("llama8b", 2, 4096, 1)
    assert bl.parse_row("llama1b-x4-4096x2") == ("llama1b", 4, 4096, 2)
    for bad in ("llama7b-4096", "llama8b", "llama8b-x0-4096", "llama8b-4096x"):
        with pytest.raises(SystemExit, match="bad --rows entry"):
            bl.parse_row(bad)


def test_plan_order_groups_and_competitors():
    """Per (row, recipe): TE eager first, captures last (isolated), torch rows only in bf16 groups,
    torchao rows only in fp8 groups; comma and space separated lists; --tag marks te_passes rows."""
    tasks = _plan("--rows", "llama8b-8192,llama1b-x4-2048", "--recipes", "bf16", "fp8", "--variants",
                  "mgc,torchao-tw-inductor,te_inductor", "eager", "torch-inductor", "--tag", "t")
    groups: dict = {}
    for t in tasks:
        groups.setdefault((t["row"], t["precision"]), []).append((t["variant"], t["isolate"]))
    assert list(groups) == [("llama8b-8192", "bf16"), ("llama8b-8192", "fp8"), ("llama1b-x4-2048", "bf16"),
                            ("llama1b-x4-2048", "fp8")]
    assert groups[("llama8b-8192", "bf16")] == [("eager", False), ("te_inductor+t", False), ("torch-inductor", False),
                                                ("mgc", True)]
    assert groups[("llama8b-8192", "fp8")] == [("eager", False), ("torchao-tw-inductor", False),
                                               ("te_inductor+t", False), ("mgc", True)]  # the rest as given


def test_bad_arguments_are_refused_with_the_reason():
    for args, msg in ((["--rows", "llama9b-1"], "bad --rows entry 'llama9b-1'"),
                      (["--recipes", "fp9"], "unknown recipe ['fp9']"),
                      (["--variants", "eager,te_bogus"], "unknown variant ['te_bogus']"),
                      (["--preset", "gpu1", "--rows", "llama8b-4096"], "give either --preset or those flags")):
        p = _cli(*args, "--plan", check=False)
        assert p.returncode != 0 and msg in p.stderr, (args, p.stderr)


def test_steps_is_iters():
    p = _cli("--steps", "0", "--plan", check=False)
    assert p.returncode != 0 and "--iters must be >= 1" in p.stderr


def test_gpu_plan_covers_the_done_when_rows_within_two_calls():
    """The two device commands: every 'Done when' configuration of issue 41 starts within its
    command's budget (by the H100 estimate), and each command ends within a 9-minute call."""
    started = set()
    for name in ("gpu1", "gpu2"):
        t, seen = 0.0, set()
        for task in bl.tasks_of(_ns(preset=name)):
            g = (task["row"], task["precision"])
            t += bl.COST_S["worker"] if g not in seen else 0.0
            seen.add(g)
            if t <= bl.GPU_BUDGET_S:
                started.add((*g, task["variant"]))
            t += bl.estimate_s(task)
    assert bl.GPU_BUDGET_S + bl.BENCH.grace_s <= bl.GPU_CALL_S <= 540
    need = {(r, p, v) for r in ("llama8b-8192", "llama8b-4096") for p, vs in
            (("bf16", ("eager", "te_inductor", "mgc", "torch-inductor")),
             ("fp8", ("eager", "te_inductor", "mgc", "torchao-tw-inductor"))) for v in vs}
    need |= {(r, "fp8-delayed", v) for r in ("llama8b-8192", "llama8b-4096") for v in ("eager", "te_inductor")}
    need |= {(r, "fp8", v) for r in ("llama1b-x4-2048", "llama1b-x4-4096x2")
             for v in ("eager", "te_inductor", "te_inductor-ro", "mgc")}
    need |= {("llama8b-4096", "bf16", "inductor")}  # the first-call goal's baseline
    assert need <= started, sorted(need - started)
    text = _cli("--gpu-plan").stdout
    assert text.count("python3 benchmarks/bench_llama.py --preset gpu") == 2 and "--budget-s 430" in text
    assert "$PWD/.whl/site" in text and "--merge $OUT/llama-gpu1 $OUT/llama-gpu2" in text


def test_dry_run_writes_every_row_with_kernel_diffs_and_goals(tmp_path):
    args = ["--rows", "llama8b-8192", "llama1b-x4-2048", "--recipes", "bf16,fp8-delayed", "--variants",
            "eager,te_inductor,te_inductor-ro,torch-inductor,mgc"]
    p = _cli("--dry-run", "--no-cpu-check", "--out", str(tmp_path), *args)
    data = json.loads((tmp_path / "bench_llama.json").read_text())
    assert [(r["row"], r["precision"], r["variant"]) for r in data["rows"]] == [
        (t["row"], t["precision"], t["variant"]) for t in _plan(*args)]
    md = (tmp_path / "bench_llama.md").read_text()
    assert md.startswith("# DRY RUN (made-up numbers)") and "DRY RUN" in p.stdout
    assert "## Kernels against TE eager" in md and "**llama8b-8192/bf16: te_inductor vs eager**" in md
    assert "removed 1 (-40 µs)" in md and "`add_mul`" in md
    goals = {g["goal"]: g["verdict"] for g in data["goals"]}
    assert "te_inductor ≥ 1.0× torch + Inductor, llama8b-8192/bf16" in goals
    assert "te_inductor-ro ≥ 1.0× mgc, llama1b-x4-2048/bf16" in goals
    assert goals["te_inductor bit-identical to TE eager, llama8b-8192/fp8-delayed"] == "MET"  # fake: 3/3


def _row(variant, ms, **kw):
    return dict(dict(variant=variant, median_ms=ms, peak_mib=100.0, kernel_ms=1.0, graphs=1, graph_breaks=0,
                     recompiles=0, recompiles_after_first=0, cudagraph_skips=0, max_rel_err=1e-3, worst="y",
                     bit_identical="1/9", first_call_s=10.0), **kw)


def test_goals_on_hand_made_rows():
    g8 = dict(row="llama8b-8192", precision="fp8")
    gb = dict(row="llama8b-8192", precision="bf16")
    g1 = dict(row="llama1b-x4-2048", precision="fp8")
    gd = dict(row="llama8b-4096", precision="fp8-delayed")
    rows = [dict(g8, **_row("eager", 10.0)),
            dict(g8, **_row("te_inductor", 10.5, peak_mib=101.0, first_call_s=30.0)),
            dict(g8, **_row("inductor", 11.0, first_call_s=20.0)), dict(g8, **_row("torchao-tw-inductor", 9.0)),
            dict(gb, **_row("eager", 12.0)), dict(gb, **_row("torch-inductor", 13.0, max_rel_err=0.3, worst="x")),
            dict(gb, **_row("te_inductor", 11.0, graphs=2)),
            dict(g1, **_row("mgc", 5.0)), dict(g1, **_row("te_inductor-ro", 5.2, peak_mib=109.0)),
            dict(g1, **_row("eager", 7.0)), dict(g1, **_row("te_inductor", 6.0, max_rel_err=0.2)),
            dict(gd, **_row("eager", 10.0)), dict(gd, **_row("te_inductor", 10.5, bit_identical="9/9"))]
    goals = {k: (v, m) for k, v, m in bl.goals(rows)}
    assert goals["te_inductor ≥ 1.0× TE eager (goal 1.05×), llama8b-8192/fp8"][0] == "NOT MET"
    assert goals["te_inductor peak memory ≤ eager + 2%, llama8b-8192/fp8"][0] == "MET"
    assert goals["te_inductor ≥ 1.0× torchao float8 tensorwise + Inductor, llama8b-8192/fp8"][0] == "NOT MET"
    assert goals["te_inductor ≥ 1.0× torch + Inductor, llama8b-8192/bf16"][0] == "MET"
    assert goals["te_inductor first call ≤ 1.2× plain Inductor's on the TE model, llama8b-8192/fp8"] == (
        "NOT MET", "30.0 vs 20.0 s")
    assert goals["torch-inductor is TE's layer (bf16 within 5e-2 of TE eager), llama8b-8192/bf16"][0] == "NOT MET"
    assert goals["te_inductor: 1 graph, 0 breaks, 0 recompiles after step 1, llama8b-8192/bf16"][0] == "NOT MET"
    assert goals["te_inductor-ro ≥ 1.0× mgc, llama1b-x4-2048/fp8"][0] == "NOT MET"
    assert goals["te_inductor-ro peak memory ≤ mgc + 10%, llama1b-x4-2048/fp8"][0] == "MET"
    assert goals["te_inductor ≥ 1.2× TE eager, llama1b-x4-2048/fp8"][0] == "NOT MET"
    assert goals["te_inductor within 0.05 of TE eager (output, every gradient), llama1b-x4-2048/fp8"][0] == "NOT MET"
    assert goals["te_inductor bit-identical to TE eager, llama8b-4096/fp8-delayed"][0] == "MET"
    assert not any("torchao" in k and "4096" in k for k in goals)  # only at 8192 tokens


def test_kernel_diff():
    base = {"gemm": [6.0, 900.0], "rmsnorm_fwd": [2.0, 40.0], "cast": [4.0, 60.0], "amax": [2.0, 10.0]}
    other = {"gemm": [6.0, 901.0], "cast": [4.0, 80.0], "amax": [3.0, 10.5],
             "triton_red_fused_add_pow_rsqrt_3": [2.0, 30.0]}
    entries = {e["name"]: e for e in kd.diff(base, other)}
    assert {n: e["change"] for n, e in entries.items()} == {
        "gemm": "same", "rmsnorm_fwd": "removed", "cast": "changed", "amax": "changed",
        "triton_red_fused_add_pow_rsqrt_3": "added"}
    assert [e["name"] for e in kd.diff(base, other)][:2] == ["rmsnorm_fwd", "triton_red_fused_add_pow_rsqrt_3"]
    s = kd.summary(kd.diff(base, other))
    assert (s["removed_us"], s["added_us"], s["changed_kinds"]) == (-40.0, 30.0, 2)
    assert kd.fused_ops("triton_red_fused_add_pow_rsqrt_3") == "add_pow_rsqrt" and kd.fused_ops("gemm") is None
    assert kd.short("void cutlass::Kernel<a|b>(int, float)") == "cutlass::Kernel<a\\|b>"
    rows = [dict(row="r", precision="bf16", variant="eager", median_ms=1.0, kernels=base),
            dict(row="r", precision="bf16", variant="te_inductor", median_ms=1.0, kernels=other),
            dict(row="r", precision="bf16", variant="mgc", error="boom")]
    md = kd.appendix(rows, ("row", "precision"))
    assert "**r/bf16: te_inductor vs eager**" in md and "`add_pow_rsqrt`" in md and "mgc" not in md
    assert kd.appendix(rows[1:], ("row", "precision")) == ""  # no baseline: nothing to diff


# ------------------------------------------------------------------ the models (torch on the CPU)
def _te():
    from te_passes.testing.capture import capture_skip_reason

    why = capture_skip_reason()
    if why:
        pytest.skip(why)
    import transformer_engine.pytorch as te

    return te


def test_rope_matches_te():
    """rope_freqs == TE's RotaryPositionEmbedding, apply_rope == TE's unfused apply_rotary_pos_emb."""
    te = _te()
    from unittest import mock

    import torch

    import llama_models as lm

    with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):
        freqs_te = te.attention.RotaryPositionEmbedding(16)(12)
    freqs = lm.rope_freqs(12, 16, "cpu")
    assert torch.equal(freqs, freqs_te) and freqs.shape == (12, 1, 1, 16)
    t = torch.randn(12, 2, 3, 16, dtype=torch.bfloat16)
    assert torch.equal(lm.apply_rope(t, freqs), te.attention.rope.apply_rotary_pos_emb(t, freqs, "sbhd", fused=False))


def test_torch_block_names_halves_and_gqa():
    """TE parameter names for every torch parameter; fc1's halves: w1 (SiLU, TE's first half), w3;
    GQA with enable_gqa equals the repeat-interleaved keys (TE's group of query head i: i // (heads / groups))."""
    import torch
    import torch.nn.functional as F

    import llama_models as lm

    model = lm.TorchStack(lm.SHAPES["tiny"], 2, device="cpu")
    names = lm.te_names(model)
    assert names["layers.1.w3.weight"] == ("layers.1.layernorm_mlp.fc1_weight", 1)
    assert names["layers.0.wk.weight"] == ("layers.0.self_attention.layernorm_qkv.key_weight", None)
    fc1 = torch.randn(2 * 128, 64)
    ref = {"y": torch.ones(1), "layers.0.layernorm_mlp.fc1_weight": fc1}
    got = lm.reference_for_torch(ref, model)
    assert torch.equal(got["layers.0.w1.weight"], fc1[:128]) and torch.equal(got["layers.0.w3.weight"], fc1[128:])
    assert set(got) == {"y", "layers.0.w1.weight", "layers.0.w3.weight"}
    model.layers[0].extra = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="no TE counterpart"):
        lm.te_names(model)
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    v = torch.randn(1, 2, 5, 8)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    b = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    assert torch.allclose(a, b, atol=1e-6)


def test_torch_block_swiglu_is_te_formula():
    """One block by hand with TE's formulas (RMSNorm in fp32, SwiGLU = silu(first half) * second
    half of fc1) equals the torch block with weights loaded from those tensors."""
    import torch
    import torch.nn.functional as F

    import llama_models as lm

    torch.manual_seed(0)
    shape = lm.SHAPES["tiny"]
    blk = lm.TorchLlamaBlock(shape, device="cpu", dtype=torch.float32)
    for p in blk.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(6, 2, shape.hidden)
    fc1 = torch.cat([blk.w1.weight, blk.w3.weight])  # TE's [2 * ffn, hidden]

    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + lm.EPS) * w

    n = rms(x, blk.attention_norm.weight)
    s, b, _ = x.shape
    q = (n @ blk.wq.weight.T).view(s, b, 4, 16).permute(1, 2, 0, 3)
    k = (n @ blk.wk.weight.T).view(s, b, 2, 16).permute(1, 2, 0, 3).repeat_interleave(2, 1)
    v = (n @ blk.wv.weight.T).view(s, b, 2, 16).permute(1, 2, 0, 3).repeat_interleave(2, 1)
    att = torch.softmax((q @ k.transpose(-1, -2)) / 4 + torch.full((s, s), -torch.inf).triu(1), -1) @ v
    h = x + att.permute(2, 0, 1, 3).reshape(s, b, 64) @ blk.wo.weight.T
    a, g = (rms(h, blk.ffn_norm.weight) @ fc1.T).chunk(2, -1)
    want = h + (F.silu(a) * g) @ blk.w2.weight.T
    assert torch.allclose(blk(x), want, atol=1e-5)


def test_cpu_check_on_fake_cuda():
    """The real-size TE stacks are built on fake CUDA and give the torch block their weights; the
    TE forward traces; the torch block runs on the CPU; torchao rows are checked or skipped with the
    reason. A broken model (wrong widths) fails the check."""
    _te()
    import llama_cpu_check
    import llama_models as lm

    tasks = bl.tasks_of(_ns(rows=["llama8b-4096"], recipes=["bf16", "fp8"],
                            variants=["eager", "te_inductor", "torch-inductor", "torchao-tw-inductor"]))
    report, failed = llama_cpu_check.check(tasks, rope=True, parse_row=bl.parse_row)
    assert not failed, report
    assert "ok    TE stack built, torch block takes its weights" in report
    assert "Dynamo trace of the TE forward, fp8" in report and "torch-inductor: tiny forward + backward" in report
    assert ("torchao-tw-inductor: torchao converts every nn.Linear: 7 Float8Linear" in report
            or "skip  torchao-tw-inductor: torchao not importable" in report)
    broken = dict(lm.SHAPES)
    broken["llama8b"] = lm.Shape(4096, 14336, 32, 7)  # 32 heads in 7 groups: TE refuses
    from unittest import mock

    with mock.patch.dict(lm.SHAPES, broken):
        report, failed = llama_cpu_check.check(tasks[:1], rope=False, parse_row=bl.parse_row)
    assert failed and "FAIL  TE stack built" in report


def test_te_variants_accumulate_and_kernel_list(monkeypatch, tmp_path):
    """build_step(accumulate=True) leaves parameter grads to accumulate (x.grad still cleared);
    measure(kernel_list) adds the per-step kernel table (empty on the CPU: no device events)."""
    import torch

    import te_variants as tv

    model = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    dy = torch.randn(2, 4)
    step, _ = tv.build_step("eager", model, None, x, dy, {}, False, accumulate=True)
    step()
    g1, xg1 = model.weight.grad.clone(), x.grad.clone()
    step()
    assert torch.allclose(model.weight.grad, 2 * g1) and torch.allclose(x.grad, xg1)
    step, _ = tv.build_step("eager", model, None, x, dy, {}, False)
    step()
    assert torch.allclose(model.weight.grad, g1)
    import types

    import harness

    table: dict = {}
    lin = torch.nn.Linear(4, 4)
    assert harness.kernel_sum_ms(lambda: lin(x).sum().backward(), 2, by_name=table) == 0.0
    assert table == {}  # no device events on the CPU
    # CPU events counted as "device" events: the table holds launches and µs per step
    monkeypatch.setattr(torch.autograd, "DeviceType", types.SimpleNamespace(CUDA=torch.autograd.DeviceType.CPU))
    ms = harness.kernel_sum_ms(lambda: lin(x).sum().backward(), 2, by_name=table)
    assert table["aten::addmm"][0] == 1.0 and table["aten::addmm"][1] > 0
    assert ms == pytest.approx(sum(us for _, us in table.values()) / 1e3)


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


def test_competitor_row_is_measured_against_te_names(monkeypatch, tmp_path):
    """A torch row's numerics go through the TE-named reference: TE eager's outputs by TE name
    (fc1's gradient one [2 * ffn, hidden] tensor) renamed to the torch block's parameters cover
    every parameter; te_variants.measure on the CPU (torch.cuda's timing stood in) then compares all
    of them (bit-identical here: the reference is this block's own eager step) and records the
    kernel list."""
    import torch

    import llama_models as lm
    import te_variants as tv

    for name, val in (("Event", _Event), ("synchronize", lambda: None), ("memory_allocated", lambda: 0),
                      ("max_memory_allocated", lambda: 2**20), ("reset_peak_memory_stats", lambda: None),
                      ("_sleep", lambda n: None)):
        monkeypatch.setattr(torch.cuda, name, val)
    torch.manual_seed(0)
    shape = lm.SHAPES["tiny"]
    model = lm.TorchStack(shape, 2, lm.rope_freqs(8, shape.head_dim, "cpu"), device="cpu")
    x = torch.randn(8, 2, shape.hidden, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(8, 2, shape.hidden, dtype=torch.bfloat16)
    own = tv.reference(model, None, x, dy)
    te_ref: dict = {"y": own["y"], "x": own["x"]}
    halves: dict = {}
    for name, (te_name, half) in lm.te_names(model).items():
        if half is None:
            te_ref[te_name] = own[name]
        else:
            halves.setdefault(te_name, [None, None])[half] = own[name]
    te_ref.update((k, torch.cat(v)) for k, v in halves.items())
    assert te_ref["layers.1.layernorm_mlp.fc1_weight"].shape == (2 * shape.ffn, shape.hidden)
    ref = lm.reference_for_torch(te_ref, model)
    assert set(ref) == set(own) and len(ref) == 2 + 9 * 2
    args = argparse.Namespace(warmup=1, iters=2, kernel_steps=1, split_steps=0, te_option=None, profile=[], trace=[],
                              out=str(tmp_path), kernel_list=True, accumulate=False)
    row = tv.measure(dict(precision="bf16", variant="eager"), args, model, x, dy, ref, prepare=False, tag="t")
    assert row["bit_identical"] == "20/20" and row["max_rel_err"] == 0.0 and row["kernels"] == {}


def test_mxfp8_left_out_with_the_reason(monkeypatch):
    """On a GPU without MXFP8 (TE's is_mxfp8_available says no: Hopper) the plan leaves the mxfp8
    rows out and writes TE's reason into the notes; on one with it they stay."""
    te = _te()
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(te, "is_mxfp8_available", lambda return_reason=False: (False, "needs sm_100+"))
    why = bl.mxfp8_reason()
    assert why == "MXFP8 unavailable on NVIDIA H100 80GB HBM3 (needs sm_100+): mxfp8 rows left out"
    args = _ns(rows=["llama8b-4096"], recipes=["fp8", "mxfp8"], variants=["eager"], gpu_plan=False, dry_run=False,
               plan=False, no_cpu_check=True, rope=False)
    assert [t["precision"] for t in bl.plan(args)] == ["fp8"] and args.plan_notes == [why]
    assert why in bl.notes(argparse.Namespace(**dict(vars(args), accumulate=False, iters=30, warmup=6,
                                                     kernel_steps=10)))
    monkeypatch.setattr(te, "is_mxfp8_available", lambda return_reason=False: (True, ""))
    assert [t["precision"] for t in bl.plan(args)] == ["fp8", "mxfp8"] and args.plan_notes == []
