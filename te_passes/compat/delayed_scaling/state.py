"""DelayedScaling state of TE modules for the te.Linear op pair: quantizer tags, registration in
TE's global amax buffers, and which calls may take the pair. docs/design.md "DelayedScaling".
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from te_passes.compat import table
from te_passes.compat.delayed_scaling import scaling as delayed_scaling
from te_passes.compat.te220.delayed_scaling import TE_QUANTIZATION_MODULE, module_delayed_state
from te_passes.compat.te220.module_init import forward_prepare_args
from te_passes.te.version import te_module


def quantization():
    """TE's ``pytorch.quantization`` module (imported)."""
    return te_module(TE_QUANTIZATION_MODULE, import_te=True)


#: attribute te_passes stamps on each delayed-scaling ``Float8Quantizer``: ``(recipe state, index)``.
TAG = table.register_stamp(
    "_te_passes_delayed", "a DelayedScaling Float8Quantizer's (DelayedScalingRecipeState, slot): te.Linear's "
    "op pair reads its scale / amax history there (TE's quantizer keeps only views of them)")
#: Module attribute: ``id`` of the DelayedScaling recipe :func:`prepare_delayed_scaling` prepared the
#: module (and every module under it) for.
DELAYED_ATTR = table.register_stamp(
    "_te_passes_delayed_recipe", "id of the DelayedScaling recipe prepare_delayed_scaling prepared a TE module for "
    "(the untouched-model start callback prepares a module once per recipe)")


#: fields that must be ``None`` / ``False`` here, with the reason named when they are not.
MUST_BE_OFF = {
    "weight_workspace": "a cached fp8 weight workspace", "output_quantizer": "fp8_output=True",
    "grad_input_quantizer": "fp8_grad=True", "grad_weight_quantizer": "a grad-weight quantizer",
    "tp_group": "tensor parallelism", "fsdp_group": "manual TE FSDP", "wgrad_store": "delayed wgrad compute",
    "skip_fp8_weight_update": "CUDA-graph weight-update skipping", "debug": "debug instrumentation",
    "custom": "a custom recipe", "save_original_input": "save_original_input", "fp8_output": "fp8_output=True",
    "backward_override": "backward_override", "sequence_parallel": "sequence parallelism",
    "fp8_calibration": "fp8 calibration", "cache_weight": "FP8 weight caching", "is_fsdp2": "FSDP2",
    "fuse_wgrad_accumulation": "fuse_wgrad_accumulation", "cpu_offloading": "CPU offload",
    "ub_overlap_ag_fprop": "Userbuffers", "ub_overlap_rs_fprop": "Userbuffers", "ub_overlap_ag_dgrad": "Userbuffers",
    "ub_overlap_rs_dgrad": "Userbuffers", "ub_bulk_dgrad": "Userbuffers", "ub_bulk_wgrad": "Userbuffers",
    "symmetric_ar_type": "symmetric all-reduce", "tensor_parallel": "tensor parallelism",
    "backward_input_needs_gather": "a sequence-parallel input gather",
}


#: per-trace bookkeeping (Dynamo replays writes to it as side effects): buffer key -> number of
#: backward states the first module's post-backward update covers.
TRACE_COUNTS: dict[str, int] = {}


def refusal(fwd_args: Any) -> str | None:
    """Why the te.Linear call of ``fwd_args`` (TE's ``LinearFwdArgs``) does not take the
    delayed-scaling op pair, or ``None``. Trace-time Python (Dynamo traces it)."""
    if not fwd_args.fp8:
        return "not fp8"
    for name in ("input_quantizer", "weight_quantizer"):
        q = getattr(fwd_args, name)
        if q is None or getattr(q, TAG, None) is None:
            return f"the {name} is not a tagged delayed-scaling quantizer"
    gq = fwd_args.grad_output_quantizer
    if gq is not None and getattr(gq, TAG, None) is None:
        return "the grad_output_quantizer is not a tagged delayed-scaling quantizer"
    for name, why in MUST_BE_OFF.items():
        v = getattr(fwd_args, name)
        if v is not None and v is not False:
            return why
    if fwd_args.tp_size != 1:
        return "tensor parallelism"
    if fwd_args.parallel_mode is not None:
        return "a parallel_mode"
    if isinstance(fwd_args.weight, torch.Tensor) and type(fwd_args.weight).__name__ not in ("Parameter", "Tensor"):
        return "a quantized weight (fp8_model_init)"
    dist = te_module("transformer_engine.pytorch.distributed")
    if dist is not None and (dist.is_fp8_activation_recompute_enabled() or dist.in_fp8_activation_recompute_phase()):
        return "TE activation recompute (te.distributed.checkpoint)"
    return None


def backward_state_index(tensors: list, t: torch.Tensor) -> int:
    for i, x in enumerate(tensors):
        if x is t:
            return i
    raise RuntimeError("te_passes: the first fp8 te.Linear's backward DelayedScaling state is not in TE's "
                       "global buffer: run one eager step (or register_delayed_state(model)) first")


def check_covered(qgo: Any) -> None:
    """A later module's backward state must be among those the first module's post-backward
    update covers (TE registers a module's state in its first forward): else refuse, loudly."""
    bstate, _ = getattr(qgo, TAG)
    q = quantization()
    manager = q.FP8GlobalStateManager
    key = manager.get_key_in_buffer(False, manager.get_fp8_recipe(), manager.get_fp8_group())
    histories = manager.quantization_state.global_amax_history_buffer.get(key, ())
    covered = TRACE_COUNTS.get(key, 0)
    for i, h in enumerate(histories):
        if h is bstate.amax_history:
            if i >= covered:
                raise RuntimeError(
                    "te_passes: this te.Linear's DelayedScaling state was registered after the first "
                    "module of the step was traced, so the compiled post-backward update would miss it; "
                    "run one eager step (or te_passes.compat.delayed_scaling.linear.register_delayed_state(model)) "
                    "before the first compiled step")
            return


