"""A hidden ``te.Linear`` running on another TE module's ``Parameter`` objects: the GEMM of the
untouched-model polyfills (:mod:`te_passes.compat.untouched.polyfills`) and of ``compile_friendly``
(one implementation). Mirrors TE ``module/linear.py`` (``te.Linear``'s weight / bias splits).
Docs: docs/untouched.md."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)  # one class per process (built on first use: TE imported)
def _split_cat_linear_cls():
    import transformer_engine.pytorch as te

    from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    from transformer_engine.pytorch.quantized_tensor import QuantizedTensor

    class _SharedLinear(te.Linear):
        """A ``te.Linear`` running on parameters owned by another module; under DelayedScaling on
        the owner's quantizers too (:func:`owner_delayed_slots`)."""

        def init_fp8_metadata(self, num_gemms: int = 1) -> None:
            if owner_delayed_slots(self, FP8GlobalStateManager) is None:
                return super().init_fp8_metadata(num_gemms)
            # the owner's DelayedScaling state is the one TE updates: none of our own (TE's
            # init_fp8_metadata with the allocation and the global-buffer registration left out)
            self.fast_setattr("fp8_parameters", FP8GlobalStateManager.with_fp8_parameters())
            self.fast_setattr("fp8", True)
            self.fast_setattr("fp8_calibration", False)
            meta, recipe, key = self.fp8_meta, FP8GlobalStateManager.get_fp8_recipe(), FP8GlobalStateManager.get_buffer_info()
            if meta.get("recipe") is not recipe:  # read by prepare_forward / end_forward
                meta["recipe"] = recipe
            if key not in meta:  # "registered": TE's add_fp8_tensors_to_global_buffer then returns
                meta[key] = []
            return None

        def _get_quantizers(self, fp8_output, fp8_grad, is_grad_enabled):
            slots = owner_delayed_slots(self, FP8GlobalStateManager)
            if slots is None:
                return super()._get_quantizers(fp8_output, fp8_grad, is_grad_enabled)
            owner, fwd, bwd = slots
            # te.Linear._get_quantizers (module/linear.py) on the owner's slots
            qin = owner.quantizers["scaling_fwd"][fwd]
            qin.internal, qin.optimize_for_gemm = True, True
            (qw,) = self._get_weight_quantizers()
            qout = owner.quantizers["scaling_fwd"][fwd + 2] if fp8_output else None
            qgo = qgi = None
            if is_grad_enabled:
                qgo = owner.quantizers["scaling_bwd"][bwd]
                qgo.internal, qgo.optimize_for_gemm = True, True
                qgi = owner.quantizers["scaling_bwd"][bwd + 1] if fp8_grad else None
            return qin, qw, qout, qgi, None, qgo

        def _get_weight_quantizers(self):
            slots = owner_delayed_slots(self, FP8GlobalStateManager)
            if slots is None:
                return super()._get_weight_quantizers()
            owner, fwd, _ = slots
            qw = owner.quantizers["scaling_fwd"][fwd + 1]
            qw.internal = True
            return [qw]

        def _get_weight_tensors(self):
            # te.Linear._get_weight_tensors (module/linear.py) on the owner's *current* Parameters:
            # a swap on the owner (functional_call, load_state_dict(assign=True), attribute
            # assignment, FSDP2) reaches the GEMM; Dynamo guards / lifts the owner's attribute
            weights = owner_tensors(self, self.weight_names)
            if any(isinstance(w, QuantizedTensor) for w in weights):
                if not self.fp8:
                    return [w.dequantize() for w in weights]
                if len(weights) != 1:
                    raise RuntimeError("Splitting QuantizedTensor into multiple params is not supported")
            return weights

        def _get_weight_and_bias_tensors(self):
            weights = self._get_weight_tensors()
            weight = weights[0] if len(weights) == 1 else torch.cat(weights, dim=0)
            bias = None
            if self.use_bias:
                biases = owner_tensors(self, self.bias_names)
                bias = biases[0] if len(biases) == 1 else torch.cat(biases, dim=0)
            return weight, bias

    return _SharedLinear


#: Hidden-``te.Linear`` attribute: ``(owner, forward slot, backward slot)`` of its GEMM in the
#: owner's fp8 meta (``te.LayerNormMLP``'s fc2: forward slots 3-5, backward 2-3; TE's
#: ``FP8FwdTensorIdx`` / ``FP8BwdTensorIdx``).
OWNER_ATTR = "_te_passes_fp8_owner"


