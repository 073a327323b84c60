"""Lean CUDA-graph replay (``te_passes.cudagraphs="lean"``, opt-in; trees is the default; issue 14)
on a GPU, against TE eager and against the same graphs under cudagraph trees.

One command on the H200 (tests/gpu/run_on_device.sh suite runs it with the rest)::

    python3 -m pytest -m gpu tests/gpu/test_lean_cudagraphs_gpu.py -q -s

What is asserted (stack4 = 4 x te.Linear(4096) + GELU, 256 tokens; te_passes/testing/gpu.py):

* 100 training steps with fresh inputs, bf16 and fp8: forward output, input gradient and every
  parameter gradient bit-identical (``torch.equal``) to the same model compiled with
  ``te_passes.cudagraphs="trees"`` (the same Inductor graphs replayed by cudagraph trees) and
  within ``REL_TOL`` of TE eager; both graphs captured lean, no fallback after capture, no
  exception (pool errors would raise), every replay counted;
* gradient accumulation over 4 micro-batches (no ``zero_grad`` between them) equal to eager;
* an output kept across steps keeps its value;
* a ``te.TransformerLayer`` training step: equal to eager whatever the policy decided, and every
  fallback the report lists carries a reason;
* peak memory: te_inductor-ro under trees (the default) no more than plain inductor-ro; lean no
  more than trees plus the pool memory its forwards hold for their lifetime (their saved
  tensors, ``LeanCUDAGraph.held_bytes``: trees' backward reuses that memory, lean's cannot),
  5% + 8 MiB slack for allocator rounding (docs/usage.md, "Memory").
"""

from __future__ import annotations

import functools

import pytest
import torch

from te_passes.testing.gpu import (PRECISIONS, REL_TOL, build_stack, copy_params, forward_fn, fresh_compile_state,
                                   grad_rel_err, grads_of, make_recipe, rel_err, train_step)

pytestmark = pytest.mark.gpu

HIDDEN = 4096
TOKENS = 256
STEPS = 100
#: events that mean "this call / graph did not replay lean" (see te_passes/cudagraphs/lean.py)
FALLBACK_EVENTS = ("eager", "disabled", "clone", "trees", "no_cudagraph", "not_captured", "copied")


def _ro(fn, cudagraphs: str):
    from te_passes.backend import te_inductor

    return torch.compile(fn, backend=functools.partial(te_inductor, mode="reduce-overhead",
                                                       options={"te_passes.cudagraphs": cudagraphs}))


def _records() -> list[dict]:
    from te_passes.report import compile_reports

    return [r for rep in compile_reports() for r in rep.cudagraphs]


def _runners():
    """Lean wrappers of the graphs this test compiled (conftest clears the reports per test)."""
    from te_passes.report import compile_reports
    from te_passes.cudagraphs.lean import lean_runners

    ids = {rep.graph_id for rep in compile_reports()}
    return sorted((r for r in lean_runners() if r.name.split(".")[0] in ids), key=lambda r: r.name)


def _close(tag, a, e, precision):
    assert torch.isfinite(a).all(), f"{tag}: non-finite values"
    err = rel_err(a, e)
    assert err <= REL_TOL[precision], f"{tag}: rel err {err:.3e} > {REL_TOL[precision]}"
    return err


def _models(n: int, precision: str):
    ref = build_stack(4, HIDDEN, seed=0)
    models = [ref] + [build_stack(4, HIDDEN, seed=0) for _ in range(n - 1)]
    for m in models[1:]:
        copy_params(ref, m)
    recipe = make_recipe(precision)
    return models, recipe