def register_delayed_state(model: torch.nn.Module) -> int:
    """TE's ``add_fp8_tensors_to_global_buffer`` for every TE module of ``model`` whose ``fp8_meta``
    holds delayed-scaling state (what each module's first forward does), and tag its
    quantizers. Returns the number of modules. Call after the modules' fp8 state exists
    (``te_passes.prepare_te_state`` or one eager step)."""
    manager = quantization().FP8GlobalStateManager
    n = 0
    for m in model.modules():
        meta = getattr(m, "fp8_meta", None)
        if isinstance(meta, dict) and module_delayed_state(meta):
            tag_module(m)
            manager.add_fp8_tensors_to_global_buffer(meta)
            n += 1
    # what the first compiled trace will record (same keys and values: no guard changes on step 2)
    for key, histories in manager.quantization_state.global_amax_history_buffer.items():
        if key.startswith("backward_"):
            TRACE_COUNTS[key] = len(histories)
    return n


def prepare_delayed_scaling(model: torch.nn.Module, recipe: Any, *, static: bool = True) -> int:
    """What the first forward under ``te.autocast(recipe=recipe)`` sets up, done eagerly before the first
    compiled step: every TE module's fp8 metadata (``init_fp8_metadata``, TE's), its registration in TE's
    global amax buffers, the quantizer tags, and (``static``) the state tensors marked static
    (:func:`te_passes.compat.delayed_scaling.scaling.mark_delayed_state_static`, for CUDA graphs). A model on
    fake tensors gets its state in their ``FakeTensorMode`` (:func:`model_fake_mode`).

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module`` or ``recipe`` is not a TE ``DelayedScaling``.
        ValueError: ``model``'s fake tensors belong to more than one ``FakeTensorMode``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"prepare_delayed_scaling: model must be a torch.nn.Module, got {type(model).__name__}")
    q = quantization()
    if not isinstance(recipe, q.DelayedScaling):
        raise TypeError(f"prepare_delayed_scaling: expected a DelayedScaling recipe, got {type(recipe).__name__}")
    te = te_module("transformer_engine.pytorch", import_te=True)
    base = te_module("transformer_engine.pytorch.module.base", import_te=True)
    mode = model_fake_mode(model)
    # no_grad: the outermost te.autocast's exit with grad enabled runs TE's post-forward update
    # (quantization.py autocast_exit) on every state already registered: a scale update no eager step makes
    with torch.no_grad(), (mode if mode is not None else contextlib.nullcontext()), \
            te.autocast(enabled=True, recipe=recipe):
        for m in model.modules():
            if isinstance(m, base.TransformerEngineBaseModule):
                args = forward_prepare_args(m)  # a fresh LayerNormMLP has no num_gemms yet: 2, not 1
                m.init_fp8_metadata(num_gemms=args[0] if args else m.fp8_meta.get("num_gemms", 1))
    n = register_delayed_state(model)
    for m in model.modules():
        table.stamp(m, DELAYED_ATTR, id(recipe))
    if static:
        delayed_scaling.mark_delayed_state_static(model)
    return n


def model_fake_mode(*models: torch.nn.Module) -> Any:
    """The one ``FakeTensorMode`` of the parameters and buffers of ``models`` when they are fake tensors (models
    built under ``FakeTensorMode``, as the CPU captures on a fake GPU build them), else ``None``. TE's
    ``DelayedScalingRecipeState`` allocates its ``scale`` / ``amax_history`` with ``torch.ones`` / ``torch.zeros``
    on the module's device (TE 2.20.2 ``quantization.py``); outside that mode (Dynamo runs its compile-start
    callbacks under ``torch.utils._python_dispatch._disable_current_modes``, torch/_dynamo/convert_frame.py) they
    would be real CUDA tensors of a fake model, or with no GPU a CUDA-init error.

    Raises:
        ValueError: the fake tensors belong to more than one ``FakeTensorMode``."""
    from torch._subclasses.fake_tensor import FakeTensor

    tensors = [t for m in models for t in (*m.parameters(), *m.buffers())]
    modes = {id(t.fake_mode): t.fake_mode for t in tensors if isinstance(t, FakeTensor)}
    if len(modes) > 1:
        raise ValueError(f"{', '.join(sorted({type(m).__name__ for m in models}))}: the fake tensors belong to "
                         f"{len(modes)} FakeTensorModes; build the model under one")
    return next(iter(modes.values()), None)


def tag_module(m: Any) -> None:
    for key in ("scaling_fwd", "scaling_bwd"):
        state = m.fp8_meta.get(key)
        qs = getattr(m, "quantizers", {}).get(key, ())
        if type(state).__name__ != "DelayedScalingRecipeState":
            continue
        for i, q in enumerate(qs):
            if getattr(q, "scale", None) is not None and q.scale._base is state.scale:
                table.stamp(q, TAG, (state, i))


def make_quantizers_tagged(original):
    """``DelayedScalingRecipeState.make_quantizers`` (TE's ``original``) that stamps :data:`TAG` on each
    quantizer it makes: ``(the recipe state, slot)``."""
    def make_quantizers(self):
        qs = original(self)
        for i, q in enumerate(qs):
            table.stamp(q, TAG, (self, i))
        return qs

    make_quantizers.__wrapped__ = original
    return make_quantizers
