"""Which graph values are (parts of) TE quantized tensors, and the role of each buffer.

See docs/internals.md#te_passestequantizedpy."""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any

import torch
import torch.fx

from te_passes.fx.graph import op_qualname
from te_passes.te.graph_model import (TE_OP_NAMESPACE, BufferRole, UnknownTEOp, decode, is_te_op_node,
                                      output_getitems)

__all__ = ["QuantizedInfo", "QUANTIZED_DTYPES", "classify_quantized", "link_saved_roles",
           "joint_saved_roles", "forward_saved_outputs"]

#: torch dtypes that only quantized tensors use (float8 families, packed fp4, E8M0 scales).
QUANTIZED_DTYPES: frozenset[torch.dtype] = frozenset(
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                "float8_e8m0fnu", "float4_e2m1fn_x2") if hasattr(torch, n))

_CAST_TARGETS = ("aten::_to_copy", "prims::convert_element_type", "aten::to", "aten::_to_dtype")


@dataclasses.dataclass(frozen=True)
class QuantizedInfo:
    """What is known about one quantized buffer."""

    role: str
    source: str
    confidence: int
    field: str | None = None
    storage_cls: str | None = None
    inner_name: str | None = None
    op: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def _dtype(node: torch.fx.Node) -> torch.dtype | None:
    v = node.meta.get("val", node.meta.get("example_value"))
    return v.dtype if isinstance(v, torch.Tensor) else None


def _target_kind(target: Any) -> str | None:
    """``"te"`` for ``transformer_engine_compile`` ops, ``"cast"`` for dtype casts, else None (cached per target)."""
    try:
        return _hashable_target_kind(target)
    except TypeError:  # an unhashable call target: not cached
        return _hashable_target_kind.__wrapped__(target)


@functools.lru_cache(maxsize=None)
def _hashable_target_kind(target: Any) -> str | None:
    name = op_qualname(target) or ""
    return "te" if name.startswith(TE_OP_NAMESPACE + "::") else "cast" if name in _CAST_TARGETS else None


def forward_saved_outputs(node: torch.fx.Node) -> dict[int, torch.fx.Node]:
    """``{flat index: getitem}`` of a TE *forward* op's saved-for-backward outputs (``dynamo/custom_op.py``
    ``_OutputPlan``: user outputs first, ``linear`` has one); ``{}`` for non-TE / backward / undecodable ops."""
    try:
        call = decode(node)
    except UnknownTEOp:
        return {}
    return _saved_outputs_of(call)


def _saved_outputs_of(call: Any) -> dict[int, torch.fx.Node]:
    """:func:`forward_saved_outputs` of an already decoded ``TEOpCall``."""
    if call.is_backward or call.module_kind != "linear":
        return {}
    return {i: g for i, g in output_getitems(call.node).items() if i >= 1}


def classify_quantized(graph: torch.fx.Graph, *,
                       saved_roles: dict[str, QuantizedInfo] | None = None) -> dict[torch.fx.Node, QuantizedInfo]:
    """Classify the quantized values of ``graph``: ``{node: QuantizedInfo}``, keyed by the node
    *using* the role (e.g. a ``detach`` in a TE storage slot); undecodable TE ops are skipped."""
    out: dict[torch.fx.Node, QuantizedInfo] = {}

    def put(node, info):
        if not isinstance(node, torch.fx.Node):
            return
        old = out.get(node)
        if old is None or old.confidence < info.confidence:
            out[node] = info

    for node in graph.nodes:
        if node.op != "call_function":
            continue
        kind = _target_kind(node.target)
        if kind == "te" and is_te_op_node(node):
            try:
                call = decode(node)
            except UnknownTEOp:
                continue
            for qb in call.quantized_buffers():
                put(qb.node, QuantizedInfo(qb.role.value, "te_storage_slot", 3, qb.field, qb.storage_cls,
                                           qb.inner_name, node.name))
            if not call.is_backward and bool(call.config.get("fp8")):
                for i, g in _saved_outputs_of(call).items():  # decoded once, not twice
                    dt = _dtype(g)
                    if dt is None or dt == torch.uint8 or dt == torch.float32 or dt in QUANTIZED_DTYPES:
                        put(g, QuantizedInfo(BufferRole.UNKNOWN.value, "te_forward_output", 1, op=node.name))
        elif kind == "cast":
            dt = _dtype(node)
            if dt in QUANTIZED_DTYPES:
                role = (BufferRole.ROWWISE_SCALE_INV if dt == getattr(torch, "float8_e8m0fnu", None)
                        else BufferRole.ROWWISE_DATA)
                put(node, QuantizedInfo(role.value, "quantize_op", 2, op=node.name))
    if saved_roles:
        for node in graph.nodes:
            info = saved_roles.get(node.name)
            if info is not None:
                put(node, info)
    return out


def _through_views(node: torch.fx.Node) -> torch.fx.Node:
    """Follow single-input view ops (``detach``, ``view``, ``alias``) back to their base."""
    seen = 0
    while (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
           and node.target.is_view and node.args and isinstance(node.args[0], torch.fx.Node) and seen < 64):
        node = node.args[0]
        seen += 1
    return node


def _slot_bases(graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, QuantizedInfo]]:
    """``(base of the slot node's views, info)`` of every TE storage-slot role in ``graph``."""
    return [(_through_views(n), i) for n, i in classify_quantized(graph).items() if i.source == "te_storage_slot"]


def link_saved_roles(fwd: torch.fx.Graph, bwd: torch.fx.Graph) -> dict[str, QuantizedInfo]:
    """Roles of the forward's saved quantized outputs, read from the backward's TE storage slots."""
    fwd_out = next((n for n in reversed(fwd.nodes) if n.op == "output"), None)
    fwd_names: set[str] = set()
    if fwd_out is not None:
        torch.fx.node.map_arg(fwd_out.args, lambda n: fwd_names.add(n.name) or n)
    roles = {base.name: dataclasses.replace(info, source="paired_backward") for base, info in _slot_bases(bwd)
             if base.op == "placeholder" and base.name in fwd_names}
    # The forward may return a view (detach) of the op output: give the base the role too.
    if fwd_out is not None:
        for n in fwd.nodes:
            if n.name in roles:
                base = _through_views(n)
                if base is not n and base.op == "call_function" and base.target is operator.getitem:
                    roles.setdefault(base.name, roles[n.name])
    return roles


def joint_saved_roles(joint: torch.fx.Graph) -> dict[str, QuantizedInfo]:
    """Roles of saved quantized buffers, read from AOTAutograd's *joint* graph."""
    return {base.name: dataclasses.replace(info, source="paired_backward") for base, info in _slot_bases(joint)
            if base.op == "call_function" and base.target is operator.getitem
            and isinstance(base.args[0], torch.fx.Node) and is_te_op_node(base.args[0])}
