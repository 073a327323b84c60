"""DelayedScaling compiled by te_inductor: the in-graph scale update and its polyfills.

See docs/internals.md#te_passescompatdelayed_scalingscalingpy and docs/design.md "DelayedScaling"."""

from __future__ import annotations

import types
from typing import Any, Callable

import torch

from te_passes.compat.gate import te_inductor_tracing  # noqa: F401  (the one frame gate; re-exported)
from te_passes.compat.te220.delayed_scaling import (
    TE_QUANTIZATION_MODULE, module_delayed_state, unfused_requested, update_refused_reason)
from te_passes.te.version import te_module

#: the update op's qualified name (``torch.ops.te_passes.delayed_scaling_update``).
UPDATE_OP = "te_passes::delayed_scaling_update"


# --------------------------------------------------------------------------- the update op
def _update_impl(amax_reduced: torch.Tensor, amax_histories: list[torch.Tensor],
                 scales: list[torch.Tensor], amax_compute_algo: str, fp8_dtype: int,
                 fp8_max: float, margin: float) -> None:
    """TE's update of one buffer key: the fused kernel (``tex.fused_amax_and_scale_update_after_
    reduction``), or TE's unfused Python update (``quantization.split_and_copy`` +
    ``_amax_and_scale_update``) where TE takes it (``NVTE_UNFUSED_FP8_UPDATE=1``) and on tensors
    that are not on CUDA. Mirrors ``FP8GlobalStateManager.reduce_and_update_fp8_tensors``."""
    q = te_module(TE_QUANTIZATION_MODULE, import_te=True)
    cuda = amax_reduced.is_cuda and all(t.is_cuda for t in (*amax_histories, *scales))
    if cuda and not unfused_requested():
        q.tex.fused_amax_and_scale_update_after_reduction(
            amax_reduced, list(amax_histories), list(scales), amax_compute_algo,
            q.tex.DType(fp8_dtype), margin)
        return
    q.split_and_copy(amax_reduced, [h[0] for h in amax_histories], [h[0].numel() for h in amax_histories])
    recipe = q.DelayedScaling(margin=int(margin), amax_compute_algo=amax_compute_algo)
    for history, scale in zip(amax_histories, scales):
        q._amax_and_scale_update(history, scale, fp8_max, recipe)


#: ``torch.ops.te_passes.delayed_scaling_update``'s ``CustomOpDef`` (our op: defined at import).
UPDATE_OP_DEF = torch.library.custom_op(UPDATE_OP, _update_impl, mutates_args=("amax_histories", "scales"))


@UPDATE_OP_DEF.register_fake
def _update_fake(amax_reduced, amax_histories, scales, amax_compute_algo, fp8_dtype, fp8_max, margin):
    return None


# --------------------------------------------------------------------------- in-graph update
def update_in_graph(histories: list, scales: list, recipe: Any, group: Any, forward: bool) -> None:
    """One buffer key's reduction and update, for Dynamo to trace: ``torch.cat`` of the histories'
    row 0, the max all-reduce over ``group`` as a functional collective (when
    ``recipe.reduce_amax`` and the group has more than one rank), then :data:`UPDATE_OP` on the
    tensors (graph inputs whose writes the op's schema declares)."""
    q = te_module(TE_QUANTIZATION_MODULE)
    contiguous_amax = torch.cat([h[0] for h in histories])
    if (recipe.reduce_amax and torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size(group=group) > 1):
        from torch.distributed import _functional_collectives as funcol

        contiguous_amax = funcol.all_reduce(
            contiguous_amax, "max", group if group is not None else torch.distributed.group.WORLD)
    torch.ops.te_passes.delayed_scaling_update(
        contiguous_amax, list(histories), list(scales), recipe.amax_compute_algo,
        int(q.get_fp8_te_dtype(recipe, forward)), float(q.get_fp8_max(recipe, forward)), float(recipe.margin))


def reduce_and_update_in_graph(manager: Any, forward: bool) -> None:
    """``reduce_and_update_fp8_tensors(forward)`` for Dynamo to trace: :func:`update_in_graph` per
    buffer key of the direction, on the module tensors of TE's global buffers."""
    qstate = manager.quantization_state
    for buffer_key, amax_buffer in qstate.global_amax_buffer.items():
        fwd_update, autocast_key = manager.split_key_in_buffer(buffer_key)
        if fwd_update != forward or len(amax_buffer) == 0:
            continue
        recipe, group = qstate.autocast_arguments[autocast_key]
        update_in_graph(qstate.global_amax_history_buffer[buffer_key], qstate.global_scale_buffer[buffer_key],
                        recipe, group, forward)


