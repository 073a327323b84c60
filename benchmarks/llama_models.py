"""The models of benchmarks/bench_llama.py: Llama-class ``te.TransformerLayer`` stacks as a TE user
writes them, and the competitor, the same block in plain torch (``nn.Linear``, ``nn.RMSNorm``,
``F.scaled_dot_product_attention`` with GQA, SwiGLU) for Inductor and torchao's float8 training.

Both take and return ``[seq, batch, hidden]`` bf16 (TE's default ``sbhd``); the torch block's weights
are TE's (:func:`load_from_te`), so its output and gradients are compared with TE eager's by name
(:func:`te_names`). Docs: docs/benchmarks.md "Llama-class sizes (issue 41)".
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import torch
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class Shape:
    """A Llama layer's widths: ``hidden``, ``ffn`` (SwiGLU inner width), query ``heads``, KV ``groups``."""

    hidden: int
    ffn: int
    heads: int
    groups: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


#: Llama-3-8B's layer and Llama-3.2-1B's (hidden, ffn, heads, KV groups); ``tiny``: the CPU check's.
SHAPES: dict[str, Shape] = {"llama8b": Shape(4096, 14336, 32, 8), "llama1b": Shape(2048, 8192, 32, 8),
                            "tiny": Shape(64, 128, 4, 2)}
#: TE's RMSNorm epsilon in te.TransformerLayer (``layernorm_epsilon`` default), used by both models.
EPS = 1e-5
#: RoPE base (TE's ``RotaryPositionEmbedding`` default; Llama-3 uses 500000, which changes no kernel).
ROPE_BASE = 10000.0


def te_layer_kwargs(shape: Shape) -> dict[str, Any]:
    """``te.TransformerLayer(hidden, ffn, heads, **kwargs)`` for a Llama layer: GQA, RMSNorm,
    SwiGLU, no bias, causal self-attention, bf16 parameters, no dropout."""
    return dict(num_gqa_groups=shape.groups, normalization="RMSNorm", activation="swiglu", bias=False,
                self_attn_mask_type="causal", params_dtype=torch.bfloat16, hidden_dropout=0.0,
                attention_dropout=0.0, layernorm_epsilon=EPS)


class TEStack(torch.nn.Module):
    """``layers`` × ``te.TransformerLayer`` (:func:`te_layer_kwargs`) called in sequence, each with
    ``rotary_pos_emb=self.rope`` when ``rope`` (fp32 ``[seq, 1, 1, head_dim]``, :func:`rope_freqs`) is
    given. ``forward(x)``: bf16 ``[seq, batch, hidden]`` -> the same shape."""

    def __init__(self, shape: Shape, layers: int, rope: torch.Tensor | None = None, device: str = "cuda"):
        import transformer_engine.pytorch as te

        super().__init__()
        self.layers = torch.nn.ModuleList(te.TransformerLayer(shape.hidden, shape.ffn, shape.heads, device=device,
                                                              **te_layer_kwargs(shape)) for _ in range(layers))
        self.register_buffer("rope", rope, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) if self.rope is None else layer(x, rotary_pos_emb=self.rope)
        return x


def rope_freqs(seq: int, head_dim: int, device: Any = "cuda") -> torch.Tensor:
    """fp32 ``[seq, 1, 1, head_dim]`` rotary angles, non-interleaved: TE's
    ``RotaryPositionEmbedding(head_dim)(seq)`` (transformer_engine/pytorch/attention/rope.py) with
    base :data:`ROPE_BASE`, computed without TE (its constructor needs a CUDA device)."""
    inv = 1.0 / ROPE_BASE ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32, device=device), inv)
    return torch.cat((freqs, freqs), dim=-1).reshape(seq, 1, 1, head_dim)


