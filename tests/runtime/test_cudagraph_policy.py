"""The lean CUDA-graph policy (te_passes/cudagraphs/policy.py, cudagraphs.py, issue 14) on CPU, with a fake
capture/replay engine.

The fake engine keeps CUDA-graph semantics where they matter for correctness: a "replay" runs
the captured function on the *captured* input tensors and writes the results into the
*captured* output tensors, so anything still aliasing them is overwritten, exactly as on a GPU.
Storage use counts (the hazard checks) are real (``torch._C._storage_Use_Count`` works on CPU).
Forward / backward graphs are wired through a ``torch.autograd.Function`` the way AOTAutograd's
``CompiledFunction`` wires Inductor's compiled forward (user outputs + saved tensors) and
backward (saved tensors + tangents -> grads), so AccumulateGrad, saved-tensor lifetimes and
gradient accumulation behave as in a real training step.
"""

from __future__ import annotations

import pytest
import torch

from te_passes.config import TePassesOptionError, TePassesOptions
from te_passes.cudagraphs import engine as eng
from te_passes.cudagraphs import policy as cgp
from te_passes.cudagraphs.engine import CudagraphRecorder
from te_passes.cudagraphs.policy import LeanCUDAGraphPolicy, static_hazard
from te_passes.cudagraphs.lean import LeanCUDAGraph


class FakeGraph:
    def __init__(self, fn, inputs, outs, pool):
        self.fn, self.inputs, self.pool = fn, inputs, pool
        self.outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]


class FakeEngine:
    """Capture = run once and remember inputs/outputs; replay = recompute from the captured
    inputs into the captured outputs (in place)."""

    def __init__(self):
        self.pools, self.warmups, self.replays = 0, 0, 0
        self.graphs: list[FakeGraph] = []
        self.capturing = False
        self.clean_calls: list = []

    def new_pool(self, device_index):
        self.pools += 1
        return ("pool", self.pools)

    def is_capturing(self):
        return self.capturing

    def warmup(self, fn, inputs, device_index):
        self.warmups += 1
        return fn(inputs)

    def capture(self, fn, inputs, pool, device_index, kept_inputs=()):
        # replays read the runner's kept tensors (same addresses); holding the call's own
        # tensors would add storage references a CUDA graph does not hold
        held = list(kept_inputs)
        # a real capture runs no kernel: undo what the run wrote into its inputs' memory
        before = [(x, x.clone()) for x in inputs if isinstance(x, torch.Tensor) and x.numel()]
        outs = fn(inputs)
        for x, v in before:
            if x.shape == v.shape and not torch.equal(x, v):  # (rebound tensors: left alone)
                x.data.copy_(v)  # (.data: no version-counter bump on the caller's tensor)
        g = FakeGraph(fn, held, outs, pool)
        self.graphs.append(g)
        return g, outs

    leak = False  # pool_is_clean answers "not clean": a tensor allocated during capture escaped

    def pool_is_clean(self, device_index, pool, live):
        self.clean_calls.append((pool, set(live)))
        return not self.leak

    def replay(self, g):
        self.replays += 1
        # (Python in the graph does not run on a real replay: rebinding these aliases is harmless)
        new = g.fn([x.detach() if isinstance(x, torch.Tensor) else x for x in g.inputs])
        for o, n in zip(g.outs, new):
            if isinstance(o, torch.Tensor) and o is not n:
                if torch._debug_has_internal_overlap(o):
                    from torch._inductor.output_code import copy_strided_storage_

                    copy_strided_storage_(o, n)  # an expanded output: write its memory
                else:
                    o.copy_(n)


# ---------------------------------------------------------------- a compiled fwd/bwd pair
def fwd_graph(args):
    """Inductor-style boxed forward: (x, w) -> [y (user output), h, x (saved)]."""
    x, w = args
    args.clear()
    h = x @ w
    return [torch.relu(h), h, x]


def bwd_graph(args):
    """Boxed backward: (h, x, w, dy) -> [dx, dw]."""
    h, x, w, dy = args
    args.clear()
    dh = dy * (h > 0)
    return [dh @ w.t(), x.t() @ dh]


def bwd_graph_clearing(args):
    """The backward of a TE fp8 Linear frees the quantized input it owns by rebinding the Python
    tensor it was given (TE 2.20.2 ``clear_tensor_data``: ``t.data = _empty_tensor()``)."""
    h, x, w, dy = args
    out = bwd_graph(args)
    h.data = torch.empty(0)  # h: allocated by the forward graph (TE: the quantized input it made)
    return out


