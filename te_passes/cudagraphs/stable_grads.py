"""``.grad`` buffers outside the CUDA-graph pool under ``mode="reduce-overhead"`` (CUDA graph trees), so
gradient accumulation across compiled calls works.

torch's ``AccumulateGrad`` makes a parameter's first gradient the backward graph's own output tensor
(it "steals" it when ``.grad`` is ``None``). Under CUDA graph trees that tensor lives in the graph pool;
the next replay of the forward starts a new generation, which frees or overwrites it
(torch/_inductor/cudagraph_trees.py ``dealloc_current_path_weakrefs``), and any later use of ``.grad``
(the next ``.grad +=``, ``zero_grad(set_to_none=False)``, the optimizer) raises "accessing gradient
tensor output of CUDAGraphs that has been overwritten by a subsequent run". torch's advice: "allocate
stable .grad buffers outside CUDAGraph capture". Its own ``cudagraph_trees_generation_cloning`` never
clones backward outputs (torch/_inductor/config.py).

:func:`protect_grads` registers, once per parameter, a post-accumulate-grad hook
(``Tensor.register_post_accumulate_grad_hook``) that replaces a ``.grad`` owned by the current CUDA
graph tree path with a copy outside the pool, right after ``AccumulateGrad`` stored it. With
``zero_grad(set_to_none=False)`` (TE's tutorials) that happens once, at the first step; later
micro-batches and steps accumulate into the stable buffer in place. With ``set_to_none=True`` it happens
once per optimizer step (one copy of the gradients). docs/usage.md "Training loop".
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Iterable

import torch

#: Attribute set on a parameter whose hook is registered (the hook's handle).
HOOK_ATTR = "_te_passes_stable_grad_hook"
#: Attribute holding a weak reference to the parameter's last ``.grad`` known to be outside the pool.
STABLE_ATTR = "_te_passes_stable_grad"

_lock = threading.Lock()
_counts = {"copied": 0}


def pool_owned(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage is a live output of the current CUDA graph tree path on its device (what a
    new generation frees). ``False`` for a tensor not on CUDA; ``True`` when torch's tree manager cannot
    be asked (assume the worst)."""
    if t.device.type != "cuda":
        return False
    try:
        from torch._inductor import cudagraph_trees
    except ImportError:  # pragma: no cover - torch without Inductor
        return True
    try:
        manager = cudagraph_trees.get_manager(t.device.index, create_if_none_exists=False)
    except Exception:  # noqa: BLE001 - torch internals moved: copy
        return True
    node = getattr(manager, "current_node", None) if manager is not None else None
    if node is None:
        return False  # no tree on this device, or no live path: nothing to be freed
    check = getattr(node, "_is_cuda_graph_recorded_tensor", None)
    return True if check is None else bool(check(t))


def _stabilize(param: torch.Tensor) -> None:
    """The hook: ``param.grad`` copied out of the graph pool when the pool owns it."""
    g = param.grad
    if g is None:
        return
    known = getattr(param, STABLE_ATTR, None)
    if known is not None and known() is g:
        return  # a buffer outside the pool, accumulated in place
    if pool_owned(g):
        g = g.clone(memory_format=torch.preserve_format)
        param.grad = g
        _counts["copied"] += 1
    setattr(param, STABLE_ATTR, weakref.ref(g))


def protect_grads(tensors: Iterable[Any], device_type: str = "cuda") -> int:
    """Register the stable-``.grad`` hook on every leaf tensor on ``device_type`` requiring grad in
    ``tensors`` (a graph's example inputs: the parameters Dynamo lifted), once per tensor. Returns how
    many were new.

    Mirrors torch's advice in torch/_inductor/cudagraph_trees.py ``format_dealloc_msg``; the hook is
    ``Tensor.register_post_accumulate_grad_hook`` (torch/_tensor.py)."""
    n = 0
    for t in tensors:
        if not (isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad and t.device.type == device_type):
            continue
        with _lock:
            if getattr(t, HOOK_ATTR, None) is not None:
                continue
            setattr(t, HOOK_ATTR, t.register_post_accumulate_grad_hook(_stabilize))
        n += 1
    return n


def copies_made() -> int:
    """How many ``.grad`` tensors the hooks copied out of the graph pool in this process."""
    return _counts["copied"]
