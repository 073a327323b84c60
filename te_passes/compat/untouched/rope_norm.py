"""RoPE and TE's ``te.ops`` norms inside te_inductor's untouched graphs (issue 38).

- ``attention/rope.py`` ``apply_rotary_pos_emb`` (what ``te.MultiheadAttention`` calls with ``fused=True``:
  TE's ``FusedRoPEFunc``, whose pybind kernels break the graph) gets a ``substitute_in_graph`` polyfill: in
  te_inductor frames the fused call is the ``te_passes::te_rope_fwd`` op (TE's kernel,
  :mod:`te_passes.ops.te_rope`); everywhere else TE's own function runs.
- ``te.RMSNorm`` / ``te.LayerNorm`` (and ``te.ops.RMSNorm`` / ``LayerNorm`` / ``L2Normalization``) inherit
  ``BasicOperation.forward``, which builds an ``OperationFuser`` and an ``autograd.Function`` around TE's
  pybind norm kernels. Dynamo never consults ``substitute_in_graph`` for a Python method it inlines as a
  module's forward, so these classes get a class-level ``forward`` (:func:`te_ops_norm_forward`) that is
  ``BasicOperation.forward`` eagerly and under other backends, and the ``te_passes::te_ops_norm_fwd`` op (TE's
  kernel; torch ops under ``TE_PASSES_UNTOUCHED_NORM=torch``) in te_inductor frames.

What stays eager is a named island (``island_records()``). Docs: docs/untouched.md."""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from typing import Any, Callable

import torch

from te_passes.ops.te_ops_norm import te_ops_norm
from te_passes.ops.te_rope import te_rope
from te_passes.compat.untouched.gate import norm_choice, note_island
from te_passes.compat.untouched.state import active_frames
from te_passes.te.norm_act import normalize

ROPE_MODULE = "transformer_engine.pytorch.attention.rope"
ROPE_TARGET = "apply_rotary_pos_emb"
#: ``te.ops`` basic operations given a class-level forward: (module, class, TE's public name).
NORM_CLASSES: tuple[tuple[str, str, str], ...] = (
    ("transformer_engine.pytorch.ops.basic.rmsnorm", "RMSNorm", "te.RMSNorm"),
    ("transformer_engine.pytorch.ops.basic.layer_norm", "LayerNorm", "te.LayerNorm"),
    ("transformer_engine.pytorch.ops.basic.l2normalization", "L2Normalization", "te.ops.L2Normalization"),
)
THD_REASON = ("tensor_format='thd' (packed sequences with cu_seqlens): left to TE's FusedRoPEFunc, as the THD "
              "attention after it is left to TE (runtime/untouched/attention.py)")
THD_FIX = "none inside te_passes for THD / padded sequences yet; unpadded sbhd / bshd batches compile to one graph"



@dataclasses.dataclass
class _KeptTE:
    """What the replacements fall back to, set by the rows' plans (te_passes/compat/untouched/rows.py):
    ``functions``, TE's functions: ``"rope"`` (a copy of ``apply_rotary_pos_emb``), ``"rope_island"``,
    ``"base_forward"`` (``BasicOperation.forward``), ``"norm_island"``; ``kinds``, (class, TE's class name) of
    each rebound norm."""

    functions: dict[str, Any] = dataclasses.field(default_factory=dict)
    kinds: list[tuple[type, str]] = dataclasses.field(default_factory=list)


_KEPT = _KeptTE()


def keep_rope(orig: Callable[..., Any]) -> None:
    """Keep TE's ``apply_rotary_pos_emb`` ``orig`` (a copy of it, and its named island) for the polyfill."""
    _KEPT.functions["rope"] = function_copy(orig)
    _KEPT.functions["rope_island"] = named_island(_KEPT.functions["rope"], ROPE_TARGET)