class Pair:
    """What AOTAutograd builds around a compiled forward/backward: the lean runners inside a
    ``torch.autograd.Function``."""

    def __init__(self, engine, recorder=None, num_clone_outputs=1, bwd=bwd_graph):
        self.rec = recorder or CudagraphRecorder()
        self.f = LeanCUDAGraph(fwd_graph, [1], name="g0.fwd", device_index=0, is_backward=False,
                               is_inference=False, num_clone_outputs=num_clone_outputs, engine=engine,
                               recorder=self.rec)
        self.b = LeanCUDAGraph(bwd, [0, 1, 2], name="g0.bwd", device_index=0, is_backward=True,
                               is_inference=False, num_clone_outputs=0, engine=engine, recorder=self.rec)
        pair = self

        class Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, w):
                y, h, xs = pair.f([x, w])
                ctx.save_for_backward(h, xs, w)
                return y

            @staticmethod
            def backward(ctx, dy):
                h, xs, w = ctx.saved_tensors
                dx, dw = pair.b([h, xs, w, dy.contiguous()])
                return dx, dw

        self.fn = Fn

    def __call__(self, x, w):
        return self.fn.apply(x, w)

    def events(self, event=None):
        return [r for r in self.rec.records if event is None or r["event"] == event]


def eager(x, w):
    return torch.relu(x @ w)


@pytest.fixture
def engine():
    return FakeEngine()


def _data(seed, n=4, d=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)


def _w(seed=0, d=8):
    return torch.randn(d, d, generator=torch.Generator().manual_seed(100 + seed)).requires_grad_()


def _train(pair, w, steps):
    """``steps`` plain training steps (``w.grad = None``, forward, backward) on ``_data(0..)``."""
    for step in range(steps):
        x, dy = _data(step)
        w.grad = None
        pair(x, w).backward(dy)


def _step(pair, w, seed, x_leaf=False):
    """One training step on ``_data(seed)``: ``w.grad = None``, forward, backward; ``x_leaf``: ``x``
    requires grad (its ``.grad`` is then the backward's output). Returns ``x, dy, y``."""
    x, dy = _data(seed)
    if x_leaf:
        x.requires_grad_()
    w.grad = None
    y = pair(x, w)
    y.backward(dy)
    return x, dy, y


def _ref_step(w0, x, dy):
    w = w0.detach().clone().requires_grad_()
    xx = x.clone().requires_grad_()
    y = eager(xx, w)
    y.backward(dy)
    return y.detach(), xx.grad, w.grad


# ------------------------------------------------------------------------- steady state
def test_steady_state_replays_bit_identical_to_eager(engine):
    pair = Pair(engine)
    w = _w()
    for step in range(6):
        x, dy, y = _step(pair, w, step, x_leaf=True)
        ry, rdx, rdw = _ref_step(w, x.detach(), dy)
        assert torch.equal(y, ry) and torch.equal(x.grad, rdx) and torch.equal(w.grad, rdw), step
        del y, x  # (a kept y keeps x and x.grad alive: see the next test)
    # call 1 warm-up (fwd and bwd), call 2 capture + replay, then replays only
    assert pair.f.captured and pair.b.captured
    assert {k: v for k, v in pair.f.stats.items() if k not in ("replay_host_ns", "launch_host_ns")} == \
        {"warmup": 1, "capture": 1, "replay": 5, "eager": 0, "copies": 4}
    assert pair.f.stats["replay_host_ns"] >= pair.f.stats["launch_host_ns"] > 0
    assert pair.b.stats["eager"] == 0 and pair.b.stats["replay"] == 5
    assert engine.pools == 1, "the backward must join its forward's pool"
    assert pair.b.pool is pair.f.pool and pair.f.pool.members == [pair.f, pair.b]
    assert pair.f.output_kinds() == ["clone", "alias", "alias"]
    assert pair.b.output_kinds() == ["alias", "alias"]
    assert not pair.events("eager") and [r["graph"] for r in pair.events("captured")] == ["g0.fwd", "g0.bwd"]
    # pool memory the outputs hold for the graphs' lifetime: y's static buffer and h (the saved x
    # is the static input buffer x is copied into, not pool memory); dx, dw. 4 x 8 fp32, dw 8 x 8
    assert pair.f.held_bytes == 2 * 4 * 8 * 4 and pair.b.held_bytes == (4 * 8 + 8 * 8) * 4


def test_output_kept_with_its_graph_keeps_leaf_grad_alive_then_cloned(engine):
    """``y`` from the previous step is still referenced while the next forward runs, and its
    autograd graph holds the leaf ``x`` whose ``.grad`` AccumulateGrad stole from the backward's
    static output: the forward must not replay over it; that output is cloned from then on."""
    pair = Pair(engine)
    w = _w()
    grads = []
    for step in range(6):
        x, dy, y = _step(pair, w, step, x_leaf=True)
        grads.append((x.grad, _ref_step(w, x.detach(), dy)[1]))
    for i, (g, ref) in enumerate(grads):
        assert torch.equal(g, ref), f"x.grad of step {i} was overwritten"
    assert pair.b.output_kinds()[0] == "clone"
    assert any(r["event"] == "clone" and r["output"] == 0 for r in pair.events())
    # while the one aliased x.grad (step 2) is kept, forwards run without the graph; once it is
    # dropped, replays resume (later grads are clones)
    assert pair.f.stats["eager"] == 4
    grads.clear()
    del x, y
    for step in range(3):
        x, dy, y = _step(pair, w, 50 + step, x_leaf=True)
        assert torch.equal(x.grad, _ref_step(w, x.detach(), dy)[1])
    assert pair.f.stats["eager"] == 4


