"""``compile_friendly(model)``: make TE modules that TE 2.20.2 runs eagerly traceable as one graph.

In TE 2.20.2 ``LayerNormLinear.forward`` and ``LayerNormMLP.forward`` are
``torch.compiler.disable``\\ d (``@no_torch_dynamo()``), and ``DotProductAttention`` reaches
``FusedAttention.forward``, which is disabled too: a ``te.TransformerLayer`` under
``torch.compile`` is cut into compiled segments between eager islands. This opt-in rewrite
changes, in place and module by module:

* ``te.LayerNormLinear`` -> the normalisation (LayerNorm / RMSNorm, ``zero_centered_gamma``,
  ``eps``) in traceable torch ops, then a ``te.Linear`` (TE's compiled op path,
  ``transformer_engine_compile::linear``);
* ``te.LayerNormMLP`` -> normalisation + ``te.Linear`` (fc1) + the activation in torch ops +
  ``te.Linear`` (fc2);
* ``DotProductAttention`` (``attention="sdpa"``) -> ``torch.nn.functional.scaled_dot_product_attention``
  with TE's scale, mask and layout for the configurations listed in :func:`attention_problem`;
* ``te.MultiheadAttention`` -> the same forward, entered with TE's default recipe (FP8 off) when
  no ``te.autocast`` is active (TE would build that recipe inside the compiled region: a break).

How: the module object stays (same parameters, buffers, hooks, ``state_dict`` keys and
``_extra_state``); its class is swapped for a subclass of its TE class whose ``forward`` is
traceable (:class:`CompileFriendlyLayerNormLinear`, ...). The GEMMs run in hidden ``te.Linear``
modules (kept out of ``_modules``, so they add no ``state_dict`` keys) whose parameters are the
original ``Parameter`` objects. :func:`restore` swaps the classes back.

Every configuration that cannot be expressed exactly is refused for that module, which is left
as it was; the reasons are returned as :class:`RewriteRecord`\\ s (also on
``model.te_passes_rewrites``) and ``strict=True`` raises :class:`CompileFriendlyError` before
changing anything. Mirrors TE 2.20.2 ``module/layernorm_linear.py``, ``module/layernorm_mlp.py``,
``module/linear.py``, ``attention/dot_product_attention/dot_product_attention.py``,
``attention/multi_head_attention.py`` and the activation kernels of
``transformer_engine/common/util/math.h``.

This is a *model* rewrite: a ``torch.compile`` backend only sees FX graphs traced after the
eager islands were already cut, so it must be applied to the model before ``torch.compile``
(the ``te_passes.compile_friendly`` option is refused for that reason).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F

from te_passes.te.version import is_supported, te_version

ATTENTION_CHOICES: tuple[str, ...] = ("sdpa", "te_fused", "keep")

#: Module attribute holding the rewrite's hidden state (hidden ``te.Linear``\ s, the original class).
_STATE_ATTR = "_te_passes_compile_friendly"
#: Model attribute holding the records of the last :func:`compile_friendly` call.
RECORDS_ATTR = "te_passes_rewrites"


class CompileFriendlyError(ValueError):
    """``compile_friendly(strict=True)`` refused at least one module, or a rewritten module was
    called with arguments the rewrite cannot express (the message names module and reason)."""


@dataclasses.dataclass(frozen=True)
class RewriteRecord:
    """What :func:`compile_friendly` did with one module.

    ``module`` — qualified name in the model (``""`` for the root); ``kind`` — the TE class
    (``"LayerNormLinear"``, ``"LayerNormMLP"``, ``"DotProductAttention"``); ``action`` —
    ``"rewritten"``, ``"refused"`` or ``"kept"`` (``attention="keep"``); ``reason`` — why it was
    refused or kept (``None`` when rewritten); ``detail`` — what it became.
    """

    module: str
    kind: str
    action: str
    reason: str | None = None
    detail: str = ""

    def __str__(self) -> str:
        name = self.module or "<root>"
        tail = f": {self.reason}" if self.reason else (f" -> {self.detail}" if self.detail else "")
        return f"{name} ({self.kind}) {self.action}{tail}"


# --------------------------------------------------------------------------- math
def normalize(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
              normalization: str, zero_centered_gamma: bool) -> torch.Tensor:
    """TE's LayerNorm / RMSNorm over the last dim, in fp32, output in ``x.dtype``.

    ``x``: [..., hidden] (bf16/fp16/fp32); ``weight`` (gamma) / ``bias`` (beta): [hidden].
    ``zero_centered_gamma`` uses ``1 + gamma`` (TE 2.20.2 ``module/layernorm_linear.py``; the
    kernels compute in fp32 and write the activation dtype). Raises ``ValueError`` for another
    ``normalization``.
    """
    shape = (x.shape[-1],)
    w = weight.float()
    if zero_centered_gamma:
        w = w + 1.0
    if normalization == "LayerNorm":
        y = F.layer_norm(x.float(), shape, w, None if bias is None else bias.float(), eps)
    elif normalization == "RMSNorm":
        y = F.rms_norm(x.float(), shape, w, eps)
    else:
        raise ValueError(f"normalization {normalization!r} is neither 'LayerNorm' nor 'RMSNorm'")
    return y.to(x.dtype)


def _gated(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor, dict], torch.Tensor]:
    # TE's gated kernels (gated_act_fn): act(first half) * second half of the last dim.
    def f(x: torch.Tensor, params: dict) -> torch.Tensor:
        a, b = x.chunk(2, dim=-1)
        return act(a) * b
    return f


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")  # TE's gelu is the tanh approximation (math.h)


def _qgelu(x: torch.Tensor, alpha: float = 1.702) -> torch.Tensor:
    return x * torch.sigmoid(alpha * x)  # "quick GELU" (math.h qgelu_with_alpha)


def _srelu(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


def _clamped_swiglu(x: torch.Tensor, params: dict) -> torch.Tensor:
    # math.h ClampedSwiGLUParam / clamped_silu: the activated half is clamped from above and goes
    # through qgelu with ``alpha``; the linear half is clamped to [-limit, limit] plus the offset.
    limit = float(params.get("limit", 7.0))
    alpha = float(params.get("alpha", 1.702))
    offset = float(params.get("glu_linear_offset", 1.0))
    a, b = x.chunk(2, dim=-1)
    return _qgelu(a.clamp(max=limit), alpha) * (b.clamp(-limit, limit) + offset)


#: TE 2.20.2 ``LayerNormMLP`` activations (``_get_act_func_supported_list``) -> ``f(x_fp32, params)``.
ACTIVATIONS: dict[str, Callable[[torch.Tensor, dict], torch.Tensor]] = {
    "gelu": lambda x, p: _gelu_tanh(x),
    "geglu": _gated(_gelu_tanh),
    "glu": _gated(torch.sigmoid),
    "qgelu": lambda x, p: _qgelu(x),
    "qgeglu": _gated(_qgelu),
    "relu": lambda x, p: F.relu(x),
    "reglu": _gated(F.relu),
    "srelu": lambda x, p: _srelu(x),
    "sreglu": _gated(_srelu),
    "silu": lambda x, p: F.silu(x),
    "swiglu": _gated(F.silu),
    "clamped_swiglu": _clamped_swiglu,
}


def activation(x: torch.Tensor, name: str, params: dict | None = None) -> torch.Tensor:
    """TE's ``LayerNormMLP`` activation ``name`` of ``x`` ([..., n] or, gated, [..., 2n] ->
    [..., n]), computed in fp32 like TE's kernels, returned in ``x.dtype``. ``params``:
    ``activation_params`` (``clamped_swiglu``: ``limit``, ``alpha``, ``glu_linear_offset``).
    Raises ``KeyError`` for an activation outside :data:`ACTIVATIONS`."""
    return ACTIVATIONS[name](x.float(), params or {}).to(x.dtype)


# --------------------------------------------------------------------------- refusals
def _te():
    import transformer_engine.pytorch as te

    return te


def _common_problem(mod: Any) -> str | None:
    """Configurations no rewritten TE module supports (shared by LayerNormLinear / LayerNormMLP)."""
    from transformer_engine.pytorch.cpu_offload import is_cpu_offload_enabled

    if getattr(mod, "tp_size", 1) != 1:
        return (f"tensor parallel (tp_size={mod.tp_size}): the norm/GEMM split with sequence-parallel "
                "gathers is not verified")
    if getattr(mod, "fuse_wgrad_accumulation", False):
        return "fuse_wgrad_accumulation (main_grad): te.Linear runs it eagerly under torch.compile"
    store = getattr(mod, "wgrad_store", None)
    if store is not None and store.delay_wgrad_compute():
        return "delay_wgrad_compute: te.Linear runs it eagerly under torch.compile"
    ub = [k for k in ("ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad",
                      "ub_bulk_wgrad", "ub_overlap_ag_fprop", "ub_overlap_rs_fprop", "ub_overlap_ag_dgrad")
          if getattr(mod, k, False)]
    if ub:
        return f"Userbuffers overlap ({', '.join(ub)}): the norm would leave TE's UB-fused GEMM"
    if getattr(mod, "return_layernorm_output", False):
        return "return_layernorm_output: not expressed (TE returns its internal norm output)"
    if getattr(mod, "symmetric_ar_type", None) is not None:
        return f"symmetric_ar_type={mod.symmetric_ar_type!r}"
    if getattr(mod, "primary_weights_in_fp8", False):
        return "quantized primary weights (fp8_model_init)"
    if getattr(mod, "fsdp_group", None) is not None:
        return "manual TE FSDP (fsdp_group)"
    if getattr(mod, "normalization", None) not in ("LayerNorm", "RMSNorm"):
        return f"normalization {getattr(mod, 'normalization', None)!r}"
    if is_cpu_offload_enabled():
        return "CPU activation offloading is enabled"
    from transformer_engine.pytorch.quantized_tensor import QuantizedTensor

    for pname, p in mod.named_parameters(recurse=False):
        if isinstance(p, QuantizedTensor) or type(p).__name__ in ("DTensor", "DistributedWeight"):
            return f"parameter {pname} is a {type(p).__name__} (quantized or distributed weight)"
    return None


def layernorm_linear_problem(mod: Any) -> str | None:
    """Why ``te.LayerNormLinear`` ``mod`` cannot be rewritten exactly, or ``None``."""
    te = _te()
    if _STATE_ATTR in mod.__dict__:
        return "already rewritten"
    if type(mod) is not te.LayerNormLinear:
        return f"{type(mod).__qualname__} is a subclass of te.LayerNormLinear (its forward may differ)"
    p = _common_problem(mod)
    if p:
        return p
    if getattr(mod, "return_layernorm_output_gathered", False):
        return "return_layernorm_output_gathered"
    if mod.parallel_mode not in (None, "column"):
        return f"parallel_mode={mod.parallel_mode!r}"
    return None


def layernorm_mlp_problem(mod: Any) -> str | None:
    """Why ``te.LayerNormMLP`` ``mod`` cannot be rewritten exactly, or ``None``."""
    te = _te()
    from transformer_engine.pytorch.module.layernorm_mlp import _get_act_func_supported_list

    if _STATE_ATTR in mod.__dict__:
        return "already rewritten"
    if type(mod) is not te.LayerNormMLP:
        return f"{type(mod).__qualname__} is a subclass of te.LayerNormMLP (its forward may differ)"
    p = _common_problem(mod)
    if p:
        return p
    te_acts = set(_get_act_func_supported_list(None))
    if mod.activation not in te_acts:
        return f"activation {mod.activation!r} is not one of TE's {sorted(te_acts)}"
    if mod.activation not in ACTIVATIONS:
        return f"activation {mod.activation!r} has no torch expression here"
    if getattr(mod, "checkpoint", False):
        return "checkpoint=True (TE's own activation recompute)"
    if getattr(mod, "gemm_gelu_fusion", False):
        return "NVTE_GEMM_GELU_FUSION (GEMM+GELU fused with UB overlap)"
    if mod.activation_params and mod.activation != "clamped_swiglu":
        return f"activation_params {mod.activation_params!r} for {mod.activation!r}"
    return None


#: Mask types the SDPA path expresses; ``causal_bottom_right`` only when s_q == s_kv (checked per call).
SDPA_MASK_TYPES: frozenset[str] = frozenset({"no_mask", "causal", "causal_bottom_right"})


def attention_problem(mod: Any) -> str | None:
    """Why ``DotProductAttention`` ``mod`` cannot go through SDPA exactly, or ``None``.

    Supported (TE 2.20.2 ``DotProductAttention``): ``qkv_format`` ``sbhd`` / ``bshd``; mask
    ``no_mask`` / ``causal`` (top-left) / ``causal_bottom_right`` with s_q == s_kv; the window
    TE derives for those masks; GQA/MQA (``num_gqa_groups`` dividing the heads); equal K and V
    head dims; ``softmax_type="vanilla"``; no softcap; no dropout; no context parallelism; no
    max-logit output. FP8 attention (``fp8_dpa`` / ``fp8_mha``) is refused per call.
    """
    from transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention import (
        DotProductAttention,
    )

    if _STATE_ATTR in mod.__dict__:
        return "already rewritten"
    if type(mod) is not DotProductAttention:
        return f"{type(mod).__qualname__} is a subclass of DotProductAttention (its forward may differ)"
    if mod.qkv_format not in ("sbhd", "bshd"):
        return f"qkv_format={mod.qkv_format!r} (SDPA path: sbhd, bshd)"
    if mod.attn_mask_type not in SDPA_MASK_TYPES:
        return f"attn_mask_type={mod.attn_mask_type!r} (SDPA path: {sorted(SDPA_MASK_TYPES)})"
    if tuple(mod.window_size or (-1, -1)) not in ((-1, -1), (-1, 0)):
        return f"sliding window {mod.window_size}"
    if mod.attention_dropout:
        return (f"attention_dropout={mod.attention_dropout}: SDPA's dropout draws a different random "
                "stream than TE's attention backends")
    if mod.softmax_type != "vanilla":
        return f"softmax_type={mod.softmax_type!r}"
    if mod.softcap:
        return f"softcap={mod.softcap}"
    if mod.cp_group is not None:
        return "context parallelism (cp_group)"
    if getattr(mod, "return_max_logit", False):
        return "return_max_logit"
    if mod.hidden_size_per_attention_head_k != mod.hidden_size_per_attention_head_v:
        return "different K and V head dims"
    if mod.tp_size != 1:
        return f"tensor parallel (tp_size={mod.tp_size})"
    return None


def multihead_attention_problem(mod: Any) -> str | None:
    """Why ``te.MultiheadAttention`` ``mod`` is not wrapped (see ``CompileFriendlyMultiheadAttention``)."""
    te = _te()
    if _STATE_ATTR in mod.__dict__:
        return "already rewritten"
    if type(mod) is not te.MultiheadAttention:
        return f"{type(mod).__qualname__} is a subclass of te.MultiheadAttention (its forward may differ)"
    return None


def _rewrite_multihead_attention(mod: Any) -> str:
    from transformer_engine.pytorch.quantization import get_default_fp8_recipe

    recipe = get_default_fp8_recipe()  # eagerly, what TE would build inside the compiled region
    str(recipe)  # TE caches the repr on first use (a guard): cache it now
    mod.__dict__[_STATE_ATTR] = _State(type(mod), recipe=recipe)
    mod.__class__ = _classes()["MultiheadAttention"]
    note = multihead_attention_note(mod)
    return f"TE's default recipe ({type(recipe).__name__}, FP8 off) when no te.autocast is active" + \
        (f"; note: {note}" if note else "")


def multihead_attention_note(mod: Any) -> str | None:
    """What in TE's own ``MultiheadAttention.forward`` (not rewritten) still breaks the graph.

    TE 2.20.2 ``attention/multi_head_attention.py``: with GQA/MQA (``num_gqa_groups`` <
    heads), or whenever the packed q/k/v pass-through is not eligible (RoPE, QK norm, KV
    cache, CPU offload), q/k/v are split with ``SplitAlongDim``, an autograd.Function whose
    backward reads ``untyped_storage().data_ptr()``: Dynamo cannot trace it (one graph break).
    Returns that reason for self-attention with GQA, else ``None`` (the other conditions are
    call-time arguments).
    """
    if getattr(mod, "attention_type", "self") == "self" and \
            mod.num_attention_heads_per_partition != mod.num_gqa_groups_per_partition:
        return ("with GQA (num_gqa_groups < heads) TE's q/k/v split uses SplitAlongDim, whose "
                "backward reads data_ptr: one graph break per layer")
    return None


# --------------------------------------------------------------------------- hidden te.Linear
def _split_cat_linear_cls():
    te = _te()

    class _SharedLinear(te.Linear):
        """A ``te.Linear`` running on parameters owned by another module.

        With several weight splits (``parameters_split``, e.g. the q/k/v of
        ``MultiheadAttention.layernorm_qkv``) TE's ``noop_cat`` compares ``data_ptr``\\ s, which
        Dynamo cannot trace; the splits are joined with ``torch.cat`` instead (a copy of the
        weight per call; same values).
        """

        def _get_weight_and_bias_tensors(self):
            weights = self._get_weight_tensors()
            weight = weights[0] if len(weights) == 1 else torch.cat(weights, dim=0)
            bias = None
            if self.use_bias:
                biases = [getattr(self, n) for n in self.bias_names]
                bias = biases[0] if len(biases) == 1 else torch.cat(biases, dim=0)
            return weight, bias

    return _SharedLinear


_SHARED_LINEAR: list[type] = []


def _shared_linear(owner: torch.nn.Module, *, in_features: int, out_features: int,
                   weight_names: list[str], bias_names: list[str], split_sizes: list[int],
                   use_bias: bool, return_bias: bool, parallel_mode: str | None, name: str | None,
                   dtype: torch.dtype) -> torch.nn.Module:
    """A hidden ``te.Linear`` (built on ``meta``, no allocation) whose weights/biases are
    ``owner``'s ``Parameter`` objects ``weight_names`` / ``bias_names``."""
    if not _SHARED_LINEAR:
        _SHARED_LINEAR.append(_split_cat_linear_cls())
    lin = _SHARED_LINEAR[0](in_features, out_features, bias=use_bias, return_bias=return_bias,
                            params_dtype=dtype, parallel_mode=parallel_mode, device="meta", name=name)
    for n in ("weight", "bias"):
        lin._parameters.pop(n, None)
        lin.__dict__.pop(n, None)
    lin.weight_names, lin.bias_names, lin.parameter_split_sizes = list(weight_names), list(bias_names), list(split_sizes)
    for n in weight_names:
        torch.nn.Module.register_parameter(lin, n, getattr(owner, n))
    for n in bias_names:
        v = getattr(owner, n)
        if isinstance(v, torch.nn.Parameter):
            torch.nn.Module.register_parameter(lin, n, v)
        else:  # TE's placeholder for "no bias": an empty plain tensor attribute
            object.__setattr__(lin, n, v)
    lin.train(owner.training)
    # Built on meta, te.Linear skipped this: the process-global cuBLAS workspace must exist before
    # the first GEMM (which may run inside a cudagraph pool under reduce-overhead). A no-op for
    # fake or non-cuda parameters.
    lin._prealloc_cublas_workspace()
    return lin


