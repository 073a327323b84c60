"""Pass ``widen_delayed_inputs``: a DelayedScaling te.Linear quantizes the fp32 values TE's fused
kernels quantize (its norm's output, an activation computed in fp32), not a bf16 rounding of them.

See docs/passes/widen_delayed_inputs.md."""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.fx.node import map_arg
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from te_passes.fx.graph import op_qualname
from te_passes.pipeline.base import PassContext, PassRecord, Stage, TEPass, TEPassResult

#: The untouched-model polyfills' norm (``te_passes.runtime.ops.te_norm``) and the DelayedScaling
#: te.Linear forward (``te_passes.runtime.delayed.linear``) whose ``inp`` (argument 1) it feeds.
NORM_OP = "te_passes::te_norm_fwd"
LINEAR_OP = "te_passes::delayed_linear_fwd"
#: Norm input dtypes the pass widens (TE's norm kernels compute in fp32 and round on the way out).
NARROW = (torch.bfloat16, torch.float16)


def _convert(log, x: torch.fx.Node, dtype: torch.dtype, **where: torch.fx.Node) -> torch.fx.Node:
    """A new ``prims.convert_element_type(x, dtype)`` at ``where`` (``after=`` / ``before=``), its fake
    ``meta["val"]`` set."""
    val = x.meta.get("val")
    meta = {"val": val.to(dtype)} if isinstance(val, torch.Tensor) else {}
    return log.call_function(torch.ops.prims.convert_element_type.default, (x, dtype), meta=meta, **where)


def _is_convert(node, dtypes) -> bool:
    """Whether ``node`` is ``prims.convert_element_type(<node>, dtype)`` with ``dtype`` in ``dtypes``."""
    return (isinstance(node, torch.fx.Node) and node.target is torch.ops.prims.convert_element_type.default
            and node.args[1] in dtypes and isinstance(node.args[0], torch.fx.Node))


def _in_other_args(lin: torch.fx.Node, value: torch.fx.Node) -> bool:
    """Whether the linear ``lin`` takes ``value`` in an argument besides its input (argument 1)."""
    return any(a is value for a in lin.args[2:]) or any(v is value for v in lin.kwargs.values())