def test_backward_that_rebinds_its_saved_inputs_like_te_fp8(engine):
    """Rebinding the tensors handed to the capture run must not touch the tensors whose memory
    the graphs replay into (the forward's static outputs): same steady state as without it."""
    pair = Pair(engine, bwd=bwd_graph_clearing)
    w = _w()
    for step in range(6):
        x, dy, y = _step(pair, w, step)
        assert torch.equal(w.grad, _ref_step(w, x, dy)[2]), step
    assert pair.f.stats["eager"] == 0 and pair.b.stats["eager"] == 0 and pair.b.captured
    assert all(o.numel() for k, o in pair.f._plan), "a static output was rebound"


def test_saved_tensors_told_apart_by_data_flow_without_aot_metadata(engine):
    pair = Pair(engine, num_clone_outputs=eng.SAVED_BY_DATAFLOW)
    w = _w()
    for step in range(5):
        x, dy, y = _step(pair, w, step)
        assert torch.equal(w.grad, _ref_step(w, x, dy)[2])
    # h and x were read by the backward's warm-up: saved; y was not: cloned
    assert pair.f.output_kinds() == ["clone", "alias", "alias"]
    assert pair.f.stats["eager"] == 0 and pair.b.stats["eager"] == 0 and not eng.RECENT


def test_failed_capture_is_recorded_and_runs_without_graph(engine):
    def boom(*a):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    engine.capture = boom
    rec = CudagraphRecorder()
    f = LeanCUDAGraph(fwd_graph, [1], name="f", device_index=0, is_backward=False, is_inference=True,
                      engine=engine, recorder=rec)
    w = _w().detach()
    outs = [f([_data(s)[0], w])[0] for s in range(3)]
    assert all(torch.equal(o, eager(_data(s)[0], w)) for s, o in enumerate(outs))
    assert rec.records[0]["event"] == "disabled"
    assert rec.records[0]["reason"].startswith("capture failed (RuntimeError: operation not permitted")


def test_static_inputs_never_copied_non_static_copied_only_when_address_differs(engine):
    w = _w()
    f = LeanCUDAGraph(fwd_graph, [1], name="f", device_index=0, is_backward=False, is_inference=True,
                      num_clone_outputs=None, engine=engine)
    x, _ = _data(0)
    f([x, w.detach()])
    f([x, w.detach()])           # capture
    assert f.captured and f.stats["copies"] == 0
    buf = f._static_inputs[0]
    assert buf is not x and f._static_inputs[1].data_ptr() == w.data_ptr()  # w static: used in place
    x2, _ = _data(1)
    out = f([x2, w.detach()])
    assert f.stats["copies"] == 1 and torch.equal(out[0], eager(x2, w.detach()))
    # the static buffer itself as input: same address, no copy, and the result is still right
    buf.copy_(x)
    out = f([buf, w.detach()])
    assert f.stats["copies"] == 1 and torch.equal(out[0], eager(x, w.detach()))
    # parameters updated in place (optimizer step): same address, no copy, new values used
    with torch.no_grad():
        w.mul_(0.5)
    out = f([x2, w.detach()])
    assert f.stats["copies"] == 2 and torch.equal(out[0], eager(x2, w.detach()))


def test_forward_user_output_kept_across_steps_keeps_its_value(engine):
    pair = Pair(engine)
    w = _w()
    kept = []
    for step in range(5):
        x, dy, y = _step(pair, w, step)
        kept.append((y, eager(x, w).detach()))
    for i, (y, ref) in enumerate(kept):
        assert torch.equal(y, ref), f"output of step {i} was overwritten by a later replay"
    assert pair.f.stats["eager"] == 0  # cloning user outputs makes keeping them free of fallbacks


def test_cloned_outputs_keep_their_strides(engine):
    def g(args):
        x, w = args
        args.clear()
        h = x @ w
        return [h.t(), h[:, :1].expand(4, 8), h[0, 0].item() if False else 3]

    f = LeanCUDAGraph(g, [1], name="f", device_index=0, is_backward=False, is_inference=True, engine=engine)
    w = _w().detach()
    for s in range(3):
        a, b, n = f([_data(s)[0], w])
        h = _data(s)[0] @ w
        assert a.stride() == h.t().stride() and b.stride() == (8, 0) and n == 3
        assert torch.equal(a, h.t()) and torch.equal(b, h[:, :1].expand(4, 8))
    assert [k for k, _ in f._plan] == [eng.CLONE, eng.CLONE_STRIDED, eng.PASS]