@dataclasses.dataclass
class _State:
    original_cls: type
    linears: tuple[torch.nn.Module, ...] = ()
    recipe: Any = None  # MultiheadAttention: the recipe entered when no te.autocast is active


def _state(mod: torch.nn.Module) -> _State:
    return mod.__dict__[_STATE_ATTR]


class _HiddenTrainMixin:
    def train(self, mode: bool = True):  # noqa: D401 - nn.Module.train
        super().train(mode)
        for lin in _state(self).linears:
            lin.train(mode)
        return self


def _classes() -> dict[str, type]:
    """The compile-friendly subclasses, built once TE is importable."""
    if _CLASSES:
        return _CLASSES
    te = _te()
    from transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention import (
        DotProductAttention,
    )

    class CompileFriendlyLayerNormLinear(_HiddenTrainMixin, te.LayerNormLinear):
        """``te.LayerNormLinear`` as normalisation + ``te.Linear`` (traceable; see module doc).

        ``forward(inp [..., in_features], is_first_microbatch, fp8_output, fp8_grad)`` returns
        what ``te.LayerNormLinear.forward`` returns for the supported configurations: the output
        [..., out_features], or ``(output, bias)`` with ``return_bias``.
        """

        def forward(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False):
            _check_norm_call(self)
            ln_out = normalize(inp, self.layer_norm_weight, self.layer_norm_bias, self.eps,
                               self.normalization, self.zero_centered_gamma)
            (lin,) = _state(self).linears
            return lin(ln_out, is_first_microbatch=is_first_microbatch, fp8_output=fp8_output,
                       fp8_grad=fp8_grad)

    class CompileFriendlyLayerNormMLP(_HiddenTrainMixin, te.LayerNormMLP):
        """``te.LayerNormMLP`` as normalisation + ``te.Linear`` + activation + ``te.Linear``.

        ``forward(inp [..., hidden], is_first_microbatch)`` returns the output [..., hidden], or
        ``(output, fc2_bias)`` with ``return_bias`` (as ``te.LayerNormMLP``).
        """

        def forward(self, inp, is_first_microbatch=None):
            _check_norm_call(self)
            fc1, fc2 = _state(self).linears
            ln_out = normalize(inp, self.layer_norm_weight, self.layer_norm_bias, self.eps,
                               self.normalization, self.zero_centered_gamma)
            h = fc1(ln_out, is_first_microbatch=is_first_microbatch)
            h = activation(h, self.activation, self.activation_params)
            return fc2(h, is_first_microbatch=is_first_microbatch)

    class SdpaDotProductAttention(DotProductAttention):
        """``DotProductAttention`` through ``torch.nn.functional.scaled_dot_product_attention``.

        Takes ``DotProductAttention.forward``'s arguments (TE 2.20.2). q: [s_q, b, h, d]
        (``sbhd``) or [b, s_q, h, d] (``bshd``); k, v: [s_kv, b, g, d] with ``g`` dividing
        ``h`` (GQA), or packed ``qkv_layer`` / ``kv_layer`` with ``qkv_interleave_dim``
        (TE's ``_unpack_packed_qkv``). Returns [s_q, b, h * d] (``sbhd``) or [b, s_q, h * d]
        (``bshd``) in q's dtype. Scale ``self.softmax_scale``. Arguments outside
        :func:`attention_problem`'s list raise :class:`CompileFriendlyError` (decided at trace
        time from Python values: no graph break).
        """

        def forward(self, query_layer=None, key_layer=None, value_layer=None, attention_mask=None,
                    qkv_format=None, attn_mask_type=None, qkv_layer=None, kv_layer=None,
                    qkv_interleave_dim=-3, **kwargs):
            from transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention import (
                _unpack_packed_qkv,
            )

            qkv_format = qkv_format or self.qkv_format
            mask = attn_mask_type or self.attn_mask_type
            _check_sdpa_call(self, qkv_format, mask, attention_mask, kwargs)
            q, k, v, _ = _unpack_packed_qkv(qkv_layer, kv_layer, query_layer, key_layer, value_layer,
                                            qkv_format, qkv_interleave_dim, kwargs.get("inference_params"))
            # [s, b, h, d] / [b, s, h, d] -> [b, h, s, d]
            perm = (1, 2, 0, 3) if qkv_format == "sbhd" else (0, 2, 1, 3)
            qt, kt, vt = (t.permute(*perm) for t in (q, k, v))
            sq, skv = qt.shape[2], kt.shape[2]
            if mask == "causal_bottom_right" and sq != skv:
                raise CompileFriendlyError(f"attn_mask_type='causal_bottom_right' with s_q={sq} != "
                                           f"s_kv={skv}: the SDPA path only expresses top-left causal")
            out = F.scaled_dot_product_attention(
                qt, kt, vt, dropout_p=0.0, is_causal=mask != "no_mask", scale=self.softmax_scale,
                enable_gqa=qt.shape[1] != kt.shape[1])
            # [b, h, s, d] -> [s, b, h*d] / [b, s, h*d]
            out = out.permute(2, 0, 1, 3) if qkv_format == "sbhd" else out.permute(0, 2, 1, 3)
            return out.reshape(*out.shape[:2], -1)

    class CompileFriendlyMultiheadAttention(te.MultiheadAttention):
        """``te.MultiheadAttention`` that supplies TE's default recipe when no ``te.autocast`` is active.

        TE 2.20.2 ``MultiheadAttention.forward`` reads ``FP8GlobalStateManager.get_fp8_recipe()``
        even without FP8; with no recipe set that builds ``get_default_fp8_recipe()``, which
        asserts it is not compiling (a graph break in bf16). Here that call finds the recipe
        ``get_default_fp8_recipe()`` returned at rewrite time (outside compilation), entered with
        ``te.autocast(enabled=False, ...)``: what TE would read, without FP8 enabled.
        """

        def forward(self, *args, **kwargs):
            from transformer_engine.pytorch.quantization import FP8GlobalStateManager

            if FP8GlobalStateManager.quantization_state.fp8_recipe is None:
                with te.autocast(enabled=False, recipe=_state(self).recipe):
                    return super().forward(*args, **kwargs)
            return super().forward(*args, **kwargs)

    _CLASSES.update(LayerNormLinear=CompileFriendlyLayerNormLinear, LayerNormMLP=CompileFriendlyLayerNormMLP,
                    DotProductAttention=SdpaDotProductAttention,
                    MultiheadAttention=CompileFriendlyMultiheadAttention)
    return _CLASSES


