"""call_te_impl_directly on the GPU: stack4 through te_inductor with TE's impls called directly.

Run on the H200 (after the gpu-kit bring-up)::

    source .gpu/s/env.sh; PYTHONPATH=$PWD python3 -m pytest -m gpu tests/gpu/test_direct_call_gpu.py -q

Per precision (bf16, fp8 Float8CurrentScaling) and mode (default, reduce-overhead), stack4
(4 × te.Linear(1024) + GELU, 256 tokens; three twins with the same weights):

* the direct-call compile is **bit-identical** to the same compile with the pass disabled
  (``te_passes.disable=["call_te_impl_directly"]``: Inductor's dispatcher call of the TE op, the
  same generated code otherwise) over several steps: output, input grad, every parameter grad;
  both are within ``REL_TOL`` of TE eager (Inductor's own GELU code may round differently from
  eager's, so eager is compared with the harness tolerance);
* default mode: TE's impl runs exactly once per op per step (4 forward + 4 backward calls,
  counted by wrapping the function in the base op's ``_impl`` closure — what both paths call),
  and the base ops' dispatcher kernels are never entered;
* the generated forward / backward code calls ``_te_direct_N`` once per TE op and never the
  ``transformer_engine_compile`` ops; reduce-overhead: no cudagraph skips.
"""

from __future__ import annotations

import contextlib
import functools
import re

import pytest
import torch

from te_passes.testing.gpu import (REL_TOL, CompileWatch, build_stack, copy_params, forward_fn, grads_of,
                                   make_recipe, rel_err, train_step)

pytestmark = pytest.mark.gpu

HIDDEN, TOKENS, LAYERS, STEPS = 1024, 256, 4, 4
NS = "transformer_engine_compile"


@contextlib.contextmanager
def _count_impls():
    """Wrap the ``impl`` in the closure of each linear base op's ``_impl`` with a counter."""
    from torch._library.custom_ops import OPDEFS

    counts = {"linear_base": 0, "linear_backward_base": 0, "dispatcher": 0}
    undo = []
    for op in ("linear_base", "linear_backward_base"):
        opdef = OPDEFS[f"{NS}::{op}"]
        fn = opdef._init_fn
        cell = dict(zip(fn.__code__.co_freevars, fn.__closure__))["impl"]
        orig = cell.cell_contents

        def counted(args, _o=orig, _k=op):
            counts[_k] += 1
            return _o(args)

        cell.cell_contents = counted
        undo.append(lambda c=cell, o=orig: setattr(c, "cell_contents", o))
        backend = opdef._backend_fns[None]

        def disp(*a, _b=backend, **k):
            counts["dispatcher"] += 1
            return _b(*a, **k)

        opdef._backend_fns[None] = disp
        undo.append(lambda d=opdef, b=backend: d._backend_fns.__setitem__(None, b))
    try:
        yield counts
    finally:
        for u in reversed(undo):
            u()


def _twin(ref, precision):
    m = build_stack(LAYERS, HIDDEN)
    copy_params(ref, m)
    return m


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("precision", ["fp8", "bf16"])
def test_stack4_direct_call_bit_identical(precision, mode):
    from torch._inductor.utils import fresh_cache

    # a fresh cache dir: both compiles really lower (and run_and_get_code sees the wrapper code)
    with fresh_cache():
        _check(precision, mode)


def _check(precision, mode):
    from torch._inductor.utils import run_and_get_code

    recipe = make_recipe(precision)
    eager_m = build_stack(LAYERS, HIDDEN)
    disp_m, direct_m = _twin(eager_m, precision), _twin(eager_m, precision)
    m = None if mode == "default" else mode
    from te_passes.backend import te_inductor

    fns = {
        "eager": (eager_m, forward_fn(eager_m, precision, recipe)),
        # torch.compile refuses mode= together with options=: the backend takes both (docs/usage.md);
        # imported here: importing te_passes.backend at collection installs te_passes' TE hooks for
        # every later test of the session (test_amax_groups checks plain inductor without them)
        "dispatcher": (disp_m, torch.compile(forward_fn(disp_m, precision, recipe), backend=functools.partial(
            te_inductor, mode=m, options={"te_passes.disable": ["call_te_impl_directly"]}))),
        "direct": (direct_m, torch.compile(forward_fn(direct_m, precision, recipe), backend="te_inductor", mode=m)),
    }
    g = torch.Generator(device="cuda").manual_seed(1)
    inputs = [(torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(),
               torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)) for _ in range(STEPS)]
    results = {}
    codes = None
    for name, (model, fn) in fns.items():
        params = list(model.parameters())
        res = []
        watch = CompileWatch()
        with watch, _count_impls() as counts:
            for i, (x0, dy) in enumerate(inputs):
                x = x0.detach().clone().requires_grad_()
                step = lambda: train_step(fn, x, dy, params, mark_step=m is not None)  # noqa: E731
                if name == "direct" and i == 0:
                    y, codes = run_and_get_code(step)
                else:
                    y = step()
                if i == 0:
                    first = dict(counts)
                res.append((y.detach().clone(), grads_of(x, model)))
            torch.cuda.synchronize()
        results[name] = res
        if name == "direct":
            if m is None:
                # steps after the first (which also compiled): exactly one impl call per op per step
                assert counts["linear_base"] - first["linear_base"] == LAYERS * (STEPS - 1), counts
                assert counts["linear_backward_base"] - first["linear_backward_base"] == LAYERS * (STEPS - 1), counts
            assert counts["dispatcher"] == 0, counts
            assert watch.stats.cudagraph_skips == 0 and watch.stats.graph_breaks == 0, watch.stats
        elif name == "dispatcher" and m is None:
            assert counts["dispatcher"] >= 2 * LAYERS * (STEPS - 1), counts
    fwd_code, bwd_code = codes[0], codes[-1]
    for code in (fwd_code, bwd_code):
        assert len(re.findall(r"= _te_direct_\d+\(", code)) == LAYERS, code
        assert not re.search(rf"torch\.ops\.{NS}\.\w+\.default\(", code)
    for step, ((y, gr), (yd, gd), (ye, ge)) in enumerate(zip(results["direct"], results["dispatcher"], results["eager"])):
        assert torch.equal(y, yd), f"step {step}: output differs from the dispatcher path"
        assert gr.keys() == gd.keys() == ge.keys()
        for k in gr:
            assert torch.equal(gr[k], gd[k]), f"step {step}: grad {k} differs from the dispatcher path"
            assert rel_err(gr[k], ge[k]) <= REL_TOL[precision], (step, k, rel_err(gr[k], ge[k]))
        assert rel_err(y, ye) <= REL_TOL[precision]