def test_backward_output_in_a_saved_tensors_memory_is_cloned(engine):
    """Inductor may reuse a donated saved tensor (the forward's static output) for a gradient."""
    def bwd_donating(args):
        h, x, w, dy = args
        args.clear()
        dh = dy * (h > 0)
        h.copy_(dh @ w.t())          # dx computed into h's (donated) memory
        return [h, x.t() @ dh]

    pair = Pair(engine, bwd=bwd_donating)
    w = _w()
    for step in range(5):
        x, dy = _data(step)
        w.grad = None
        pair(x, w).backward(dy)
        assert torch.equal(w.grad, _ref_step(w, x, dy)[2]), step
    assert pair.b.output_kinds() == ["clone", "alias"] and pair.f.stats["eager"] == 0


def test_empty_outputs_are_neither_guarded_nor_pool_memory(engine):
    def g(args):
        x, w = args
        args.clear()
        h = x @ w
        return [torch.relu(h), h, torch.empty(0), torch.empty(0, 8)]

    f = LeanCUDAGraph(g, [1], name="f", device_index=0, is_backward=False, is_inference=False,
                      num_clone_outputs=1, engine=engine)
    w = _w().detach()
    kept = [f([_data(s)[0], w]) for s in range(4)]  # empty outputs kept: no hazard
    # calls 3 and 4 see the kept alias h of call 2 (no backward ran): without the graph; the
    # kept empty outputs never count
    assert f.stats["eager"] == 2
    assert [it[2] for it in f._own] == [0, 1] and 0 not in f._pool_storages and 0 not in eng.OWNERS
    assert engine.clean_calls[-1][1] == {f._plan[j][1].untyped_storage().data_ptr() for j in (0, 1)}
    assert f.output_kinds() == ["clone", "alias", "alias", "alias"]
    del kept


def test_output_referenced_elsewhere_at_capture_is_never_replayed_over(engine):
    """An op that keeps a reference to a graph output (an opaque op's cache): the baseline is our
    own references only, so that holder always counts and the graph never overwrites it."""
    stash = []

    def g(args):
        x, w = args
        args.clear()
        h = x @ w
        if len(stash) < 2:  # warm-up and capture run (a real replay runs no Python)
            stash.append(h.view(-1))
        return [torch.relu(h), h]

    rec = CudagraphRecorder()
    f = LeanCUDAGraph(g, [1], name="f", device_index=0, is_backward=False, is_inference=False,
                      num_clone_outputs=1, engine=engine, recorder=rec)
    w = _w().detach()
    f([_data(0)[0], w])          # warm-up
    f([_data(1)[0], w])          # capture: the stash now holds a view of the static output h
    kept = stash[1]
    ref = kept.clone()
    for s in range(2, 5):
        out = f([_data(s)[0], w])
        assert torch.equal(out[0], eager(_data(s)[0], w))
    assert any(r["event"] == "referenced" for r in rec.records)
    assert f.stats["eager"] == 3 and f.stats["replay"] == 1
    assert torch.equal(kept, ref), "the held view was overwritten"


def fwd_graph_views(args):
    """A forward whose outputs are autograd views of temporaries, as TE's impls return them
    (``out.view(...)`` inside ``_linear_forward_impl``, run below autograd by a direct call):
    each view keeps its base alive, a second tensor on the same storage."""
    x, w = args
    args.clear()
    with torch.no_grad(), torch._C._AutoDispatchBelowAutograd():
        h = (x @ w).view(-1).view(x.shape[0], -1)
        y = torch.relu(h).view(-1).view(x.shape[0], -1)
    assert h._is_view() and y._is_view()
    return [y, h, x]


def test_view_outputs_keep_their_bases_and_still_replay(engine):
    """A view output's base is a reference we hold ourselves, not an outside holder: the pair
    replays every step (before the fix: "referenced outside the graph right after capture", then
    every call ran without the CUDA graph)."""
    pair = Pair(engine)
    pair.f._model = fwd_graph_views
    w0 = _w()
    w = w0.detach().clone().requires_grad_()
    for s in range(6):
        x, dy, y = _step(pair, w, s)
        y_ref, _, dw_ref = _ref_step(w0, x, dy)
        assert torch.equal(y.detach(), y_ref) and torch.allclose(w.grad, dw_ref)
    assert pair.events("referenced") == [] and pair.events("eager") == [], pair.rec.records
    assert pair.f.stats["eager"] == 0 and pair.f.stats["replay"] == 5 and pair.b.stats["replay"] == 5


def test_outside_holder_of_a_view_output_is_described(engine):
    """An outside holder found at capture is named in the record (tensor, referrer type)."""
    stash = []

    def g(args):
        out = fwd_graph_views(args)
        if len(stash) < 2:
            stash.append(out[1][:])  # another tensor on h's storage
        return out

    pair = Pair(engine)
    pair.f._model = g
    w = _w()
    for s in range(3):
        x, dy = _data(s)
        pair(x, w).backward(dy)
    (rec,) = pair.events("referenced")
    assert rec["outputs"] == [1]
    (desc,) = rec["holders"].values()
    assert desc[0].startswith("tensor (4, 8) torch.float32 held by list") and desc[-1].startswith("storage use count")


