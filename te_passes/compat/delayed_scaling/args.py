"""The arguments of te.Linear's DelayedScaling op pair: TE's ``LinearFwdArgs`` on the graph's
state tensors, the flat payload's layout, and the backward's output plan (cached per call geometry).

See docs/internals.md#te_passescompatdelayed_scalinglinearpy and docs/design.md "DelayedScaling"."""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
from typing import Any

import torch

from te_passes.compat.delayed_scaling.state import quantization
from te_passes.te.version import te_module

TE_LINEAR = "transformer_engine.pytorch.module.linear"


def te_linear():
    """TE's ``transformer_engine.pytorch.module.linear`` (imported on first use)."""
    return te_module(TE_LINEAR, import_te=True)


@functools.lru_cache(maxsize=256)
def decode(config: str) -> dict:
    """The op pair's config string (``linear._encode``) as ``{"simple", "q", "autocast_key", "slots"}``
    (``simple["activation_dtype"]`` a ``torch.dtype``); cached per string."""
    cfg = json.loads(config)
    simple = dict(cfg["simple"])
    simple["activation_dtype"] = getattr(torch, simple["activation_dtype"].removeprefix("torch."))
    return {"simple": simple, "q": cfg["q"], "autocast_key": cfg["autocast_key"], "slots": cfg["slots"]}


def _quantizer(scale: torch.Tensor, history: torch.Tensor, i: int, desc) -> Any:
    """TE's ``DelayedScalingRecipeState.make_quantizers`` construction for slot ``i``
    (``quantization.py``), with the usage / flags of the traced call."""
    from_te = te_module("transformer_engine.pytorch.tensor.float8_tensor", import_te=True)
    dtype, internal, opt, row, col = desc
    q = from_te.Float8Quantizer(scale[i], history[0][i].reshape((1,)), quantization().DType(dtype), rowwise=row,
                                columnwise=col)
    q.internal, q.optimize_for_gemm = internal, opt
    return q


def fwd_args(cfg: dict, weight, inp, bias, scale_f, hist_f, scale_b, hist_b) -> Any:
    """TE's ``LinearFwdArgs`` of the traced call on fresh quantizers over the given state: the
    input / weight quantizers on forward slots ``cfg["slots"][0]`` / ``+1`` of ``scale_f`` [n] and
    ``hist_f`` [history, n] (fp32), the grad-output one on slot ``cfg["slots"][1]`` of the backward
    state (``None`` without it)."""
    lin = te_linear()
    kw = dict(cfg["simple"])
    q = cfg["q"]
    fwd, bwd = cfg["slots"]  # the input's forward slot (the weight's is the next), the grad output's
    kw.update(weight=weight, inp=inp, bias=bias, weight_workspace=None, tp_group=None, fsdp_group=None,
              wgrad_store=None, output_quantizer=None, grad_input_quantizer=None, grad_weight_quantizer=None,
              input_quantizer=_quantizer(scale_f, hist_f, fwd, q["input"]),
              weight_quantizer=_quantizer(scale_f, hist_f, fwd + 1, q["weight"]),
              grad_output_quantizer=(_quantizer(scale_b, hist_b, bwd, q["grad_output"])
                                     if q["grad_output"] is not None and scale_b is not None else None))
    return lin.LinearFwdArgs(**kw)


def te_custom_op():
    """TE's ``transformer_engine.pytorch.dynamo.custom_op`` (its payload helpers)."""
    return te_module("transformer_engine.pytorch.dynamo.custom_op", import_te=True)


@functools.lru_cache(maxsize=None)
def fwd_tensor_fields() -> tuple:
    """The tensor fields of TE's ``LinearFwdArgs`` (TE's ``_parse_arg_type``), once."""
    return tuple(te_custom_op()._parse_arg_type(te_linear().LinearFwdArgs).tensor_field_names())


def on_device(flat: list, device: torch.device) -> list:
    """``flat`` with TE's ``None`` sentinels (0-element ``complex32``, made on the CPU by
    ``custom_op._encode_none``) re-made on ``device``: a CPU tensor among a graph's outputs makes
    Inductor cut the graph there, and the op's list then crossed the partition boundary
    (cudagraph trees: ``AssertionError: <class 'list'>``, H200 2026-12-02). TE decodes a sentinel by
    dtype and size only."""
    cd = te_custom_op()
    return [torch.empty(0, dtype=cd._NONE_SENTINEL_DTYPE, device=device)
            if t.dtype == cd._NONE_SENTINEL_DTYPE and t.numel() == 0 and t.device != device else t for t in flat]


