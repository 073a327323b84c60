"""TE's base ops as :mod:`te_passes.ops.direct_call` calls them: the op family of an FX
node target and what a base op's kernel runs (``plan`` / ``impl`` / ``pack_result``, read from
its ``CustomOpDef`` and checked).

See docs/internals.md#te_passesopste_basepy."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch

from te_passes.fx.graph import op_qualname
from te_passes.te.graph_model import TE_OP_NAMESPACE

#: TE's ``dynamo/custom_op.py``: the module and qualname of the base op's kernel function
#: and the names it closes over.
_TE_CUSTOM_OP_MODULE = "transformer_engine.pytorch.dynamo.custom_op"
_BASE_IMPL_QUALNAME = "_register_base_op.<locals>._impl"
_BASE_IMPL_FREEVARS = ("impl", "pack_result", "plan")
_FIELD_KINDS = frozenset({"TENSOR", "TENSOR_OR_QUANTIZED", "PROCESS_GROUP", "SIMPLE", "UNSUPPORTED"})


class DirectCallUnavailable(Exception):
    """A TE base op cannot be called directly; the message says why (the op keeps its
    dispatcher call)."""


# --------------------------------------------------------------------------- op families
@dataclasses.dataclass(frozen=True)
class TEOpFamily:
    """The four ops TE's ``register_custom_op(op_name=name)`` defines (``dynamo/custom_op.py``
    ``_register_custom_op_impl``) as ``transformer_engine_compile::`` qualnames: ``forward`` (``<name>``),
    ``backward`` (``<name>_backward``), ``forward_base`` (``<name>_base``), ``backward_base``."""

    name: str
    forward: str
    backward: str
    forward_base: str
    backward_base: str

    def base_of(self, qualname: str) -> str | None:
        """The base op a wrapper op forwards to (``None`` when ``qualname`` is not a wrapper)."""
        return {self.forward: self.forward_base, self.backward: self.backward_base}.get(qualname)

    def is_base(self, qualname: str) -> bool:
        return qualname in (self.forward_base, self.backward_base)


def opdefs() -> dict[str, Any]:
    from torch._library.custom_ops import OPDEFS

    return OPDEFS


def op_family(target: Any) -> TEOpFamily | None:
    """The TE op family of an FX node target (an ``OpOverload`` of any of its four ops), decoded
    from the op name and checked against ``torch._library.custom_ops.OPDEFS`` (all four ops
    defined, each wrapper's schema arguments equal to its base op's); ``None`` for anything else
    (not a ``transformer_engine_compile`` op, or a TE op outside such a family)."""
    qual = op_qualname(target) if isinstance(target, torch._ops.OpOverload) else None
    if qual is None or not qual.startswith(TE_OP_NAMESPACE + "::"):
        return None
    stem = qual.split("::", 1)[1].removesuffix("_base").removesuffix("_backward")
    ns = TE_OP_NAMESPACE
    fam = TEOpFamily(stem, f"{ns}::{stem}", f"{ns}::{stem}_backward", f"{ns}::{stem}_base",
                     f"{ns}::{stem}_backward_base")
    defs = opdefs()
    members = (fam.forward, fam.backward, fam.forward_base, fam.backward_base)
    if qual not in members or not all(q in defs for q in members):
        return None
    for w, b in ((fam.forward, fam.forward_base), (fam.backward, fam.backward_base)):
        if _arg_sig(defs[w]._opoverload) != _arg_sig(defs[b]._opoverload):
            return None
    return fam


def _arg_sig(op: torch._ops.OpOverload) -> tuple:
    return tuple((a.name, str(a.type)) for a in op._schema.arguments)


def overload(qualname: str) -> torch._ops.OpOverload:
    """The ``.default`` ``OpOverload`` of a custom op qualname (``_opoverload`` of its CustomOpDef)."""
    return opdefs()[qualname]._opoverload


# --------------------------------------------------------------------------- the base op's impl
@dataclasses.dataclass(frozen=True)
class BaseOpImpl:
    """What a TE base op's kernel runs, read from its ``CustomOpDef``: ``plan`` (TE's
    ``_ArgPlan``), and the closure *cells* holding ``impl`` / ``pack_result`` (read on every call,
    so the direct call runs whatever the op would run at that moment)."""

    qualname: str
    plan: Any
    impl_cell: Any
    pack_cell: Any
    storage_unflatten: Any
    resolve_process_group: Any
    tq_kind_key: str
    tq_kinds: Any
    simple_slot: str

    @property
    def impl(self) -> Any:
        return self.impl_cell.cell_contents

    @property
    def pack_result(self) -> Any:
        return self.pack_cell.cell_contents


def _one_positional(fn: Any) -> bool:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    req = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(req) == 1


def resolve_base_impl(qualname: str) -> BaseOpImpl:
    """Read ``plan`` / ``impl`` / ``pack_result`` from the base op's ``CustomOpDef`` and check that the op's
    dispatcher kernel is exactly TE's ``_register_base_op._impl``.

    Raises:
        DirectCallUnavailable: any check fails (the message names it).
    """
    import sys

    defs = opdefs()
    opdef = defs.get(qualname)
    if opdef is None:
        raise DirectCallUnavailable(f"{qualname} is not a torch.library custom op (not in OPDEFS)")
    # custom_op registers its init function as the device-agnostic kernel (key None).
    if set(getattr(opdef, "_backend_fns", {})) - {None}:
        raise DirectCallUnavailable(f"{qualname} has device-specific kernels {sorted(map(str, opdef._backend_fns))}")
    if getattr(opdef, "_autocast_dtype", None):
        raise DirectCallUnavailable(f"{qualname} has an autocast rule")
    if getattr(opdef, "_disabled_kernel", set()):
        raise DirectCallUnavailable(f"{qualname} has disabled kernels {sorted(map(str, opdef._disabled_kernel))}")
    if getattr(opdef, "_torch_dispatch_fns", {}):
        raise DirectCallUnavailable(f"{qualname} has register_torch_dispatch rules")
    for key in ("CPU", "CUDA"):
        if torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key):
            raise DirectCallUnavailable(f"{qualname} has a {key} kernel besides the custom op's own")
    fn = opdef._init_fn
    if getattr(fn, "__module__", None) != _TE_CUSTOM_OP_MODULE or getattr(fn, "__qualname__", None) != _BASE_IMPL_QUALNAME:
        raise DirectCallUnavailable(f"{qualname}'s kernel is {getattr(fn, '__module__', '?')}."
                                    f"{getattr(fn, '__qualname__', fn)!s}, not TE's {_BASE_IMPL_QUALNAME}")
    code = fn.__code__
    if tuple(sorted(code.co_freevars)) != _BASE_IMPL_FREEVARS or fn.__closure__ is None:
        raise DirectCallUnavailable(f"{qualname}'s kernel closes over {code.co_freevars}, expected {_BASE_IMPL_FREEVARS}")
    cells = dict(zip(code.co_freevars, fn.__closure__))
    plan = cells["plan"].cell_contents
    if type(plan).__name__ != "_ArgPlan" or type(plan).__module__ != _TE_CUSTOM_OP_MODULE:
        raise DirectCallUnavailable(f"{qualname}: plan is a {type(plan).__qualname__}, not TE's _ArgPlan")
    schema_names = tuple(a.name for a in opdef._opoverload._schema.arguments)
    if tuple(plan.slot_names) != schema_names:
        raise DirectCallUnavailable(f"{qualname}: plan slots {plan.slot_names} differ from the schema {schema_names}")
    kinds = {getattr(f.kind, "name", str(f.kind)) for f in plan.fields}
    if not kinds <= _FIELD_KINDS:
        raise DirectCallUnavailable(f"{qualname}: unknown field kinds {sorted(kinds - _FIELD_KINDS)}")
    for name in ("impl", "pack_result"):
        if not _one_positional(cells[name].cell_contents):
            raise DirectCallUnavailable(f"{qualname}: {name} does not take exactly one positional argument")
    mod = sys.modules.get(_TE_CUSTOM_OP_MODULE)
    needed = ("_storage_unflatten", "_TQ_KIND_KEY", "_TensorOrQuantizedKind", "_SIMPLE_META_SLOT")
    missing = [n for n in needed if not hasattr(mod, n)]
    if missing:
        raise DirectCallUnavailable(f"{_TE_CUSTOM_OP_MODULE} lacks {missing}")
    return BaseOpImpl(qualname, plan, cells["impl"], cells["pack_result"], mod._storage_unflatten,
                      getattr(mod, "_resolve_process_group", None), mod._TQ_KIND_KEY,
                      mod._TensorOrQuantizedKind, mod._SIMPLE_META_SLOT)


def impl_name(fn: Any) -> str:
    """``module.qualname`` of a function (records, dumps)."""
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