def test_inference_graph_clones_every_output(engine):
    w = _w().detach()
    f = LeanCUDAGraph(fwd_graph, [1], name="g1.inference", device_index=0, is_backward=False,
                      is_inference=True, num_clone_outputs=None, engine=engine)
    outs = [f([_data(s)[0], w]) for s in range(4)]
    assert f.output_kinds() == ["clone", "clone", "clone"]
    for s, o in enumerate(outs):
        assert torch.equal(o[0], eager(_data(s)[0], w))


# ----------------------------------------------------------------------- runtime hazards
def test_second_forward_before_backward_runs_without_graph_and_stays_correct(engine):
    pair = Pair(engine)
    w = _w()
    _train(pair, w, 3)  # warm-up, capture, replay
    assert pair.f.captured and pair.b.captured
    # pipeline-style: two forwards, then both backwards
    (x1, dy1), (x2, dy2) = _data(10), _data(11)
    w.grad = None
    y1 = pair(x1, w)
    y2 = pair(x2, w)           # y1's saved tensors are pending: must not be overwritten
    assert pair.f.stats["eager"] == 1
    y1.backward(dy1)
    y2.backward(dy2)           # saved tensors of the eager forward: copied into the static outputs
    w_ref = w.detach().clone().requires_grad_()
    r1, r2 = eager(x1, w_ref), eager(x2, w_ref)
    (r1 * dy1).sum().backward()
    (r2 * dy2).sum().backward()
    assert torch.equal(y1, r1.detach()) and torch.equal(y2, r2.detach())
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=0, atol=1e-6)
    reasons = [r["reason"] for r in pair.events("eager")]
    assert any("second forward before its backward" in r for r in reasons), reasons
    assert pair.events("copied"), "bwd of the eager forward copies its saved tensors into the static ones"
    # ... but w.grad (accumulated into by the second backward) still aliases the first one's
    # static output: that backward runs without the graph, and the grad is cloned from then on
    assert pair.b.stats["eager"] == 1 and pair.b.output_kinds()[1] == "clone"


def test_gradient_accumulation_over_4_micro_batches_equals_eager(engine):
    pair = Pair(engine)
    w = _w()
    w_ref = w.detach().clone().requires_grad_()
    for step in range(3):
        w.grad = None
        w_ref.grad = None
        for mb in range(4):
            x, dy = _data(10 * step + mb)
            pair(x, w).backward(dy)
            eager(x, w_ref).backward(dy)
        torch.testing.assert_close(w.grad, w_ref.grad, rtol=0, atol=1e-5)
        with torch.no_grad():  # optimizer step, in place (addresses unchanged)
            w -= 0.01 * w.grad
            w_ref -= 0.01 * w_ref.grad
    clones = pair.events("clone")
    assert clones and clones[0]["graph"] == "g0.bwd", pair.rec.records
    # after the switch the grad output is cloned: later steps replay without fallbacks
    assert pair.b.output_kinds()[1] == "clone"
    n_eager = pair.b.stats["eager"]
    w.grad = None
    w_ref.grad = None
    for mb in range(4):
        x, dy = _data(100 + mb)
        pair(x, w).backward(dy)
        eager(x, w_ref).backward(dy)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=0, atol=1e-5)
    assert pair.b.stats["eager"] == n_eager


def test_grad_kept_by_caller_is_not_overwritten_by_the_next_forward(engine):
    pair = Pair(engine)
    w = _w()
    _train(pair, w, 3)  # warm-up, capture, replay
    x, dy = _data(20)
    w.grad = None
    pair(x, w).backward(dy)
    g = w.grad                   # the backward's static output, stolen by AccumulateGrad
    ref = g.clone()
    w.grad = None
    x2, dy2 = _data(21)
    pair(x2, w).backward(dy2)    # forward sees the held grad: must not replay over it
    assert torch.equal(g, ref)
    assert pair.events("clone")


def test_parameter_reassigned_runs_without_graph(engine):
    pair = Pair(engine)
    w = _w()
    _train(pair, w, 3)  # warm-up, capture, replay
    w2 = _w(1)
    x, dy = _data(30)
    y = pair(x, w2)
    y.backward(dy)
    assert torch.equal(y, eager(x, w2).detach())
    assert any("static input 1 moved" in r["reason"] for r in pair.events("eager"))


def test_interleaved_inference_graph_does_not_disturb_training_pair(engine):
    pair = Pair(engine)
    w = _w()
    inf = LeanCUDAGraph(fwd_graph, [1], name="g0.inference", device_index=0, is_backward=False,
                        is_inference=True, num_clone_outputs=None, engine=engine)
    for step in range(5):
        x, dy = _data(step)
        w.grad = None
        y = pair(x, w)
        with torch.no_grad():
            ev = inf([_data(50 + step)[0], w.detach()])[0]   # eval between forward and backward
        y.backward(dy)
        _, _, rdw = _ref_step(w, x, dy)
        assert torch.equal(w.grad, rdw) and torch.equal(ev, eager(_data(50 + step)[0], w.detach()))
    assert inf.pool is not pair.f.pool and pair.f.stats["eager"] == 0 and pair.b.stats["eager"] == 0


