"""CPU checks of the GPU harness (te_passes/testing/gpu.py).

The GPU suite only runs on the H200; what it counts must be right before device time is spent,
so it is tested here on CPU with ``backend="eager"`` graphs; so is the GPU suite's construction
counter. The benchmarks' reporting and goals: tests/benchmarks/test_bench_harness_cpu.py,
tests/benchmarks/test_bench_transformer_layer_cpu.py.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

from te_passes.testing.gpu import CompileWatch, forward_fn, fwd_bwd, gpu_skip_reason, make_recipe, rel_err


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
    # which frames the graphs are: _f and the resume function after its break, each compiled twice
    line = _f.__code__.co_firstlineno
    first, resume = f"_f (test_gpu_harness_cpu.py:{line}) ops 1", f"(test_gpu_harness_cpu.py:{line + 3}) ops 2"
    assert [f.split(" ", 1)[1] for f in w.stats.frames[::2]] == [first, first], w.stats.frames
    assert all(f.startswith(f"1/{i} torch_dynamo_resume_in__f") and f.endswith(resume)
               for i, f in enumerate(w.stats.frames[1::2])), w.stats.frames


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


def test_fwd_bwd_clears_grads_and_returns_the_step_s_own():
    """fwd_bwd starts from cleared grads (a second call does not accumulate) and takes a tuple's
    first output."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3, requires_grad=True)
    dy = torch.ones(4, 2)
    y1, g1 = fwd_bwd(lambda t: (lin(t), None), lin, x, dy)
    y2, g2 = fwd_bwd(lin, lin, x, dy)
    torch.testing.assert_close(y1, x.detach() @ lin.weight.detach().T + lin.bias.detach())
    assert sorted(g1) == ["bias", "weight", "x"]
    for k in g1:
        torch.testing.assert_close(g1[k], g2[k])
    torch.testing.assert_close(g1["weight"], dy.T @ x.detach())
    torch.testing.assert_close(g1["x"], dy @ lin.weight.detach())


# --------------------------------------------------------------------------- the GPU suite's construction counter
def _gpu_test_module():
    path = pathlib.Path(__file__).resolve().parents[1] / "gpu" / "test_hoist_recipe_lookups_gpu.py"
    spec = importlib.util.spec_from_file_location("_hoist_gpu_tests", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_count_constructions_restores_quantizer_class():
    """The GPU suite's construction counter (tests/gpu/test_hoist_recipe_lookups_gpu.py) leaves TE's
    quantizer class constructible afterwards (a mock.patch of ``__new__`` did not, which broke every
    later fp8 test in the H200 run of 2026-11-29)."""
    pytest.importorskip("transformer_engine.pytorch")
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    counting = _gpu_test_module()._count_constructions
    for _ in range(2):
        with counting() as counts:
            Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, device=torch.device("cpu"))
        assert counts["other"] == 1  # built by this test, not by a _rebuild_quantizer call
        q = Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, device=torch.device("cpu"))
        assert type(q) is Float8CurrentScalingQuantizer
