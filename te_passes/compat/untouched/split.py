"""TE's ``SplitAlongDim`` (``transformer_engine/pytorch/utils.py``, TE 2.20) as ``torch.split`` in te_inductor's
untouched frames: ``te.MultiheadAttention`` splits GQA's q/k/v (and cross attention's k/v) with it, an
``autograd.Function`` whose backward compares storages' ``data_ptr`` (Dynamo breaks the graph) and whose strided
outputs send TE's ``DotProductAttention`` to its eager island (its layout detection reads ``data_ptr`` too).
See docs/untouched.md."""

from __future__ import annotations

from typing import Any

import torch

from te_passes.compat.untouched.state import active_frames
from te_passes.compat.te220.untouched_rules import SPLIT_ALONG_DIM_MODULE as TE_MHA_MODULE

#: TE's ``SplitAlongDim`` (``[cls]``), kept by the row that rebinds it (te_passes/compat/untouched/rows.py).
TE_SPLIT: list[Any] = []


class GraphSplitAlongDim:
    """Stands in for TE's ``SplitAlongDim`` in :data:`TE_MHA_MODULE`: ``apply`` is TE's own everywhere but in a
    frame Dynamo traces for te_inductor with a plain tensor, where it is ``torch.split`` (sections as TE's) with
    contiguous parts (the values TE's forward returns; the backward is ``torch.cat``, TE's values without its
    no-copy shortcut). ``x`` [..., sum(sections) along ``dim``, ...] -> parts, ``dim`` squeezed with ``squeeze``."""

    @staticmethod
    def apply(x: torch.Tensor, dim: int, sections: Any, *squeeze: bool) -> Any:
        if not torch.compiler.is_compiling():  # eager: TE's, with the caller's arguments (as many as given)
            return TE_SPLIT[0].apply(x, dim, sections, *squeeze)
        from transformer_engine.pytorch.quantized_tensor import QuantizedTensorStorage

        if isinstance(x, QuantizedTensorStorage) or not active_frames():
            return TE_SPLIT[0].apply(x, dim, sections, *squeeze)
        squeeze = bool(squeeze and squeeze[0])
        parts = torch.split(x, sections if isinstance(sections, int) else list(sections), dim=dim)
        return tuple((p.squeeze(dim) if squeeze else p).contiguous() for p in parts)