def test_pool_check_after_capture_covers_the_pair_and_a_leak_disables_the_graph(engine):
    pair = Pair(engine)
    w = _w()
    for step in range(2):
        x, dy = _data(step)
        w.grad = None
        pair(x, w).backward(dy)
    (pf, live_f), (pb, live_b) = engine.clean_calls
    h = pair.f._plan[1][1]
    dw = pair.b._plan[1][1]
    xbuf = pair.f._static_inputs[0]
    assert pf == pb and h.untyped_storage().data_ptr() in live_f and live_f < live_b
    assert dw.untyped_storage().data_ptr() in live_b
    assert xbuf.untyped_storage().data_ptr() not in live_b, "static input buffers are not pool memory"
    # a leaked pool tensor: the graph is never replayed, results stay right
    engine2 = FakeEngine()
    engine2.leak = True
    pair2 = Pair(engine2)
    for step in range(4):
        x, dy = _data(step)
        w.grad = None
        y = pair2(x, w)
        y.backward(dy)
        assert torch.equal(w.grad, _ref_step(w, x, dy)[2])
    assert not pair2.f.captured and pair2.f.stats["eager"] == 3 and pair2.f.stats["capture"] == 1
    assert "not graph outputs" in pair2.events("disabled")[0]["reason"]


def test_inside_outer_capture_runs_plain(engine):
    f = LeanCUDAGraph(fwd_graph, [1], name="f", device_index=0, is_backward=False, is_inference=True,
                      engine=engine)
    engine.capturing = True
    out = f([_data(0)[0], _w().detach()])
    assert f.stats["eager"] == 1 and not f.captured and len(out) == 3


def test_static_inputs_that_never_settle_disable_capture(engine):
    rec = CudagraphRecorder()
    f = LeanCUDAGraph(fwd_graph, [1], name="f", device_index=0, is_backward=False, is_inference=True,
                      engine=engine, recorder=rec, max_unready_calls=3)
    ws = [_w(s).detach() for s in range(6)]  # all alive: six distinct addresses
    for s in range(6):
        f([_data(s)[0], ws[s]])
    assert not f.captured and f.stats["eager"] == 3
    assert rec.records[0]["event"] == "disabled"


# -------------------------------------------------------------------- policy decisions
def test_static_hazards():
    x = torch.empty(2, 2)
    assert static_hazard([x], [0], device_type="cpu") is None
    assert "on cpu" in static_hazard([x], [0])
    assert static_hazard([x, 3], [0], device_type="cpu") is None  # a specialised int is fine
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    s = ShapeEnv().create_unbacked_symint()
    assert "dynamic shapes" in static_hazard([x, s], [0], device_type="cpu")
    assert "mutates non-static input(s) [1]" in static_hazard([x, x], [0], mutated_input_idxs=[1], device_type="cpu")
    assert static_hazard([x, x], [0, 1], mutated_input_idxs=[1], device_type="cpu") is None
    assert "kernel-free" in static_hazard([x], [0], kernel_free=True, device_type="cpu")


@pytest.fixture
def trees_calls(monkeypatch):
    calls = []

    def fake_cudagraphify(model, static_input_idxs=(), **kw):
        calls.append((model, tuple(static_input_idxs), kw))
        return ("trees", model)

    monkeypatch.setattr("torch._inductor.compile_fx.cudagraphify", fake_cudagraphify)
    return calls


def _kw(is_backward=False, is_inference=False, **extra):
    return dict(device_index=0, is_backward=is_backward, is_inference=is_inference, stack_traces=[],
                constants=(), placeholders=(), mutated_input_idxs=(), kernel_free_cudagraph=False,
                user_visible_output_idxs=(), **extra)


def test_policy_wraps_lean_and_backward_follows_forward(engine, trees_calls, monkeypatch):
    monkeypatch.setattr(cgp, "forward_user_output_count", lambda: 1)
    pol = LeanCUDAGraphPolicy(graph_id="g3", engine=engine, device_type="cpu")
    x = torch.empty(2, 2)
    f = pol.cudagraphify(fwd_graph, [x, x], [1], **_kw())
    b = pol.cudagraphify(bwd_graph, [x, x, x, x], [0, 1, 2], **_kw(is_backward=True))
    assert isinstance(f, LeanCUDAGraph) and isinstance(b, LeanCUDAGraph) and not trees_calls
    assert f._num_clone == 1 and b._num_clone == 0 and f.name == "g3.fwd" and b.name == "g3.bwd"
    assert [r["event"] for r in pol.recorder.records] == ["lean", "lean"]


