"""Scans of FX graphs for TE objects: where recipe / process-group / quantizer objects occur
(node arguments, nested in bundles and containers), which nodes use them, and which call
targets may be TE's recipe lookups. Pure functions over a graph (no mutation, no TE globals);
shared by ``fold_recipe_lookups`` and ``remove_quantizer_setattrs``
(docs/passes/fold_recipe_lookups.md, docs/passes/remove_quantizer_setattrs.md).
"""

from __future__ import annotations

import builtins
import enum
import operator
from typing import Any, Iterator

import torch
import torch.fx

from te_passes.fx.graph import PLAIN_TYPES as _PLAIN_TYPES
from te_passes.te import recipes
from te_passes.te.graph_model import is_te_op_node
from te_passes.te.graph_constants import TEConstKind, bundle_dict, quantizer_fields, te_const_kind

UNKNOWN = object()

#: ``class -> te_const_kind`` of its instances: :func:`te_const_kind` depends only on the class
#: of a non-class value; this plain dict lookup is the scans' per-value check (they visit every
#: value of every node). Class values (``isinstance(v, type)``) are never stored, so they always
#: take :func:`te_const_kind` itself.
_KIND_BY_TYPE: dict[type, TEConstKind | None] = {}


def const_kind(v: Any) -> TEConstKind | None:
    """``te_const_kind(v)``, memoized per class for instances."""
    t = type(v)
    k = _KIND_BY_TYPE.get(t, UNKNOWN)
    if k is UNKNOWN:
        k = te_const_kind(v)
        if not isinstance(v, type):
            _KIND_BY_TYPE[t] = k
    return k



# --------------------------------------------------------------------------- object scans
def walk_values(obj: Any, path: tuple, depth: int = 0) -> Iterator[tuple[tuple, Any]]:
    """Yield ``(path, value)`` for every value inside ``obj`` (args/kwargs), recursing into
    lists/tuples/dicts and TE bundles (pre-order, at most 10 levels deep).

    Iterative (an explicit stack, not nested generators: each level of a recursive generator
    re-yields every value below it, which dominated scans of 100k-node graphs)."""
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



#: ``call_function`` targets that can be part of a recipe lookup (besides TE's own functions).
LOOKUP_BUILTINS = frozenset({builtins.getattr, builtins.hasattr, builtins.isinstance, operator.is_,
                              operator.is_not})


def _is_object_constant(v: Any) -> bool:
    return (not isinstance(v, (torch.fx.Node, bool, int, float, str, type(None), torch.dtype, torch.device,
                                enum.Enum, type, list, tuple, dict)))


def object_occurrences(graph: torch.fx.Graph) -> dict[int, list[tuple[torch.fx.Node, tuple]]]:
    """``{id(obj): [(node, path), ...]}`` for every non-primitive constant object used by a node
    (args, kwargs, inside bundles) or held by a ``get_attr`` target. Identity, not equality."""
    occ: dict[int, list[tuple[torch.fx.Node, tuple]]] = {}
    owner = graph.owning_module
    for node in graph.nodes:
        roots: list[tuple[tuple, Any]] = [(("args",), node.args), (("kwargs",), node.kwargs)]
        if node.op == "get_attr" and owner is not None:
            val = get_attr_path(owner, str(node.target))
            if val is not UNKNOWN:
                roots.append((("get_attr",), val))
        for base, root in roots:
            for path, v in walk_values(root, base):
                if _is_object_constant(v):
                    occ.setdefault(id(v), []).append((node, path))
    return occ


def leaf_values(obj: Any, depth: int = 0) -> Iterator[Any]:
    """The values :func:`walk_values` yields, without building paths (for whole-graph scans)."""
    stack = [(obj, depth)]
    while stack:
        o, d = stack.pop()
        if d > 10:
            continue
        yield o
        if isinstance(o, torch.fx.Node) or isinstance(o, _PLAIN_TYPES):
            continue
        if isinstance(o, (list, tuple)):
            stack.extend((v, d + 1) for v in reversed(o))
        elif isinstance(o, dict):
            stack.extend((v, d + 1) for v in reversed(list(o.values())))
        elif const_kind(o) is TEConstKind.BUNDLE:
            stack.extend((v, d + 1) for v in reversed(list(bundle_dict(o).values())))


