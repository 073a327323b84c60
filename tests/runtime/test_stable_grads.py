"""``.grad`` outside the CUDA-graph pool (te_passes/cudagraphs/stable_grads.py): the
post-accumulate-grad hook's decisions on CPU, with the pool test replaced by a set of "pool" tensors
(torch's tree manager needs a GPU; tests/gpu/test_training_loop_gpu.py runs the real thing: gradient
accumulation with ``zero_grad(set_to_none=False)`` under ``mode="reduce-overhead"``)."""

from __future__ import annotations

import pytest
import torch

from te_passes.cudagraphs import stable_grads


@pytest.fixture
def pool(monkeypatch):
    """Storages registered here count as owned by the graph pool; ``backward`` produces gradients
    in such storages (as a replayed backward graph's outputs are)."""
    # the storages, kept alive (no address reuse); a reference to the tensor would stop AccumulateGrad's steal
    owned: list[torch.UntypedStorage] = []
    monkeypatch.setattr(stable_grads, "pool_owned",
                        lambda t: any(t.untyped_storage().data_ptr() == o.data_ptr() for o in owned))
    return owned


class _PoolGrad(torch.autograd.Function):
    """``y = x * w``; the gradient of ``w`` is a fresh tensor put in ``pool`` (a graph output)."""

    @staticmethod
    def forward(ctx, x, w, pool):
        ctx.save_for_backward(x)
        ctx.pool = pool
        return x * w

    @staticmethod
    def backward(ctx, gy):
        (x,) = ctx.saved_tensors
        gw = (gy * x).sum(0)
        ctx.pool.append(gw.untyped_storage())
        return None, gw, None


def _step(w, pool):
    x = torch.ones(3, 4)
    _PoolGrad.apply(x, w, pool).sum().backward()


def test_first_grad_is_copied_out_of_the_pool_then_accumulates_in_place(pool):
    w = torch.nn.Parameter(torch.zeros(4))
    assert stable_grads.protect_grads([w], device_type="cpu") == 1
    assert stable_grads.protect_grads([w], device_type="cpu") == 0  # once per parameter
    n0 = stable_grads.copies_made()
    _step(w, pool)
    g1 = w.grad
    assert not stable_grads.pool_owned(g1)  # AccumulateGrad stole the pool tensor; the hook replaced it
    assert stable_grads.copies_made() == n0 + 1
    assert torch.equal(g1, torch.full((4,), 3.0))
    _step(w, pool)  # second micro-batch: .grad += (in place, into the stable buffer)
    assert w.grad is g1 and torch.equal(g1, torch.full((4,), 6.0))
    w.grad.zero_()  # zero_grad(set_to_none=False)
    _step(w, pool)
    assert w.grad is g1 and stable_grads.copies_made() == n0 + 1


def test_set_to_none_copies_once_per_step(pool):
    w = torch.nn.Parameter(torch.zeros(4))
    stable_grads.protect_grads([w], device_type="cpu")
    n0 = stable_grads.copies_made()
    for _ in range(3):
        _step(w, pool)
        _step(w, pool)  # accumulation inside the step: no copy
        assert not stable_grads.pool_owned(w.grad) and torch.equal(w.grad, torch.full((4,), 6.0))
        w.grad = None  # zero_grad(set_to_none=True)
    assert stable_grads.copies_made() == n0 + 3


def test_grad_not_in_the_pool_is_left_alone(pool):
    w = torch.nn.Parameter(torch.zeros(4))
    stable_grads.protect_grads([w], device_type="cpu")
    n0 = stable_grads.copies_made()
    (torch.ones(4) * w).sum().backward()  # an eager gradient
    g = w.grad
    (torch.ones(4) * w).sum().backward()
    assert w.grad is g and stable_grads.copies_made() == n0


def test_only_leaf_parameters_of_the_device_get_the_hook():
    a = torch.nn.Parameter(torch.zeros(2))
    frozen = torch.zeros(2)
    non_leaf = a * 2
    assert stable_grads.protect_grads([a, frozen, non_leaf, 3, None], device_type="cuda") == 0  # CPU tensors
    assert stable_grads.protect_grads([a, frozen, non_leaf, 3, None], device_type="cpu") == 1
    assert getattr(frozen, stable_grads.HOOK_ATTR, None) is None


def test_pool_owned_without_a_tree_is_false_on_cpu():
    assert stable_grads.pool_owned(torch.zeros(2)) is False
