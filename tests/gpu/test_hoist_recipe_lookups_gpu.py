"""``hoist_te_constants`` (until issue 12 part of ``hoist_recipe_lookups``) on the GPU: TE constants built once, same numerics, no per-step rebuilds.

Run on the H200 with ``pytest -m gpu tests/gpu/test_hoist_recipe_lookups_gpu.py``; skipped without
a GPU / TE compile path (tests/gpu/conftest.py). Self-contained: builds its own models.

Asserted for the fp8 (Float8CurrentScaling) 4-layer te.Linear/GELU stack, ``te_inductor`` default
mode (Inductor's Python wrapper, no CUDA graphs):

* the generated forward and backward wrappers construct no TE object in their call path
  (``_rebuild_quantizer(`` / ``OpaqueValueBundle(`` occurrences = 0); with the pass disabled
  the same wrappers rebuild 52 per step (8 per layer forward, 5 per layer backward);
* over 10 steps after warm-up: 0 quantizer and 0 bundle constructions (counted on the classes),
  against 52 per step without the pass, and 0 recompiles;
* outputs and gradients over 6 steps with fresh inputs are bit-identical with and without the
  pass (it only changes where constants are built: TE's ops update quantizer usage flags in
  place each call, exactly as TE eager does with its module-persistent quantizers), and within
  ``REL_TOL`` of TE eager.
"""

from __future__ import annotations

import contextlib
import re
import sys
from unittest import mock

import pytest
import torch

from te_passes.testing.gpu import (
    REL_TOL,
    CompileWatch,
    build_stack,
    copy_params,
    forward_fn,
    make_recipe,
    rel_err,
    train_step,
)

pytestmark = pytest.mark.gpu

HIDDEN = 1024
TOKENS = 256
LAYERS = 4
PASS = "hoist_te_constants"


def _compiled(model, recipe, hoist: bool):
    opts = {} if hoist else {"te_passes.disable": [PASS]}
    return torch.compile(forward_fn(model, "fp8", recipe), backend="te_inductor", options=opts)


