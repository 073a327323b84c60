"""te_passes.compile_step / te_passes.make_graphed on CPU (issue 22).

* whole-step capture of TE custom ops (the toy family registered through TE's own
  ``register_custom_op``, tests/_helpers/_toy_te_op.py, TE's real impls need a GPU) compiled by
  te_inductor (Inductor on CPU): one Dynamo graph, no graph break, TE's impls called directly,
  loss and every ``.grad`` equal to eager for gradient accumulation, ``zero_grad`` with
  ``set_to_none`` True and False, an optimizer step outside (inside: refused), a shape change
  (recompiles), losses held across steps;
* real te.Linear is not traced whole-step here: the fake GPU cannot run ``autograd.grad`` on fake
  ``cuda`` tensors (the autograd engine asks CUDA for a primary context); real TE, all recipes:
  tests/gpu/test_step_capture_gpu.py;
* ``trace_autograd_ops`` is set only while the step's frames are traced;
* refusals: compile_step / make_graphed arguments, TE in capture state, ``te_passes.guards`` given
  to the backend, graph breaks under ``fullgraph``; make_graphed's reset after a failed
  ``te.make_graphed_callables``.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import te_passes
from te_passes.report import clear_compile_reports, compile_reports
from te_passes.step_capture import CompiledStep, StepCaptureError, compile_step, make_graphed

NO_CACHE: dict = {}  # Inductor's caches on: identical toy graphs across tests compile once


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _params(seed=0, tokens=8):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 16, generator=g)
    ps = [torch.randn(s, generator=g).requires_grad_() for s in ((32, 16), (32,), (32, 32), (32,))]
    return x, ps


def _clone_params(ps):
    return [p.detach().clone().requires_grad_() for p in ps]


def _graphs_and_breaks():
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _close(a, b):
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def _assert_grads(ps, ref):
    for p, r in zip(ps, ref):
        assert (p.grad is None) == (r.grad is None)
        if r.grad is not None:
            assert _close(p.grad, r.grad), (p.grad - r.grad).abs().max()


# --------------------------------------------------------------------------- whole step, toy TE ops
def test_whole_step_is_one_graph_with_direct_calls(toy):
    x, ps = _params()
    ref = _clone_params(ps)

    def step(x, ps):
        loss = toy.model(x, *ps).square().mean()
        loss.backward()
        return loss

    clear_compile_reports()
    toy.CALLS["fwd"].clear(), toy.CALLS["bwd"].clear()
    cstep = compile_step(step, mode=None, options={"fx_graph_cache": False})  # the passes run: records
    assert isinstance(cstep, CompiledStep) and not cstep.cudagraphs
    losses = []
    for _ in range(3):
        for p in ps:
            p.grad = None
        losses.append(cstep(x, ps))
    assert _graphs_and_breaks() == (1, 0), dict(counters["graph_break"])
    # TE's forward and backward impls ran inside the compiled step, called directly (no autograd engine)
    assert len(toy.CALLS["fwd"]) == 2 * 3 and len(toy.CALLS["bwd"]) == 2 * 3
    for p in ref:
        p.grad = None
    ref_loss = step(x, ref)
    assert all(_close(lo, ref_loss) for lo in losses) and not losses[0].requires_grad
    _assert_grads(ps, ref)
    recs = [r.data["op"] for rep in compile_reports() for r in rep.records("direct_call")]
    assert sorted(set(recs)) == sorted({f"transformer_engine_compile::{toy.OP_NAME}_base",
                                        f"transformer_engine_compile::{toy.OP_NAME}_backward_base"}), recs
    toy.CALLS["fwd"].clear(), toy.CALLS["bwd"].clear()


def test_gradient_accumulation_and_zero_grad(toy):
    """Two micro-batches accumulate into .grad (the second graph takes existing .grad tensors:
    one recompile, no break); zero_grad(set_to_none=False) zeroes in place, True drops them."""
    x, ps = _params()
    x2, _ = _params(seed=1)
    ref = _clone_params(ps)
    opt, ropt = torch.optim.SGD(ps, lr=0.1), torch.optim.SGD(ref, lr=0.1)

    step = _sum_step(toy)

    cstep = compile_step(step, mode=None, options=NO_CACHE)
    for set_to_none in (True, False, True, False):
        opt.zero_grad(set_to_none=set_to_none), ropt.zero_grad(set_to_none=set_to_none)
        for mb in (x, x2):  # gradient accumulation over two micro-batches
            assert _close(cstep(mb, ps), step(mb, ref))
        _assert_grads(ps, ref)
    graphs, breaks = _graphs_and_breaks()
    assert breaks == 0 and graphs == 2  # .grad absent / present


def test_optimizer_step_outside_and_refused_inside(toy):
    """Outside: eager's parameters. Inside: torch.optim's step() breaks the graph on purpose
    (optimizer.py ``_use_grad``), refused under fullgraph with the advice. (With fullgraph=False
    the step deadlocks in torch 2.14.1: the eager backward Dynamo leaves behind lazily compiles
    AOT's backward, whose compile-start callbacks Dynamo then tries to compile under
    callback_handler's non-reentrant lock; docs/usage.md.)"""
    x, ps = _params()
    ref = _clone_params(ps)
    inside_ps = _clone_params(ps)
    opt, ropt, iopt = (torch.optim.SGD(p, lr=0.05, momentum=0.9) for p in (ps, ref, inside_ps))

    def fwd_bwd(x, ps):
        loss = toy.model(x, *ps).square().mean()
        loss.backward()
        return loss

    def full_step(x):
        loss = fwd_bwd(x, inside_ps)
        iopt.step()
        return loss

    outside = compile_step(fwd_bwd, mode=None, options=NO_CACHE)
    with pytest.raises(StepCaptureError, match=r"optimizer.step\(\), which breaks the graph on purpose.*outside"
                       r".*fullgraph=False does not help"):
        compile_step(full_step, mode=None, options=NO_CACHE)(x)
    for _ in range(3):
        ropt.zero_grad(set_to_none=True)
        ref_loss = fwd_bwd(x, ref)
        ropt.step()
        opt.zero_grad(set_to_none=True)
        assert _close(outside(x, ps), ref_loss)
        opt.step()
    for a, r in zip(ps, ref):
        assert _close(a, r)


def _sum_step(toy):
    """The plain training step of the toy model: sum loss, backward, the loss returned."""
    def step(x, ps):
        loss = toy.model(x, *ps).sum()
        loss.backward()
        return loss

    return step


def _mean_step_two_shapes(toy):
    """A step (mean loss, backward) of the toy model, its params with 8- and 4-token inputs and a
    clone of the params for eager: ``step, x8, x4, ps, ref``."""
    def step(x, ps):
        loss = toy.model(x, *ps).mean()
        loss.backward()
        return loss

    x8, ps = _params(tokens=8)
    return step, x8, x8[:4].clone(), ps, _clone_params(ps)


def test_shape_change_recompiles_and_held_losses_stay(toy):
    step, x8, x4, ps, ref = _mean_step_two_shapes(toy)
    cstep = compile_step(step, mode=None, options=NO_CACHE)
    held = []
    for x in (x8, x4, x8, x4):
        for p, r in zip(ps, ref):
            p.grad = r.grad = None
        held.append((cstep(x, ps), step(x, ref).detach()))
        _assert_grads(ps, ref)
    assert all(_close(a, b) for a, b in held)
    assert not _close(held[0][0], held[1][0])  # the two shapes really give different losses
    assert counters["stats"]["unique_graphs"] == 2


def test_reduce_overhead_on_cpu_runs_and_clones_nothing_needed(toy):
    """mode="reduce-overhead" (the default): CUDA graphs requested; on CPU Inductor skips them
    (as for backend="inductor") and the step is still one graph with eager's numerics."""
    x, ps = _params()
    ref = _clone_params(ps)

    step = _sum_step(toy)

    cstep = compile_step(step, options=NO_CACHE)
    assert cstep.cudagraphs
    assert _close(cstep(x, ps), step(x, ref))
    _assert_grads(ps, ref)
    assert _graphs_and_breaks() == (1, 0)


def test_skip_unsafe_guards_still_recompile_on_a_new_shape(toy):
    step, x8, x4, ps, ref = _mean_step_two_shapes(toy)
    cstep = compile_step(step, mode=None, options={**NO_CACHE, "te_passes.guards": "skip_unsafe"}, guard_warmup=1)
    for x in (x8, x8, x8, x4, x4, x8):
        for p, r in zip(ps, ref):
            p.grad = r.grad = None
        assert _close(cstep(x, ps), step(x, ref))
        _assert_grads(ps, ref)
    assert counters["stats"]["unique_graphs"] == 2
    assert not torch._dynamo.eval_frame._is_skip_guard_eval_unsafe_stance()  # stance restored


# --------------------------------------------------------------------------- scoped config
def test_trace_autograd_ops_is_scoped_to_the_steps_compiles(toy):
    seen = []

    def recording(gm, example_inputs):
        seen.append(torch._dynamo.config.trace_autograd_ops)
        return gm.forward

    x, ps = _params()

    step = _sum_step(toy)

    assert torch._dynamo.config.trace_autograd_ops is False
    cstep = compile_step(step, backend=recording)
    cstep(x, ps)
    assert seen == [True] and torch._dynamo.config.trace_autograd_ops is False

    # a plain torch.compile afterwards does not trace backward(): it graph-breaks there
    def plain_step(t):
        loss = (t * 2).sum()
        loss.backward()
        return loss

    counters.clear()
    torch.compile(plain_step, backend=recording)(torch.ones(3, requires_grad=True))
    assert any("backward" in str(k) for k in counters["graph_break"]), dict(counters["graph_break"])
    assert torch._dynamo.config.trace_autograd_ops is False


def test_trace_autograd_ops_restored_after_a_failed_compile(toy):
    def boom(gm, example_inputs):
        raise RuntimeError("backend failed")

    x, ps = _params()

    step = _sum_step(toy)

    with pytest.raises(Exception, match="backend failed"):
        compile_step(step, backend=boom)(x, ps)
    assert torch._dynamo.config.trace_autograd_ops is False


# --------------------------------------------------------------------------- refusals
def test_compile_step_refusals(toy):
    with pytest.raises(TypeError, match="callable"):
        compile_step(42)
    with pytest.raises(te_passes.TePassesOptionError, match="te_passes.guards must be one of"):
        compile_step(lambda: None, options={"te_passes.guards": "none"})
    with pytest.raises(te_passes.TePassesOptionError, match="guard_warmup"):
        compile_step(lambda: None, guard_warmup=0)
    with pytest.raises(te_passes.TePassesOptionError, match="unknown te_inductor option"):
        compile_step(lambda: None, options={"te_passes.nope": 1})
    cs = compile_step(lambda: None)
    with pytest.raises(TypeError, match="already a compiled step"):
        compile_step(cs)


def test_guards_option_given_to_the_backend_is_refused_with_the_reason():
    with pytest.raises(te_passes.TePassesOptionError, match="Dynamo evaluates guards before a backend runs"):
        te_passes.te_inductor_backend(options={"te_passes.guards": "skip_unsafe"})


def test_zero_grad_inside_the_step_is_an_error_naming_it(toy):
    x, ps = _params()
    opt = torch.optim.SGD(ps, lr=0.1)

    def step(x):
        opt.zero_grad()
        loss = toy.model(x, *ps).sum()
        loss.backward()
        return loss

    with pytest.raises(StepCaptureError, match="zero_grad.*outside the compiled step"):
        compile_step(step, mode=None, options=NO_CACHE)(x)


def test_graph_break_in_the_step_is_an_error_naming_it(toy):
    x, ps = _params()

    def step(x, ps):
        loss = toy.model(x, *ps).sum()
        torch._dynamo.graph_break()
        loss.backward()
        return loss

    with pytest.raises(torch._dynamo.exc.Unsupported, match="graph_break"):
        compile_step(step, mode=None, options=NO_CACHE)(x, ps)


def test_compile_step_refuses_te_capture_state(toy, monkeypatch):
    import transformer_engine.pytorch.graph as te_graph

    monkeypatch.setattr(te_graph, "_IS_GRAPH_CAPTURING", True)
    x, ps = _params()
    cstep = compile_step(lambda x, ps: toy.model(x, *ps).sum(), mode=None)
    with pytest.raises(StepCaptureError, match="CUDA-graph-capture state"):
        cstep(x, ps)


def test_make_graphed_refusals(monkeypatch):
    pytest.importorskip("transformer_engine.pytorch")
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        make_graphed(lambda t: t, (x,))
    with pytest.raises(StepCaptureError, match="already torch.compile'd"):
        make_graphed(torch.compile(lin), (x,))
    with pytest.raises(TypeError, match="sample_args"):
        make_graphed(lin, [1, 2])
    for k in ("_order", "cache_quantized_params", "_reuse_graph_input_output_buffers"):
        with pytest.raises(StepCaptureError, match=f"{k}=.* refused"):
            make_graphed(lin, (x,), **{k: [1] if k == "_order" else True})
    from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling

    with pytest.raises(StepCaptureError, match="enabled is not True"):
        make_graphed(lin, (x,), recipe=Float8CurrentScaling())
    with pytest.raises(StepCaptureError, match="DelayedScaling is not supported"):
        make_graphed(lin, (x,), enabled=True, recipe=DelayedScaling())
    with pytest.raises(StepCaptureError, match="triton.cudagraphs"):
        make_graphed(lin, (x,), options={"triton.cudagraphs": True})
    with pytest.raises(StepCaptureError, match="te_passes.guards does not apply"):
        make_graphed(lin, (x,), options={"te_passes.guards": "all"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(StepCaptureError, match="no CUDA device"):
        make_graphed(lin, (x,))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(StepCaptureError, match=r"sample_args \[0\] are not CUDA tensors"):
        make_graphed(lin, x)


def _damage_like_a_failed_mgc(module, *args, **kwargs):
    """What te.make_graphed_callables leaves when it raises mid-capture (TE graph.py: no finally)."""
    import transformer_engine.pytorch.graph as te_graph
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    te_graph.set_capture_start()
    cls = type(module)
    old = cls.__call__

    def call_func(self, *a, **k):
        return old(self, *a, **k)

    cls.__call__ = call_func
    from transformer_engine.common.recipe import Float8CurrentScaling

    FP8GlobalStateManager.autocast_enter(enabled=False, fp8_recipe=Float8CurrentScaling(), _graph=True)  # no CUDA query
    module.forward = lambda *a: None
    raise RuntimeError("CUDA error: operation not permitted when stream is capturing")


def test_make_graphed_resets_te_after_a_failed_capture(toy, monkeypatch):
    import transformer_engine.pytorch as te

    from te_passes import step_capture as sc
    from te_passes.compat.te220.capture_state import te_capture_state

    monkeypatch.setattr(sc, "_check_make_graphed_args", lambda m, a, o, k: (tuple(a), dict(o or {})))
    monkeypatch.setattr(te, "make_graphed_callables", _damage_like_a_failed_mgc)
    lin = torch.nn.Linear(4, 4)
    with pytest.raises(StepCaptureError, match="make_graphed_callables failed.*operation not permitted.*reset "
                                               "TE's graph-capture flag, TE's FP8 autocast state, "
                                               "GraphedModule.__call__, the module's forward") as ei:
        make_graphed(lin, (torch.randn(2, 4),), warmup=False)
    assert isinstance(ei.value.__cause__, RuntimeError)
    assert te_capture_state() == []
    assert "__call__" not in sc.GraphedModule.__dict__
    # a compile after the failure traces TE ops again (not silently eager)
    x, ps = _params()
    ref = _clone_params(ps)

    step = _sum_step(toy)

    assert _close(compile_step(step, mode=None, options=NO_CACHE)(x, ps), step(x, ref))
    assert _graphs_and_breaks() == (1, 0)


def test_graphed_module_clears_te_capture_flag_around_the_compiled_call(monkeypatch):
    pytest.importorskip("transformer_engine.pytorch")
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    from te_passes.step_capture import GraphedModule

    seen = []

    class Probe(torch.nn.Module):
        def forward(self, t):
            seen.append(FP8GlobalStateManager.quantization_state.fp8_graph_capturing)
            return t

    from transformer_engine.common.recipe import Float8CurrentScaling

    g = GraphedModule(Probe())
    state = FP8GlobalStateManager.get_autocast_state()
    FP8GlobalStateManager.autocast_enter(enabled=False, fp8_recipe=Float8CurrentScaling(), _graph=True)
    try:
        g(torch.ones(1))
        assert FP8GlobalStateManager.quantization_state.fp8_graph_capturing is True
    finally:
        FP8GlobalStateManager.autocast_exit(enabled=False, _graph=True)
        FP8GlobalStateManager.set_autocast_state(state)
    g(torch.ones(1))
    assert seen == [False, False]


def test_fullgraph_false_is_refused_with_the_reason():
    """fullgraph=False: a break after loss.backward() deadlocks in torch 2.14.1 (no message), so
    compile_step refuses it up front, naming why and what to do."""
    import te_passes
    from te_passes.step_capture import StepCaptureError

    with pytest.raises(StepCaptureError, match=r"fullgraph=False is refused.*deadlocks"):
        te_passes.compile_step(lambda x: x, fullgraph=False)