def owner_delayed_slots(lin: torch.nn.Module, manager) -> tuple[torch.nn.Module, int, int] | None:
    """``(owner, forward slot, backward slot)`` when hidden ``te.Linear`` ``lin`` runs on its owner's
    DelayedScaling quantizers: fp8 on with a DelayedScaling recipe (``manager``: TE's
    ``FP8GlobalStateManager``) and the owner's state made and registered in TE's global amax buffers
    (``te_passes.prepare_delayed_scaling``); else ``None`` (TE's own path: state of its own).
    Eager LayerNormLinear / LayerNormMLP update exactly that state, so checkpoints and TE's scale
    update see one state per module."""
    link = lin.__dict__.get(OWNER_ATTR)
    if link is None or not manager.is_fp8_enabled():
        return None
    recipe = manager.get_fp8_recipe()
    if recipe is None or not recipe.delayed():
        return None
    owner = link[0]
    meta = owner.fp8_meta
    state = meta.get("scaling_fwd")
    if (type(state).__name__ != "DelayedScalingRecipeState" or manager.get_buffer_info() not in meta
            or "scaling_fwd" not in owner.quantizers):
        return None
    return link


def owner_tensors(lin: torch.nn.Module, names: list[str]) -> list:
    """The tensors ``names`` of hidden ``te.Linear`` ``lin``'s owner as the owner holds them *now*
    (``Parameter``\\ s, or TE's empty placeholder tensor for "no bias"): the hidden module keeps no
    reference of its own, so a parameter swapped on the owner is what the GEMM reads."""
    owner = lin.__dict__[OWNER_ATTR][0]
    return [getattr(owner, n) for n in names]


def shared_linear(owner: torch.nn.Module, *, in_features: int, out_features: int,
                   weight_names: list[str], bias_names: list[str], split_sizes: list[int],
                   use_bias: bool, return_bias: bool, parallel_mode: str | None, name: str | None,
                   dtype: torch.dtype, slots: tuple[int, int] = (0, 0)) -> torch.nn.Module:
    """A hidden ``te.Linear`` (built on ``meta``, no allocation) whose GEMM reads ``owner``'s
    weights / biases ``weight_names`` / ``bias_names`` at every call (:func:`owner_tensors`: it
    registers no ``Parameter`` of its own, so a swapped owner parameter is never ignored) and, under
    DelayedScaling, whose quantizers are ``owner``'s at ``slots`` (forward, backward:
    :func:`owner_delayed_slots`)."""
    lin = _split_cat_linear_cls()(in_features, out_features, bias=use_bias, return_bias=return_bias,
                                  params_dtype=dtype, parallel_mode=parallel_mode, device="meta", name=name)
    for n in ("weight", "bias", *weight_names, *bias_names):
        lin._parameters.pop(n, None)
        lin.__dict__.pop(n, None)
    lin.weight_names, lin.bias_names, lin.parameter_split_sizes = list(weight_names), list(bias_names), list(split_sizes)
    lin.train(owner.training)
    lin.__dict__[OWNER_ATTR] = (owner, *slots)
    # Built on meta, te.Linear skipped this: the process-global cuBLAS workspace must exist before
    # the first GEMM (which may run inside a cudagraph pool under reduce-overhead). TE's method reads
    # the weight by name: lent for the call. A no-op for fake or non-cuda parameters.
    lin._parameters[weight_names[0]] = getattr(owner, weight_names[0])
    try:
        lin._prealloc_cublas_workspace()
    finally:
        del lin._parameters[weight_names[0]]
    return lin


def layernorm_linear_gemm(mod: torch.nn.Module) -> torch.nn.Module:
    """The hidden ``te.Linear`` of ``te.LayerNormLinear`` ``mod`` (its weight splits, bias,
    ``return_bias``, ``parallel_mode``, name and dtype; ``module/layernorm_linear.py``)."""
    return shared_linear(mod, in_features=mod.in_features, out_features=mod.out_features,
                         weight_names=mod.weight_names, bias_names=mod.bias_names,
                         split_sizes=mod.parameter_split_sizes, use_bias=mod.use_bias,
                         return_bias=mod.return_bias, parallel_mode=mod.parallel_mode, name=mod.name,
                         dtype=getattr(mod, mod.weight_names[0]).dtype)


def layernorm_mlp_gemms(mod: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The hidden fc1 / fc2 ``te.Linear``\\ s of ``te.LayerNormMLP`` ``mod``
    (``module/layernorm_mlp.py``: fc1 [hidden -> fc1_out], fc2 [ffn -> hidden], fc2 returns the bias
    with ``return_bias``)."""
    hidden = mod.layer_norm_weight.shape[0]
    fc1_out, ffn = mod.fc1_weight.shape[0], mod.fc2_weight.shape[1]
    dtype = mod.fc1_weight.dtype
    name = mod.name
    fc1 = shared_linear(mod, in_features=hidden, out_features=fc1_out, weight_names=["fc1_weight"],
                        bias_names=["fc1_bias"], split_sizes=[fc1_out], use_bias=mod.use_bias,
                        return_bias=False, parallel_mode=None, name=name and name + ".fc1", dtype=dtype)
    fc2 = shared_linear(mod, in_features=ffn, out_features=hidden, weight_names=["fc2_weight"],
                        bias_names=["fc2_bias"], split_sizes=[hidden], use_bias=mod.use_bias,
                        return_bias=mod.return_bias, parallel_mode=None, name=name and name + ".fc2",
                        dtype=dtype, slots=(3, 2))
    return fc1, fc2
