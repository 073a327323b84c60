"""Pass ``widen_delayed_inputs``: a DelayedScaling te.Linear quantizes the fp32 values TE's fused
kernels quantize (its norm's output, LayerNormMLP's activation and its gradient), not a bf16
rounding of them.

See docs/passes/widen_delayed_inputs.md."""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.fx.node import map_arg
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from te_passes.fx.graph import op_qualname
from te_passes.pipeline.base import PassContext, PassRecord, Stage, TEPass, TEPassResult
from te_passes.runtime.ops import te_act
from te_passes.runtime.untouched.polyfills import NORM_ENV
from te_passes.te.norm_act import DBIAS_FUSED

#: The untouched-model polyfills' TE-kernel ops (``te_passes.runtime.ops.te_norm`` / ``te_act``) and
#: the DelayedScaling te.Linear op pair (``te_passes.runtime.delayed.linear``): the forward's ``inp``
#: is argument 1, the backward's ``grad_output`` argument 0.
NORM_OP = "te_passes::te_norm_fwd"
ACT_OP, ACT_BWD_OP = te_act.FWD_OP, te_act.BWD_OP
LINEAR_OP = "te_passes::delayed_linear_fwd"
LINEAR_BWD_OP = "te_passes::delayed_linear_bwd"
#: Activation dtypes the pass widens (TE's kernels compute in fp32 and round on the way out).
NARROW = (torch.bfloat16, torch.float16)
_A = torch.ops.aten


def _add(log, target, args: tuple, before: torch.fx.Node | None = None, after: torch.fx.Node | None = None
         ) -> torch.fx.Node:
    """A new ``target(*args)`` node before ``before`` (or after ``after``), its fake ``meta["val"]``
    (and ``tensor_meta``) computed by running ``target`` on the arguments' fake values."""
    vals = map_arg(args, lambda a: a.meta["val"])
    with detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)]):
        val = target(*vals)
    return log.call_function(target, args, meta={"val": val, "tensor_meta": _extract_tensor_metadata(val)},
                             before=before, after=after)


def _f32(log, x, before):
    return _add(log, torch.ops.prims.convert_element_type.default, (x, torch.float32), before)


def _dtype(node) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def _in_other_args(lin: torch.fx.Node, value: torch.fx.Node, i: int) -> bool:
    """Whether ``lin`` takes ``value`` in an argument besides argument ``i``."""
    seen: list = []
    map_arg(([a for k, a in enumerate(lin.args) if k != i], lin.kwargs), lambda a: seen.append(a) or a)
    return any(a is value for a in seen)