@pytest.mark.parametrize("precision", PRECISIONS)
def test_stack4_100_steps_bit_identical_to_trees_and_close_to_eager(precision):
    (m_eager, m_lean, m_trees), recipe = _models(3, precision)
    f_eager = forward_fn(m_eager, precision, recipe)
    f_lean = _ro(forward_fn(m_lean, precision, recipe), "lean")
    f_trees = _ro(forward_fn(m_trees, precision, recipe), "trees")
    gen = torch.Generator(device="cuda").manual_seed(0)
    equal_to_eager = 0
    for step in range(STEPS):
        x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
        dy = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
        xs = [x.clone().requires_grad_() for _ in range(3)]
        ye = train_step(f_eager, xs[0], dy, list(m_eager.parameters()))
        yl = train_step(f_lean, xs[1], dy, list(m_lean.parameters()))
        yt = train_step(f_trees, xs[2], dy, list(m_trees.parameters()), mark_step=True)
        ge, gl, gt = grads_of(xs[0], m_eager), grads_of(xs[1], m_lean), grads_of(xs[2], m_trees)
        assert ge.keys() == gl.keys() == gt.keys()
        pairs = [("y", yl.detach(), yt.detach(), ye.detach())] + [(k, gl[k], gt[k], ge[k]) for k in ge]
        for tag, a, t, e in pairs:
            assert torch.equal(a, t), f"step {step} {tag}: lean differs from trees (max |diff| " \
                                      f"{(a.float() - t.float()).abs().max().item():.3e})"
            _close(f"step {step} {tag}", a, e, precision)
        equal_to_eager += all(torch.equal(a, e) for _, a, _, e in pairs)
        # a kept y keeps its autograd graph, hence x and x.grad (the backward's static output)
        # alive into the next step: lean would then clone that output (tested on CPU); drop them
        del ye, yl, yt, xs, ge, gl, gt, pairs
    torch.cuda.synchronize()
    recs = _records()
    print(f"stack4 {precision} lean: {equal_to_eager}/{STEPS} steps bit-identical to TE eager; records {recs}")
    lean = [r for r in _runners() if r.captured]
    for r in lean:
        print(r.name, r.stats, r.output_kinds())
        assert r.stats["eager"] == 0, (r.name, r.stats)
    # (a TE guard may fail once and recompile: then the second graph's pair does the replays)
    for kind in ("fwd", "bwd"):
        replays = [r.stats["replay"] for r in lean if r.name.endswith("." + kind)]
        assert replays and max(replays) >= STEPS - 5, f"{kind}: replays {replays}; records {recs}"
    bad = [r for r in recs if r["event"] in FALLBACK_EVENTS]
    assert not bad, f"fallbacks in a plain training loop: {bad}"


@pytest.mark.parametrize("precision", PRECISIONS)
def test_gradient_accumulation_4_micro_batches_equals_eager(precision):
    (m_eager, m_lean), recipe = _models(2, precision)
    f_eager = forward_fn(m_eager, precision, recipe)
    f_lean = _ro(forward_fn(m_lean, precision, recipe), "lean")
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step in range(4):
        for p in [*m_eager.parameters(), *m_lean.parameters()]:
            p.grad = None
        for mb in range(4):
            x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
            dy = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
            f_eager(x).backward(dy)
            f_lean(x).backward(dy)
        ge = {n: p.grad for n, p in m_eager.named_parameters()}
        for n, p in m_lean.named_parameters():
            _close(f"step {step} grad[{n}]", p.grad, ge[n], precision)
    print(f"grad accumulation {precision}: records {_records()}")
    for r in _runners():
        print(r.name, r.stats, r.output_kinds())