def test_policy_falls_back_to_trees_with_reason(engine, trees_calls, monkeypatch):
    monkeypatch.setattr(cgp, "forward_user_output_count", lambda: 1)
    x = torch.empty(2, 2)
    # a forward that mutates a non-static input: trees, and its backward follows
    pol = LeanCUDAGraphPolicy(graph_id="g4", engine=engine, device_type="cpu")
    kw = _kw()
    kw["mutated_input_idxs"] = (0,)
    assert pol.cudagraphify(fwd_graph, [x, x], [1], **kw) == ("trees", fwd_graph)
    assert pol.cudagraphify(bwd_graph, [x] * 4, [0, 1, 2], **_kw(is_backward=True)) == ("trees", bwd_graph)
    assert [(r["graph"], r["event"]) for r in pol.recorder.records] == [("g4.fwd", "trees"), ("g4.bwd", "trees")]
    assert "mutates non-static input(s) [0]" in pol.recorder.records[0]["reason"]
    assert "its forward graph uses cudagraph trees" in pol.recorder.records[1]["reason"]
    assert trees_calls[0][1] == (1,) and trees_calls[0][2]["is_backward"] is False
    # a lean forward whose backward has a hazard: that backward runs without a CUDA graph
    pol = LeanCUDAGraphPolicy(graph_id="g5", engine=engine, device_type="cpu")
    assert isinstance(pol.cudagraphify(fwd_graph, [x, x], [1], **_kw()), LeanCUDAGraph)
    kw = _kw(is_backward=True)
    kw["mutated_input_idxs"] = (3,)
    assert pol.cudagraphify(bwd_graph, [x] * 4, [0, 1, 2], **kw) is bwd_graph
    assert pol.recorder.records[-1]["event"] == "no_cudagraph"
    # static hazards from the backend (UB) and missing AOT metadata
    pol = LeanCUDAGraphPolicy(graph_id="g6", engine=engine, device_type="cpu", static_hazards=["graph reads UB"])
    assert pol.cudagraphify(fwd_graph, [x, x], [1], **_kw())[0] == "trees"
    assert pol.recorder.records[-1]["reason"] == "graph reads UB"
    monkeypatch.setattr(cgp, "forward_user_output_count", lambda: None)
    pol = LeanCUDAGraphPolicy(graph_id="g7", engine=engine, device_type="cpu")
    f = pol.cudagraphify(fwd_graph, [x, x], [1], **_kw())
    assert isinstance(f, LeanCUDAGraph) and f._num_clone == eng.SAVED_BY_DATAFLOW
    assert "metadata not available" in pol.recorder.records[0]["reason"]
    # inference graphs need no metadata (every output is cloned)
    assert isinstance(pol.cudagraphify(fwd_graph, [x, x], [1], **_kw(is_inference=True)), LeanCUDAGraph)


def test_forward_user_output_count_reads_aot_metadata():
    from types import SimpleNamespace

    assert cgp.forward_user_output_count() is None
    ctx = torch._guards.TracingContext(None)
    ctx.fw_metadata = SimpleNamespace(num_forward=3)
    with torch._guards.tracing(ctx):
        assert cgp.forward_user_output_count() == 3


def test_should_wrap_declines_partitioned_graphs():
    from types import SimpleNamespace

    pol = LeanCUDAGraphPolicy(graph_id="g8", device_type="cpu", engine=FakeEngine())
    assert pol.should_wrap(SimpleNamespace(partition_maps=None, fx_kwargs={}))
    assert pol.should_wrap(SimpleNamespace(partition_maps=[object()], fx_kwargs={}))
    assert not pol.should_wrap(SimpleNamespace(partition_maps=[object(), object()], fx_kwargs={"is_backward": True}))
    rec = pol.recorder.records[-1]
    assert rec["graph"] == "g8.bwd" and rec["event"] == "not_captured"
    assert "2 Inductor graph partitions" in rec["reason"]


def test_recorder_dedups_and_refreshes_once_per_reason():
    sink, refreshed = [], []
    rec = CudagraphRecorder(sink, refresh=lambda: refreshed.append(1))
    for _ in range(3):
        rec.event("g0.fwd", "eager", "why")
    rec.event("g0.fwd", "eager", "other")
    assert [(r["reason"], r["count"]) for r in sink] == [("why", 3), ("other", 1)] and len(refreshed) == 2


# -------------------------------------------------------------------- option + backend
def test_option_validation(monkeypatch):
    # trees is the default: lean measured slower than trees on the H200 (docs/usage.md)
    assert TePassesOptions.parse({})[0].cudagraphs == "trees"
    assert TePassesOptions.parse({"te_passes.cudagraphs": "lean"})[0].cudagraphs == "lean"
    assert TePassesOptions.parse({"te_passes.cudagraphs": "trees"})[0].cudagraphs == "trees"
    with pytest.raises(TePassesOptionError, match=r"te_passes.cudagraphs must be one of \['lean', 'trees'\]"):
        TePassesOptions.parse({"te_passes.cudagraphs": "fast"})
    assert TePassesOptions.parse({}, environ={"TE_PASSES_CUDAGRAPHS": "lean"})[0].cudagraphs == "lean"
    with pytest.raises(TePassesOptionError, match="TE_PASSES_CUDAGRAPHS"):
        TePassesOptions.parse({}, environ={"TE_PASSES_CUDAGRAPHS": "nope"})
    # not part of the pass pipeline's cache identity
    a = TePassesOptions.parse({"te_passes.cudagraphs": "lean"})[0].fingerprint_data()
    assert a == TePassesOptions.parse({})[0].fingerprint_data()