class WidenDelayedInputs(TEPass):
    """At ``post_grad_fwd`` / ``post_grad_bwd``, for each DelayedScaling te.Linear op
    (``te_passes::delayed_linear_fwd``'s ``inp``, ``delayed_linear_bwd``'s ``grad_output``) whose
    value, bf16 / fp16, comes from one of TE's kernels that TE eager fuses with that FP8 cast:

    * ``te_norm_fwd``'s output ``y``: the linear takes ``y32``, rebuilt in fp32 from the norm's own
      statistics as TE's norm kernels compute it (``ln_fwd_kernels.cuh`` / ``rmsnorm_fwd_kernels.cuh``,
      TE 2.20.2: ``g * (rs * (x - mu)) + b``, ``g * (rs * x)``, ``g = w (+ 1 zero-centred)``); ``y``
      stays for its other users;
    * ``te_act_fwd``'s output (LayerNormMLP's activation: TE fuses every activation with fc2's input
      cast): the op runs on an fp32 copy of its input and the linear takes its fp32 output; other
      users get it converted back;
    * ``te_act_bwd``'s output (the activation's gradient, fc1's grad output), for activations with
      a fused ``dbias_d*`` kernel (``norm_act.DBIAS_FUSED``; gated ones: TE eager computes their
      gradient in bf16 and quantizes that, kept with the reason): the same on fp32 copies.

    The bf16 / fp16 values the graph returns are unchanged, so the other graph is untouched. A
    rounding from fp32 anywhere else (a torch activation between two te.Linears; the torch-ops
    polyfills of ``TE_PASSES_UNTOUCHED_NORM=torch``) is kept and recorded: TE eager quantizes the
    user's rounded value too. Float8CurrentScaling needs none of this (TE computes those outputs in
    the input dtype first).

    Records: ``"fed_fp32"`` (the linear; ``value``: the fp32 node it takes, ``skipped``: the
    narrow node, ``argument``: ``inp`` / ``grad_output``, ``source``: the TE op), ``"widened"``
    (a ``te_act_*`` node now on fp32 copies; ``dtype``: its former one), ``"kept"`` (the linear;
    ``reason``)."""

    name = "widen_delayed_inputs"
    stages = frozenset({Stage.POST_GRAD_FWD, Stage.POST_GRAD_BWD})
    description = ("DelayedScaling: te.Linear quantizes the fp32 values TE's fused kernels quantize (norm output, "
                   "LayerNormMLP's activation and its gradient), not a bf16 rounding")

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> TEPassResult:
        records: list[PassRecord] = []
        seen: set[torch.fx.Node] = set()
        for lin in list(gm.graph.nodes):
            name = op_qualname(lin.target) if lin.op == "call_function" else None
            if name not in (LINEAR_OP, LINEAR_BWD_OP):
                continue
            i, argument = (1, "inp") if name == LINEAR_OP else (0, "grad_output")
            v = lin.args[i] if len(lin.args) > i else None
            if not isinstance(v, torch.fx.Node) or v in seen:
                continue
            seen.add(v)
            takers = [u for u in v.users if u.op == "call_function" and op_qualname(u.target) == name
                      and len(u.args) > i and u.args[i] is v]
            source = self._source(v)
            why = self._problem(v, source, argument, name)
            if why is not None:
                records.extend(PassRecord("kept", u.name, {"reason": why}) for u in takers if why)
                continue
            ok = [u for u in takers if not _in_other_args(u, v, i)]
            records.extend(PassRecord("kept", u.name, {"reason": f"it takes its {argument} in another argument too"})
                           for u in takers if u not in ok)
            if source != NORM_OP and len(ok) < len(takers):  # widening v would hand those a bf16 copy: leave v
                records.extend(PassRecord("kept", u.name, {"reason": f"another te.Linear takes its {argument} in "
                                                                     "two arguments"}) for u in ok)
                ok = []
            if not ok:
                continue
            log = ctx.journal
            # lin: the first taker in graph order (the loop walks the graph), so the new nodes precede them all
            value = self._rebuild(log, v, lin) if source == NORM_OP else self._widen(log, v, ok, records)
            for u in ok:
                log.set_args(u, (*u.args[:i], value, *u.args[i + 1:]))
                data = {"value": value.name, "skipped": v.name} if value is not v else {"value": value.name}
                records.append(PassRecord("fed_fp32", u.name, {**data, "argument": argument, "source": source}))
        return TEPassResult(gm, bool(ctx.journal), records)

    @staticmethod
    def _source(v: torch.fx.Node) -> str | None:
        """The TE op producing ``v`` (``te_norm_fwd`` through its output 0), else ``None``."""
        if v.op != "call_function":
            return None
        if v.target is operator.getitem and v.args[1] == 0 and isinstance(v.args[0], torch.fx.Node):
            return NORM_OP if op_qualname(v.args[0].target) == NORM_OP else None
        name = op_qualname(v.target)
        return name if name in (ACT_OP, ACT_BWD_OP) else None

    @staticmethod
    def _problem(v, source, argument, linear_op) -> str | None:
        """Why ``v`` is not widened: ``""`` (nothing to say: another producer, or done by a
        previous run), a reason to record, or ``None``: widen."""
        dtype = _dtype(v)
        if source is None:
            rounded = (v.op == "call_function" and v.target is torch.ops.prims.convert_element_type.default
                       and dtype in NARROW and _dtype(v.args[0]) == torch.float32)
            return (f"its {argument} is rounded from fp32 by torch ops, not by one of TE's kernels (te_norm_fwd / "
                    "te_act_fwd / te_act_bwd): a user's torch activation, whose rounded value TE eager quantizes "
                    f"too, or the torch-ops polyfills ({NORM_ENV}=torch; te gives TE eager's numerics)"
                    if rounded else "")
        if (source == ACT_BWD_OP) != (linear_op == LINEAR_BWD_OP):
            return ""
        producer = v.args[0] if source == NORM_OP else v
        if dtype is None:
            return f"its {argument} has no tensor meta['val']"
        if dtype not in NARROW:
            first = producer.args[0]
            if source != NORM_OP and getattr(first, "target", None) is torch.ops.prims.convert_element_type.default:
                return ""  # widened by a previous run
            return f"its {argument} is {dtype}: nothing to widen"
        if source == ACT_BWD_OP and producer.args[2] not in DBIAS_FUSED:
            return (f"its grad_output is the gradient of {producer.args[2]!r}, which TE eager computes in "
                    f"{str(dtype).removeprefix('torch.')} and then quantizes (no fused dbias kernel under "
                    "DelayedScaling)")
        n_tensor = 3 if source == NORM_OP else 2 if source == ACT_BWD_OP else 1
        if any(isinstance(a, torch.fx.Node) and not isinstance(a.meta.get("val"), torch.Tensor)
               for a in producer.args[:n_tensor]):
            return f"an input of its {argument}'s {source} has no tensor meta['val']"
        return None

    @staticmethod
    def _rebuild(log, y: torch.fx.Node, lin: torch.fx.Node) -> torch.fx.Node:
        """``y32`` from the norm node's input, weight, bias and statistics (mu, rsigma: shaped like
        ``x`` without its last dim, ``te_norm_fwd``), before ``lin`` (the first linear taking ``y``,
        in graph order)."""
        norm = y.args[0]
        x, w, b, _eps, rms, zcg = norm.args[:6]
        stats = {u.args[1]: u for u in norm.users if u.target is operator.getitem}
        for k in (2,) if rms else (1, 2):  # rsigma (and mu): the graph's getitem, else a new one (no-grad graphs)
            if k not in stats:
                val = norm.meta["val"][k]
                stats[k] = log.call_function(operator.getitem, (norm, k), before=lin, meta={
                    "val": val, "tensor_meta": _extract_tensor_metadata(val)})
        rs = _add(log, _A.unsqueeze.default, (stats[2], -1), lin)
        x32 = _f32(log, x, lin)
        if rms:
            yn = _add(log, _A.mul.Tensor, (rs, x32), lin)
        else:
            yn = _add(log, _A.mul.Tensor, (rs, _add(log, _A.sub.Tensor, (x32, _add(
                log, _A.unsqueeze.default, (stats[1], -1), lin)), lin)), lin)
        g = _f32(log, w, lin)
        if zcg:
            g = _add(log, _A.add.Tensor, (g, 1.0), lin)
        y32 = _add(log, _A.mul.Tensor, (g, yn), lin)
        if not rms and isinstance(b, torch.fx.Node):
            y32 = _add(log, _A.add.Tensor, (y32, _f32(log, b, lin)), lin)
        return y32

    @staticmethod
    def _widen(log, v: torch.fx.Node, takers: list[torch.fx.Node], records: list[PassRecord]) -> torch.fx.Node:
        """``v`` (a ``te_act_fwd`` / ``te_act_bwd`` node) on fp32 copies of its tensor inputs, its
        value fp32; its users other than ``takers`` get a copy in its former dtype. Returns ``v``."""
        dtype = _dtype(v)
        n = 1 if op_qualname(v.target) == ACT_OP else 2
        log.set_args(v, (*[_f32(log, a, v) for a in v.args[:n]], *v.args[n:]))
        val = v.meta["val"].to(torch.float32)
        log.set_meta(v, "val", val)
        if "tensor_meta" in v.meta:
            log.set_meta(v, "tensor_meta", _extract_tensor_metadata(val))
        others = [u for u in v.users if u not in takers]
        if others:
            narrow = _add(log, torch.ops.prims.convert_element_type.default, (v, dtype), after=v)
            for user in others:
                log.set_args(user, map_arg(user.args, lambda a: narrow if a is v else a),
                             map_arg(user.kwargs, lambda a: narrow if a is v else a))
        records.append(PassRecord("widened", v.name, {"dtype": str(dtype).removeprefix("torch.")}))
        return v
