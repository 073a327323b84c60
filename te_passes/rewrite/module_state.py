"""What a module rewritten by :func:`te_passes.rewrite.compile_friendly.compile_friendly`
carries: its hidden state (the original class, the hidden ``te.Linear``\\ s, the default recipe),
the hidden ``te.Linear`` built on the original ``Parameter`` objects, and the rewrite's error type.

Mirrors TE 2.20.2 ``module/linear.py`` (``te.Linear``'s weight / bias splits)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


class CompileFriendlyError(ValueError):
    """``compile_friendly(strict=True)`` refused at least one module, or a rewritten module was
    called with arguments the rewrite cannot express (the message names module and reason)."""


#: Module attribute holding the rewrite's hidden state (hidden ``te.Linear``\ s, the original class).
STATE_ATTR = "_te_passes_compile_friendly"


def te_module():
    import transformer_engine.pytorch as te

    return te


def _split_cat_linear_cls():
    te = te_module()

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


@dataclasses.dataclass
class ModuleState:
    original_cls: type
    linears: tuple[torch.nn.Module, ...] = ()
    recipe: Any = None  # MultiheadAttention: the recipe entered when no te.autocast is active


def state_of(mod: torch.nn.Module) -> ModuleState:
    return mod.__dict__[STATE_ATTR]


class HiddenTrainMixin:
    def train(self, mode: bool = True):  # noqa: D401 - nn.Module.train
        super().train(mode)
        for lin in state_of(self).linears:
            lin.train(mode)
        return self


def is_rewritten(mod: torch.nn.Module) -> bool:
    """Whether ``mod`` itself was rewritten by :func:`compile_friendly`."""
    return STATE_ATTR in mod.__dict__
