"""TE's fused RoPE kernel as the ``te_passes::te_rope_fwd`` / ``te_rope_bwd`` ops: what
``te.MultiheadAttention``'s ``apply_rotary_pos_emb(..., fused=True)`` runs (TE's ``FusedRoPEFunc``,
``attention/rope.py``, TE 2.20.2: ``tex.fused_rope_forward`` / ``tex.fused_rope_backward``, pybind, so
Dynamo breaks the graph there), as ops a graph can hold. Same kernel, same arguments: TE eager's
numerics. Docs: docs/untouched.md.
"""

from __future__ import annotations

import torch

_NS = "te_passes"
FWD_OP = f"{_NS}::te_rope_fwd"
BWD_OP = f"{_NS}::te_rope_bwd"
#: TE's ``FusedRoPEFunc`` formats (``QKVFormat`` keys it accepts).
FORMATS = ("sbhd", "bshd", "thd")


def _contiguous(out: torch.Tensor) -> torch.Tensor:
    # the fakes promise a contiguous result (a no-op when TE's kernel allocates one)
    return out if out.is_contiguous() else out.contiguous()


@torch.library.custom_op(FWD_OP, mutates_args=())
def te_rope_fwd(t: torch.Tensor, freqs: torch.Tensor, start_positions: torch.Tensor | None, tensor_format: str,
                interleaved: bool, cu_seqlens: torch.Tensor | None, cp_size: int, cp_rank: int) -> torch.Tensor:
    """``tex.fused_rope_forward`` with ``FusedRoPEFunc.forward``'s arguments: ``t`` [s, b, h, d] (sbhd),
    [b, s, h, d] (bshd) or [t, h, d] (thd), any strides, bf16 / fp16 / fp32; ``freqs`` [s2, 1, 1, d2]
    fp32 (``s2 >= s``, ``d2 <= d``); ``start_positions`` [b] int or ``None``; ``cu_seqlens`` [b + 1]
    int32 (thd) or ``None`` -> ``t``'s shape and dtype, contiguous. TE's kernel checks the rest."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.cpp_extensions.fused_attn import QKVFormat

    return _contiguous(tex.fused_rope_forward(t, freqs, start_positions, QKVFormat[tensor_format], interleaved,
                                              cu_seqlens, cp_size, cp_rank))


@te_rope_fwd.register_fake
def _(t, freqs, start_positions, tensor_format, interleaved, cu_seqlens, cp_size, cp_rank):
    return t.new_empty(t.shape)


@torch.library.custom_op(BWD_OP, mutates_args=())
def te_rope_bwd(grad: torch.Tensor, freqs: torch.Tensor, start_positions: torch.Tensor | None, tensor_format: str,
                interleaved: bool, cu_seqlens: torch.Tensor | None, cp_size: int, cp_rank: int) -> torch.Tensor:
    """``tex.fused_rope_backward`` (``FusedRoPEFunc.backward``): ``grad`` [t's shape] -> the gradient of
    ``t`` [same shape, ``grad.dtype``], contiguous."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.cpp_extensions.fused_attn import QKVFormat

    return _contiguous(tex.fused_rope_backward(grad, freqs, start_positions, QKVFormat[tensor_format], interleaved,
                                               cu_seqlens, cp_size, cp_rank))


@te_rope_bwd.register_fake
def _(grad, freqs, start_positions, tensor_format, interleaved, cu_seqlens, cp_size, cp_rank):
    return grad.new_empty(grad.shape)


def _setup(ctx, inputs, output):
    _t, freqs, start_positions, ctx.tensor_format, ctx.interleaved, cu_seqlens, ctx.cp_size, ctx.cp_rank = inputs
    ctx.save_for_backward(freqs, start_positions, cu_seqlens)


def _backward(ctx, grad):
    freqs, start_positions, cu_seqlens = ctx.saved_tensors
    dt = te_rope_bwd(grad, freqs, start_positions, ctx.tensor_format, ctx.interleaved, cu_seqlens, ctx.cp_size,
                     ctx.cp_rank)
    return dt, None, None, None, None, None, None, None


te_rope_fwd.register_autograd(_backward, setup_context=_setup)


def te_rope(t: torch.Tensor, freqs: torch.Tensor, tensor_format: str = "sbhd",
            start_positions: torch.Tensor | None = None, interleaved: bool = False,
            cu_seqlens: torch.Tensor | None = None, cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """TE's ``apply_rotary_pos_emb(t, freqs, ..., fused=True)`` (``attention/rope.py``) with TE's kernel:
    ``freqs`` cast to fp32 as ``FusedRoPEFunc`` does, the result in ``t``'s shape and dtype; the gradient
    flows to ``t`` only (TE's backward returns none for ``freqs``). Raises ``ValueError`` for a
    ``tensor_format`` outside ``sbhd`` / ``bshd`` / ``thd`` or thd without ``cu_seqlens``."""
    if tensor_format not in FORMATS:
        raise ValueError(f"tensor_format {tensor_format!r}: TE's fused RoPE takes one of {list(FORMATS)}")
    if tensor_format == "thd" and cu_seqlens is None:
        raise ValueError("tensor_format 'thd' needs cu_seqlens (TE's apply_rotary_pos_emb asserts the same)")
    if freqs.dtype != torch.float32:
        freqs = freqs.float()
    return te_rope_fwd(t, freqs, start_positions, tensor_format, bool(interleaved), cu_seqlens, int(cp_size),
                       int(cp_rank))