@pytest.fixture
def captured_patches(monkeypatch):
    seen = []

    def fake_compile_fx(gm, example_inputs, config_patches=None, **kw):
        seen.append(dict(config_patches or {}))
        return gm.forward

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", fake_compile_fx)
    return seen


@pytest.mark.parametrize("mode, options, expect", [
    ("reduce-overhead", {}, False),  # trees is the default
    ("reduce-overhead", {"te_passes.cudagraphs": "lean"}, True),
    (None, {"te_passes.cudagraphs": "lean"}, False),
    ("reduce-overhead", {"te_passes.cudagraphs": "trees"}, False),
    (None, {"triton.cudagraphs": True, "te_passes.cudagraphs": "lean"}, True),
])
def test_backend_sets_policy_only_with_cudagraphs_on(captured_patches, mode, options, expect):
    import functools

    from te_passes.backend import te_inductor
    from te_passes.report import compile_reports

    torch._dynamo.reset()
    m = torch.nn.Linear(4, 4)
    fn = torch.compile(m, backend=functools.partial(te_inductor, mode=mode, options=options))
    x = torch.randn(2, 4)
    torch.testing.assert_close(fn(x), m(x))
    pol = captured_patches[-1].get("cudagraph_policy")
    assert (isinstance(pol, LeanCUDAGraphPolicy)) is expect, captured_patches[-1]
    if expect:
        assert pol.graph_id == compile_reports()[-1].graph_id
        assert pol.recorder.records is compile_reports()[-1].cudagraphs
    torch._dynamo.reset()


def test_non_tree_cudagraphs_refused_before_any_policy(captured_patches):
    """``triton.cudagraph_trees=False`` under reduce-overhead is refused (issue 16 item 10), so no
    graph is compiled and no policy chosen."""
    import functools

    from te_passes import TePassesOptionError
    from te_passes.backend import te_inductor

    torch._dynamo.reset()
    m = torch.nn.Linear(4, 4)
    fn = torch.compile(m, backend=functools.partial(te_inductor, mode="reduce-overhead",
                                                    options={"triton.cudagraph_trees": False}))
    with pytest.raises(TePassesOptionError, match="cudagraph_trees"):
        fn(torch.randn(2, 4))
    assert not captured_patches
    torch._dynamo.reset()


def test_user_policy_wins(captured_patches):
    import functools

    from te_passes.backend import te_inductor

    torch._dynamo.reset()
    mine = torch._inductor.cudagraph_utils.CUDAGraphPolicy()
    m = torch.nn.Linear(4, 4)
    with torch._inductor.config.patch(cudagraph_policy=mine):  # (options= cannot carry one: torch's type check)
        torch.compile(m, backend=functools.partial(te_inductor, mode="reduce-overhead"))(torch.randn(2, 4))
    assert "cudagraph_policy" not in captured_patches[-1]
    torch._dynamo.reset()


def test_ub_hazard_only_when_ub_is_initialised():
    """Every TE op carries UB flags (so a TE graph always "reads UB state"); only an initialised
    UB makes lean replay step aside for the graph."""
    from te_passes.pipeline.compilation import Compilation
    from te_passes.pipeline.manager import PassManager
    from te_passes.report import new_compile_report
    from te_passes.te.state import TEState
    from te_passes.te.ub import UbSnapshot

    opts = TePassesOptions.parse({"te_passes.cudagraphs": "lean"})[0]
    rep = new_compile_report("reduce-overhead")

    def policy(ub, patches={"triton.cudagraphs": True}):  # noqa: B006 - read only
        comp = Compilation(PassManager([]), opts, TEState(ub=ub), rep)
        return comp.cudagraph_policy(patches)

    rep.uuid = {"ub_reads": ["te op linear: ub_overlap_ag_fprop flag"]}
    off = policy(UbSnapshot(source="absent"))
    assert isinstance(off, LeanCUDAGraphPolicy) and off.static_hazards == ()
    on = policy(UbSnapshot(initialized=True, source="live"))
    assert len(on.static_hazards) == 1 and "Userbuffers" in on.static_hazards[0]
    rep.uuid = {"ub_reads": []}
    assert policy(UbSnapshot(initialized=True)).static_hazards == ()
    assert policy(None, {"triton.cudagraphs": False}) is None


def test_report_json_carries_cudagraph_records():
    from te_passes.report import new_compile_report

    rep = new_compile_report("reduce-overhead")
    CudagraphRecorder(rep.cudagraphs).event(f"{rep.graph_id}.fwd", "trees", "dynamic shapes")
    assert rep.to_json()["cudagraphs"] == [{"graph": f"{rep.graph_id}.fwd", "event": "trees",
                                            "reason": "dynamic shapes", "count": 1}]
