"""Alias rules for FX nodes: which arguments a node's outputs may alias, whether it may also
allocate, and whether its callee may keep references (what :func:`te_passes.analyses.liveness.analyze` applies).

See docs/internals.md#te_passesanalysesalias_rulespy."""

from __future__ import annotations

import builtins
import dataclasses
import functools
import operator
from typing import Any

import torch
import torch.fx

__all__ = ["OpRule", "PY_STORE_FUNCS", "PY_STORE_METHODS", "arg_at", "arg_values", "is_opaque_call",
           "name_alias_kind", "nodes_in", "op_rule"]


#: Ops that return (a view of) their first argument without an alias annotation in their schema.
_VIEW_EXTRA = {"aten::_unsafe_view", "_c10d_functional::wait_tensor", "c10d_functional::wait_tensor"}
_OPAQUE_SAFE_NAMESPACES = frozenset({"aten", "prims", "inductor", "te_passes", "_c10d_functional",
                                     "c10d_functional", "_quantized", "quantized"})
#: Python-level stores of a value into an object (``setattr``, ``setitem``): an escape.
PY_STORE_FUNCS = {builtins.setattr, operator.setitem, builtins.object.__setattr__}
#: Method names that store their argument into the receiver (``list.append``, ``dict.update``, ...).
PY_STORE_METHODS = {"append", "extend", "insert", "add", "update", "setdefault", "__setitem__",
                     "__setattr__"}


def is_opaque_call(node: torch.fx.Node) -> bool:
    """Whether ``node`` calls code whose references the compiler cannot see: a custom op
    outside ATen/prims (TE's ``transformer_engine_compile`` ops included), a higher-order op,
    or any non-torch Python callable. Such a callee may keep a reference to its arguments."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return False
    if node.op == "call_module":
        return True
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return op_rule(t).opaque
    if isinstance(t, torch._ops.OpOverloadPacket):
        return t._qualified_op_name.split("::")[0] not in _OPAQUE_SAFE_NAMESPACES
    if isinstance(t, torch._ops.HigherOrderOperator):
        return True
    if t is operator.getitem:
        return False
    if node.op == "call_method":
        return False
    mod = getattr(t, "__module__", "") or ""
    return not (mod.startswith("torch") or mod in ("_operator", "operator", "builtins", "math"))


def _schema_alias_sources(op: torch._ops.OpOverload) -> tuple[list[list[int]], bool]:
    """For each return of ``op``: positions (in the flattened schema args) it aliases; and
    whether the op may also allocate (``maybe_aliasing_or_mutating``)."""
    schema = op._schema
    args = schema.arguments
    out: list[list[int]] = []
    for r in schema.returns:
        ai = r.alias_info
        srcs: list[int] = []
        if ai is not None and ai.before_set:
            srcs = [i for i, a in enumerate(args) if a.alias_info is not None
                    and a.alias_info.before_set & ai.before_set]
        elif ai is not None or (op.is_view and "[]" in str(r.type)):
            # list-returning views: Tensor(a -> *) self -> Tensor(a)[]
            srcs = [i for i, a in enumerate(args) if a.alias_info is not None
                    and ("*" in a.alias_info.after_set or a.alias_info.before_set)]
        out.append(srcs)
    if schema.name in _VIEW_EXTRA and out:
        out[0] = [0]
    maybe = torch.Tag.maybe_aliasing_or_mutating in op.tags
    return out, maybe


@dataclasses.dataclass(frozen=True)
class OpRule:
    """Alias behaviour of one ``OpOverload``, derived once from its schema."""

    is_set: bool
    srcs: tuple[tuple[int, ...], ...]   # per return: aliased argument positions
    maybe: bool                         # maybe_aliasing_or_mutating
    returns_list: bool                  # a single ``Tensor[]`` return
    arg_names: tuple[str, ...]
    opaque: bool = False                # outside ATen/prims/...: may keep references

    @property
    def fresh(self) -> bool:
        return not self.is_set and not self.maybe and not any(self.srcs)


#: ``id(op) -> (op, rule)`` (by identity: ``OpOverload.__hash__`` is Python-level; the op keeps the id valid).
_RULES: dict[int, tuple[torch._ops.OpOverload, OpRule]] = {}


def op_rule(op: torch._ops.OpOverload) -> OpRule:
    """The :class:`OpRule` of ``op`` (derived from its schema once, cached by identity)."""
    hit = _RULES.get(id(op))
    if hit is not None and hit[0] is op:
        return hit[1]
    schema = op._schema
    srcs, maybe = _schema_alias_sources(op)
    rule = OpRule(is_set=schema.name.startswith("aten::set_"), srcs=tuple(tuple(s) for s in srcs),
                   maybe=maybe,
                   returns_list=len(schema.returns) == 1 and "[]" in str(schema.returns[0].type),
                   arg_names=tuple(a.name for a in schema.arguments),
                   opaque=op.namespace not in _OPAQUE_SAFE_NAMESPACES)
    _RULES[id(op)] = (op, rule)
    return rule


def arg_at(node: torch.fx.Node, rule: OpRule, i: int) -> Any:
    """The FX argument at schema position ``i`` of ``node`` (positional, else by keyword; ``None`` if absent)."""
    if i < len(node.args):
        return node.args[i]
    return node.kwargs.get(rule.arg_names[i]) if i < len(rule.arg_names) else None


def arg_values(op: torch._ops.OpOverload, node: torch.fx.Node) -> list[Any]:
    """``node``'s arguments in ``op``'s schema order (keywords placed, missing ones ``None``)."""
    rule = op_rule(op)
    return [arg_at(node, rule, i) for i in range(len(rule.arg_names))]


def nodes_in(obj: Any) -> list[torch.fx.Node]:
    """The FX nodes inside an argument (recursing into lists, tuples, dicts and slices), in order."""
    out: list[torch.fx.Node] = []
    torch.fx.node.map_arg(obj, out.append)
    return out


@functools.lru_cache(maxsize=4096)
def name_alias_kind(name: str) -> str:
    """``"alias"`` (pure view / in-place), ``"fresh"`` or ``"maybe"`` for a torch-level name."""
    if name in ("contiguous", "reshape", "flatten", "reshape_as", "to", "type", "type_as", "cuda",
                "cpu", "float", "half", "bfloat16", "double", "int", "long", "view_as", "expand_as",
                "__getitem__", "getitem"):
        return "alias" if name in ("view_as", "expand_as") else "maybe"
    if name.endswith("_") and not name.startswith("_"):
        return "alias"
    name = name.removeprefix("__").removesuffix("__") if name.startswith("__") else name
    pkt = getattr(torch.ops.aten, name, None) if hasattr(torch.ops.aten, name) else None
    if pkt is None:
        return "maybe"
    kinds = set()
    for ov in pkt.overloads():
        op = getattr(pkt, ov)
        if any(a.is_out for a in op._schema.arguments):
            continue  # out= variants alias their out argument, not the inputs
        srcs, maybe = _schema_alias_sources(op)
        kinds.add("maybe" if maybe else ("alias" if any(srcs) else "fresh"))
    return kinds.pop() if kinds in ({"alias"}, {"fresh"}) else "maybe"
