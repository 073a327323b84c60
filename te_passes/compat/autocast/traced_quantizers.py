"""te.Linear's compiled op in a te_inductor trace gets per-call copies of its quantizers, so the grad mode decides
their usage flags inside the graph and the module's quantizers (which Dynamo guards on) stay as they were.

TE 2.20.2's ``Linear.forward`` (``module/linear.py``) hands its compiled op ``_linear_op(fwd_args)`` the module's
persistent quantizers (``Linear._get_quantizers``: ``self.quantizers``); while Dynamo traces, the op's
``forward_fn`` runs ``_linear_forward_fake``, which calls ``set_usage`` on them by grad mode (input: columnwise
only with grad, linear.py:832; weight: linear.py:861-868). TE registers these quantizers as value-opaque constants
(``dynamo/quantizer_opaque.py``): Dynamo runs those calls on the real objects at trace time and guards on their
values (``EQUALS_MATCH``, the usage attributes), and the graph's op call holds the objects themselves. A
``torch.no_grad()`` evaluation traced after a training step leaves the module's quantizers with columnwise usage
off: the training graph's guards fail at the next step, the recompiled training graph turns it back on, failing
the inference graph's guards (every train <-> no_grad switch recompiled, issue 42), and the compiled training
graph's op call now holds the no_grad usage. The copies (TE's own ``Quantizer.copy``, what TE's ``TensorSpec``
does with a quantizer) carry the module's values into the op and take the fake impl's per-call usage writes; the
module's quantizers keep the values the guards saw, and each graph keeps its own. Docs: docs/usage.md "Training
loop"."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from te_passes.compat import table
from te_passes.compat.gate import te_inductor_tracing
from te_passes.te.version import te_module

#: The patch-table row (:mod:`te_passes.compat.autocast.rows`).
ROW = "autocast.traced_quantizer_copies"
#: TE's module and the name the row rebinds (TE's compiled te.Linear op, ``dynamo.custom_op``'s ``forward_fn``).
TE_LINEAR_MODULE = "transformer_engine.pytorch.module.linear"
TARGET = "_linear_op"
#: TE's module with ``is_value_opaque_quantizer`` (the quantizer classes TE registers as value-opaque constants).
TE_OPAQUE_MODULE = "transformer_engine.pytorch.dynamo.quantizer_opaque"
#: The ``LinearFwdArgs`` fields holding quantizers (linear.py:2520-2525).
QUANTIZER_FIELDS: tuple[str, ...] = ("input_quantizer", "weight_quantizer", "output_quantizer",
                                     "grad_input_quantizer", "grad_weight_quantizer", "grad_output_quantizer")
#: Attribute set on the wrappers :func:`op_wrapper` makes (the row's plan finds one already in TE's ``_linear_op``
#: chain).
MARK = "traced_quantizer_copies"


@torch._dynamo.assume_constant_result
def active() -> bool:
    """Whether row :data:`ROW` is active; a trace-time constant (no guard on the table). A wrapper that a later row
    wrapped stays in TE's ``_linear_op`` chain when this row alone is reverted (``table.revert`` leaves a rebinding
    replaced after it alone): it then passes TE's call through."""
    return table.refusal(ROW) is None


def op_wrapper(te_op: Callable[[Any], Any], is_value_opaque: Callable[[Any], bool]) -> Callable[[Any], Any]:
    """TE's ``module.linear._linear_op(fwd_args) -> (out, new_weight_workspace)`` (``te_op``) called, while Dynamo
    traces a te_inductor frame, with ``dataclasses.replace(fwd_args, ...)``: each value-opaque quantizer of
    :data:`QUANTIZER_FIELDS` (``is_value_opaque``: TE's ``is_value_opaque_quantizer``) replaced by its ``copy()``;
    ``None`` and other quantizers (TE's ``Float8Quantizer`` of DelayedScaling, a ``DebugQuantizer``: identity-keyed)
    as given. Elsewhere (eager, other backends' frames) TE's call as is."""
    def linear_op(fwd_args):
        if torch.compiler.is_compiling() and te_inductor_tracing() and active():
            copies = {}
            for name in QUANTIZER_FIELDS:
                q = getattr(fwd_args, name)
                if q is not None and is_value_opaque(q):
                    copies[name] = q.copy()
            if copies:
                fwd_args = dataclasses.replace(fwd_args, **copies)
        return te_op(fwd_args)

    setattr(linear_op, MARK, True)
    return linear_op


def plan() -> list[table.Rebind]:
    """The plan of row :data:`ROW`: rebind ``module.linear._linear_op`` to :func:`op_wrapper`; no change when a
    wrapper of ours is still in its ``__wrapped__`` chain (this row reverted alone under a later row's wrapper:
    active again, it copies again).

    Raises:
        table.Refused: ``"pending: ..."`` while TE's ``module/linear.py`` is not imported; TE has no compiled
            te.Linear op, lacks ``is_value_opaque_quantizer`` or a quantizer field, or a value-opaque class lacks
            ``copy``."""
    lin = te_module(TE_LINEAR_MODULE)
    if lin is None:
        raise table.Refused(f"pending: {TE_LINEAR_MODULE} is not imported yet")
    te_op = getattr(lin, TARGET, None)
    opaque = te_module(TE_OPAQUE_MODULE, import_te=True)
    is_value_opaque = getattr(opaque, "is_value_opaque_quantizer", None)
    if te_op is None or is_value_opaque is None:
        raise table.Refused(f"TE lacks {TE_LINEAR_MODULE}.{TARGET} or {TE_OPAQUE_MODULE}.is_value_opaque_quantizer")
    fields = {f.name for f in dataclasses.fields(lin.LinearFwdArgs)}
    missing = [f for f in QUANTIZER_FIELDS if f not in fields]
    if missing:
        raise table.Refused(f"TE's LinearFwdArgs lacks {missing}")
    no_copy = sorted(q for q in getattr(opaque, "_VALUE_OPAQUE_QUALNAMES", ()) if not _has_copy(q))
    if no_copy:
        raise table.Refused(f"TE's value-opaque quantizer classes {no_copy} have no copy()")
    if wrappers_in(te_op):
        return []
    return [table.Rebind(lin, TARGET, op_wrapper(te_op, is_value_opaque))]


def wrappers_in(fn: Any) -> int:
    """How many wrappers of :func:`op_wrapper` are in ``fn``'s ``__wrapped__`` chain (``fn`` included)."""
    n = 0
    while fn is not None:
        n += getattr(fn, MARK, False) is True
        fn = getattr(fn, "__wrapped__", None)
    return n


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


__all__ = ["MARK", "QUANTIZER_FIELDS", "ROW", "TARGET", "active", "op_wrapper", "plan", "wrappers_in"]