def users_of_objects(graph: torch.fx.Graph, ids: set[int]) -> dict[int, set[torch.fx.Node]]:
    """``{id(obj): {node, ...}}`` for the objects whose ids are in ``ids``: the nodes of
    :func:`object_occurrences` for those objects, computed without paths (one explicit stack
    per node; the same values :func:`leaf_values` visits)."""
    out: dict[int, set[torch.fx.Node]] = {}
    owner = graph.owning_module
    node_t, plain, seq = torch.fx.Node, _PLAIN_TYPES, (list, tuple)
    for node in graph.nodes:
        stack: list[tuple[Any, int]] = [(node.args, 0), (node.kwargs, 0)]
        if node.op == "get_attr" and owner is not None:
            val = get_attr_path(owner, str(node.target))
            if val is not UNKNOWN:
                stack.append((val, 0))
        while stack:
            o, d = stack.pop()
            if d > 10:
                continue
            if id(o) in ids and _is_object_constant(o):
                out.setdefault(id(o), set()).add(node)
            if isinstance(o, node_t) or isinstance(o, plain):
                continue
            if isinstance(o, seq):
                stack.extend([(v, d + 1) for v in o])
            elif isinstance(o, dict):
                stack.extend([(v, d + 1) for v in o.values()])
            elif const_kind(o) is TEConstKind.BUNDLE:
                stack.extend([(v, d + 1) for v in bundle_dict(o).values()])
    return out


def get_attr_path(owner: torch.nn.Module, target: str) -> Any:
    val: Any = owner
    try:
        for part in target.split("."):
            val = getattr(val, part)
    except AttributeError:
        return UNKNOWN
    return val


def find_recipe_and_pg_objects(gm: torch.fx.GraphModule) -> list[tuple[str, str, str]]:
    """Every recipe / recipe-part / process-group object left in ``gm``'s graph, as
    ``(node name, path, type name)``: constants in node args/kwargs (inside bundles too) and
    ``get_attr`` values. An empty list is what the pass guarantees for TE module graphs."""
    out = []
    for node in gm.graph.nodes:
        roots: list[tuple[tuple, Any]] = [(("args",), node.args), (("kwargs",), node.kwargs)]
        if node.op == "get_attr":
            roots.append((("get_attr",), get_attr_path(gm, str(node.target))))
        for base, root in roots:
            if not _has_objects(root) or not any(_is_recipe_or_pg(v) for v in leaf_values(root)):
                continue  # the common case, checked without building paths
            for path, v in walk_values(root, base):
                if isinstance(v, _PLAIN_TYPES) or isinstance(v, torch.fx.Node):
                    continue
                if recipes.is_recipe(v) or recipes.is_recipe_part(v) or recipes.is_process_group(v):
                    out.append((node.name, "/".join(map(str, path)), type(v).__name__))
    return out


def _is_recipe_or_pg(v: Any) -> bool:
    if isinstance(v, _PLAIN_TYPES) or isinstance(v, torch.fx.Node):
        return False
    if isinstance(v, type):  # a class value: the answer depends on the class itself
        return recipes.is_recipe(v) or recipes.is_recipe_part(v) or recipes.is_process_group(v)
    t = type(v)
    hit = _RECIPE_OR_PG_TYPES.get(id(t))
    if hit is not None and hit[0] is t:
        return hit[1]
    ans = recipes.is_recipe(v) or recipes.is_recipe_part(v) or recipes.is_process_group(v)
    _RECIPE_OR_PG_TYPES[id(t)] = (t, ans)
    return ans


#: ``id(class) -> (class, answer)`` of :func:`_is_recipe_or_pg` for instances: ``is_recipe``,
#: ``is_recipe_part`` and ``is_process_group`` read only the instance's class (module, MRO
#: names). The class is kept so its id stays valid.
_RECIPE_OR_PG_TYPES: dict[int, tuple[type, bool]] = {}


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
