"""Scans of FX graphs for TE objects: where recipe / process-group / quantizer objects occur
(node arguments, nested in bundles and containers), which nodes use them, and which call
targets may be TE's recipe lookups. Pure functions over a graph (no mutation, no TE globals);
shared by ``fold_recipe_lookups`` and ``remove_quantizer_setattrs``
(docs/passes/fold_recipe_lookups.md, docs/passes/remove_quantizer_setattrs.md).
"""

from __future__ import annotations

import builtins
import enum
import functools
import operator
from typing import Any, Iterator

import torch
import torch.fx

from te_passes.fx.graph import PLAIN_TYPES as _PLAIN_TYPES
from te_passes.fx.graph import UNKNOWN, get_attr_path  # noqa: F401 - re-exported for the passes
from te_passes.te import recipes
from te_passes.te.graph_model import is_te_op_node
from te_passes.te.graph_constants import TEConstKind, bundle_dict, leaf_values, quantizer_fields  # noqa: F401
from te_passes.te.graph_constants import is_te_object, mro_names
from te_passes.te.graph_constants import te_const_kind as const_kind

#: ``call_function`` targets that can be part of a recipe lookup (besides TE's own functions).
LOOKUP_BUILTINS = frozenset({builtins.getattr, builtins.hasattr, builtins.isinstance, operator.is_,
                              operator.is_not})


def walk_values(obj: Any, path: tuple, depth: int = 0) -> Iterator[tuple[tuple, Any]]:
    """``(path, value)`` for every value :func:`leaf_values` yields, in the same order."""
    stack = [(obj, path, depth)]
    pop, push = stack.pop, stack.extend
    while stack:
        o, p, d = pop()
        if d > 10:
            continue
        yield p, o
        if isinstance(o, torch.fx.Node) or isinstance(o, _PLAIN_TYPES):
            continue  # leaves (a plain value is never a bundle, list or dict)
        if const_kind(o) is TEConstKind.BUNDLE:
            push([(v, p + (k,), d + 1) for k, v in reversed(list(bundle_dict(o).items()))])
        elif isinstance(o, (list, tuple)):
            push([(o[i], p + (i,), d + 1) for i in range(len(o) - 1, -1, -1)])
        elif isinstance(o, dict):
            push([(v, p + (k,), d + 1) for k, v in reversed(list(o.items()))])


def _is_object_constant(v: Any) -> bool:
    return (not isinstance(v, (torch.fx.Node, bool, int, float, str, type(None), torch.dtype, torch.device,
                                enum.Enum, type, list, tuple, dict)))


def _roots(node: torch.fx.Node, owner: Any) -> list[tuple[tuple, Any]]:
    """``(path base, value)`` of what ``node`` holds: its args, kwargs and ``get_attr`` value."""
    roots: list[tuple[tuple, Any]] = [(("args",), node.args), (("kwargs",), node.kwargs)]
    if node.op == "get_attr" and owner is not None:
        val = get_attr_path(owner, str(node.target))
        if val is not UNKNOWN:
            roots.append((("get_attr",), val))
    return roots


def object_occurrences(graph: torch.fx.Graph) -> dict[int, list[tuple[torch.fx.Node, tuple]]]:
    """``{id(obj): [(node, path), ...]}`` for every non-primitive constant object used by a node
    (args, kwargs, inside bundles) or held by a ``get_attr`` target. Identity, not equality."""
    occ: dict[int, list[tuple[torch.fx.Node, tuple]]] = {}
    for node in graph.nodes:
        for base, root in _roots(node, graph.owning_module):
            for path, v in walk_values(root, base):
                if _is_object_constant(v):
                    occ.setdefault(id(v), []).append((node, path))
    return occ


def users_of_objects(graph: torch.fx.Graph, ids: set[int]) -> dict[int, set[torch.fx.Node]]:
    """``{id(obj): {node, ...}}`` for the objects whose ids are in ``ids``: the nodes of
    :func:`object_occurrences` for those objects, computed without paths."""
    out: dict[int, set[torch.fx.Node]] = {}
    for node in graph.nodes:
        for _, root in _roots(node, graph.owning_module):
            for v in leaf_values(root):
                if id(v) in ids and _is_object_constant(v):
                    out.setdefault(id(v), set()).add(node)
    return out


def find_recipe_and_pg_objects(gm: torch.fx.GraphModule) -> list[tuple[str, str, str]]:
    """Every recipe / recipe-part / process-group object left in ``gm``'s graph, as
    ``(node name, path, type name)``: constants in node args/kwargs (inside bundles too) and
    ``get_attr`` values. An empty list is what the pass guarantees for TE module graphs."""
    out = []
    for node in gm.graph.nodes:
        for base, root in _roots(node, gm):
            if not _has_objects(root) or not any(_is_recipe_or_pg(v) for v in leaf_values(root)):
                continue  # the common case, checked without building paths
            out.extend((node.name, "/".join(map(str, path)), type(v).__name__)
                       for path, v in walk_values(root, base) if _is_recipe_or_pg(v))
    return out


def _is_recipe_or_pg(v: Any) -> bool:
    if isinstance(v, _PLAIN_TYPES) or isinstance(v, torch.fx.Node):
        return False
    if isinstance(v, type):
        return recipes.is_recipe(v) or recipes.is_recipe_part(v) or recipes.is_process_group(v)
    return _instances_are_recipe_or_pg(type(v))


@functools.lru_cache(maxsize=None)
def _instances_are_recipe_or_pg(cls: type) -> bool:
    """Whether instances of ``cls`` are recipes, recipe parts or process groups (the answer reads only the class)."""
    names = mro_names(cls)
    # recipes.is_recipe / is_process_group of an instance, recipes.is_recipe_part (which reads the class)
    return (is_te_object(cls) and "Recipe" in names) or recipes.is_recipe_part(cls) or "ProcessGroup" in names


def may_be_te_lookup(target: Any) -> bool:
    """Cheap filter: a classmethod of a class (``FP8GlobalStateManager.*``) or a function defined
    in ``transformer_engine`` (the pure recipe functions)."""
    if isinstance(getattr(target, "__self__", None), type):
        return True
    return (getattr(target, "__module__", None) or "").startswith("transformer_engine")


def _has_objects(root: Any) -> bool:
    """Fast pre-check: whether args/kwargs ``root`` hold anything besides nodes and plain values."""
    if isinstance(root, (tuple, list)):
        return any(_has_objects(a) for a in root)
    if isinstance(root, dict):
        return any(_has_objects(a) for a in root.values())
    return not (isinstance(root, _PLAIN_TYPES) or isinstance(root, torch.fx.Node))


def bundle_quantizers(graph: torch.fx.Graph) -> list[tuple[str, str, Any, Any]]:
    """``(node, path, quantizer object, value key)`` for every quantizer inside a TE op's args."""
    out = []
    keys: dict[int, tuple] = {}  # id(quantizer) -> value key; nothing mutates them during the scan
    for node in graph.nodes:
        if not is_te_op_node(node):
            continue
        for path, v in walk_values(node.args, ("args",)):
            if const_kind(v) is TEConstKind.QUANTIZER:
                key = keys.get(id(v))
                if key is None:
                    key = keys[id(v)] = tuple(sorted((k, repr(x)) for k, x in quantizer_fields(v).items()))
                out.append((node.name, "/".join(map(str, path)), v, key))
    return out
