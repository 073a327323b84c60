"""The lean CUDA-graph policy through the real compile path on CPU: Dynamo -> te_inductor ->
AOTAutograd -> Inductor (C++ codegen) -> ``cudagraph_post_compile`` -> ``LeanCUDAGraphPolicy``,
with the fake capture/replay engine of tests/runtime/test_cudagraph_policy.py.

Inductor never cudagraphs CPU graphs, so two of its device checks are patched for these tests
only (``check_lowering_disable_cudagraph`` -> no reason; an empty ``device_idxs`` -> ``{0}``);
everything else — the kwargs Inductor passes to the policy, AOTAutograd's ``fw_metadata``, its
``CompiledFunction`` saving the forward's outputs for the backward, the backward's static input
indices, AccumulateGrad stealing the returned gradients — is the real thing.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch._inductor.utils import fresh_cache

import te_passes.cudagraphs.policy as pol
import te_passes.cudagraphs.lean as cg
from te_passes.backend import te_inductor
from te_passes.report import clear_compile_reports, compile_reports
from te_passes.te.version import torch_at_least

from test_cudagraph_policy import FakeEngine


@pytest.fixture(autouse=True)
def cpu_cudagraphs(monkeypatch):
    import torch._inductor.output_code as oc

    monkeypatch.setattr("torch._inductor.cudagraph_utils.check_lowering_disable_cudagraph", lambda m: None)
    orig = oc.cudagraph_post_compile

    def post(example_inputs, compiled_graph, *a, **k):
        if not compiled_graph.device_idxs:
            compiled_graph.device_idxs = {0}
        return orig(example_inputs, compiled_graph, *a, **k)

    monkeypatch.setattr(oc, "cudagraph_post_compile", post)
    init = pol.LeanCUDAGraphPolicy.__init__

    def cpu_init(self, **kw):
        kw.setdefault("engine", FakeEngine())
        kw.setdefault("device_type", "cpu")
        init(self, **kw)

    monkeypatch.setattr(pol.LeanCUDAGraphPolicy, "__init__", cpu_init)
    torch._dynamo.reset()
    clear_compile_reports()
    yield
    torch._dynamo.reset()


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 16))


def _pair(**opts):
    m, ref = _mlp(), _mlp()
    fn = torch.compile(m, backend=functools.partial(
        te_inductor, options={"triton.cudagraphs": True, "fx_graph_cache": False, "te_passes.cudagraphs": "lean",
                              **opts}))
    return m, ref, fn


def _runners():
    ids = {rep.graph_id for rep in compile_reports()}
    return {r.name.split(".")[1]: r for r in cg.lean_runners() if r.name.split(".")[0] in ids}


def _records():
    return [r for rep in compile_reports() for r in rep.cudagraphs]


def _assert_grads(m, ref):
    for (n, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_train_steps_replay_lean_with_aot_metadata():
    m, ref, fn = _pair()
    kept = []
    for step in range(6):
        x, dy = torch.randn(8, 16), torch.randn(8, 16)
        for p in [*m.parameters(), *ref.parameters()]:
            p.grad = None
        y = fn(x)
        y.backward(dy)
        yr = ref(x)
        yr.backward(dy)
        kept.append((y, yr.detach()))
        _assert_grads(m, ref)
    for y, yr in kept:  # outputs kept across steps keep their values
        torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-6)
    r = _runners()
    assert set(r) == {"fwd", "bwd"} and r["fwd"].captured and r["bwd"].captured
    assert r["bwd"].pool is r["fwd"].pool
    kinds = r["fwd"].output_kinds()
    assert kinds[0] == "clone" and kinds.count("clone") == 1 and "alias" in kinds  # y; saved tensors
    assert set(r["bwd"].output_kinds()) <= {"alias", "pass"}
    assert r["fwd"].stats["eager"] == 0 and r["bwd"].stats["eager"] == 0 and r["fwd"].stats["replay"] == 5
    assert [e["event"] for e in _records()] == ["lean", "lean", "captured", "captured"]


def test_gradient_accumulation_and_two_forwards_before_backward():
    m, ref, fn = _pair()
    for step in range(3):
        for p in [*m.parameters(), *ref.parameters()]:
            p.grad = None
        for mb in range(4):  # 4 micro-batches, no zero_grad between them
            x, dy = torch.randn(8, 16), torch.randn(8, 16)
            fn(x).backward(dy)
            ref(x).backward(dy)
        _assert_grads(m, ref)
    for p in [*m.parameters(), *ref.parameters()]:
        p.grad = None
    xs = [torch.randn(8, 16) for _ in range(2)]
    dys = [torch.randn(8, 16) for _ in range(2)]
    ys = [fn(x) for x in xs]  # the second forward runs while the first one's backward is pending
    for y, dy in zip(ys, dys):
        y.backward(dy)
    for x, dy in zip(xs, dys):
        ref(x).backward(dy)
    _assert_grads(m, ref)
    events = {(e["graph"].split(".")[1], e["event"]) for e in _records()}
    assert ("bwd", "clone") in events and ("fwd", "eager") in events, _records()
    reasons = " | ".join(e["reason"] for e in _records())
    assert "second forward before its backward" in reasons


def test_aot_cache_hit_tells_saved_tensors_by_data_flow(monkeypatch):
    """On an AOTAutograd / FX-graph cache hit no forward metadata is in the tracing context."""
    seen = []
    with fresh_cache():
        for attempt in range(2):
            torch._dynamo.reset()
            clear_compile_reports()
            m, ref, fn = _pair(fx_graph_cache=True)
            for step in range(4):
                x, dy = torch.randn(8, 16), torch.randn(8, 16)
                for p in [*m.parameters(), *ref.parameters()]:
                    p.grad = None
                fn(x).backward(dy)
                ref(x).backward(dy)
                _assert_grads(m, ref)
            r = _runners()
            assert r["fwd"].captured and r["bwd"].captured and r["fwd"].stats["eager"] == 0
            kinds = r["fwd"].output_kinds()
            # torch 2.15 (not 2.14): the backward's static inputs leave out a saved tensor that is a
            # forward input (x: [1, 2, 3], 2.14 [0, 1, 2, 3]), so the data flow on a cache hit does not
            # see it read and clones that output too (one copy of x per step; gradients as above)
            both = attempt == 1 and torch_at_least(2, 15)
            assert kinds[:2] == (["clone", "clone"] if both else ["clone", "alias"]), kinds
            assert kinds.count("clone") == (2 if both else 1), kinds
            seen.append([e["event"] for e in _records()])
    # first compile: metadata; second: a cache hit, saved tensors found by data flow
    assert "dataflow" not in seen[0] and seen[1][0] == "dataflow", seen
