"""te.Linear's quantizers in a te_inductor trace: per-call copies, so the grad mode decides their usage flags
inside the graph and the module's quantizers (which Dynamo guards on) stay as they were.

TE 2.20.2's ``Linear.forward`` (``module/linear.py``) takes its six quantizers from ``Linear._get_quantizers`` (the
module's persistent ``self.quantizers`` objects) and its compiled path runs ``_linear_forward_fake`` while Dynamo
traces, which calls ``set_usage`` on them by grad mode (input: columnwise only with grad, linear.py:832; weight:
linear.py:861-868). TE registers these quantizers as value-opaque constants (``dynamo/quantizer_opaque.py``):
Dynamo runs those calls on the real objects at trace time and guards on their values (``EQUALS_MATCH``, the
usage attributes). A ``torch.no_grad()`` evaluation traced after a training step leaves the module's quantizers
with columnwise usage off, so the training graph's guards fail at the next step and the recompiled training
graph turns it back on, failing the inference graph's guards: every train <-> no_grad switch recompiles (issue
42). The copies (TE's own ``Quantizer.copy``, what TE's ``TensorSpec`` does with a quantizer) carry the same
values into the op, get TE's per-call writes (usage, ``optimize_for_gemm``, the amax-reduction group) instead of
the module's objects, and the module's quantizers keep the values the guards saw. Docs: docs/usage.md "Training
loop"."""

from __future__ import annotations

from typing import Any, Callable

import torch

from te_passes.compat import table
from te_passes.compat.gate import te_inductor_tracing
from te_passes.te.version import te_module

#: The patch-table row (:mod:`te_passes.compat.autocast.rows`).
ROW = "autocast.traced_quantizer_copies"
#: TE's module and the method the row rebinds.
TE_LINEAR_MODULE = "transformer_engine.pytorch.module.linear"
TARGET = "Linear._get_quantizers"
#: TE's module with ``is_value_opaque_quantizer`` (the quantizer classes TE registers as value-opaque constants).
TE_OPAQUE_MODULE = "transformer_engine.pytorch.dynamo.quantizer_opaque"


def copies_wrapper(te_get: Callable[..., Any], is_value_opaque: Callable[[Any], bool]) -> Callable[..., Any]:
    """TE's ``Linear._get_quantizers(self, fp8_output, fp8_grad, is_grad_enabled)`` (``te_get``) returning, while
    Dynamo traces a te_inductor frame, a copy of each value-opaque quantizer (``is_value_opaque``: TE's
    ``is_value_opaque_quantizer``) in place of the module's object; ``None`` entries and other quantizers (TE's
    ``Float8Quantizer`` of DelayedScaling, a ``DebugQuantizer``: not value-opaque, identity-keyed) as TE's.
    Elsewhere (eager, other backends' frames) TE's result as is. Returns TE's 6-tuple / list."""
    def _get_quantizers(self, fp8_output, fp8_grad, is_grad_enabled):
        quantizers = te_get(self, fp8_output, fp8_grad, is_grad_enabled)
        if not (torch.compiler.is_compiling() and te_inductor_tracing()):
            return quantizers
        return tuple(q.copy() if q is not None and is_value_opaque(q) else q for q in quantizers)

    _get_quantizers.__wrapped__ = te_get
    return _get_quantizers


def plan() -> list[table.Rebind]:
    """The plan of row :data:`ROW`: rebind ``Linear._get_quantizers`` to :func:`copies_wrapper`.

    Raises:
        table.Refused: ``"pending: ..."`` while TE's ``module/linear.py`` is not imported; TE lacks
            ``Linear._get_quantizers`` or ``is_value_opaque_quantizer``, or a value-opaque class lacks ``copy``."""
    lin = te_module(TE_LINEAR_MODULE)
    if lin is None:
        raise table.Refused(f"pending: {TE_LINEAR_MODULE} is not imported yet")
    te_get = lin.Linear.__dict__.get("_get_quantizers")
    opaque = te_module(TE_OPAQUE_MODULE, import_te=True)
    is_value_opaque = getattr(opaque, "is_value_opaque_quantizer", None)
    if te_get is None or is_value_opaque is None:
        raise table.Refused(f"TE lacks {TE_LINEAR_MODULE}.{TARGET} or {TE_OPAQUE_MODULE}.is_value_opaque_quantizer")
    no_copy = sorted(q for q in getattr(opaque, "_VALUE_OPAQUE_QUALNAMES", ()) if not _has_copy(q))
    if no_copy:
        raise table.Refused(f"TE's value-opaque quantizer classes {no_copy} have no copy()")
    return [table.Rebind(lin.Linear, "_get_quantizers", copies_wrapper(te_get, is_value_opaque))]


def _has_copy(qualname: str) -> bool:
    """Whether TE's quantizer class ``qualname`` (a registered value-opaque class) defines its own ``copy``."""
    base = te_module("transformer_engine.pytorch.quantized_tensor", import_te=True).Quantizer
    stack = list(base.__subclasses__())
    while stack:
        cls = stack.pop()
        if cls.__qualname__ == qualname:
            return callable(getattr(cls, "copy", None))
        stack.extend(cls.__subclasses__())
    return False


__all__ = ["ROW", "TARGET", "copies_wrapper", "plan"]
