"""TE's ``SplitAlongDim`` (``transformer_engine/pytorch/utils.py``, TE 2.20) as ``torch.split`` in te_inductor's
untouched frames: ``te.MultiheadAttention`` splits GQA's q/k/v (and cross attention's k/v) with it, an
``autograd.Function`` whose backward compares storages' ``data_ptr`` (Dynamo breaks the graph) and whose strided
outputs send TE's ``DotProductAttention`` to its eager island (its layout detection reads ``data_ptr`` too).
See docs/untouched.md."""

from __future__ import annotations

import threading
from typing import Any

import torch

from te_passes.compat.untouched.state import active_frames
from te_passes.te.untouched_rules import SPLIT_ALONG_DIM_MODULE as TE_MHA_MODULE
_STATE: dict[str, Any] = {"te": None, "refused": None}
_LOCK = threading.Lock()


class GraphSplitAlongDim:
    """Stands in for TE's ``SplitAlongDim`` in :data:`TE_MHA_MODULE`: ``apply`` is TE's own everywhere but in a
    frame Dynamo traces for te_inductor with a plain tensor, where it is ``torch.split`` (sections as TE's) with
    contiguous parts (the values TE's forward returns; the backward is ``torch.cat``, TE's values without its
    no-copy shortcut). ``x`` [..., sum(sections) along ``dim``, ...] -> parts, ``dim`` squeezed with ``squeeze``."""

    @staticmethod
    def apply(x: torch.Tensor, dim: int, sections: Any, *squeeze: bool) -> Any:
        if not torch.compiler.is_compiling():  # eager: TE's, with the caller's arguments (as many as given)
            return _STATE["te"].apply(x, dim, sections, *squeeze)
        from transformer_engine.pytorch.quantized_tensor import QuantizedTensorStorage

        if isinstance(x, QuantizedTensorStorage) or not active_frames():
            return _STATE["te"].apply(x, dim, sections, *squeeze)
        squeeze = bool(squeeze and squeeze[0])
        parts = torch.split(x, sections if isinstance(sections, int) else list(sections), dim=dim)
        return tuple((p.squeeze(dim) if squeeze else p).contiguous() for p in parts)


def install_split_polyfill() -> bool:
    """Rebind :data:`TE_MHA_MODULE`'s ``SplitAlongDim`` to :class:`GraphSplitAlongDim` (idempotent); ``False``
    while TE's module is not imported or when refused (:func:`refused_reason`: the global is not TE's
    ``autograd.Function``). Call outside a Dynamo trace: traces guard on the global."""
    import sys

    with _LOCK:
        if _STATE["te"] is not None or _STATE["refused"] is not None:
            return _STATE["te"] is not None
        mha = sys.modules.get(TE_MHA_MODULE)
        if mha is None:
            return False
        te_split = getattr(mha, "SplitAlongDim", None)
        if not (isinstance(te_split, type) and issubclass(te_split, torch.autograd.Function)):
            _STATE["refused"] = f"{TE_MHA_MODULE}.SplitAlongDim is {te_split!r}, not TE's autograd.Function"
            return False
        _STATE["te"] = te_split
        mha.SplitAlongDim = GraphSplitAlongDim
        return True


def installed() -> bool:
    """Whether :func:`install_split_polyfill` rebound TE's ``SplitAlongDim``."""
    return _STATE["te"] is not None


def refused_reason() -> str | None:
    """Why :func:`install_split_polyfill` left TE's ``SplitAlongDim`` alone (``None``: it did not, or has not run)."""
    return _STATE["refused"]
