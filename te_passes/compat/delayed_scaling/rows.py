"""The patch-table rows of DelayedScaling under te_inductor (:class:`te_passes.compat.table.Row`), in install order.

The in-graph scale update (``scaling``: ``reduce_and_update``, ``check_recipe_support``) and te.Linear's op pair
(``linear``: the other four; all six or none — they share their preconditions, :func:`_linear_parts`). Every plan
waits (``"pending: ..."``, retried at the next install) while TE's module is not imported yet, and refuses a TE
whose delayed-scaling layout was not checked (``compat.te220.delayed_scaling.layout_unchecked_reason``).
"""

from __future__ import annotations

from typing import Any

from te_passes.compat.delayed_scaling import linear, scaling
from te_passes.compat.delayed_scaling.state import make_quantizers_tagged
from te_passes.compat.table import Change, Rebind, Refused, Row, Substitute
from te_passes.compat.te220.delayed_scaling import TE_QUANTIZATION_MODULE, layout_unchecked_reason
from te_passes.te.version import te_module

_TE = "==2.20.*"
_TORCH = ">=2.14,<2.16"
_DROP = "TE compiles DelayedScaling under torch.compile (its check_recipe_support refuses it in 2.20)"


def _quantization() -> Any:
    """TE's loaded ``pytorch.quantization`` module, checked.

    Raises:
        Refused: ``"pending: ..."`` while it is not imported (the next install retries); the layout reason."""
    q = te_module(TE_QUANTIZATION_MODULE)
    if q is None:
        raise Refused(f"pending: {TE_QUANTIZATION_MODULE} is not imported yet")
    reason = layout_unchecked_reason(q)
    if reason is not None:
        raise Refused(reason)
    return q


def _linear_parts() -> tuple[Any, Any]:
    """``(quantization, module.linear)`` of TE when te.Linear's op pair can be installed.

    Raises:
        Refused: as :func:`_quantization`; TE's linear module not imported yet (pending) or lacking a name."""
    q = _quantization()
    lin = te_module("transformer_engine.pytorch.module.linear")
    if lin is None:
        raise Refused("pending: transformer_engine.pytorch.module.linear is not imported yet")
    reason = linear.unavailable_reason(lin, te_module("transformer_engine.pytorch.dynamo.custom_op"))
    if reason is not None:
        raise Refused(reason)
    return q, lin


def _reduce_and_update_plan() -> list[Change]:
    manager = _quantization().FP8GlobalStateManager
    original = manager.__dict__["reduce_and_update_fp8_tensors"].__func__
    return [Rebind(manager, "reduce_and_update_fp8_tensors", classmethod(scaling.make_reduce_and_update(original)))]


def _check_recipe_support_plan() -> list[Change]:
    q = _quantization()
    return [Substitute(q.check_recipe_support, scaling.make_check_recipe_support(q, q.check_recipe_support))]


def _float8_quantizer_specs_plan() -> list[Change]:
    _linear_parts()
    f8 = te_module("transformer_engine.pytorch.tensor.float8_tensor", import_te=True)
    base = te_module("transformer_engine.pytorch.quantized_tensor", import_te=True).Quantizer
    # delayed and current scaling produce the same Float8TensorStorage layout; TE 2.20 gives only the
    # current-scaling quantizer the TensorSpec methods (checked per call: args.expected_layout)
    return [Rebind(f8.Float8Quantizer, name, f8.Float8CurrentScalingQuantizer.__dict__[name])
            for name in ("storage_metadata", "inner_tensor_specs")
            if getattr(f8.Float8Quantizer, name) is getattr(base, name)]


def _make_quantizers_plan() -> list[Change]:
    q, _ = _linear_parts()
    rs = q.DelayedScalingRecipeState
    return [Rebind(rs, "make_quantizers", make_quantizers_tagged(rs.__dict__["make_quantizers"]))]


def _compile_unsupported_reason_plan() -> list[Change]:
    _, lin = _linear_parts()
    args = lin.LinearFwdArgs
    return [Rebind(args, "compile_unsupported_reason",
                   linear.unsupported_reason_wrapper(args.__dict__["compile_unsupported_reason"]))]


def _linear_op_plan() -> list[Change]:
    _, lin = _linear_parts()
    names = linear.simple_fields_of(lin.LinearFwdArgs)
    return [Rebind(lin, "_linear_op", linear.linear_op_wrapper(lin._linear_op, names))]


ROWS: tuple[Row, ...] = (
    Row(name="delayed_scaling.reduce_and_update",
        target="transformer_engine.pytorch.quantization.FP8GlobalStateManager.reduce_and_update_fp8_tensors",
        kind="rebind",
        why="under te_inductor the scale update goes into the graph (te_passes::delayed_scaling_update on TE's global "
            "buffers); a classmethod, which Dynamo does not substitute: rebound",
        drop_when=_DROP, te=_TE, torch=_TORCH, plan=_reduce_and_update_plan),
    Row(name="delayed_scaling.check_recipe_support",
        target="transformer_engine.pytorch.quantization.check_recipe_support", kind="substitute",
        why="TE refuses DelayedScaling under torch.compile; te_inductor compiles it (the update in the graph) and "
            "refuses, naming it, only what the in-graph update does not support",
        drop_when=_DROP, te=_TE, torch=_TORCH, plan=_check_recipe_support_plan),
    Row(name="delayed_scaling.float8_quantizer_specs",
        target="transformer_engine.pytorch.tensor.float8_tensor.Float8Quantizer.storage_metadata / inner_tensor_specs",
        kind="rebind",
        why="te.Linear's op pair describes a delayed-scaling quantizer's output as TE's TensorSpec; TE 2.20 gives "
            "those methods to Float8CurrentScalingQuantizer only (same Float8TensorStorage layout): copied",
        drop_when="TE gives Float8Quantizer storage_metadata / inner_tensor_specs", te=_TE, torch=_TORCH,
        plan=_float8_quantizer_specs_plan),
    Row(name="delayed_scaling.make_quantizers",
        target="transformer_engine.pytorch.quantization.DelayedScalingRecipeState.make_quantizers", kind="rebind",
        why="each delayed-scaling quantizer is stamped with its (recipe state, slot): the op pair reads the scale "
            "and amax history there",
        drop_when=_DROP, te=_TE, torch=_TORCH, plan=_make_quantizers_plan),
    Row(name="delayed_scaling.compile_unsupported_reason",
        target="transformer_engine.pytorch.module.linear.LinearFwdArgs.compile_unsupported_reason", kind="rebind",
        why="TE refuses a delayed-scaling quantizer under torch.compile (not a value-opaque type); a te_inductor "
            "trace takes the call through the op pair instead",
        drop_when=_DROP, te=_TE, torch=_TORCH, plan=_compile_unsupported_reason_plan),
    Row(name="delayed_scaling.linear_op", target="transformer_engine.pytorch.module.linear._linear_op",
        kind="rebind",
        why="te.Linear's delayed-scaling call becomes the te_passes::delayed_linear_fwd / _bwd op pair with the "
            "amax-history write-back and the post-backward update in the graph",
        drop_when=_DROP, te=_TE, torch=_TORCH, plan=_linear_op_plan),
)