def keep_norm(cls: type, kind: str, base: Callable[..., Any]) -> None:
    """Keep TE's ``BasicOperation.forward`` ``base`` for :func:`te_ops_norm_forward` on class ``cls``
    (``kind``: ``"RMSNorm"``, ``"LayerNorm"`` or ``"L2Normalization"``)."""
    _KEPT.functions["base_forward"] = base
    if "norm_island" not in _KEPT.functions:
        _KEPT.functions["norm_island"] = named_island(base, "BasicOperation.forward")
    if all(c is not cls for c, _ in _KEPT.kinds):
        _KEPT.kinds.append((cls, kind))


def function_copy(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` with another identity (same code, globals, defaults, closure): Dynamo traces it as TE's own
    function, never as the polyfill registered for ``f``."""
    g = types.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    g.__kwdefaults__ = dict(f.__kwdefaults__ or {}) or None
    g.__qualname__, g.__doc__, g.__module__ = f.__qualname__, f.__doc__, f.__module__
    return g


def named_island(f: Callable[..., Any], label: str) -> Callable[..., Any]:
    """``f`` under ``torch._dynamo.disable``, named ``te_passes_untouched_island[<label>]`` in graphs."""
    @functools.wraps(f)
    def island(*args: Any, **kwargs: Any) -> Any:
        return f(*args, **kwargs)

    island.__name__ = island.__qualname__ = f"te_passes_untouched_island[{label}]"
    return torch._dynamo.disable(island, recursive=True)


# --------------------------------------------------------------------------- RoPE
def rope_call_problem(tensor_format: str, cu_seqlens: Any) -> str | None:
    """Why a fused ``apply_rotary_pos_emb`` call stays with TE (named island), or ``None``."""
    if tensor_format == "thd":
        return THD_REASON
    if cu_seqlens is not None:
        return (f"cu_seqlens with tensor_format={tensor_format!r} (padded sequences): left to TE's FusedRoPEFunc, "
                "as the padded attention after it is left to TE (runtime/untouched/attention.py)")
    if tensor_format not in ("sbhd", "bshd"):
        return f"tensor_format={tensor_format!r} (TE's fused RoPE takes sbhd / bshd / thd)"
    return None


def rope_polyfill(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False, fused=False,
                          cu_seqlens=None, cp_size=1, cp_rank=0):
    """TE's ``apply_rotary_pos_emb`` (``attention/rope.py``, TE 2.20.2; same signature) as Dynamo traces it:
    ``fused=False`` or another backend's frame: TE's own function; a fused call in a te_inductor frame:
    ``te_passes::te_rope_fwd`` (``t`` [s, b, h, d] / [b, s, h, d] -> same shape), a THD / padded call a named
    island."""
    te_fn = _KEPT.functions["rope"]
    if not fused or not active_frames():
        return te_fn(t, freqs, tensor_format, start_positions, interleaved, fused, cu_seqlens, cp_size, cp_rank)
    problem = rope_call_problem(tensor_format, cu_seqlens)
    if problem is not None:
        note_island("te.apply_rotary_pos_emb", "", problem, THD_FIX)
        return _KEPT.functions["rope_island"](t, freqs, tensor_format, start_positions, interleaved, fused,
                                              cu_seqlens, cp_size, cp_rank)
    return te_rope(t, freqs, tensor_format, start_positions, interleaved, None, cp_size, cp_rank)


# --------------------------------------------------------------------------- te.ops norms
class _L2Normalize(torch.autograd.Function):
    """TE's ``L2Normalization`` (``ops/basic/l2normalization.py``) with TE's formulas
    (``jit.py`` ``l2normalization_fwd_fused_`` / ``l2normalization_backward_fused_``): fp32 math, the
    output in ``x.dtype``; the backward recomputes the squared norm as TE's does."""

    @staticmethod
    def forward(ctx, x, eps):
        xf = x.float()
        rsqrt_norm = torch.rsqrt(xf.pow(2).sum(dim=-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rsqrt_norm)
        ctx.eps = eps
        return (xf * rsqrt_norm).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, rsqrt_norm = ctx.saved_tensors
        xf, dyf = x.float(), dy.float()
        x_dy_sum = (xf * dyf).sum(dim=-1, keepdim=True)
        x_norm_squared = xf.pow(2).sum(dim=-1, keepdim=True) + ctx.eps
        return (rsqrt_norm * (dyf - xf * x_dy_sum / x_norm_squared)).to(x.dtype), None


def te_ops_norm_problem(op: Any, inp: Any, extra_inputs: tuple, kwargs: dict) -> str | None:
    """Trace time: why the call ``op(inp, *extra_inputs, **kwargs)`` of a ``te.ops`` norm stays with TE
    (a named island), or ``None``."""
    from transformer_engine.pytorch.quantized_tensor import QuantizedTensorStorage

    if extra_inputs or kwargs:
        return "extra inputs / op kwargs (te.ops fuser channels)"
    if not isinstance(inp, torch.Tensor) or isinstance(inp, QuantizedTensorStorage):
        return f"a {type(inp).__name__} input (TE dequantizes quantized inputs first)"
    weight = getattr(op, "weight", None)
    if weight is not None and weight.device.type == "meta":
        return "parameters on the meta device (TE initialises them in its first forward)"
    margins = getattr(op, "_sm_margins", None)
    if margins is not None and margins.get("backward", 0):
        return (f"sm_margin['backward']={margins['backward']}: te_passes::te_ops_norm_fwd's backward launches TE's "
                "kernel with sm_margin 0")
    return None


def te_ops_norm_forward(self, input, *extra_inputs, **kwargs):  # noqa: A002 - TE's parameter name
    """The forward of TE's ``te.ops`` ``RMSNorm`` / ``LayerNorm`` / ``L2Normalization`` (so of ``te.RMSNorm`` /
    ``te.LayerNorm``): ``BasicOperation.forward`` (TE's) eagerly and in frames of other backends; in frames
    traced for te_inductor, ``input`` [..., *normalized_shape] -> the same shape in TE's dtype (the
    ``torch.autocast`` dtype if enabled, else the weight's; L2Normalization: the input's), through
    ``te_passes::te_ops_norm_fwd`` (TE's kernels, TE's casts: ``ops/basic/rmsnorm.py`` ``op_forward``) or the
    torch-ops norm under ``TE_PASSES_UNTOUCHED_NORM=torch``. Raises ``ValueError`` as TE does for an input
    whose trailing dims are not the weight's."""
    base = _KEPT.functions["base_forward"]
    if not torch.compiler.is_compiling() or not active_frames():
        return base(self, input, *extra_inputs, **kwargs)
    problem = te_ops_norm_problem(self, input, extra_inputs, kwargs)
    kind = next((name for cls, name in _KEPT.kinds if isinstance(self, cls)), None)
    if problem is not None or kind is None:
        note_island(f"te.{type(self).__name__}", "", problem or "not a te.ops norm te_passes expresses",
                    "none inside te_passes for this call; the rest of the model still compiles")
        return _KEPT.functions["norm_island"](self, input, *extra_inputs, **kwargs)
    if kind == "L2Normalization":
        return _L2Normalize.apply(input, self.eps)
    weight = self.weight
    dims = tuple(weight.shape)
    if tuple(input.shape[input.dim() - len(dims):]) != dims or input.dim() < len(dims):
        raise ValueError(f"Input tensor (shape={tuple(input.shape)}) and weight tensor (shape={dims}) are not "
                         "compatible")
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else weight.dtype
    inner = math.prod(dims)
    x = input.to(dtype).reshape(*input.shape[:input.dim() - len(dims)], inner)
    w = weight.to(dtype).reshape(inner)
    b = self.bias.to(dtype).reshape(inner) if kind == "LayerNorm" else None
    normalization = "RMSNorm" if kind == "RMSNorm" else "LayerNorm"
    if norm_choice() == "te":
        grad = torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad
                                            or (b is not None and self.bias.requires_grad))
        margin = self._sm_margins["forward" if grad else "inference"]
        y = te_ops_norm(x, w, b, self.eps, normalization, self.zero_centered_gamma, margin)
    else:
        y = normalize(x, w, b, self.eps, normalization, self.zero_centered_gamma)
    return y.view(input.shape)
