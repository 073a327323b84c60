"""Direct calls of TE's op implementations from Inductor's wrapper code.

See docs/internals.md#te_passesopsdirect_callpy and docs/design.md "Direct calls"."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from te_passes._logging import get_logger
from te_passes.ops.te_base import DirectCallUnavailable, impl_name, overload, resolve_base_impl

log = get_logger()

#: ``node.meta`` key of the :class:`DirectTECall` the ``call_te_impl_directly`` pass attaches.
META_KEY = "te_passes_direct_call"
#: ``node.meta`` key the lowering sets to the wrapper-global name it emitted (dumps, tests).
EMITTED_KEY = "te_passes_direct_call_name"
#: Prefix of the wrapper-module globals holding :class:`DirectTECall` objects.
NAME_PREFIX = "_te_direct_"


# --------------------------------------------------------------------------- the call object
_object_setattr = object.__setattr__
_profiler = torch.autograd.profiler
#: The dispatch guard around TE's impl (docs/internals.md; the cost: docs/benchmarks.md).
_below_autograd = torch._C._AutoDispatchBelowADInplaceOrView


def _make_builder(cls: type, fixed: Sequence[tuple[str, Any]], args: Sequence[tuple[str, int]]):
    """``build(flat) -> obj``: a fresh ``cls`` instance (``cls.__new__(cls)``, as TE's
    ``_ArgPlan.unpack``) with the ``fixed`` fields set to their values and the ``args`` fields to
    ``flat[i]``."""
    import keyword

    names = [n for n, _ in fixed] + [n for n, _ in args]
    plain = cls.__setattr__ is object.__setattr__ and all(n.isidentifier() and not keyword.iskeyword(n)
                                                          for n in names)
    if not plain:
        def build(flat, _new=cls.__new__, _cls=cls, _fixed=tuple(fixed), _args=tuple(args)):
            obj = _new(_cls)
            for name, v in _fixed:
                _object_setattr(obj, name, v)
            for name, i in _args:
                _object_setattr(obj, name, flat[i])
            return obj
        return build
    params = ", ".join(f"_c{j}=_v[{j}]" for j in range(len(fixed)))
    body = [f"    obj.{n} = _c{j}" for j, (n, _) in enumerate(fixed)]
    body += [f"    obj.{n} = flat[{int(i)}]" for n, i in args]
    src = "\n".join([f"def _make(_v, _new, _cls):",
                     f"  def build(flat, _new=_new, _cls=_cls{', ' + params if params else ''}):",
                     "    obj = _new(_cls)", *body, "    return obj",
                     "  return build"])
    env: dict[str, Any] = {}
    exec(compile(src, f"<te_passes direct call: {cls.__qualname__}>", "exec"), env)  # noqa: S102 - field names only
    return env["_make"]([v for _, v in fixed], cls.__new__, cls)


class DirectTECall:
    """``_register_base_op._impl`` of one TE base op node with its constant slots decoded once.

    Args:
        qualname: the base op, ``"transformer_engine_compile::linear_base"``.
        nargs: number of schema slots (the call takes exactly that many positional arguments).
        consts: ``((slot index, value), ...)`` for every slot whose value is the same object on
            every call: ``None`` for absent tensors, ``[]`` for empty ``Tensor[]`` slots, the
            ``OpaqueValueBundle`` constants (``_simple_meta``, ``<field>__meta``).

    Raises:
        DirectCallUnavailable: the op's kernel is not TE's (:func:`resolve_base_impl`), a slot
            the plan needs constant is not (config bundle, ``__meta`` bundles), a bundle lacks
            a field, or a process group name cannot be resolved without ``torch.distributed``.
    """

    def __init__(self, qualname: str, nargs: int, consts: Sequence[tuple[int, Any]]) -> None:
        self._qualname = qualname
        self._nargs = int(nargs)
        self._consts = tuple((int(i), v) for i, v in consts)
        b = resolve_base_impl(qualname)
        self._base = b
        plan = b.plan
        if len(plan.slot_names) != self._nargs:
            raise DirectCallUnavailable(f"{qualname}: {self._nargs} arguments for {len(plan.slot_names)} slots")
        index = {n: i for i, n in enumerate(plan.slot_names)}
        const = dict(self._consts)
        bundle = None
        if b.simple_slot in index:
            si = index[b.simple_slot]
            if si not in const:
                raise DirectCallUnavailable(f"{qualname}: the config bundle slot {b.simple_slot} is not a constant")
            bundle = const[si]
        fixed: list[tuple[str, Any]] = []
        args: list[tuple[str, int]] = []
        storages: list[tuple[str, Any, int]] = []
        pgs: list[tuple[str, str]] = []

        def slot_value(name: str, field: str) -> None:
            i = index[name]
            if i in const:
                fixed.append((field, const[i]))
            else:
                args.append((field, i))

        for f in plan.fields:
            kind = f.kind.name
            if kind == "TENSOR":
                slot_value(f.slots[0].name, f.name)
            elif kind == "TENSOR_OR_QUANTIZED":
                t_slot, inner_slot, meta_slot = (s.name for s in f.slots)
                mi = index[meta_slot]
                if mi not in const:
                    raise DirectCallUnavailable(f"{qualname}: {meta_slot} is not a constant")
                meta = const[mi]
                tq = meta[b.tq_kind_key]
                if tq == b.tq_kinds.NONE:
                    fixed.append((f.name, None))
                elif tq == b.tq_kinds.TENSOR:
                    slot_value(t_slot, f.name)
                else:  # STORAGE: rebuilt from this call's buffers, as TE's unpack does
                    ii = index[inner_slot]
                    if ii in const:
                        raise DirectCallUnavailable(f"{qualname}: storage field {f.name} has constant buffers")
                    storages.append((f.name, meta, ii))
            elif kind == "PROCESS_GROUP":
                if bundle is None:
                    continue  # TE's unpack leaves the field unset without a bundle
                pg = bundle[f.name]
                if pg is None:
                    fixed.append((f.name, None))
                elif b.resolve_process_group is None:
                    raise DirectCallUnavailable(f"{qualname}: {f.name} names process group {pg!r} but "
                                                "torch.distributed has no _resolve_process_group")
                else:
                    pgs.append((f.name, pg))
            elif kind == "SIMPLE":
                if bundle is not None:
                    try:
                        fixed.append((f.name, bundle[f.name]))
                    except KeyError:
                        raise DirectCallUnavailable(f"{qualname}: config bundle lacks field {f.name!r}") from None
            else:  # UNSUPPORTED: always None after unpack
                fixed.append((f.name, None))
        self._cls = plan.arg_type
        self._fixed = tuple(fixed)
        self._args = tuple(args)
        self._storages = tuple(storages)
        self._pgs = tuple(pgs)
        self._impl_cell, self._pack_cell = b.impl_cell, b.pack_cell
        self._unflatten, self._resolve_pg = b.storage_unflatten, b.resolve_process_group
        self._build = _make_builder(self._cls, self._fixed, self._args)

    # -- introspection (records, dumps, tests)
    @property
    def qualname(self) -> str:
        return self._qualname

    @property
    def impl(self) -> Any:
        """TE's impl the call runs (read from the op's closure cell now)."""
        return self._impl_cell.cell_contents

    @property
    def pack_result(self) -> Any:
        return self._pack_cell.cell_contents

    def describe(self) -> dict[str, Any]:
        """JSON-able summary: op, impl, tensor slots per field, constant / storage / group fields."""
        return {"op": self._qualname, "impl": impl_name(self.impl), "tensor_fields": dict(self._args),
                "constant_fields": len(self._fixed), "storage_fields": [n for n, _, _ in self._storages],
                "process_group_fields": [n for n, _ in self._pgs]}

    def __call__(self, *flat: Any) -> list[torch.Tensor]:
        obj = self._build(flat)
        if self._storages:
            unflatten = self._unflatten
            for name, meta, i in self._storages:
                _object_setattr(obj, name, unflatten(meta, flat[i]))
        if self._pgs:
            resolve = self._resolve_pg
            for name, pg in self._pgs:
                _object_setattr(obj, name, resolve(pg))
        if _profiler._is_profiler_enabled:
            with _profiler.record_function(f"te_passes.direct::{self._qualname}"), _below_autograd():
                return self._pack_cell.cell_contents(self._impl_cell.cell_contents(obj))
        with _below_autograd():
            return self._pack_cell.cell_contents(self._impl_cell.cell_contents(obj))

    def __reduce__(self):
        return _rebuild_direct_call, (self._qualname, self._nargs, self._consts)

    def __repr__(self) -> str:
        return f"DirectTECall({self._qualname}, impl={impl_name(self.impl)})"


class OpCall:
    """Stand-in for a :class:`DirectTECall` that could not be rebuilt when an FX-graph-cache
    entry was loaded: the base op's dispatcher call (``torch.ops.<ns>.<op>.default(*flat)``),
    i.e. what the graph would run without the direct call."""

    def __init__(self, qualname: str, reason: str) -> None:
        self._qualname, self.reason = qualname, reason
        self._op = overload(qualname)

    def __call__(self, *flat: Any) -> Any:
        return self._op(*flat)

    def __reduce__(self):
        return OpCall, (self._qualname, self.reason)

    def __repr__(self) -> str:
        return f"OpCall({self._qualname}: {self.reason})"


def _rebuild_direct_call(qualname: str, nargs: int, consts: tuple) -> Any:
    try:
        return DirectTECall(qualname, nargs, consts)
    except DirectCallUnavailable as e:
        log.warning("te_passes: cached direct call of %s cannot be rebuilt (%s); it calls the op instead",
                    qualname, e)
        return OpCall(qualname, str(e))