def fake_forward(args: Any) -> tuple:
    """TE's fake forward (``_linear_forward_fake``, TensorSpecs, no allocation) of ``LinearFwdArgs`` ``args``.
    It sets the usage flags of ``args``' quantizers, as TE's impl would."""
    return te_linear()._linear_forward_fake(te_custom_op()._spec_view(args, fwd_tensor_fields()))


@functools.lru_cache(maxsize=256)
def backward_reads_input(config: str) -> bool:
    """Whether TE's backward of a call with op-pair config ``config`` reads the input's values: TE's
    forward saves ``inp`` itself for backward (``ctx_attrs["saved_tensor_aliases"][0] == "inp"``:
    ``save_original_input``, ``backward_override="high_precision"``) rather than its FP8 copy. From
    TE's fake forward (``_linear_forward_fake``, TE 2.20.2) on 16 × 16 meta tensors: the alias
    depends on the call's flags and quantizers, not on shapes. ``False`` for a call that saves
    nothing for backward (grad disabled). Cached per config."""
    cfg = decode(config)
    dtype = cfg["simple"]["activation_dtype"]
    fwd, bwd = cfg["slots"]
    n = max(fwd + 2, bwd + 1)
    meta = dict(device="meta", dtype=torch.float32)
    w, x = (torch.empty(16, 16, device="meta", dtype=dtype) for _ in range(2))
    args = fwd_args(cfg, w, x, None, torch.ones(n, **meta), torch.zeros(1, n, **meta), torch.ones(n, **meta),
                    torch.zeros(1, n, **meta))
    aliases = (te_custom_op()._OutputPlan.parse(fake_forward(args)).ctx_attrs or {}).get("saved_tensor_aliases")
    return aliases is not None and aliases[0] == "inp"  # no aliases: nothing saved (no grad)


def _layout(fake_result: tuple) -> list[tuple]:
    """``(shape, dtype)`` per flat slot of a fwd fake result (TensorSpecs, no allocation)."""
    cd = te_custom_op()
    n_out = len(fake_result) - 2
    values = list(fake_result[:n_out]) + list(fake_result[n_out] or ())
    out = []
    for v in values:
        if v is None:
            out.append(((0,), cd._NONE_SENTINEL_DTYPE))
        elif v.quantizer is None:
            out.append((tuple(v.shape), v.dtype))
        else:
            out.extend((tuple(sh), dt) for sh, dt in v.quantizer.inner_tensor_specs(tuple(v.shape)).values())
    return out


@dataclasses.dataclass
class _ArgsState:
    """The process caches of this module: ``layouts``, the fake's payload layout per ``(config, input shape,
    weight shape, no bias)`` (:func:`expected_layout`); ``plans``, the backward's output plan per forward call
    geometry: ``key -> (plan, usage of the input / weight quantizers after TE's fake forward, (spec, fwd
    quantizer index, rowwise, columnwise) per quantized spec)`` (:func:`_output_plan`); ``in_use``, the cached
    specs the running backward call re-pointed (under :data:`PLAN_LOCK`, until :func:`release_call_state`)."""

    layouts: dict = dataclasses.field(default_factory=dict)
    plans: dict = dataclasses.field(default_factory=dict)
    in_use: list = dataclasses.field(default_factory=list)


_ARGS = _ArgsState()


def expected_layout(cfg: dict, weight, inp, bias, scale, history, config: str) -> list[tuple]:
    """The fake's payload layout for this call (cached per config and shapes), from quantizers
    of its own, built before the real impl changes any usage flag."""
    key = (config, tuple(inp.shape), tuple(weight.shape), bias is None)
    want = _ARGS.layouts.get(key)
    if want is None:
        args = fwd_args(cfg, weight, inp, bias, scale, history.clone(), None, None)
        want = _ARGS.layouts[key] = _layout(fake_forward(args))
    return want


#: Held from the re-pointing of a cached plan to :func:`release_call_state` (a backward call).
PLAN_LOCK = threading.RLock()


def _plan_key(config: str, weight, inp, bias) -> tuple:
    lin = te_linear()
    return (config, tuple(inp.shape), inp.dtype, inp.device, tuple(weight.shape), weight.dtype, type(weight),
            None if bias is None else bias.dtype, lin.is_fp8_activation_recompute_enabled(),
            lin.in_fp8_activation_recompute_phase())


