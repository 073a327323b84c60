"""te_passes.compile_step and te_passes.make_graphed on a GPU (issue 22): numerics against TE eager.

Run on the H200 with ``pytest -m gpu tests/gpu/test_step_capture_gpu.py`` (~3-5 min: one
te_inductor compile per case). Every case runs a TE-eager twin (same weights, inputs, optimizer)
step by step and compares the loss and every ``.grad`` (and parameters after optimizer steps)
within ``REL_TOL`` (te_passes/testing/gpu.py), for bf16 and the fp8 recipes the device supports
(Float8CurrentScaling, Float8BlockScaling; MXFP8BlockScaling needs Blackwell and is skipped on
Hopper with TE's reason):

* compile_step, reduce-overhead: one Dynamo graph, no break, no cudagraph skip; gradient
  accumulation over two micro-batches with ``zero_grad(set_to_none=True/False)``; an optimizer
  step outside the step (inside is refused: tests/test_step_capture.py); a shape change (a new graph, never a stale replay); losses
  held across steps; ``.grad`` read right after each step;
* make_graphed: each case in its own subprocess (tests/gpu/_make_graphed_worker.py), since a
  failed ``te.make_graphed_callables`` would leave TE in capture state for the process; the same
  numerics, plus a shape change refused with StepCaptureError.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from te_passes.testing.gpu import REL_TOL, build_stack, copy_params, rel_err

pytestmark = pytest.mark.gpu

HIDDEN = 1024
TOKENS = 256
RECIPES = ("bf16", "fp8-cs", "fp8-block", "mxfp8")


def recipe_of(name: str):
    """``(recipe or None, tolerance key)``; skips when the device cannot run the recipe."""
    if name == "bf16":
        return None, "bf16"
    from transformer_engine.common import recipe as r
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as M

    ok, why = {"fp8-cs": M.is_fp8_available, "fp8-block": M.is_fp8_block_scaling_available,
               "mxfp8": M.is_mxfp8_available}[name]()
    if not ok:
        pytest.skip(f"{name}: {why}")
    return {"fp8-cs": r.Float8CurrentScaling, "fp8-block": r.Float8BlockScaling,
            "mxfp8": r.MXFP8BlockScaling}[name](), "fp8"


def _twins(seed=0):
    ref = build_stack(2, HIDDEN, seed=seed)
    model = build_stack(2, HIDDEN, seed=seed)
    copy_params(ref, model)
    return ref, model


def _inputs(tokens=TOKENS, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)


def _loss_fn(model, recipe):
    import transformer_engine.pytorch as te

    def loss_of(x):
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = model(x)
        return y.float().square().mean()
    return loss_of


def _check(tag, got, ref, tol):
    assert got.shape == ref.shape, tag
    assert torch.isfinite(got).all(), f"{tag}: non-finite"
    err = rel_err(got, ref)
    assert err <= REL_TOL[tol], f"{tag}: rel err {err:.3e} > {REL_TOL[tol]:.0e}"


def _check_grads(tag, model, ref, tol):
    for (n, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert (p.grad is None) == (r.grad is None), f"{tag}: {n}.grad presence differs"
        if r.grad is not None:
            _check(f"{tag} {n}.grad", p.grad, r.grad, tol)


@pytest.fixture(autouse=True)
def _fresh_counters():
    """Dynamo's global counters start empty in every test: ``torch._dynamo.reset()`` (the suite's
    fresh compile state) does not clear them, so without this fixture ``_counts`` sums every earlier
    test of the process (H200, 2026-12-02: 21-28 "graphs" and 1 "break" reported by tests that
    compile 2 graphs; not re-run with the fixture yet)."""
    from torch._dynamo.utils import counters

    counters.clear()
    yield


def _counts():
    from torch._dynamo.utils import counters

    skips = sum(v for k, v in counters["inductor"].items() if "cudagraph_skip" in k)
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()), skips


def _twin_step(name):
    """Twin stacks under ``name``'s recipe: ``(tol, ref, model, ref_loss, step)``, ``ref_loss(x)``
    the eager twin's loss, ``step(x)`` the other twin's loss and backward (to compile)."""
    recipe, tol = recipe_of(name)
    ref, model = _twins()
    ref_loss, loss_of = _loss_fn(ref, recipe), _loss_fn(model, recipe)

    def step(x):
        loss = loss_of(x)
        loss.backward()
        return loss

    return tol, ref, model, ref_loss, step


# --------------------------------------------------------------------------- compile_step
@pytest.mark.parametrize("name", RECIPES)
def test_compile_step_accumulation_zero_grad_held_losses(name):
    import te_passes

    tol, ref, model, ref_loss, step = _twin_step(name)
    cstep = te_passes.compile_step(step)
    held, ref_held = [], []
    for i, set_to_none in enumerate((True, True, False, False, True)):
        model.zero_grad(set_to_none=set_to_none), ref.zero_grad(set_to_none=set_to_none)
        for mb in range(2):  # two micro-batches accumulate into .grad
            x = _inputs(seed=10 * i + mb)
            held.append(cstep(x))
            lr = ref_loss(x)
            lr.backward()
            ref_held.append(lr.detach())
        _check_grads(f"step {i} set_to_none={set_to_none}", model, ref, tol)  # .grad read right after the step
    for j, (a, b) in enumerate(zip(held, ref_held)):  # losses held across steps are still right
        _check(f"held loss {j}", a, b, tol)
    graphs, breaks, skips = _counts()
    assert breaks == 0 and skips == 0, _counts()
    assert graphs <= 2, f"{graphs} graphs: .grad absent / present should be the only two"


@pytest.mark.parametrize("name", ("bf16", "fp8-cs"))
@pytest.mark.parametrize("where", ("outside",))  # inside: refused (torch.optim breaks the graph on purpose)
def test_compile_step_optimizer(name, where):
    import te_passes

    recipe, tol = recipe_of(name)
    ref, model = _twins()
    ref_loss, loss_of = _loss_fn(ref, recipe), _loss_fn(model, recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, capturable=True)

    def step(x):
        loss = loss_of(x)
        loss.backward()
        if where == "inside":
            opt.step()
        return loss

    # inside: torch.optim's step() graph-breaks on purpose (optimizer.py _use_grad), so fullgraph=False:
    # forward+backward one graph, the compiled optimizer another
    cstep = te_passes.compile_step(step, fullgraph=where == "outside")
    for i in range(4):
        x = _inputs(seed=i)
        opt.zero_grad(set_to_none=True)  # Dynamo never traces Optimizer.zero_grad: always outside
        loss = cstep(x)
        if where == "outside":
            opt.step()
        ropt.zero_grad(set_to_none=True)
        lr = ref_loss(x)
        lr.backward()
        ropt.step()
        _check(f"loss {i}", loss, lr.detach(), tol)
        for (n, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
            _check(f"step {i} {n}", p.detach(), r.detach(), tol)
    _, breaks, skips = _counts()
    assert skips == 0 and (breaks == 0 if where == "outside" else True), _counts()


@pytest.mark.parametrize("name", ("bf16", "fp8-cs"))
def test_compile_step_shape_change_recompiles(name):
    import te_passes

    tol, ref, model, ref_loss, step = _twin_step(name)
    cstep = te_passes.compile_step(step)
    for i, tokens in enumerate((256, 128, 256, 128)):
        model.zero_grad(set_to_none=True), ref.zero_grad(set_to_none=True)
        x = _inputs(tokens=tokens, seed=i)
        loss = cstep(x)
        lr = ref_loss(x)
        lr.backward()
        _check(f"loss tokens={tokens}", loss, lr.detach(), tol)
        _check_grads(f"tokens={tokens}", model, ref, tol)
    graphs, breaks, _ = _counts()
    assert graphs == 2 and breaks == 0, _counts()


# --------------------------------------------------------------------------- make_graphed (isolated)
_WORKER = Path(__file__).with_name("_make_graphed_worker.py")


def _isolated(case: str, name: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(_WORKER.parents[2]), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, str(_WORKER), case, name], capture_output=True, text=True, timeout=300,
                       env=env)
    got = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert got, f"worker {case}/{name} gave no result (rc {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    res = json.loads(got[-1][7:])
    if res.get("skip"):
        pytest.skip(res["skip"])
    return res


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("clone", (True, False))
def test_make_graphed_matches_eager(name, clone):
    res = _isolated(f"train-clone{int(clone)}", name)
    assert res["status"] == "ok", res
    assert res["max_rel_err"] <= REL_TOL[res["tol"]], res
    assert res["capture_state_after"] == [], res


def test_make_graphed_refuses_a_shape_change():
    res = _isolated("shape-change", "bf16")
    assert res["status"] == "ok", res
    assert "captured for" in res["error"] and res["error_type"] == "StepCaptureError", res
