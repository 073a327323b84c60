"""A toy TE op family registered with TE's own ``register_custom_op`` (TE 2.20.2
``transformer_engine/pytorch/dynamo/custom_op.py``), with CPU impls.

TE's real impls (``_linear_forward_impl``) need a GPU; this family has the same machinery
(wrapper + base ops, ``_ArgPlan``, config bundle, tensor-or-quantized slots, ``pack_result``)
so a compiled call can run on CPU through both paths: the dispatcher op and
:class:`te_passes.ops.direct_call.DirectTECall`.

``ToyFwdArgs`` fields cover every ``_FieldKind`` te.Linear uses except PROCESS_GROUP:
TENSOR (``inp``, ``bias``), TENSOR_OR_QUANTIZED holding a tensor (``weight``) and ``None``
(``extra``), SIMPLE (``scale``, ``mode``, ``out_dtype``) and UNSUPPORTED (``note``, always
``None``). ``CALLS`` counts impl calls and records the args object each got (TE impls may
set fields on it: ``fwd_impl`` does, as ``_linear_forward_impl`` sets scratch fields).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

OP_NAME = "tpq_direct_toy"

CALLS: dict[str, list[Any]] = {"fwd": [], "bwd": []}


def _te():
    from transformer_engine.pytorch.dynamo import custom_op as co
    from transformer_engine.pytorch.dynamo.tensor_spec import TensorSpec

    return co, TensorSpec


co, TensorSpec = _te()


@dataclasses.dataclass
class ToyFwdArgs:
    weight: co.TensorOrQuantized
    inp: torch.Tensor
    bias: Optional[torch.Tensor]
    extra: Optional[co.TensorOrQuantized]
    scale: float
    mode: str
    out_dtype: torch.dtype
    note: Optional[Any] = None
    scratch: Optional[int] = None  # set by the impl (UNSUPPORTED kind: crosses as None)


@dataclasses.dataclass
class ToyBwdArgs:
    grad_output: Optional[torch.Tensor] = None
    saved_inp: Optional[torch.Tensor] = None
    saved_weight: Optional[torch.Tensor] = None
    scale: float = 1.0
    mode: str = "mm"

    def setup_saved_tensors(self, ctx) -> None:
        from transformer_engine.pytorch.quantized_tensor import restore_from_func_ctx

        self.saved_inp, self.saved_weight = restore_from_func_ctx(ctx)


def fwd_impl(a: ToyFwdArgs):
    CALLS["fwd"].append(a)
    assert a.scratch is None and a.note is None and a.extra is None
    a.scratch = len(CALLS["fwd"])  # TE impls set fields on their args object
    out = torch.addmm(a.bias, a.inp, a.weight.t(), alpha=a.scale) if a.bias is not None \
        else (a.inp @ a.weight.t()) * a.scale
    if a.mode == "gelu":
        out = torch.nn.functional.gelu(out)
    # saved tensors must not alias op inputs (torch's custom-op aliasing check): copies, as TE
    # saves quantized copies
    return out.to(a.out_dtype), [a.inp.clone(), a.weight.clone()], None


def fwd_fake(a: ToyFwdArgs):
    out = TensorSpec(shape=(a.inp.shape[0], a.weight.shape[0]), dtype=a.out_dtype, device=a.inp.device)
    return out, [a.inp, a.weight], None


def setup_ctx(bwd: ToyBwdArgs, fwd: ToyFwdArgs, outputs, ctx_attrs, saved):
    bwd.scale, bwd.mode = fwd.scale, fwd.mode
    return saved


def bwd_impl(a: ToyBwdArgs):
    CALLS["bwd"].append(a)
    if a.mode != "mm":
        raise NotImplementedError("toy backward: mode 'mm' only")
    g = a.grad_output * a.scale
    return g.t() @ a.saved_inp, g @ a.saved_weight, a.grad_output.sum(0)


def bwd_fake(a: ToyBwdArgs):
    w, x, g = a.saved_weight, a.saved_inp, a.grad_output
    return (TensorSpec(shape=tuple(w.shape), dtype=g.dtype, device=g.device),
            TensorSpec(shape=tuple(x.shape), dtype=g.dtype, device=g.device),
            TensorSpec(shape=(w.shape[0],), dtype=g.dtype, device=g.device))


toy_linear = co.register_custom_op(
    op_name=OP_NAME, input_tensors_for_grad=["weight", "inp", "bias"], fwd_arg_type=ToyFwdArgs,
    fwd_impl=fwd_impl, fwd_fake_impl=fwd_fake, setup_context=setup_ctx, bwd_arg_type=ToyBwdArgs,
    bwd_impl=bwd_impl, bwd_fake_impl=bwd_fake)
if toy_linear is None:  # pragma: no cover - TE could not register (old torch)
    raise ImportError("TE's register_custom_op refused the toy op family")


def model(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    """Two toy linears with a tanh between (``x``: ``[T, K]``, ``w1``: ``[N, K]``, ``w2``: ``[N, N]``)."""
    h = toy_linear(ToyFwdArgs(weight=w1, inp=x, bias=b1, extra=None, scale=0.5, mode="mm", out_dtype=x.dtype))
    h = torch.tanh(h)
    return toy_linear(ToyFwdArgs(weight=w2, inp=h, bias=b2, extra=None, scale=2.0, mode="mm", out_dtype=x.dtype))