def _all_updates_compile(manager: Any, forward: bool) -> str | None:
    """The refusal (:func:`te_passes.compat.te220.delayed_scaling.update_refused_reason`) of the first
    recipe with state of this direction whose update cannot go into a graph, or ``None``."""
    qstate = manager.quantization_state
    for buffer_key, amax_buffer in qstate.global_amax_buffer.items():
        fwd_update, autocast_key = manager.split_key_in_buffer(buffer_key)
        if fwd_update != forward or len(amax_buffer) == 0:
            continue
        reason = update_refused_reason(qstate.autocast_arguments[autocast_key][0])
        if reason is not None:
            return reason
    return None


def _copy_function(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` under another identity (same code, globals, closure): what a polyfill calls to run
    TE's own function without Dynamo substituting it again."""
    out = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    out.__qualname__ = fn.__qualname__
    out.__module__ = fn.__module__
    return out


class DelayedScalingRefused(RuntimeError):
    """A DelayedScaling configuration te_inductor cannot compile (the message names it)."""


def make_reduce_and_update(original: Callable) -> Callable:
    """The function rebound (as a classmethod) in place of ``FP8GlobalStateManager.reduce_and_update_fp8_tensors``
    (``original``: TE's function): while Dynamo traces a te_inductor frame, :func:`reduce_and_update_in_graph`
    (or :class:`DelayedScalingRefused` naming the recipe it cannot compile); TE's own function otherwise."""
    te_original = _copy_function(original)

    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        if torch.compiler.is_compiling() and te_inductor_tracing():
            reason = _all_updates_compile(cls, forward)
            if reason is not None:
                raise DelayedScalingRefused(f"te_inductor does not compile DelayedScaling with {reason}")
            return reduce_and_update_in_graph(cls, forward)
        return te_original(cls, forward)

    reduce_and_update_fp8_tensors.__doc__ = original.__doc__
    reduce_and_update_fp8_tensors.__wrapped__ = original
    return reduce_and_update_fp8_tensors


def make_check_recipe_support(q: Any, original: Callable) -> Callable:
    """The polyfill Dynamo traces for TE's ``quantization.check_recipe_support`` (``original``; ``q``: TE's
    quantization module): under te_inductor a DelayedScaling recipe is checked for what the in-graph update
    supports (:class:`DelayedScalingRefused`) and for fp8 support (``RuntimeError``) and not refused as TE's own
    check refuses it under torch.compile; TE's check otherwise."""
    te_original = _copy_function(original)

    def check_recipe_support_polyfill(recipe):
        if te_inductor_tracing() and isinstance(recipe, q.DelayedScaling):
            reason = update_refused_reason(recipe)
            if reason is not None:
                raise DelayedScalingRefused(f"te_inductor does not compile DelayedScaling with {reason}")
            supported, why = q.check_fp8_support()
            if not supported:
                raise RuntimeError(why)
            return None
        return te_original(recipe)

    return check_recipe_support_polyfill


def mark_delayed_state_static(owners: Any) -> int:
    """Mark every delayed-scaling ``scale`` / ``amax_history`` of ``owners`` (a module — all its
    submodules' ``fp8_meta`` —, an ``fp8_meta`` dict, or an iterable of either) as static inputs
    (``torch._dynamo.mark_static_address``): their addresses never change, so CUDA graphs
    (reduce-overhead) capture the update in place. Returns how many tensors were marked."""
    if isinstance(owners, torch.nn.Module):
        metas = [m.fp8_meta for m in owners.modules() if isinstance(getattr(m, "fp8_meta", None), dict)]
    elif isinstance(owners, dict):
        metas = [owners]
    else:
        metas = []
        for o in owners:
            metas.append(o) if isinstance(o, dict) else metas.extend(
                m.fp8_meta for m in o.modules() if isinstance(getattr(m, "fp8_meta", None), dict))
    n = 0
    for meta in metas:
        for scale, history in module_delayed_state(meta).values():
            for t in (scale, history):
                torch._dynamo.mark_static_address(t)
                n += 1
    return n


def mark_registered_state_static() -> int:
    """Mark every tensor of TE's global DelayedScaling buffers (``global_amax_history_buffer``,
    ``global_scale_buffer``: the state of every module registered in this process, of this model
    or another one run eagerly) as static inputs. The compiled update writes every tensor of its
    buffer key, and CUDA graph trees run a graph that writes a non-static input without CUDA graphs
    ("skipping cudagraphs due to mutated inputs"). Returns how many tensors were marked."""
    q = te_module(TE_QUANTIZATION_MODULE)
    if q is None:
        return 0
    qstate = q.FP8GlobalStateManager.quantization_state
    tensors = [t for buf in (qstate.global_amax_history_buffer, qstate.global_scale_buffer)
               for ts in buf.values() for t in ts]
    for t in tensors:
        torch._dynamo.mark_static_address(t)
    return len(tensors)