_CLASSES: dict[str, type] = {}

#: ``DotProductAttention.forward`` keyword arguments and the values the SDPA path accepts
#: (TE 2.20.2 signature); a callable decides for the value given.
_NEUTRAL_KWARGS: dict[str, Callable[[Any], bool]] = {
    "cu_seqlens_q": lambda v: v is None, "cu_seqlens_kv": lambda v: v is None,
    "cu_seqlens_q_padded": lambda v: v is None, "cu_seqlens_kv_padded": lambda v: v is None,
    "max_seqlen_q": lambda v: v is None, "max_seqlen_kv": lambda v: v is None,
    "window_size": lambda v: v is None or tuple(v) in ((-1, -1), (-1, 0)),
    "bottom_right_diagonal": lambda v: True,  # only changes causal masks with s_q != s_kv (checked)
    "softcap": lambda v: not v,
    "checkpoint_core_attention": lambda v: not v,
    "core_attention_bias_type": lambda v: v in (None, "no_bias"),
    "core_attention_bias": lambda v: v is None, "alibi_slopes": lambda v: v is None,
    "fast_zero_fill": lambda v: True,
    "inference_params": lambda v: v is None,
    "pad_between_seqs": lambda v: not v,
    "fp8_output": lambda v: not v, "bf16_backward": lambda v: not v,
    "num_splits": lambda v: v in (None, 1),
    "score_mod": lambda v: v is None, "score_mod_bprop": lambda v: v is None,
    "score_mod_tensors": lambda v: v is None, "score_mod_bprop_tensors": lambda v: v is None,
    "thd_attention_policies": lambda v: v is None,
    "thd_attention_policy_dispatch": lambda v: True,
}


