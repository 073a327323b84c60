"""Generic ``torch.fx`` graph helpers (no TE knowledge)."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

#: Types of plain FX constants (no node, no object identity that matters).
PLAIN_TYPES = (bool, int, float, str, type(None), torch.dtype, torch.device)

#: What :func:`get_attr_path` returns for an attribute that is not there.
UNKNOWN: Any = object()


def get_attr_path(owner: Any, target: str) -> Any:
    """``owner.<target>`` for a dotted ``get_attr`` target, or :data:`UNKNOWN` when a part is missing."""
    try:
        return operator.attrgetter(target)(owner)
    except AttributeError:
        return UNKNOWN


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A node-for-node copy of ``graph`` (node meta copied shallowly), for rollback."""
    new = torch.fx.Graph(owning_module=graph.owning_module, tracer_cls=graph._tracer_cls)
    val_map: dict[torch.fx.Node, torch.fx.Node] = {}
    out = new.graph_copy(graph, val_map, return_output_node=True)
    if out is not None:
        new.output(out[0] if isinstance(out, tuple) else out)
    new._codegen = graph._codegen
    return new


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A node-for-node copy of ``gm`` sharing its parameters, buffers and submodules (same class
    name; ``gm.meta`` and each node's ``meta`` copied shallowly)."""
    new = torch.fx.GraphModule(gm, copy_graph(gm.graph), class_name=type(gm).__name__)
    new.meta = dict(getattr(gm, "meta", {}))
    return new


def same_objects(a: Any, b: Any) -> bool:
    """Whether ``a is b``, element-wise through lists / tuples of the same type (FX arguments by identity)."""
    if isinstance(a, (list, tuple)) and type(a) is type(b):
        return len(a) == len(b) and all(map(same_objects, a, b))
    return a is b


def op_qualname(target: Any) -> str | None:
    """``"ns::op"`` of an ``OpOverload`` (AOT / post-grad graphs) or ``OpOverloadPacket`` (Dynamo
    graphs) node target, else ``None`` (``torch._ops``)."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None
