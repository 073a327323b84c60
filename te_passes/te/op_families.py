"""TE's op families and their schema layout: the ``transformer_engine_compile`` names every other
part of :mod:`te_passes.te` decodes by.

See docs/internals.md#te_passesteop_familiespy."""

from __future__ import annotations

import dataclasses

import torch

from te_passes.te.version import te_version

TE_OP_NAMESPACE = "transformer_engine_compile"

#: Ops whose slot layout this model was written against (``*_base`` ops share their wrapper's schema).
KNOWN_OPS: frozenset[str] = frozenset({"linear", "linear_backward", "linear_base", "linear_backward_base"})

TQ_TENSORS_SUFFIX = "__tensors"
TQ_META_SUFFIX = "__meta"
CONFIG_SLOT = "_simple_meta"


class UnknownTEOp(Exception):
    """A ``transformer_engine_compile`` node this model cannot decode; the message names node, op, TE version."""


#: Roles of the four ops one ``register_custom_op(op_name=<name>)`` call defines
#: (``dynamo/custom_op.py`` ``_register_custom_op_impl``): op name suffix -> (direction, tier).
FAMILY_SUFFIXES: dict[str, tuple[str, str]] = {
    "": ("forward", "wrapper"),
    "_base": ("forward", "base"),
    "_backward": ("backward", "wrapper"),
    "_backward_base": ("backward", "base"),
}


@dataclasses.dataclass(frozen=True)
class TEOpFamily:
    """One op family registered by TE's ``register_custom_op(op_name=name)``: its four member
    ``ops`` (:data:`FAMILY_SUFFIXES` order) and the queried ``op``'s ``direction`` and ``tier``."""

    name: str
    op: str
    direction: str
    tier: str
    ops: tuple[str, ...]


def _registered_custom_op(op: str) -> bool:
    """Whether ``transformer_engine_compile::<op>`` was defined through ``torch.library.custom_op``."""
    from torch._library.custom_ops import OPDEFS

    return f"{TE_OP_NAMESPACE}::{op}" in OPDEFS


def op_family(op: str) -> TEOpFamily | None:
    """The ``register_custom_op`` family ``op`` belongs to, or ``None``."""
    for suffix in sorted(FAMILY_SUFFIXES, key=len, reverse=True):
        if suffix and not op.endswith(suffix):
            continue
        name = op[: len(op) - len(suffix)] if suffix else op
        if not name:
            continue
        members = tuple(name + s for s in FAMILY_SUFFIXES)
        if all(_registered_custom_op(m) for m in members):
            direction, tier = FAMILY_SUFFIXES[suffix]
            return TEOpFamily(name, op, direction, tier, members)
    return None


def _bundle_type_names() -> frozenset[str]:
    """How schemas spell TE's ``OpaqueValueBundle`` type: ``PyObject`` or its registered opaque-type name."""
    names = {"PyObject"}
    try:
        from torch._library.opaque_object import get_opaque_type_name
        from transformer_engine.pytorch.dynamo.custom_op import OpaqueValueBundle
    except Exception:  # noqa: BLE001 - TE not importable: only the generic spelling
        return frozenset(names)
    name = get_opaque_type_name(OpaqueValueBundle)
    if name:
        names |= {name, name.split(".")[-1]}
    return frozenset(names)


def schema_layout_problem(schema: torch._C.FunctionSchema) -> str | None:
    """Why ``schema`` is not a layout TE's ``_ArgPlan`` produces, or ``None`` if it is."""
    rets = [str(r.type) for r in schema.returns]
    if rets not in (["List[Tensor]"], ["Tensor[]"]):
        return f"returns {rets}, not one Tensor[]"
    bundle = _bundle_type_names()
    args = list(schema.arguments)

    def is_bundle_arg(a) -> bool:
        t = str(a.type)
        return t in bundle or t.split(".")[-1] in bundle

    i = 0
    while i < len(args):
        a, t = args[i], str(args[i].type)
        if a.name == CONFIG_SLOT:
            if i != len(args) - 1 or not is_bundle_arg(a):
                return f"config slot {CONFIG_SLOT} must be the last argument and a bundle (is {t} at {i})"
            i += 1
            continue
        nxt = args[i + 1] if i + 1 < len(args) else None
        if nxt is not None and nxt.name == a.name + TQ_TENSORS_SUFFIX:
            meta = args[i + 2] if i + 2 < len(args) else None
            if t not in ("Tensor?", "Optional[Tensor]") or str(nxt.type) not in ("Tensor[]", "List[Tensor]") \
                    or meta is None or meta.name != a.name + TQ_META_SUFFIX or not is_bundle_arg(meta):
                return f"tensor-or-quantized field {a.name!r} is not the triple (Tensor?, Tensor[], bundle)"
            i += 3
            continue
        if a.name.endswith((TQ_TENSORS_SUFFIX, TQ_META_SUFFIX)):
            return f"slot {a.name!r} outside a tensor-or-quantized triple"
        if t not in ("Tensor", "Tensor?", "Optional[Tensor]"):
            return f"slot {a.name!r} has type {t}, which TE's arg plan never emits"
        i += 1
    return None


def te_op_family(op: str) -> TEOpFamily:
    """The family of a ``transformer_engine_compile`` op whose slots this model can decode; raises
    :class:`UnknownTEOp` for a non-member or a schema that is not TE's layout (saying which)."""
    fam = op_family(op)
    if fam is None:
        raise UnknownTEOp(f"unknown TE op {TE_OP_NAMESPACE}::{op} (TE {te_version()}): not one of "
                          f"{sorted(KNOWN_OPS)} nor a member of a register_custom_op family "
                          f"(<name>, <name>_base, <name>_backward, <name>_backward_base)")
    if op not in KNOWN_OPS:
        packet = getattr(getattr(torch.ops, TE_OP_NAMESPACE), op)
        problem = schema_layout_problem(packet.default._schema)
        if problem is not None:
            raise UnknownTEOp(f"TE op {TE_OP_NAMESPACE}::{op} of family {fam.name!r}: schema is not "
                              f"TE's register_custom_op layout: {problem}")
    return fam