def apply_rope(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """``t`` ``[seq, batch, heads, head_dim]`` rotated by ``freqs`` (:func:`rope_freqs`): TE's unfused
    ``apply_rotary_pos_emb(t, freqs, "sbhd")`` — cos / sin in fp32 then cast to ``t``'s dtype,
    ``t * cos + rotate_half(t) * sin``."""
    cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    t1, t2 = t.chunk(2, dim=-1)
    return t * cos + torch.cat((-t2, t1), dim=-1) * sin


class TorchLlamaBlock(torch.nn.Module):
    """One Llama block in plain torch, TE's ``te.TransformerLayer`` math (pre-norm RMSNorm,
    GQA causal SDPA with ``enable_gqa=True``, SwiGLU ``silu(w1 x) * w3 x`` then ``w2``, residuals,
    no bias), torchtitan's module names (``wq wk wv wo w1 w2 w3``, ``attention_norm``,
    ``ffn_norm``). ``forward(x, rope=None)``: bf16 ``[seq, batch, hidden]`` -> the same shape."""

    def __init__(self, shape: Shape, device: Any = "cuda", dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        kw = dict(bias=False, device=device, dtype=dtype)
        h, d = shape.hidden, shape.head_dim
        self.shape = shape
        self.attention_norm = torch.nn.RMSNorm(h, eps=EPS, device=device, dtype=dtype)
        self.wq = torch.nn.Linear(h, shape.heads * d, **kw)
        self.wk = torch.nn.Linear(h, shape.groups * d, **kw)
        self.wv = torch.nn.Linear(h, shape.groups * d, **kw)
        self.wo = torch.nn.Linear(shape.heads * d, h, **kw)
        self.ffn_norm = torch.nn.RMSNorm(h, eps=EPS, device=device, dtype=dtype)
        self.w1 = torch.nn.Linear(h, shape.ffn, **kw)
        self.w3 = torch.nn.Linear(h, shape.ffn, **kw)
        self.w2 = torch.nn.Linear(shape.ffn, h, **kw)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
        s, b, _ = x.shape
        heads, groups, d = self.shape.heads, self.shape.groups, self.shape.head_dim
        n = self.attention_norm(x)
        q, k, v = self.wq(n).view(s, b, heads, d), self.wk(n).view(s, b, groups, d), self.wv(n).view(s, b, groups, d)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(o.permute(2, 0, 1, 3).reshape(s, b, heads * d))
        n = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(n)) * self.w3(n))


class TorchStack(torch.nn.Module):
    """``layers`` × :class:`TorchLlamaBlock` in sequence (``rope`` as in :class:`TEStack`)."""

    def __init__(self, shape: Shape, layers: int, rope: torch.Tensor | None = None, device: Any = "cuda"):
        super().__init__()
        self.layers = torch.nn.ModuleList(TorchLlamaBlock(shape, device) for _ in range(layers))
        self.register_buffer("rope", rope, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, self.rope)
        return x


#: torch block parameter -> (TE TransformerLayer parameter, which half of it: 0 / 1, None = all).
#: TE's ``fc1_weight`` is ``[2 * ffn, hidden]``, SiLU on its first half (TE's gated activations
#: gate the first half: ops/basic/swiglu.py); q / k / v are separate parameters
#: (``fuse_qkv_params=False``), the query rows head by head.
TE_NAMES: dict[str, tuple[str, int | None]] = {
    "attention_norm.weight": ("self_attention.layernorm_qkv.layer_norm_weight", None),
    "wq.weight": ("self_attention.layernorm_qkv.query_weight", None),
    "wk.weight": ("self_attention.layernorm_qkv.key_weight", None),
    "wv.weight": ("self_attention.layernorm_qkv.value_weight", None),
    "wo.weight": ("self_attention.proj.weight", None),
    "ffn_norm.weight": ("layernorm_mlp.layer_norm_weight", None),
    "w1.weight": ("layernorm_mlp.fc1_weight", 0),
    "w3.weight": ("layernorm_mlp.fc1_weight", 1),
    "w2.weight": ("layernorm_mlp.fc2_weight", None),
}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def te_names(torch_model: torch.nn.Module) -> dict[str, tuple[str, int | None]]:
    """Every parameter name of a :class:`TorchStack` -> ``(TEStack parameter name, half)``.

    Raises:
        ValueError: a parameter has no TE counterpart in :data:`TE_NAMES`.
    """
    out = {}
    for name, _ in torch_model.named_parameters():
        m = _LAYER.match(name)
        if m is None or m.group(2) not in TE_NAMES:
            raise ValueError(f"torch parameter {name!r} has no TE counterpart (TE_NAMES)")
        te_name, half = TE_NAMES[m.group(2)]
        out[name] = (f"layers.{m.group(1)}.{te_name}", half)
    return out