def _output_plan(args: Any, key: tuple) -> Any:
    """TE's ``_OutputPlan`` of the forward call ``args`` (the backward's view of its flat payload),
    derived from TE's fake forward once per ``key`` (:func:`_plan_key`: the fake reads only the
    call's config, shapes, dtypes and TE's activation-recompute state). A cached plan is re-applied
    to this call: the usage flags the fake set on ``args``' input / weight quantizers, and each
    quantized spec's quantizer copy (which the rebuilt saved tensors hold) re-pointed at this call's
    scale / amax with the usage it had. ``key`` ``None`` (fake tensors, symbolic shapes): not
    cached. Called under :data:`PLAN_LOCK`."""
    qs = (args.input_quantizer, args.weight_quantizer)
    entry = _ARGS.plans.get(key) if key is not None else None
    if entry is None:
        plan = te_custom_op()._OutputPlan.parse(fake_forward(args))
        specs = []
        for spec in (*plan.user_specs, *plan.saved_specs):
            sq = getattr(spec, "quantizer", None)
            if sq is None:
                continue
            i = next((i for i, q in enumerate(qs) if q is not None and sq.scale is q.scale), None)
            if i is None:  # a quantizer not of this call: nothing to re-point, no cache
                return plan
            specs.append((spec, i, sq.rowwise_usage, sq.columnwise_usage))
        if key is None:  # fake tensors (tracing, symbolic shapes): never cached
            return plan
        _ARGS.plans[key] = (plan, tuple((q.rowwise_usage, q.columnwise_usage) for q in qs), tuple(specs))
        _ARGS.in_use.extend(s[0] for s in specs)
        return plan
    plan, usage, specs = entry
    for q, (row, col) in zip(qs, usage):
        q.rowwise_usage, q.columnwise_usage = row, col
    for spec, i, row, col in specs:
        _ARGS.in_use.append(spec)  # first: released even if the re-pointing stopped half-way
        sq = spec.quantizer
        sq.scale, sq.amax, sq.rowwise_usage, sq.columnwise_usage = qs[i].scale, qs[i].amax, row, col
    return plan


def release_call_state() -> None:
    """Drop the cached plans' references to the finished backward call's tensors (its scale views and
    the amax views of its history copy): held by a global cache they would outlive the call, and
    under CUDA graph trees a per-call tensor that stays alive is an untracked allocation of the
    graph's pool (``Detected 1 tensor(s) in the cudagraph pool not tracked as outputs``, H200
    2026-12-03). Called under :data:`PLAN_LOCK` after TE's backward impl."""
    try:
        for spec in _ARGS.in_use:
            spec.quantizer.scale = spec.quantizer.amax = None
    finally:
        _ARGS.in_use.clear()


def bwd_args(grad_output, weight, inp, bias, scale_f, hist_f, scale_b, hist_b, fwd_flat, config, fake):
    """TE's ``LinearBwdArgs`` for the backward op (a spec view of them with ``fake``): the forward
    call's args rebuilt on the graph's state tensors, its saved tensors from ``fwd_flat`` through
    the cached output plan (:func:`_output_plan`), TE's ``_linear_setup_ctx`` (``module/linear.py``,
    TE 2.20.2)."""
    cd, lin = te_custom_op(), te_linear()
    fwd = fwd_args(decode(config), weight, inp, bias, scale_f, hist_f, scale_b, hist_b)
    flat = [cd._encode_none(None)] + list(fwd_flat)  # the output itself is not kept for backward
    bwd = lin.LinearBwdArgs()
    with PLAN_LOCK:
        plan = _output_plan(fwd, None if fake else _plan_key(config, weight, inp, bias))
        saved = lin._linear_setup_ctx(bwd, fwd, tuple(plan.user_outputs(flat)), plan.ctx_attrs,
                                      tuple(plan.saved_tensors(flat)))
    bwd.inputmat, bwd.weight_fp8, bwd.saved_weight, bwd.bias = saved
    bwd.grad_output = grad_output
    bwd.reduce_and_update_bwd_fp8_tensors = False  # in the graph (the Function's backward)
    if fake:
        return cd._spec_view(bwd, tuple(cd._parse_arg_type(lin.LinearBwdArgs).tensor_field_names()))
    return bwd