def test_output_held_across_steps_keeps_its_value():
    (m_eager, m_lean), recipe = _models(2, "fp8")
    f_eager = forward_fn(m_eager, "fp8", recipe)
    f_lean = _ro(forward_fn(m_lean, "fp8", recipe), "lean")
    gen = torch.Generator(device="cuda").manual_seed(2)
    kept = []
    for step in range(8):
        x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
        dy = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
        y = train_step(f_lean, x.clone().requires_grad_(), dy, list(m_lean.parameters()))
        ye = train_step(f_eager, x.clone().requires_grad_(), dy, list(m_eager.parameters()))
        kept.append((y, ye.detach().clone()))  # y itself, not a copy
    torch.cuda.synchronize()
    for step, (y, ye) in enumerate(kept):
        _close(f"kept output of step {step}", y.detach(), ye, "fp8")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_transformer_layer_step_correct_whatever_the_policy_decides(precision):
    import transformer_engine.pytorch as te

    def build():
        torch.manual_seed(0)
        return te.TransformerLayer(1024, 4096, 16, hidden_dropout=0.0, attention_dropout=0.0,
                                   params_dtype=torch.bfloat16, device="cuda")

    m_eager, m_lean = build(), build()
    copy_params(m_eager, m_lean)
    recipe = make_recipe(precision)
    f_eager = forward_fn(m_eager, precision, recipe)
    f_lean = _ro(forward_fn(m_lean, precision, recipe), "lean")
    gen = torch.Generator(device="cuda").manual_seed(3)
    for step in range(6):
        x = torch.randn(128, 2, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)
        dy = torch.randn(128, 2, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)
        xe, xl = x.clone().requires_grad_(), x.clone().requires_grad_()
        ye = train_step(f_eager, xe, dy, list(m_eager.parameters()))
        yl = train_step(f_lean, xl, dy, list(m_lean.parameters()))
        ge, gl = grads_of(xe, m_eager), grads_of(xl, m_lean)
        _close(f"step {step} y", yl.detach(), ye.detach(), precision)
        for k in ge:  # attention key bias: 0 in exact arithmetic, measured on the query bias's scale
            err = grad_rel_err(k, gl[k], ge[k], ge)
            assert torch.isfinite(gl[k]).all() and err <= REL_TOL[precision], f"step {step} grad[{k}]: {err:.3e}"
    recs = _records()
    print(f"TransformerLayer {precision}: {len(recs)} records:")
    for r in recs:
        print("  ", r)
    for r in _runners():
        print("  ", r.name, r.stats, r.output_kinds())
    assert all(r["reason"] for r in recs)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_peak_memory_not_above_inductor_ro(precision):
    from te_passes.cudagraphs.stable_grads import copies_made
    from te_passes.testing.gpu import ensure_te_inductor_backend

    ensure_te_inductor_backend()
    gen = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    dy = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    excess = {}
    copies = {}
    saved_mib = None
    for variant in ("inductor-ro", "te_inductor-ro-trees", "te_inductor-ro-lean"):
        with fresh_compile_state():
            model = build_stack(4, HIDDEN, seed=0)
            recipe = make_recipe(precision)
            base = forward_fn(model, precision, recipe)
            fn = (torch.compile(base, backend="inductor", mode="reduce-overhead") if variant == "inductor-ro"
                  else _ro(base, variant.rsplit("-", 1)[1]))
            params = list(model.parameters())
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start, copied = torch.cuda.memory_allocated(), copies_made()
            for _ in range(20):
                train_step(fn, x, dy, params, mark_step=True)
            torch.cuda.synchronize()
            excess[variant] = (torch.cuda.max_memory_allocated() - start) / 2**20
            copies[variant] = copies_made() - copied
            largest_grad_mib = max(p.numel() * p.element_size() for p in params) / 2**20
            if variant.endswith("lean"):
                fwd = [r for r in _runners() if r.name.endswith(".fwd") and r.captured]
                assert fwd, "lean captured no forward graph"
                saved_mib = sum(r.held_bytes for r in fwd) / 2**20
            x.grad = None
            del fn, base, model, params
    print(f"peak memory over start, {precision} stack4 {TOKENS} tokens (MiB): {excess}; "
          f"lean forwards hold {saved_mib:.1f} MiB; stable .grad copies {copies}")
    # te_inductor's reduce-overhead copies a .grad the CUDA-graph pool owns out of the pool (cudagraphs/stable_grads.py,
    # issue 42) while the pool's tensor is still alive: up to one parameter's gradient more at the peak (bf16 stack4,
    # H200 session 21: +28 MiB over inductor-ro, the largest gradient 32 MiB; fp8: +0)
    stable_copy_mib = largest_grad_mib if copies["te_inductor-ro-trees"] else 0.0
    assert excess["te_inductor-ro-trees"] <= excess["inductor-ro"] * 1.05 + 8 + stable_copy_mib, (excess, copies)
    bound = excess["te_inductor-ro-trees"] * 1.05 + saved_mib + 8
    assert excess["te_inductor-ro-lean"] <= bound, (excess, saved_mib, bound)
