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
from te_passes.te.norm_act import activation_provenance

#: The untouched-model polyfills' norm (``te_passes.runtime.ops.te_norm``) and the DelayedScaling
#: te.Linear forward (``te_passes.runtime.delayed.linear``) whose ``inp`` (argument 1) it feeds.
NORM_OP = "te_passes::te_norm_fwd"
LINEAR_OP = "te_passes::delayed_linear_fwd"
#: Its backward op, whose ``grad_output`` (argument 0) the third rule feeds.
LINEAR_BWD_OP = "te_passes::delayed_linear_bwd"
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


def _in_other_args(lin: torch.fx.Node, value: torch.fx.Node, i: int = 1) -> bool:
    """Whether the linear op ``lin`` takes ``value`` in an argument besides argument ``i`` (the
    forward op's input, the backward op's grad output: 0)."""
    seen: list = []
    map_arg(([a for k, a in enumerate(lin.args) if k != i], lin.kwargs), lambda a: seen.append(a) or a)
    return any(a is value for a in seen)


class WidenDelayedInputs(TEPass):
    """At ``post_grad_fwd`` / ``post_grad_bwd``, for each DelayedScaling te.Linear
    (``te_passes::delayed_linear_fwd`` / ``_bwd``):

    * its input ``y`` from a ``te_passes::te_norm_fwd``: the norm runs on fp32 copies of its input,
      weight and bias and the linear quantizes the fp32 ``y``; every other user of ``y`` (a returned
      norm output, a backward that reads the input itself) gets ``y`` converted back to the input dtype;
    * its input a ``prims.convert_element_type(t, bf16 / fp16)`` of an fp32 ``t`` traced inside the
      untouched LayerNormMLP's activation (``te/norm_act.py``, :func:`activation_provenance`): the
      linear takes ``t``; the convert stays for its other users;
    * the backward op's ``grad_output`` such a convert of the activation's fp32 gradient, for an
      activation whose backward TE fuses with the FP8 cast (``norm_act.DBIAS_FUSED``: not the gated
      ones): the op takes the fp32 gradient (its bias gradient comes back in the activation dtype,
      as the fake says).

    TE eager under DelayedScaling quantizes those values from fp32 inside its kernels: the norm
    (``Impl::FULLY_FUSED`` for a ``Float8Quantizer``, ``transformer_engine/pytorch/csrc/extensions/
    normalization.cpp``), LayerNormMLP's activation with fc2's input quantizer (every activation)
    and its backward with fc1's grad-output quantizer (``dbias_dgelu`` and kin: gelu, qgelu, relu,
    srelu, silu; ``activation.cpp``, ``module/layernorm_mlp.py``, TE 2.20.2); the untouched split
    rounded them to bf16 first, so the FP8 values and their amax differed. A rounding traced anywhere else (a torch activation of the
    user's between two te.Linears) is TE eager's too: left alone, recorded. Float8CurrentScaling
    needs none of this: TE computes those outputs in the input dtype first too.

    Records: ``"widened"`` (the norm node; ``linear``, ``dtype``), ``"fed_fp32"`` (the linear node;
    ``value``: the fp32 node it now takes, ``skipped``: the convert, ``argument``: ``inp`` /
    ``grad_output``), ``"kept"`` (the norm or linear node; ``reason``)."""

    name = "widen_delayed_inputs"
    stages = frozenset({Stage.POST_GRAD_FWD, Stage.POST_GRAD_BWD})
    description = ("DelayedScaling: te.Linear quantizes the fp32 values TE's fused kernels quantize (norm output, "
                   "LayerNormMLP's activation and its gradient), not a bf16 rounding")

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
            others = [u for u in y.users if u not in linears]  # the linears keep y (fp32) as argument 1
            narrow = _convert(log, y, dtype, after=y) if others else None
            for user in others:
                log.set_args(user, map_arg(user.args, lambda a: narrow if a is y else a),
                             map_arg(user.kwargs, lambda a: narrow if a is y else a))
            records.append(PassRecord("widened", norm.name, {"linear": ", ".join(n.name for n in linears),
                                                             "dtype": str(dtype).removeprefix("torch.")}))
        return TEPassResult(gm, any(r.kind in ("widened", "fed_fp32") for r in records), records)

    @staticmethod
    def _feed_fp32(gm: torch.fx.GraphModule, ctx: PassContext, records: list[PassRecord]) -> None:
        """The second and third rules: a delayed linear's input (forward op) or grad output (backward
        op) rounded from the activation's fp32 value takes the fp32 value."""
        for lin in list(gm.graph.nodes):
            name = op_qualname(lin.target) if lin.op == "call_function" else None
            if name not in (LINEAR_OP, LINEAR_BWD_OP):
                continue
            i, argument = (1, "inp") if name == LINEAR_OP else (0, "grad_output")
            c = lin.args[i] if len(lin.args) > i else None
            if not _is_convert(c, NARROW):
                continue
            t = c.args[0]
            val = t.meta.get("val")
            if not isinstance(val, torch.Tensor) or val.dtype != torch.float32:
                continue
            why, where = None, activation_provenance(c)
            if where == "no stack trace":
                why = f"its {argument} is rounded from fp32 where the graph has no stack trace: cannot tell by whom"
            elif where == "elsewhere":
                why = (f"its {argument} is rounded from fp32 outside te_passes' LayerNormMLP activation: "
                       "TE eager quantizes the rounded value too")
            elif where == "backward_unfused" and name == LINEAR_BWD_OP:
                why = ("its grad_output is a gated activation's gradient, which TE eager computes in bf16 "
                       "and then quantizes (no fused dbias kernel under DelayedScaling)")
            elif _in_other_args(lin, c, i):
                why = f"the rounded {argument} is in another of its arguments too"
            if why is not None:
                records.append(PassRecord("kept", lin.name, {"reason": why}))
                continue
            ctx.journal.set_args(lin, (*lin.args[:i], t, *lin.args[i + 1:]))
            records.append(PassRecord("fed_fp32", lin.name, {"value": t.name, "skipped": c.name,
                                                             "argument": argument}))

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
