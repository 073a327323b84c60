"""Pass ``widen_quantized_inputs``: a quantizing te.Linear quantizes the values TE eager's fused norm /
activation kernels quantize under its recipe (``te.norm_act.FUSED_QUANTIZE``), not a bf16 rounding
of them.

See docs/passes/widen_quantized_inputs.md."""

from __future__ import annotations

import operator
import os

import torch
import torch.fx
from torch.fx.node import map_arg
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from te_passes.fx.graph import op_qualname
from te_passes.fx.rounding import NARROW, add_node as _add, rounded_like
from te_passes.pipeline.base import PassContext, PassRecord, Stage, TEPass, TEPassResult
from te_passes.ops import te_act
from te_passes.compat.api import UNTOUCHED_NORM_ENV as NORM_ENV
from te_passes.te.graph_model import UnknownTEOp, decode
from te_passes.te.norm_act import CUDNN_NORM_ENV, FUSED_QUANTIZE, QUANTIZER_RECIPES, fused_quantize

#: The untouched-model polyfills' TE-kernel ops (``te_passes.ops.te_norm`` / ``te_act``).
NORM_OP = "te_passes::te_norm_fwd"
ACT_OP, ACT_BWD_OP = te_act.FWD_OP, te_act.BWD_OP
#: The DelayedScaling te.Linear op pair (``te_passes.compat.delayed_scaling.linear``): the forward's ``inp`` is
#: argument 1, the backward's ``grad_output`` argument 0; its quantizers are ``Float8Quantizer``\\ s.
LINEAR_OP = "te_passes::delayed_linear_fwd"
LINEAR_BWD_OP = "te_passes::delayed_linear_bwd"
#: TE's own te.Linear ops (``module/linear.py`` ``register_custom_op(op_name="linear")``, TE 2.20.2): every
#: other recipe; ``inp`` / ``grad_output`` and the quantizers found by name (``te.graph_model.decode``).
TE_LINEAR_OPS = {"transformer_engine_compile::linear": False, "transformer_engine_compile::linear_base": False,
                 "transformer_engine_compile::linear_backward": True,
                 "transformer_engine_compile::linear_backward_base": True}
_SOURCES = {NORM_OP: "norm", ACT_OP: "act", ACT_BWD_OP: "dact"}
_A = torch.ops.aten
_CONVERT = torch.ops.prims.convert_element_type.default


def _f32(log, x, before):
    return _add(log, _CONVERT, (x, torch.float32), before)


def _dtype(node) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def _arg(node: torch.fx.Node, i: int, name: str):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name)


def _set_arg(log, node: torch.fx.Node, i: int, name: str, value) -> None:
    if len(node.args) > i:
        log.set_args(node, (*node.args[:i], value, *node.args[i + 1:]))
    else:
        log.set_args(node, node.args, {**node.kwargs, name: value})


def _in_other_args(lin: torch.fx.Node, value: torch.fx.Node, i: int, name: str) -> bool:
    """Whether ``lin`` takes ``value`` in an argument besides argument ``i`` / keyword ``name``."""
    seen: list = []
    map_arg(([a for k, a in enumerate(lin.args) if k != i], {k: a for k, a in lin.kwargs.items() if k != name}),
            lambda a: seen.append(a) or a)
    return any(a is value for a in seen)


def quantizing_linear(node: torch.fx.Node) -> tuple[int, str, str, bool] | None:
    """``(argument index, argument name, quantizer class name, has bias)`` of a te.Linear op node whose
    FP8 / MXFP8 / block cast this pass can feed (``inp`` of a forward op, ``grad_output`` of a backward
    op), else ``None`` (another node, a bf16 call without a quantizer, an op ``decode`` refuses)."""
    if node.op != "call_function":
        return None
    name = op_qualname(node.target)
    if name in (LINEAR_OP, LINEAR_BWD_OP):
        return (1, "inp", "Float8Quantizer", False) if name == LINEAR_OP else (0, "grad_output", "Float8Quantizer", False)
    backward = TE_LINEAR_OPS.get(name)
    if backward is None:
        return None
    try:
        call = decode(node)
    except UnknownTEOp:
        return None
    argument = "grad_output" if backward else "inp"
    slot = next((s for s in call.slots if s.name == argument), None)
    q = call.config.get("grad_output_quantizer" if backward else "input_quantizer")
    return None if slot is None or q is None else (slot.index, argument, type(q).__name__,
                                                    bool(call.config.get("use_bias")))