def _check_norm_call(mod: Any) -> None:
    """Per-call refusals of the rewritten LayerNormLinear / LayerNormMLP (trace-time Python)."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    qstate = FP8GlobalStateManager.quantization_state
    recipe = qstate.fp8_recipe
    if qstate.fp8_enabled and recipe is not None and recipe.delayed():
        raise CompileFriendlyError(
            f"rewritten {_state(mod).original_cls.__name__} {mod.name or ''}: DelayedScaling keeps amax "
            "history in the module's fp8 meta (its _extra_state); the rewrite's te.Linear would keep "
            "its own and checkpoints would not carry it. Use a stateless recipe "
            "(Float8CurrentScaling, MXFP8BlockScaling, ...) or restore() the model")
    if torch.is_autocast_enabled():
        raise CompileFriendlyError(
            f"rewritten {_state(mod).original_cls.__name__}: torch.autocast is enabled; TE casts the "
            "norm input to the autocast dtype inside its kernel, which the rewrite does not express")


def _check_sdpa_call(mod: Any, qkv_format: str, mask: str, attention_mask: Any, kwargs: dict) -> None:
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    where = f"rewritten DotProductAttention (layer_number={getattr(mod, 'layer_number', None)})"
    for k, v in kwargs.items():
        ok = _NEUTRAL_KWARGS.get(k)
        if ok is None:
            raise TypeError(f"{where}: unexpected keyword argument {k!r}")
        if not ok(v):
            raise CompileFriendlyError(f"{where}: {k}={v!r} is not expressed by the SDPA path; "
                                       "rewrite with attention='keep'")
    if qkv_format not in ("sbhd", "bshd"):
        raise CompileFriendlyError(f"{where}: qkv_format={qkv_format!r} (SDPA path: sbhd, bshd)")
    if mask not in SDPA_MASK_TYPES:
        raise CompileFriendlyError(f"{where}: attn_mask_type={mask!r} (SDPA path: {sorted(SDPA_MASK_TYPES)})")
    if attention_mask is not None:
        raise CompileFriendlyError(f"{where}: an attention_mask tensor with attn_mask_type={mask!r}")
    qstate = FP8GlobalStateManager.quantization_state
    recipe = qstate.fp8_recipe
    if qstate.fp8_enabled and recipe is not None and (getattr(recipe, "fp8_dpa", False)
                                                      or getattr(recipe, "fp8_mha", False)):
        raise CompileFriendlyError(f"{where}: FP8 attention (recipe fp8_dpa/fp8_mha) is not expressed")


# --------------------------------------------------------------------------- rewrite
def _rewrite_layernorm_linear(mod: Any) -> str:
    lin = _shared_linear(mod, in_features=mod.in_features, out_features=mod.out_features,
                         weight_names=mod.weight_names, bias_names=mod.bias_names,
                         split_sizes=mod.parameter_split_sizes, use_bias=mod.use_bias,
                         return_bias=mod.return_bias, parallel_mode=mod.parallel_mode, name=mod.name,
                         dtype=getattr(mod, mod.weight_names[0]).dtype)
    mod.__dict__[_STATE_ATTR] = _State(type(mod), (lin,))
    mod.__class__ = _classes()["LayerNormLinear"]
    return f"{mod.normalization} + te.Linear({mod.in_features}, {mod.out_features})"


def _rewrite_layernorm_mlp(mod: Any) -> str:
    hidden = mod.layer_norm_weight.shape[0]
    fc1_out, ffn = mod.fc1_weight.shape[0], mod.fc2_weight.shape[1]
    dtype = mod.fc1_weight.dtype
    name = mod.name
    fc1 = _shared_linear(mod, in_features=hidden, out_features=fc1_out, weight_names=["fc1_weight"],
                         bias_names=["fc1_bias"], split_sizes=[fc1_out], use_bias=mod.use_bias,
                         return_bias=False, parallel_mode=None, name=name and name + ".fc1", dtype=dtype)
    fc2 = _shared_linear(mod, in_features=ffn, out_features=hidden, weight_names=["fc2_weight"],
                         bias_names=["fc2_bias"], split_sizes=[hidden], use_bias=mod.use_bias,
                         return_bias=mod.return_bias, parallel_mode=None, name=name and name + ".fc2",
                         dtype=dtype)
    mod.__dict__[_STATE_ATTR] = _State(type(mod), (fc1, fc2))
    mod.__class__ = _classes()["LayerNormMLP"]
    return (f"{mod.normalization} + te.Linear({hidden}, {fc1_out}) + {mod.activation} + "
            f"te.Linear({ffn}, {hidden})")


def _rewrite_attention(mod: Any) -> str:
    mod.__dict__[_STATE_ATTR] = _State(type(mod))
    mod.__class__ = _classes()["DotProductAttention"]
    return f"scaled_dot_product_attention ({mod.attn_mask_type}, {mod.qkv_format}, scale {mod.softmax_scale:.4g})"


def _plan(model: torch.nn.Module, attention: str) -> list[tuple[str, Any, str, str | None, Callable | None]]:
    te = _te()
    from transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention import (
        DotProductAttention,
    )

    plan = []
    for name, mod in model.named_modules():
        if isinstance(mod, te.MultiheadAttention):
            plan.append((name, mod, "MultiheadAttention", multihead_attention_problem(mod),
                         _rewrite_multihead_attention))
        if isinstance(mod, te.LayerNormLinear):
            plan.append((name, mod, "LayerNormLinear", layernorm_linear_problem(mod), _rewrite_layernorm_linear))
        elif isinstance(mod, te.LayerNormMLP):
            plan.append((name, mod, "LayerNormMLP", layernorm_mlp_problem(mod), _rewrite_layernorm_mlp))
        elif isinstance(mod, DotProductAttention):
            if attention == "keep":
                plan.append((name, mod, "DotProductAttention", "attention='keep'", None))
            else:
                plan.append((name, mod, "DotProductAttention", attention_problem(mod), _rewrite_attention))
    return plan


def compile_friendly(model: torch.nn.Module, *, attention: str = "sdpa", strict: bool = False) -> torch.nn.Module:
    """Rewrite, in place, the TE modules of ``model`` that TE 2.20.2 runs eagerly under
    ``torch.compile`` into traceable equivalents (see the module docstring); returns ``model``.

    Args:
        model: any ``torch.nn.Module`` (``te.TransformerLayer``, a stack of them, ...); every
            ``te.LayerNormLinear``, ``te.LayerNormMLP`` and ``DotProductAttention`` inside it
            (the root included) is considered.
        attention: ``"sdpa"`` — core attention through torch's ``scaled_dot_product_attention``;
            ``"keep"`` — leave ``DotProductAttention`` as TE wrote it; ``"te_fused"`` — TE's
            fused attention as a custom op (not built yet: raises ``NotImplementedError``).
        strict: raise :class:`CompileFriendlyError` listing every refused module, before
            changing any, instead of leaving refused modules as they are.

    Returns:
        ``model``, with ``model.te_passes_rewrites`` = the list of :class:`RewriteRecord`
        (one per TE module considered, in ``named_modules`` order).

    Raises:
        ValueError: ``attention`` is not one of :data:`ATTENTION_CHOICES`.
        NotImplementedError: ``attention="te_fused"``.
        CompileFriendlyError: ``strict=True`` and a module was refused.
        ImportError: Transformer Engine is not importable.

    Parameters, buffers, ``state_dict`` keys and values and ``_extra_state`` are unchanged
    (the module objects stay; see :func:`restore`).
    """
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"attention must be one of {list(ATTENTION_CHOICES)}, got {attention!r}")
    if attention == "te_fused":
        raise NotImplementedError("attention='te_fused' (TE's fused attention as a register_custom_op op, "
                                  "issue 15 part 2) is not built in this te_passes; use 'sdpa' or 'keep'")
    if not is_supported():
        raise CompileFriendlyError(f"compile_friendly mirrors TE 2.20.x module internals; installed TE is "
                                   f"{te_version()}")
    plan = _plan(model, attention)
    refused = [f"{n or '<root>'} ({k}): {p}" for n, _, k, p, fn in plan if p is not None and fn is not None]
    if strict and refused:
        raise CompileFriendlyError("compile_friendly refused: " + "; ".join(refused))
    records = []
    for name, mod, kind, problem, fn in plan:
        if problem is not None:
            records.append(RewriteRecord(name, kind, "kept" if fn is None else "refused", problem))
            continue
        records.append(RewriteRecord(name, kind, "rewritten", None, fn(mod)))
    object.__setattr__(model, RECORDS_ATTR, records)
    return model


def restore(model: torch.nn.Module) -> list[str]:
    """Undo :func:`compile_friendly` on every module of ``model``; returns their names."""
    out = []
    for name, mod in model.named_modules():
        st = mod.__dict__.pop(_STATE_ATTR, None)
        if st is not None:
            mod.__class__ = st.original_cls
            out.append(name)
    return out


def rewrite_records(model: torch.nn.Module) -> list[RewriteRecord]:
    """The records of the last :func:`compile_friendly` call on ``model`` (``[]`` if none)."""
    return list(model.__dict__.get(RECORDS_ATTR, []))


def is_rewritten(mod: torch.nn.Module) -> bool:
    """Whether ``mod`` itself was rewritten by :func:`compile_friendly`."""
    return _STATE_ATTR in mod.__dict__


def describe(records: Iterable[RewriteRecord]) -> str:
    """One line per record."""
    return "\n".join(str(r) for r in records)
