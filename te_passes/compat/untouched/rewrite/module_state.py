"""What a module rewritten by :func:`te_passes.compat.untouched.rewrite.compile_friendly.compile_friendly` carries (the
original class, the hidden ``te.Linear``\\ s, the default recipe), and the rewrite's error type."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


class CompileFriendlyError(ValueError):
    """``compile_friendly(strict=True)`` refused a module, or a rewritten module was called with
    arguments the rewrite cannot express (the message names module and reason)."""


#: Module attribute holding the rewrite's hidden state (hidden ``te.Linear``\ s, the original class).
STATE_ATTR = "_te_passes_compile_friendly"


def te_module():
    import transformer_engine.pytorch as te

    return te


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