def te_value(tensors: dict[str, torch.Tensor], te_name: str, half: int | None) -> torch.Tensor:
    """``tensors[te_name]`` or its first / second half along dim 0 (``half`` 0 / 1)."""
    t = tensors[te_name]
    return t if half is None else t.chunk(2, dim=0)[half]


def load_from_te(torch_model: torch.nn.Module, te_model: torch.nn.Module) -> None:
    """Copy a :class:`TEStack`'s parameters into a :class:`TorchStack` of the same shape, in place.

    Raises:
        ValueError: a parameter has no counterpart, or the shapes differ.
    """
    te_params = dict(te_model.named_parameters())
    with torch.no_grad():
        for name, p in torch_model.named_parameters():
            te_name, half = te_names(torch_model)[name]
            if te_name not in te_params:
                raise ValueError(f"{name!r}: TE model has no parameter {te_name!r}")
            src = te_value(te_params, te_name, half)
            if src.shape != p.shape:
                raise ValueError(f"{name!r} {tuple(p.shape)} vs TE {te_name!r} (half {half}) {tuple(src.shape)}")
            p.copy_(src)


def reference_for_torch(ref: dict[str, torch.Tensor], torch_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """TE eager's outputs by name (``y``, ``x``, TE parameter gradients) renamed to the torch
    model's parameter names (``fc1_weight``'s gradient split into ``w1`` / ``w3``)."""
    out = {k: ref[k] for k in ("y", "x") if k in ref}
    for name, (te_name, half) in te_names(torch_model).items():
        if te_name in ref:
            out[name] = te_value(ref, te_name, half)
    return out


#: competitor variant -> torchao float8 recipe name (``Float8LinearConfig.from_recipe_name``), None: bf16.
TORCHAO_RECIPES: dict[str, str | None] = {"torch-inductor": None, "torch-eager": None,
                                          "torchao-tw-inductor": "tensorwise", "torchao-rw-inductor": "rowwise"}


def torchao_skip_reason() -> str | None:
    """Why torchao's float8 training cannot be used here (not importable), or ``None``. Its C++
    extensions are not loaded (``TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1``: float8 training is Python +
    ``torch._scaled_mm``, and 0.18.0's extensions were built for an older torch)."""
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    try:
        import torchao.float8  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError or torchao's own import errors
        return (f"torchao not importable ({type(exc).__name__}: {exc}); install the bench extra "
                f"(pip install 'te_passes[bench]') or put torchao on PYTHONPATH")[:300]
    return None


def to_float8(torch_model: torch.nn.Module, recipe: str) -> int:
    """``torchao.float8.convert_to_float8_training`` on every ``nn.Linear`` of ``torch_model`` with
    ``Float8LinearConfig.from_recipe_name(recipe)`` (``"tensorwise"`` / ``"rowwise"``), in place;
    returns how many linears became ``Float8Linear``.

    Raises:
        RuntimeError: torchao is not importable (:func:`torchao_skip_reason`).
    """
    why = torchao_skip_reason()
    if why is not None:
        raise RuntimeError(why)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(torch_model, config=Float8LinearConfig.from_recipe_name(recipe))
    return sum(type(m).__name__ == "Float8Linear" for m in torch_model.modules())
