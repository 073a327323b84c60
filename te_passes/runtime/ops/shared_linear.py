"""A hidden ``te.Linear`` running on another TE module's ``Parameter`` objects: the GEMM of the
untouched-model polyfills (:mod:`te_passes.runtime.untouched.polyfills`) and of ``compile_friendly``
(one implementation). Mirrors TE ``module/linear.py`` (``te.Linear``'s weight / bias splits).
Docs: docs/untouched.md."""

from __future__ import annotations

import torch


def _split_cat_linear_cls():
    import transformer_engine.pytorch as te

    class _SharedLinear(te.Linear):
        """A ``te.Linear`` running on parameters owned by another module."""

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


def shared_linear(owner: torch.nn.Module, *, in_features: int, out_features: int,
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
                        dtype=dtype)
    return fc1, fc2