def _inputs(seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    dy = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
    return x, dy


def _call_bodies(codes):
    return [c[c.index("def call("):] for c in codes if "def call(" in c]


@contextlib.contextmanager
def _count_constructions():
    """Counts the TE constants the compiled call path builds: quantizers built by TE's
    ``_rebuild_quantizer`` (the expression Inductor's wrapper evaluates; counted in
    ``Float8CurrentScalingQuantizer.__new__`` by its caller) and ``OpaqueValueBundle`` s built
    directly by a generated Inductor module (caller's file under Inductor's cache directory).
    Constructions TE's ops make internally for their own work are counted apart (``other``)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    from transformer_engine.pytorch.dynamo.custom_op import OpaqueValueBundle
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    counts = {"quantizer": 0, "bundle": 0, "other": 0}
    orig_init = OpaqueValueBundle.__init__
    inductor_dir = cache_dir()

    def new(cls, *args, **kwargs):
        caller = sys._getframe(1).f_code
        counts["quantizer" if caller.co_name == "_rebuild_quantizer" else "other"] += 1
        return object.__new__(cls)

    def init(self, *args, **kwargs):
        caller = sys._getframe(1).f_code
        counts["bundle" if caller.co_filename.startswith(inductor_dir) else "other"] += 1
        orig_init(self, *args, **kwargs)

    # Not mock.patch.object(cls, "__new__"): when the class inherits object.__new__, mock's
    # restore deletes the attribute and leaves a __new__ slot that rejects constructor
    # arguments ("object.__new__() takes exactly one argument") for the rest of the process.
    had_new = "__new__" in Float8CurrentScalingQuantizer.__dict__
    orig_new = Float8CurrentScalingQuantizer.__dict__.get("__new__")
    Float8CurrentScalingQuantizer.__new__ = new
    try:
        with mock.patch.object(OpaqueValueBundle, "__init__", init):
            yield counts
    finally:
        if had_new:
            Float8CurrentScalingQuantizer.__new__ = orig_new
        else:
            Float8CurrentScalingQuantizer.__new__ = _object_new_ignoring_args


def _object_new_ignoring_args(cls, *args, **kwargs):
    """What ``object.__new__`` does for a class that overrides ``__init__`` only."""
    return object.__new__(cls)


@pytest.mark.parametrize("hoist", [True, False], ids=["hoisted", "pass-disabled"])
def test_stack4_wrappers_construct_no_te_object_per_call(hoist):
    from torch._inductor.utils import run_and_get_code

    recipe = make_recipe("fp8")
    model = build_stack(LAYERS, HIDDEN)
    fn = _compiled(model, recipe, hoist)
    x, dy = _inputs(0)
    _, codes = run_and_get_code(lambda: train_step(fn, x, dy, list(model.parameters())))
    bodies = _call_bodies(codes)
    assert len(bodies) >= 2, f"expected forward and backward wrappers, got {len(bodies)}"
    rebuilds = sum(b.count("_rebuild_quantizer(") for b in bodies)
    bundles = sum(b.count("OpaqueValueBundle(") for b in bodies)
    if hoist:
        assert (rebuilds, bundles) == (0, 0)
        # distinct hoisted constants per wrapper: 3 and 4 per layer (H200, session 21; 4 and 8 before row
        # autocast.traced_quantizer_copies gave te.Linear's op per-call quantizer copies, session 20)
        per_body = sorted(len(set(re.findall(r"_te_const_\d+", b))) for b in bodies)
        assert per_body == [LAYERS * 3, LAYERS * 4], per_body
    else:
        # 32 quantizer rebuilds per fp8 stack4 step (H200, session 21); 52 before the traced quantizer copies
        # (GOALS.md's figure)
        assert rebuilds == 32, rebuilds


@pytest.mark.parametrize("hoist", [True, False], ids=["hoisted", "pass-disabled"])
def test_no_constructions_and_no_recompiles_over_steps(hoist):
    recipe = make_recipe("fp8")
    model = build_stack(LAYERS, HIDDEN)
    fn = _compiled(model, recipe, hoist)
    params = list(model.parameters())
    for s in range(3):  # warm-up: compiles (TE's documented first-call recompile included)
        x, dy = _inputs(s)
        train_step(fn, x, dy, params)
    torch.cuda.synchronize()
    steps = 10
    inputs = [_inputs(100 + s) for s in range(steps)]
    with CompileWatch() as watch, _count_constructions() as counts:
        for x, dy in inputs:
            train_step(fn, x, dy, params)
        torch.cuda.synchronize()
    assert watch.stats.recompiles == 0 and watch.stats.graphs == 0
    if hoist:
        assert (counts["quantizer"], counts["bundle"]) == (0, 0), counts
    else:
        # Baseline: the wrappers rebuild constants on every call. Measured on an H200
        # (2026-11-29): 320 quantizers over 10 steps (32 per step at run time, fewer than the 52
        # rebuild expressions in the wrappers' source: test_stack4_wrappers_construct_no_te_object_per_call).
        # Asserted as "rebuilds happen every step", which is what the hoisted case removes.
        assert counts["quantizer"] >= steps and counts["quantizer"] % steps == 0, counts
        assert counts["bundle"] >= steps, counts


def test_numerics_identical_with_and_without_hoisting_and_close_to_eager():
    recipe = make_recipe("fp8")
    eager = build_stack(LAYERS, HIDDEN, seed=0)
    m_on = build_stack(LAYERS, HIDDEN, seed=1)
    m_off = build_stack(LAYERS, HIDDEN, seed=2)
    copy_params(eager, m_on)
    copy_params(eager, m_off)
    f_eager = forward_fn(eager, "fp8", recipe)
    f_on, f_off = _compiled(m_on, recipe, True), _compiled(m_off, recipe, False)
    for step in range(6):
        x, dy = _inputs(step)
        outs = {}
        for tag, fn, model in (("eager", f_eager, eager), ("on", f_on, m_on), ("off", f_off, m_off)):
            xi = x.detach().clone().requires_grad_(True)
            y = train_step(fn, xi, dy, list(model.parameters()))
            outs[tag] = [y.detach().clone(), xi.grad.clone(), *(p.grad.clone() for p in model.parameters())]
        for a, b in zip(outs["on"], outs["off"]):
            assert torch.equal(a, b), f"step {step}: hoisting changed a result"
        for a, e in zip(outs["on"], outs["eager"]):
            assert rel_err(a, e) <= REL_TOL["fp8"], f"step {step}: {rel_err(a, e):.3e} vs eager"
