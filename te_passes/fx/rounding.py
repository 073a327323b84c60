"""FX nodes that compute a value the way a later Inductor compile keeps it: a new node with its fake
value, and a bf16 / fp16 rounding written in integer ops (Inductor elides a ``convert`` pair inside a
fused kernel). Generic FX: no TE knowledge."""

from __future__ import annotations

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.fx.node import map_arg
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from te_passes.fx.journal import GraphJournal

_A = torch.ops.aten
#: The narrow float dtypes :func:`rounded_like` rounds to.
NARROW = (torch.bfloat16, torch.float16)


def add_node(log: GraphJournal, target, args: tuple, before: torch.fx.Node | None = None,
             after: torch.fx.Node | None = None) -> torch.fx.Node:
    """A new ``target(*args)`` node before ``before`` (or after ``after``), recorded in ``log``, its fake
    ``meta["val"]`` (and ``tensor_meta``) computed by running ``target`` on the arguments' fake values.
    Raises what ``target`` raises on them."""
    vals = map_arg(args, lambda a: a.meta["val"])
    with detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)]):
        val = target(*vals)
    return log.call_function(target, args, meta={"val": val, "tensor_meta": _extract_tensor_metadata(val)},
                             before=before, after=after)


#: fp16 (IEEE binary16): mantissa bits fp32 has beyond it, smallest normal, largest finite.
_FP16 = (13, 2.0 ** -14, 65504.0)


def rounded_like(log: GraphJournal, x32: torch.fx.Node, dtype: torch.dtype, before: torch.fx.Node) -> torch.fx.Node:
    """``x32`` (an fp32 node) rounded to ``dtype`` (bf16 / fp16; round to nearest even, what a store of
    that dtype does) and held as fp32 values, as new nodes before ``before``; same shape as ``x32``.

    Not ``convert(convert(x32, dtype), fp32)``: inside a fused kernel Inductor keeps a bf16 / fp16
    intermediate in fp32 (``torch/_inductor/codegen/triton.py`` ``triton_compute_type``; the C++ backend
    alike, unless ``emulate_precision_casts``), so that pair rounds nothing. bf16: the fp32 bits plus
    ``0x7FFF + lsb`` with the low 16 bits cleared; fp16: the same at bit 13 for normal values,
    ``round(x * 2**24) * 2**-24`` below the smallest normal, infinity past 65504; NaN kept.

    Raises:
        ValueError: ``dtype`` is not bf16 / fp16."""
    if dtype not in NARROW:
        raise ValueError(f"no exact rounding to {dtype} (bf16 / fp16 only)")

    def op(target, *args):
        return add_node(log, target, args, before)

    low = 16 if dtype is torch.bfloat16 else _FP16[0]
    bits = op(_A.view.dtype, x32, torch.int32)
    lsb = op(_A.bitwise_and.Scalar, op(_A.bitwise_right_shift.Tensor_Scalar, bits, low), 1)
    up = op(_A.add.Tensor, op(_A.add.Tensor, bits, (1 << (low - 1)) - 1), lsb)
    r = op(_A.view.dtype, op(_A.bitwise_and.Scalar, up, -(1 << low)), torch.float32)
    if dtype is torch.float16:
        _, tiny, big = _FP16
        sub = op(_A.mul.Tensor, op(_A.round.default, op(_A.mul.Tensor, x32, 2.0 ** 24)), 2.0 ** -24)
        r = op(_A.where.self, op(_A.lt.Scalar, op(_A.abs.default, x32), tiny), sub, r)
        inf = op(_A.mul.Tensor, op(_A.sign.default, x32), float("inf"))
        r = op(_A.where.self, op(_A.gt.Scalar, op(_A.abs.default, r), big), inf, r)
    return op(_A.where.self, op(_A.ne.Tensor, x32, x32), x32, r)