class WidenQuantizedInputs(TEPass):
    """At ``post_grad_fwd`` / ``post_grad_bwd``, for each quantizing te.Linear op (the DelayedScaling op
    pair, TE's ``transformer_engine_compile::linear`` / ``linear_backward``: :func:`quantizing_linear`)
    whose ``inp`` / ``grad_output``, bf16 / fp16, comes from one of TE's kernels that TE eager fuses
    with that cast, per its quantizer class (``te.norm_act.fused_quantize``, TE 2.20.2):

    * rule ``"fp32"`` (DelayedScaling: norm, activation, dbias-fused activation gradient; MXFP8:
      activation and its dbias-fused gradient): the linear takes the fp32 value; ``te_norm_fwd``'s
      output ``y`` is rebuilt in fp32 from the norm's own statistics as TE's norm kernels compute it
      (``ln_fwd_kernels.cuh`` / ``rmsnorm_fwd_kernels.cuh``: ``g * (rs * (x - mu)) + b``,
      ``g * (rs * x)``, ``g = w (+ 1 zero-centred)``; ``y`` stays for its other users);
      ``te_act_fwd`` / ``te_act_bwd`` run on fp32 copies of their inputs (other users get their
      output converted back);
    * rule ``"amax"`` (Float8CurrentScaling, the activation: TE's kernel writes bf16 and the amax of
      its fp32 values, which the cast uses): ``te_act_fwd`` runs on an fp32 copy, ``m = amax(|a32|)``,
      ``r`` = ``a32`` rounded to bf16 in integer ops (:func:`rounded_like`: Inductor would elide a
      bf16 round trip), and the linear takes ``where(|a32| == m, a32, clamp(r, -m, m))``: the bf16
      values, whose own amax is ``m`` (the top elements cast to the FP8 maximum either way).

    The bf16 / fp16 values the graph returns are unchanged, so the other graph is untouched. A rounding
    from fp32 by torch ops (a user's activation; the torch-ops polyfills of ``TE_PASSES_UNTOUCHED_NORM=
    torch``) is kept and recorded where the recipe has a rule: TE eager quantizes the user's rounding too.

    Records: ``"fed_fp32"`` / ``"fed_fp32_amax"`` (the linear; ``value``: the node it takes, ``skipped``:
    the one it took, when another; ``argument``; ``source``: the TE op; ``quantizer``: its class),
    ``"widened"`` (a ``te_act_*`` node now on fp32 copies; ``dtype``: its former one), ``"kept"``
    (the linear; ``reason``)."""

    name = "widen_quantized_inputs"
    stages = frozenset({Stage.POST_GRAD_FWD, Stage.POST_GRAD_BWD})
    description = ("te.Linear quantizes the values TE's fused kernels quantize (DelayedScaling, MXFP8: the fp32 "
                   "norm output / activation / its gradient; Float8CurrentScaling: the activation with its fp32 amax)")

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> TEPassResult:
        records: list[PassRecord] = []
        seen: set[torch.fx.Node] = set()
        for lin in list(gm.graph.nodes):
            taker = quantizing_linear(lin)
            if taker is None:
                continue
            i, argument, qcls, _ = taker
            name = op_qualname(lin.target)
            v = _arg(lin, i, argument)
            if not isinstance(v, torch.fx.Node) or v in seen:
                continue
            seen.add(v)
            takers = [u for u in v.users if u.op == "call_function" and op_qualname(u.target) == name
                      and (t := quantizing_linear(u)) is not None and t[2] == qcls and _arg(u, i, argument) is v]
            source = self._source(v)
            rule, why = self._rule(v, source, argument, qcls, any(quantizing_linear(u)[3] for u in takers)
                                   and name in TE_LINEAR_OPS)
            if why:
                records.extend(PassRecord("kept", u.name, {"reason": why}) for u in takers)
            if rule is None:
                continue
            ok = [u for u in takers if not _in_other_args(u, v, i, argument)]
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
            if source == NORM_OP:
                value = self._rebuild(log, v, lin)
            else:
                narrow = _dtype(v)
                value = self._widen(log, v, ok, records)
                if rule == "amax":
                    value = self._amax_matched(log, v, narrow, lin)
            for u in ok:
                _set_arg(log, u, i, argument, value)
                data = {"value": value.name, "skipped": v.name} if value is not v else {"value": value.name}
                records.append(PassRecord("fed_fp32" if rule == "fp32" else "fed_fp32_amax", u.name,
                                          {**data, "argument": argument, "source": source, "quantizer": qcls}))
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
    def _rule(v, source, argument, qcls, bias) -> tuple[str | None, str]:
        """``(rule, reason)``: the :data:`~te_passes.te.norm_act.FUSED_QUANTIZE` rule to apply
        (``None``: none) and, when there is one to record, why ``v`` is left alone (``""``: nothing
        to say: TE eager quantizes this bf16 value too, another producer, or done by a previous run)."""
        dtype = _dtype(v)
        backward = argument == "grad_output"
        known = qcls in FUSED_QUANTIZE
        if source is None:
            rounded = (v.op == "call_function" and v.target is _CONVERT and dtype in NARROW
                       and _dtype(v.args[0]) == torch.float32)
            has_rule = not known or any((k == "dact") == backward for k in FUSED_QUANTIZE[qcls])
            return None, (f"its {argument} is rounded from fp32 by torch ops, not by one of TE's kernels (te_norm_fwd / "
                          "te_act_fwd / te_act_bwd): a user's torch activation, whose rounded value TE eager quantizes "
                          f"too, or the torch-ops polyfills ({NORM_ENV}=torch; te gives TE eager's numerics)"
                          if rounded and has_rule else "")
        if (source == ACT_BWD_OP) != backward:
            return None, ""
        producer = v.args[0] if source == NORM_OP else v
        act = producer.args[2] if source == ACT_BWD_OP else producer.args[1] if source == ACT_OP else None
        try:
            rule = fused_quantize(qcls, _SOURCES[source], act)
        except KeyError as e:
            return None, f"a {qcls} cast: {e.args[0]}; left as the split computes it"
        if rule is None:
            if source == ACT_BWD_OP and FUSED_QUANTIZE[qcls].get("dact"):
                return None, (f"its grad_output is the gradient of {act!r}, which TE eager computes in "
                              f"{str(dtype).removeprefix('torch.')} and then quantizes (no fused dbias kernel "
                              f"under {QUANTIZER_RECIPES.get(qcls, qcls)})")
            if source == NORM_OP and qcls == "MXFP8Quantizer" and os.environ.get(CUDNN_NORM_ENV, "0") not in ("", "0"):
                return None, (f"{CUDNN_NORM_ENV}=1: TE eager's MXFP8 norm may run cuDNN's fused kernel (both dims "
                              "multiples of 128), which quantizes its own fp32 values: not expressed")
            return None, ""
        if dtype is None:
            return None, f"its {argument} has no tensor meta['val']"
        if dtype not in NARROW:
            first = producer.args[0]
            if source != NORM_OP and getattr(first, "target", None) is _CONVERT:
                return None, ""  # widened by a previous run
            return None, f"its {argument} is {dtype}: nothing to widen"
        if bias and backward:
            return None, (f"its grad_output would be fp32 and TE's linear_backward then returns the bias gradient in "
                          "fp32 where its fake says the activation dtype (a bias with a dbias-fused activation)")
        n_tensor = 3 if source == NORM_OP else 2 if source == ACT_BWD_OP else 1
        if any(isinstance(a, torch.fx.Node) and not isinstance(a.meta.get("val"), torch.Tensor)
               for a in producer.args[:n_tensor]):
            return None, f"an input of its {argument}'s {source} has no tensor meta['val']"
        return rule, ""

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
        g = _add(log, _A.add.Tensor, (_f32(log, w, lin), 1.0), lin) if zcg else _f32(log, w, lin)
        y32 = _add(log, _A.mul.Tensor, (g, yn), lin)
        if not rms and isinstance(b, torch.fx.Node):
            y32 = _add(log, _A.add.Tensor, (y32, _f32(log, b, lin)), lin)
        return y32

    @staticmethod
    def _widen(log, v: torch.fx.Node, takers: list[torch.fx.Node], records: list[PassRecord]) -> torch.fx.Node:
        """``v`` (a ``te_act_fwd`` / ``te_act_bwd`` node) on fp32 copies of its tensor inputs, its
        value fp32; its users other than ``takers`` get a copy in its former dtype, made right after
        ``v``. Returns ``v``."""
        dtype = _dtype(v)
        n = 1 if op_qualname(v.target) == ACT_OP else 2
        log.set_args(v, (*[_f32(log, a, v) for a in v.args[:n]], *v.args[n:]))
        val = v.meta["val"].to(torch.float32)
        log.set_meta(v, "val", val)
        if "tensor_meta" in v.meta:
            log.set_meta(v, "tensor_meta", _extract_tensor_metadata(val))
        others = [u for u in v.users if u not in takers]
        if others:
            narrow = _add(log, _CONVERT, (v, dtype), after=v)
            for user in others:
                log.set_args(user, map_arg(user.args, lambda a: narrow if a is v else a),
                             map_arg(user.kwargs, lambda a: narrow if a is v else a))
        records.append(PassRecord("widened", v.name, {"dtype": str(dtype).removeprefix("torch.")}))
        return v

    @staticmethod
    def _amax_matched(log, a32: torch.fx.Node, narrow: torch.dtype, lin: torch.fx.Node) -> torch.fx.Node:
        """``where(|a32| == m, a32, min(max(r, -m), m))``, ``m = amax(|a32|)`` (0-dim fp32), ``r`` the
        rounding of ``a32`` to ``narrow`` (bf16 / fp16) as fp32 values (:func:`rounded_like`), before ``lin``."""
        mag = _add(log, _A.abs.default, (a32,), lin)
        m = _add(log, _A.amax.default, (mag,), lin)
        rounded = rounded_like(log, a32, narrow, lin)
        low = _add(log, _A.maximum.default, (rounded, _add(log, _A.neg.default, (m,), lin)), lin)  # not clamp.Tensor:
        clamped = _add(log, _A.minimum.default, (low, m), lin)  # Inductor decomposes it, has no lowering
        top = _add(log, _A.eq.Tensor, (mag, m), lin)
        return _add(log, _A.where.self, (top, a32, clamped), lin)
