"""te.Linear under DelayedScaling in a te_inductor graph: TE's impls as a functional op pair.

See docs/internals.md#te_passescompatdelayed_scalinglinearpy and docs/design.md "DelayedScaling"."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from typing import Any

import torch

from te_passes.fx.graph import op_qualname
from te_passes.compat import table
from te_passes.compat.delayed_scaling.args import (PLAN_LOCK, backward_reads_input, bwd_args, decode,
                                            expected_layout, fake_forward, fwd_args, on_device, release_call_state,
                                            te_custom_op, te_linear)
from te_passes.compat.delayed_scaling.scaling import update_in_graph
from te_passes.compat.gate import te_inductor_tracing
from te_passes.compat.delayed_scaling.state import (TAG, TRACE_COUNTS, backward_state_index, check_covered,  # noqa: F401
                                                   prepare_delayed_scaling, quantization, refusal,
                                                   register_delayed_state)

FWD_OP = "te_passes::delayed_linear_fwd"
BWD_OP = "te_passes::delayed_linear_bwd"
#: TE's reason for refusing a delayed-scaling quantizer (``LinearFwdArgs.compile_unsupported_reason``).
TE_QUANTIZER_REASON = "a quantizer not registered as a torch.compile value-opaque type"

_TENSOR_FIELDS = ("weight", "inp", "bias", "weight_workspace")
_QUANTIZER_FIELDS = ("input_quantizer", "weight_quantizer", "output_quantizer", "grad_input_quantizer",
                     "grad_weight_quantizer", "grad_output_quantizer")
#: The patch-table rows te.Linear's op pair needs, all or none (:mod:`te_passes.compat.delayed_scaling.rows`).
ROW_NAMES = ("delayed_scaling.reduce_and_update", "delayed_scaling.check_recipe_support",
             "delayed_scaling.float8_quantizer_specs", "delayed_scaling.make_quantizers",
             "delayed_scaling.compile_unsupported_reason", "delayed_scaling.linear_op")
#: What the op pair uses of TE's ``module.linear`` / ``dynamo.custom_op`` (checked before any row applies).
LINEAR_NAMES = ("LinearFwdArgs", "LinearBwdArgs", "_linear_forward_impl", "_linear_backward_impl",
                "_linear_forward_fake", "_linear_backward_fake", "_linear_setup_ctx", "_check_fp8_reduce_and_update",
                "_linear_op", "is_fp8_activation_recompute_enabled", "in_fp8_activation_recompute_phase")
CUSTOM_OP_NAMES = ("_parse_arg_type", "_spec_view", "_pack_fwd_result", "_pack_bwd_result", "_OutputPlan",
                   "_encode_none", "_decode_none")


def simple_fields_of(args_cls: type) -> tuple[str, ...]:
    """The fields of TE's ``LinearFwdArgs`` dataclass ``args_cls`` that cross the op pair in its config string
    (every field but the tensors, the quantizers and the process groups / wgrad store)."""
    return tuple(f.name for f in dataclasses.fields(args_cls)
                 if f.name not in _TENSOR_FIELDS and f.name not in _QUANTIZER_FIELDS
                 and f.name not in ("tp_group", "fsdp_group", "wgrad_store"))


def _desc(q: Any) -> tuple:
    return (int(q.dtype), bool(q.internal), bool(q.optimize_for_gemm), bool(q.rowwise_usage),
            bool(q.columnwise_usage))


@torch._dynamo.assume_constant_result
def _encode(names: tuple, values: tuple, qin: tuple, qw: tuple, qgo: tuple, autocast_key: str,
            slots: tuple = (0, 0)) -> str:
    simple = {n: (str(v) if isinstance(v, torch.dtype) else v) for n, v in zip(names, values)}
    return json.dumps({"simple": simple, "q": {"input": qin, "weight": qw, "grad_output": qgo},
                       "autocast_key": autocast_key, "slots": list(slots)}, sort_keys=True)


@torch._dynamo.assume_constant_result
def _saves_input(config: str) -> bool:
    """:func:`~te_passes.compat.delayed_scaling.args.backward_reads_input`, a trace-time constant."""
    return backward_reads_input(config)


@contextlib.contextmanager
def _traced_autocast_state(cfg: dict):
    """TE's fp8 state of the traced ``te.autocast`` around a TE impl call: the impls read the recipe
    (``FP8GlobalStateManager.get_fp8_recipe()``, ``linear.py:611``), and a compiled ``te.autocast`` region
    has left TE's state by the time the graph runs.

    Raises:
        RuntimeError: TE has no ``autocast_arguments`` entry for the traced key.
    """
    manager = quantization().FP8GlobalStateManager
    qstate = manager.quantization_state
    key = cfg["autocast_key"]
    current = manager.get_unique_autocast_key(qstate.fp8_recipe, qstate.fp8_distributed_group)
    if qstate.fp8_enabled and current == key:
        yield
        return
    entry = qstate.autocast_arguments.get(key)
    if entry is None:
        raise RuntimeError(f"te_passes: {FWD_OP}: TE's autocast_arguments has no entry {key!r} (the traced "
                           "te.autocast recipe); was FP8GlobalStateManager reset after compiling?")
    saved = manager.get_autocast_state()
    recipe, group = entry
    manager.set_autocast_state((True, False, recipe, group, qstate.is_first_fp8_module, False))
    try:
        yield
    finally:
        manager.set_autocast_state(saved)


# --------------------------------------------------------------------------- the ops
def _fwd_impl(weight: torch.Tensor, inp: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor,
              amax_history: torch.Tensor, config: str) -> list[torch.Tensor]:
    """TE's forward on quantizers over a copy of ``amax_history``; returns TE's flat payload and
    the copy. Raises ``RuntimeError`` when TE's payload is not the fake's slot for slot (the fake
    fixed the graph's layout)."""
    cd = te_custom_op()
    cfg = decode(config)
    history = amax_history.clone()
    want = expected_layout(cfg, weight, inp, bias, scale, history, config)
    args = fwd_args(cfg, weight, inp, bias, scale, history, None, None)
    with _traced_autocast_state(cfg):
        flat = cd._pack_fwd_result(te_linear()._linear_forward_impl(args))
    got = [(tuple(t.shape), t.dtype) for t in flat]
    if got != want:
        raise RuntimeError(f"te_passes: {FWD_OP}: TE's forward returned the payload {got}, its fake {want}")
    return on_device(flat, weight.device) + [history]


def _fwd_fake(weight, inp, bias, scale, amax_history, config):
    cd = te_custom_op()
    history = torch.empty_like(amax_history)
    args = fwd_args(decode(config), weight, inp, bias, scale, history, None, None)
    return on_device(cd._pack_fwd_result(fake_forward(args)), weight.device) + [history]


def _bwd_impl(grad_output: torch.Tensor, weight: torch.Tensor, inp: torch.Tensor, bias: torch.Tensor | None,
              scale_fwd: torch.Tensor, amax_history_fwd: torch.Tensor, scale_bwd: torch.Tensor,
              amax_history_bwd: torch.Tensor, fwd_flat: list[torch.Tensor], config: str) -> list[torch.Tensor]:
    cd = te_custom_op()
    history = amax_history_bwd.clone()
    with PLAN_LOCK:  # the cached output plan is this call's until TE's impl has run
        try:
            bwd = bwd_args(grad_output, weight, inp, bias, scale_fwd, amax_history_fwd.clone(), scale_bwd, history,
                           fwd_flat, config, fake=False)
            with _traced_autocast_state(decode(config)):
                grads = te_linear()._linear_backward_impl(bwd)
        finally:
            release_call_state()
    return on_device(cd._pack_bwd_result(grads_in_fake_dtypes(grads, decode(config)), 3, BWD_OP),
                     weight.device) + [history]


def grads_in_fake_dtypes(grads: tuple, cfg: dict) -> tuple:
    """TE's ``(wgrad, dgrad, grad_bias)`` with ``grad_bias`` in the activation dtype, as TE's fake
    (``_linear_backward_fake``, TE 2.20.2) gives it: TE's ``bgrad_quantize`` returns the bias gradient
    in the grad output's dtype, which is fp32 when ``widen_quantized_inputs`` feeds the activation's fp32
    gradient (TE eager's fused ``dbias_dgelu`` reduces in fp32 and writes the activation dtype too).

    Raises:
        RuntimeError: TE returned a floating wgrad / dgrad not in the activation dtype (both GEMMs'
            ``out_dtype``, the fake's dtype; ``fuse_wgrad_accumulation`` is refused, ``state.MUST_BE_OFF``).
    """
    wgrad, dgrad, bgrad = grads
    dtype = cfg["simple"]["activation_dtype"]
    for name, g in (("wgrad", wgrad), ("dgrad", dgrad)):
        if isinstance(g, torch.Tensor) and g.is_floating_point() and g.dtype != dtype:
            raise RuntimeError(f"te_passes: {BWD_OP}: TE's {name} is {g.dtype}, its fake {dtype}")
    if isinstance(bgrad, torch.Tensor) and bgrad.dtype != dtype:
        bgrad = bgrad.to(dtype)
    return (wgrad, dgrad, bgrad)


def _bwd_fake(grad_output, weight, inp, bias, scale_fwd, amax_history_fwd, scale_bwd, amax_history_bwd,
              fwd_flat, config):
    cd = te_custom_op()
    history = torch.empty_like(amax_history_bwd)
    bwd = bwd_args(grad_output, weight, inp, bias, scale_fwd, torch.empty_like(amax_history_fwd), scale_bwd,
                    history, fwd_flat, config, fake=True)
    return on_device(cd._pack_bwd_result(te_linear()._linear_backward_fake(bwd), 3, BWD_OP), weight.device) + [history]


#: The op pair's ``CustomOpDef``\ s (our ops: defined at import).
FWD_OP_DEF = torch.library.custom_op(FWD_OP, _fwd_impl, mutates_args=())
FWD_OP_DEF.register_fake(_fwd_fake)
BWD_OP_DEF = torch.library.custom_op(BWD_OP, _bwd_impl, mutates_args=())
BWD_OP_DEF.register_fake(_bwd_fake)


# --------------------------------------------------------------------------- the Function
class DelayedLinearFunction(torch.autograd.Function):
    """Traced by Dynamo: the op pair plus the write-back of the histories and, for the first fp8
    module of the forward, the post-backward update of every backward state of its buffer key."""

    @staticmethod
    def forward(ctx, weight, inp, bias, scale_f, hist_f, config, update, own, *bwd_state):
        # bwd_state: (histories..., scales...) of the backward states; ``own`` indexes this
        # module's; ``update`` is (recipe, group) for the first fp8 module (post-backward update)
        flat = torch.ops.te_passes.delayed_linear_fwd(weight, inp, bias, scale_f, hist_f, config)
        hist_f.copy_(flat[-1])
        # TE's backward reads the input's geometry only (it saved the FP8 copy, in ``flat``) unless it
        # saved the input itself: keep a 1-element stand-in of its shape, not the activation
        saved_inp = inp if _saves_input(config) else inp.new_empty(()).expand(inp.shape)
        ctx.save_for_backward(weight, saved_inp, bias, *flat[1:-1])
        ctx.scale_f, ctx.hist_f, ctx.config, ctx.update, ctx.own, ctx.bwd_state = (
            scale_f, hist_f, config, update, own, bwd_state)
        return flat[0]

    @staticmethod
    def backward(ctx, grad_out):
        weight, inp, bias, *fwd_flat = ctx.saved_tensors
        n = len(ctx.bwd_state) // 2
        histories, scales = list(ctx.bwd_state[:n]), list(ctx.bwd_state[n:])
        hist_b, scale_b = histories[ctx.own], scales[ctx.own]
        res = torch.ops.te_passes.delayed_linear_bwd(grad_out.contiguous(), weight, inp, bias, ctx.scale_f,
                                                     ctx.hist_f, scale_b, hist_b, fwd_flat, ctx.config)
        hist_b.copy_(res[3])
        if ctx.update is not None:
            update_in_graph(histories, scales, ctx.update[0], ctx.update[1], False)
        cd = te_custom_op()
        wgrad, dgrad, bgrad = (cd._decode_none(g) for g in res[:3])
        return (wgrad, dgrad, bgrad) + (None,) * (5 + len(ctx.bwd_state))


# --------------------------------------------------------------------------- the trace-time path
def delayed_linear_call(fwd_args: Any, names: tuple[str, ...]):
    """What te.Linear's ``_linear_op(fwd_args)`` call becomes for a delayed-scaling call under
    te_inductor: ``(out, None)`` through :class:`DelayedLinearFunction`; ``names``: the fields of
    ``fwd_args`` that cross the op pair in its config (:func:`simple_fields_of`). Traced by Dynamo."""
    lin = te_linear()
    qi, qw, qgo = fwd_args.input_quantizer, fwd_args.weight_quantizer, fwd_args.grad_output_quantizer
    fstate, i_in = getattr(qi, TAG)
    fstate_w, i_w = getattr(qw, TAG)
    if fstate_w is not fstate or i_w != i_in + 1 or i_in % 3:
        raise RuntimeError("te_passes: te.Linear's input / weight quantizers are not slots 3g / 3g+1 of one "
                           "DelayedScalingRecipeState (TE's make_quantizers layout, FP8FwdTensorIdx)")
    manager = quantization().FP8GlobalStateManager
    autocast_key = manager.get_unique_autocast_key(manager.get_fp8_recipe(), manager.get_fp8_group())
    i_go = getattr(qgo, TAG)[1] if qgo is not None else 0
    config = _encode(names, tuple(getattr(fwd_args, n) for n in names), _desc(qi), _desc(qw),
                     _desc(qgo) if qgo is not None else None, autocast_key, (i_in, i_go))
    update = None
    own = 0
    bwd_state: tuple = ()
    needs_grad = fwd_args.is_grad_enabled and (fwd_args.input_requires_grad or fwd_args.weight_requires_grad
                                               or fwd_args.bias_requires_grad)
    if needs_grad:
        if qgo is None:
            raise RuntimeError("te_passes: a differentiable delayed-scaling te.Linear call without a "
                               "grad-output quantizer")
        bstate, i_go = getattr(qgo, TAG)
        if i_go % 2:
            raise RuntimeError("te_passes: te.Linear's grad-output quantizer is not slot 2g of its state "
                               "(FP8BwdTensorIdx)")
        bwd_state = (bstate.amax_history, bstate.scale)
        if lin._check_fp8_reduce_and_update():
            manager = quantization().FP8GlobalStateManager
            qstate = manager.quantization_state
            recipe, group = manager.get_fp8_recipe(), manager.get_fp8_group()
            key = manager.get_key_in_buffer(False, recipe, group)
            histories = list(qstate.global_amax_history_buffer.get(key, ()))
            scales = list(qstate.global_scale_buffer.get(key, ()))
            own = backward_state_index(histories, bstate.amax_history)
            TRACE_COUNTS[key] = len(histories)
            update = (recipe, group)
            bwd_state = tuple(histories) + tuple(scales)
        else:
            check_covered(qgo)
    out = DelayedLinearFunction.apply(fwd_args.weight, fwd_args.inp, fwd_args.bias, fstate.scale,
                                      fstate.amax_history, config, update, own, *bwd_state)
    return out, None


def unsupported_reason_wrapper(original):
    """``LinearFwdArgs.compile_unsupported_reason`` (TE's ``original``) that, while Dynamo traces a te_inductor
    frame, accepts the call :func:`delayed_linear_call` takes (TE refuses its quantizers:
    :data:`TE_QUANTIZER_REASON`)."""
    def compile_unsupported_reason(self):
        reason = original(self)
        if (reason == TE_QUANTIZER_REASON and torch.compiler.is_compiling() and te_inductor_tracing()
                and refusal(self) is None):
            return None
        return reason

    compile_unsupported_reason.__wrapped__ = original
    return compile_unsupported_reason


def linear_op_wrapper(te_op, names: tuple[str, ...]):
    """TE's ``module.linear._linear_op`` (``te_op``) that, while Dynamo traces a te_inductor frame, sends a
    tagged delayed-scaling call to :func:`delayed_linear_call` (``names``: :func:`simple_fields_of`)."""
    def linear_op(fwd_args):
        # type(...).__qualname__ first: Dynamo evaluates it on TE's value-opaque quantizers too
        # (TE's is_value_opaque_quantizer does the same), where a getattr could not be traced
        if (torch.compiler.is_compiling() and te_inductor_tracing() and fwd_args.fp8
                and type(fwd_args.input_quantizer).__qualname__ == "Float8Quantizer"
                and getattr(fwd_args.input_quantizer, TAG, None) is not None and refusal(fwd_args) is None):
            return delayed_linear_call(fwd_args, names)
        return te_op(fwd_args)

    linear_op.__wrapped__ = te_op
    return linear_op


def cudagraph_hazard(gm: torch.fx.GraphModule) -> str | None:
    """Why ``gm`` must not be CUDA-graphed, or ``None``: a delayed-scaling op in it (or in a
    subgraph) returns a CPU tensor. Inductor cuts a graph at a CPU tensor and the op's list output
    then crosses the partition boundary, which cudagraph trees fail to record (``AssertionError:
    <class 'list'>``, H200 2026-12-02). The ops return TE's ``None`` sentinels on the weight's device
    (:func:`_on_device`), so only a graph whose op values are on the CPU trips this."""
    for m in gm.modules():
        for n in m.graph.nodes if isinstance(m, torch.fx.GraphModule) else ():
            name = op_qualname(n.target) if n.op == "call_function" else None
            if name is None or not name.startswith("te_passes::delayed_"):
                continue
            leaves = torch.utils._pytree.tree_leaves(n.meta.get("example_value", n.meta.get("val")))
            if any(isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in leaves):
                return (f"{name} returns a CPU tensor: Inductor would cut the graph there and CUDA graph trees fail "
                        "on the op's list output, so this graph is compiled without CUDA graphs (default-mode speed)")
    return None


@torch._dynamo.assume_constant_result
def refused_reason() -> str | None:
    """Why te.Linear's op pair is not in place: the first row of :data:`ROW_NAMES` not active, with its
    ``table.refusal`` (``None``: every row is active). A trace-time constant (read while Dynamo traces the
    untouched-model polyfills: no guard on the table)."""
    return next((f"{n}: {table.refusal(n)}" for n in ROW_NAMES if table.refusal(n) is not None), None)


def unavailable_reason(lin: Any, cd: Any) -> str | None:
    """Why TE's ``module.linear`` (``lin``) / ``dynamo.custom_op`` (``cd``) lack what the op pair uses
    (:data:`LINEAR_NAMES`, :data:`CUSTOM_OP_NAMES`), or ``None``."""
    missing = [n for n in LINEAR_NAMES if getattr(lin, n, None) is None]
    missing += [n for n in CUSTOM_OP_NAMES if getattr(cd, n, None) is None]
    return f"TE's linear module lacks {', '.join(missing)}" if missing else None