class WidenDelayedInputs(TEPass):
    """At ``post_grad_fwd``, for each ``te_passes::delayed_linear_fwd`` (a DelayedScaling te.Linear):

    * its input ``y`` from a ``te_passes::te_norm_fwd``: the norm runs on fp32 copies of its input,
      weight and bias and the linear quantizes the fp32 ``y``; every other user of ``y`` (the
      backward's saved input, a returned norm output) gets ``y`` converted back to the input dtype;
    * its input a ``prims.convert_element_type(t, bf16 / fp16)`` of an fp32 ``t`` (an activation
      the untouched LayerNormMLP computes in fp32, ``te/norm_act.py``): the linear takes ``t``; the
      convert stays for its other users.

    TE eager under DelayedScaling quantizes those values from fp32 inside its kernels: the norm
    (``Impl::FULLY_FUSED`` for a ``Float8Quantizer``, ``transformer_engine/pytorch/csrc/extensions/
    normalization.cpp``) and LayerNormMLP's activation with fc2's input quantizer (``activation.cpp``,
    TE 2.20.2); the untouched split rounded them to bf16 first, so the FP8 input and its amax differed.
    Float8CurrentScaling needs neither: TE computes those outputs in the input dtype first too.

    Records: ``"widened"`` (the norm node; ``linear``, ``dtype``), ``"fed_fp32"`` (the linear node;
    ``value``: the fp32 node it now takes, ``skipped``: the convert), ``"kept"`` (the norm node; ``reason``)."""

    name = "widen_delayed_inputs"
    stages = frozenset({Stage.POST_GRAD_FWD})
    description = ("DelayedScaling: te.Linear quantizes the fp32 values TE's fused kernels quantize (norm output, "
                   "fp32 activation), not a bf16 rounding")

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> TEPassResult:
        records: list[PassRecord] = []
        self._feed_fp32(gm, ctx, records)
        for norm in list(gm.graph.nodes):
            if norm.op != "call_function" or op_qualname(norm.target) != NORM_OP:
                continue
            why, y, linears = self._match(norm)
            if why is not None:
                if linears:
                    records.append(PassRecord("kept", norm.name, {"reason": why}))
                continue
            x, weight, bias = norm.args[:3]
            dtype = x.meta["val"].dtype
            log = ctx.journal
            wide = [_convert(log, a, torch.float32, before=norm) if isinstance(a, torch.fx.Node)
                    and a.meta["val"].dtype != torch.float32 else a for a in (x, weight, bias)]
            log.set_args(norm, (*wide, *norm.args[3:]))
            for node in (norm, *norm.users):
                val = _widened(node.meta.get("val"))
                log.set_meta(node, "val", val)
                if "tensor_meta" in node.meta and isinstance(val, torch.Tensor):
                    log.set_meta(node, "tensor_meta", _extract_tensor_metadata(val))
            narrow = _convert(log, y, dtype, after=y)
            for user in list(y.users):
                if user is not narrow and user not in linears:  # the linears keep y (fp32) as argument 1
                    log.set_args(user, map_arg(user.args, lambda a: narrow if a is y else a),
                                 map_arg(user.kwargs, lambda a: narrow if a is y else a))
            records.append(PassRecord("widened", norm.name, {"linear": ", ".join(n.name for n in linears),
                                                             "dtype": str(dtype).removeprefix("torch.")}))
        return TEPassResult(gm, any(r.kind in ("widened", "fed_fp32") for r in records), records)

    @staticmethod
    def _feed_fp32(gm: torch.fx.GraphModule, ctx: PassContext, records: list[PassRecord]) -> None:
        """The second rule: a delayed linear's input rounded from an fp32 value takes the fp32 value."""
        for lin in list(gm.graph.nodes):
            if lin.op != "call_function" or op_qualname(lin.target) != LINEAR_OP or len(lin.args) < 2:
                continue
            c = lin.args[1]
            if not _is_convert(c, NARROW):
                continue
            t = c.args[0]
            val = t.meta.get("val")
            if not isinstance(val, torch.Tensor) or val.dtype != torch.float32:
                continue
            if _in_other_args(lin, c):
                continue  # the rounded value also in another argument: left alone
            ctx.journal.set_args(lin, (lin.args[0], t, *lin.args[2:]))
            records.append(PassRecord("fed_fp32", lin.name, {"value": t.name, "skipped": c.name}))

    @staticmethod
    def _match(norm: torch.fx.Node) -> tuple[str | None, torch.fx.Node | None, list[torch.fx.Node]]:
        """``(why not, y, the delayed linears taking y as their input)``; ``why`` ``None``: widen."""
        y = next((u for u in norm.users if u.target is operator.getitem and u.args[1] == 0), None)
        linears = [u for u in (y.users if y is not None else ()) if u.op == "call_function"
                   and op_qualname(u.target) == LINEAR_OP and len(u.args) > 1 and u.args[1] is y]
        if not linears:
            return "no DelayedScaling te.Linear takes its output", y, []
        x = norm.args[0]
        if _is_convert(x, (torch.float32,)):
            return "widened already", y, []  # a second run: nothing to do, nothing to record
        val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor):
            return "its input has no tensor meta['val']", y, linears
        if val.dtype not in NARROW:
            return f"its input is {val.dtype}: nothing to widen", y, linears
        if any(isinstance(a, torch.fx.Node) and not isinstance(a.meta.get("val"), torch.Tensor) for a in norm.args[1:3]):
            return "its weight or bias has no tensor meta['val']", y, linears
        if any(u.target is not operator.getitem for u in norm.users):
            return "a user takes the norm's whole tuple", y, linears
        if any(_in_other_args(u, y) for u in linears):
            return "a delayed te.Linear takes the norm output in another argument too", y, linears
        return None, y, linears


def _widened(val):
    """``val`` (a fake tensor or a tuple of them) with its :data:`NARROW` tensors in fp32."""
    if isinstance(val, torch.Tensor):
        return val.to(torch.float32) if val.dtype in NARROW else val
    if isinstance(val, (tuple, list)):
        return type(val)(_widened(v) for v in val)
    return val
