"""AOTAutograd's cache for fp8 training under ``te_inductor`` (GPU; the CPU half is
tests/pipeline/test_aot_autograd_cache.py).

Run on the H200 with ``pytest -m gpu tests/gpu/test_aot_autograd_cache_gpu.py``; skipped without a
GPU / TE compile path (tests/gpu/conftest.py).

What the CPU tests cannot do: run a compiled fp8 *training* step (AOTAutograd's joint trace and
the wrappers need CUDA), so the AOTAutograd entries of the forward+backward frames are never
saved there. Here, for a Float8CurrentScaling 2-layer te.Linear/GELU stack, ``te_inductor``
default mode, fresh local caches:

* first model, 3 steps (frame 0, then TE's recompiled frames, whose module quantizers are the
  ones the compiled forward returned — hoisted ``_te_const_N`` objects): every frame looks the
  cache up (misses) and saves its entry, none bypasses (before the fix every recompiled frame
  logged "Failed to pickle cache key" and bypassed);
* ``torch._dynamo.reset()``, a second model built the same way, 3 steps: every frame hits the
  AOTAutograd cache, nothing misses or bypasses, and outputs and gradients are bit-identical to
  the first model's.
"""

from __future__ import annotations

import pytest
import torch

from te_passes.testing.gpu import build_stack, forward_fn, make_recipe, train_step

pytestmark = pytest.mark.gpu

HIDDEN = 1024
TOKENS = 256
LAYERS = 2
STEPS = 3


def _inputs(seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    dy = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
    return x, dy


def _train():
    model = build_stack(LAYERS, HIDDEN, seed=0)
    fn = torch.compile(forward_fn(model, "fp8", make_recipe("fp8")), backend="te_inductor")
    params = list(model.parameters())
    results = []
    for step in range(STEPS):
        x, dy = _inputs(step)
        y = train_step(fn, x, dy, params)
        results.append([y.detach().clone(), x.grad.clone(), *(p.grad.clone() for p in params)])
    torch.cuda.synchronize()
    return results


def test_fp8_training_frames_are_saved_then_hit_in_the_aot_autograd_cache(tmp_path, monkeypatch):
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    with torch._inductor.config.patch(fx_graph_cache=True, fx_graph_remote_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=True):
        counters.clear()
        first = _train()
        aot = dict(counters["aot_autograd"])
        assert aot.get("autograd_cache_bypass", 0) == 0, aot
        frames = aot.get("autograd_cache_miss", 0)
        assert frames >= 2, aot  # frame 0 and TE's recompiled frame (module quantizers from the wrapper)
        assert aot.get("autograd_cache_saved", 0) == frames, aot

        torch._dynamo.reset()
        counters.clear()
        second = _train()
        aot2 = dict(counters["aot_autograd"])
        assert aot2.get("autograd_cache_hit", 0) == frames, aot2
        assert aot2.get("autograd_cache_miss", 0) == 0 and aot2.get("autograd_cache_bypass", 0) == 0, aot2
    for step, (a, b) in enumerate(zip(first, second)):
        for x, y in zip(a, b):
            assert torch.equal(x, y), f"step {step}: a cached compile changed a result"
