"""Direct calls of TE's op implementations from Inductor's wrapper code (issue 13).

What a compiled TE op call costs without this module
----------------------------------------------------
Transformer Engine 2.20.2 registers each module's forward / backward as four
``torch.library`` custom ops (``transformer_engine/pytorch/dynamo/custom_op.py``
``register_custom_op``): the wrapper ops ``<name>`` / ``<name>_backward`` that graphs hold and
the base ops ``<name>_base`` / ``<name>_backward_base`` under them. Inductor emits a dispatcher
call of the wrapper op; that goes through the dispatcher, a Python autograd kernel
(``torch/_library/autograd.py`` ``make_autograd_impl``), the dynamo-disabled backend function,
TE's slot forwarder (``_make_slot_forwarder``), then the same again for the base op (plus
torch's output-aliasing check, ``custom_ops.py`` ``_c_check_aliasing_constraint``), and only then
TE's ``_register_base_op._impl``: ``plan.unpack(dict(zip(plan.slot_names, flat)))`` rebuilds the
args dataclass from the flat slots (every config-bundle field looked up, quantized inputs
rebuilt with ``_storage_unflatten``), ``impl(obj)`` is TE's real ``_linear_forward_impl`` /
``_linear_backward_impl``, and ``pack_result`` flattens its return into the op's ``Tensor[]``.

What this module does
---------------------
:class:`DirectTECall` is that ``_impl`` with everything constant done once: built from the base
op's own ``CustomOpDef`` (``torch._library.custom_ops.OPDEFS[qualname]``: the ``plan``, ``impl``
and ``pack_result`` its ``_impl`` closes over, checked by name and signature) and the node's
constant slot values (the config / ``__meta`` bundles that ``hoist_recipe_lookups`` made fixed
wrapper-module globals), it decodes every SIMPLE field, every NONE / TENSOR
tensor-or-quantized field and every unsupported (always ``None``) field once. Per call it makes
a fresh args object (TE impls set fields on it), sets the constant fields, the tensor fields
from its arguments, rebuilds STORAGE fields with TE's ``_storage_unflatten`` (their buffers
change every call) and resolves process groups by name (as TE's ``unpack`` does), then returns
``pack_result(impl(obj))`` under ``torch._C._AutoDispatchBelowAutograd`` (where the op's
kernel runs them). The output list is the op's, so Inductor's ``MultiOutput`` indexing is
unchanged. It takes the op's flat arguments in schema order (constants included, ignored: it
holds the same objects), so the generated line keeps the op call's shape::

    buf0 = _te_direct_0(primals_1, [], _te_const_0, primals_3, primals_2, None, [], _te_const_1, _te_const_2)

The Inductor side (:func:`ensure_lowering`): one lowering per TE base op, registered once
(idempotent, process-wide) for every TE op family by :func:`install_lowerings` at
``runtime.install()`` time (a pass only looks it up: :func:`lowering_reason`), built on Inductor's own ``make_fallback`` with the layout
constraint Inductor's implicit fallback would pick (``GraphLowering.call_function``,
torch 2.14.1). For a node whose ``meta`` carries a :class:`DirectTECall` under :data:`META_KEY`
(set by the ``call_te_impl_directly`` pass) it lets Inductor build the ``FallbackKernel`` as
usual and then names the call object as that kernel's ``python_kernel_name``, registered in
``V.graph.opaque_value_type_classes`` — the dict whose entries become wrapper-module globals
(``graph.py`` ``compile_to_module``) and are pickled with the FX-graph-cache entry
(``output_code.py`` ``CompiledFxGraph``; restored by ``CompiledFxGraphConstants.unwrap``).
Every other call of the base op (no plan: plain ``backend="inductor"`` graphs, a graph whose
plan was refused) lowers exactly as Inductor's implicit fallback would.

Cache: :class:`DirectTECall` pickles as ``(qualname, number of slots, constant slots)``; the
constants are the same objects as the ``_te_const_N`` globals (one ``pickle.dumps`` of the
cache entry keeps them shared). Unpickling rebuilds the plan from the op's ``CustomOpDef``;
when that is no longer possible (TE changed) it becomes :class:`OpCall`, a plain dispatcher
call of the base op, and logs why.

What a direct call skips, and why that is safe: the dispatcher (no autograd is recorded —
compiled graphs run TE ops with grad disabled, and the op's own autograd kernel would only
redispatch below autograd, which the guard reproduces), the wrapper's subclass flattening
(the pass proves no quantized-tensor subclass reaches the node, from ``meta["val"]``), the
dynamo-disable wrapper (the wrapper code is never traced) and torch's output-aliasing assertion
(a debugging check; TE's outputs are fresh tensors). Not seen by a direct call: Python
``TorchDispatchMode``\\ s active around the compiled call (they would see the op); under
``torch.profiler`` the call is recorded as a ``record_function`` range named after the op.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
from typing import Any, Sequence

import torch

from te_passes._logging import get_logger
from te_passes.te.graph_model import TE_OP_NAMESPACE

log = get_logger()

#: ``node.meta`` key of the :class:`DirectTECall` the ``call_te_impl_directly`` pass attaches.
META_KEY = "te_passes_direct_call"
#: ``node.meta`` key the lowering sets to the wrapper-global name it emitted (dumps, tests).
EMITTED_KEY = "te_passes_direct_call_name"
#: Prefix of the wrapper-module globals holding :class:`DirectTECall` objects.
NAME_PREFIX = "_te_direct_"

#: TE 2.20.2 ``dynamo/custom_op.py``: the module and qualname of the base op's kernel function
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
    """The four ops TE's ``register_custom_op(op_name=name)`` defines (TE 2.20.2
    ``dynamo/custom_op.py`` ``_register_custom_op_impl``), as qualnames
    ``transformer_engine_compile::<op>``: ``forward`` (``<name>``), ``backward``
    (``<name>_backward``), ``forward_base`` (``<name>_base``), ``backward_base``
    (``<name>_backward_base``)."""

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


def _opdefs() -> dict[str, Any]:
    from torch._library.custom_ops import OPDEFS

    return OPDEFS


def op_qualname(target: Any) -> str | None:
    """``"ns::op"`` of an ``OpOverload`` target, else ``None``."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    return None


def op_family(target: Any) -> TEOpFamily | None:
    """The TE op family of an FX node target (an ``OpOverload`` of any of its four ops), decoded
    from the op name and checked against ``torch._library.custom_ops.OPDEFS`` (all four ops
    defined, each wrapper's schema arguments equal to its base op's); ``None`` for anything else
    (not a ``transformer_engine_compile`` op, or a TE op outside such a family)."""
    qual = op_qualname(target)
    if qual is None or not qual.startswith(TE_OP_NAMESPACE + "::"):
        return None
    op = qual.split("::", 1)[1]
    stem = op.removesuffix("_base").removesuffix("_backward")
    ns = TE_OP_NAMESPACE
    fam = TEOpFamily(stem, f"{ns}::{stem}", f"{ns}::{stem}_backward", f"{ns}::{stem}_base",
                     f"{ns}::{stem}_backward_base")
    defs = _opdefs()
    if qual not in (fam.forward, fam.backward, fam.forward_base, fam.backward_base):
        return None
    if not all(q in defs for q in (fam.forward, fam.backward, fam.forward_base, fam.backward_base)):
        return None
    for w, b in ((fam.forward, fam.forward_base), (fam.backward, fam.backward_base)):
        if _arg_sig(defs[w]._opoverload) != _arg_sig(defs[b]._opoverload):
            return None
    return fam


def _arg_sig(op: torch._ops.OpOverload) -> tuple:
    return tuple((a.name, str(a.type)) for a in op._schema.arguments)


def overload(qualname: str) -> torch._ops.OpOverload:
    """The ``.default`` ``OpOverload`` of a custom op qualname (``_opoverload`` of its CustomOpDef)."""
    return _opdefs()[qualname]._opoverload


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
    """Read ``plan`` / ``impl`` / ``pack_result`` from the base op's ``CustomOpDef`` and check
    that the op's dispatcher kernel is exactly TE's ``_register_base_op._impl`` (TE 2.20.2).

    Checks: the op is a ``torch.library.custom_op`` (in ``OPDEFS``) with no device-specific
    kernel, disabled kernel, autocast or ``register_torch_dispatch`` rule (any of them would run instead
    of ``_impl``); no other dispatcher kernel for ``CPU`` / ``CUDA``; its init function is
    ``custom_op._register_base_op.<locals>._impl`` closing over exactly ``impl``,
    ``pack_result``, ``plan``; ``plan`` is TE's ``_ArgPlan`` whose ``slot_names`` equal the
    op's schema arguments and whose field kinds are the five TE 2.20 knows; ``impl`` and
    ``pack_result`` take one positional argument; TE's ``_storage_unflatten`` and the
    tensor-or-quantized tags exist.

    Raises:
        DirectCallUnavailable: any check fails (the message names it).
    """
    import sys

    defs = _opdefs()
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


# --------------------------------------------------------------------------- the call object
_object_setattr = object.__setattr__
_profiler = torch.autograd.profiler
_below_autograd = torch._C._AutoDispatchBelowAutograd


def _make_builder(cls: type, fixed: Sequence[tuple[str, Any]], args: Sequence[tuple[str, int]]):
    """``build(flat) -> obj``: a fresh ``cls`` instance (``cls.__new__(cls)``, as TE's
    ``_ArgPlan.unpack``) with the ``fixed`` fields set to their values and the ``args`` fields to
    ``flat[i]``.

    When ``cls`` keeps ``object.__setattr__`` (TE's args dataclasses: plain, ``slots=True``) the
    stores are generated attribute assignments (one ``STORE_ATTR`` each, the values bound as
    defaults), which is what ``object.__setattr__(obj, name, v)`` does without a call per field
    (cost: docs/benchmarks.md, issue 13); otherwise (a custom ``__setattr__``, or a field name that is not an identifier) a loop of
    ``object.__setattr__``, exactly as TE does."""
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

    Calling it with the op's flat arguments (tensors at the non-constant slots; values at the
    constant slots are ignored) returns exactly what the base op returns: the ``list[Tensor]``
    from TE's ``pack_result``.

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


# --------------------------------------------------------------------------- Inductor lowering
_lock = threading.Lock()
#: ``base OpOverload -> None (registered) | reason it is not``.
_LOWERINGS: dict[Any, str | None] = {}
_FEATURE_ERROR: list[str | None] = []


def _stored_names(fn: Any) -> frozenset[str]:
    """Attribute names a function's code refers to (``co_names``, nested code objects included),
    ``frozenset()`` for something without code."""
    code = getattr(getattr(fn, "__wrapped__", fn), "__code__", None)
    names: set[str] = set()
    stack = [code] if code is not None else []
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, type(c)))
    return frozenset(names)


def feature_error() -> str | None:
    """Why this torch's Inductor cannot take the direct-call lowering (``None``: it can).

    Needs (torch 2.14): ``torch._inductor.lowering.make_fallback`` / ``lowerings`` /
    ``tag_to_layout_constraint``, ``torch._library.utils.get_layout_constraint_tag``,
    ``ir.FallbackKernel`` with ``python_kernel_name`` (a class attribute) / ``unflatten_args``, and
    ``GraphLowering.opaque_value_type_classes`` / ``operations``. Instance attributes are checked
    in the names the constructor's code object stores (``__init__.__code__.co_names``), which
    costs microseconds; the result is computed once per process.
    """
    if _FEATURE_ERROR:
        return _FEATURE_ERROR[0]
    reason = None
    try:
        from torch._inductor import graph as G, ir, lowering as L
        from torch._library.utils import get_layout_constraint_tag  # noqa: F401

        for mod, names in ((L, ("make_fallback", "lowerings", "tag_to_layout_constraint")),
                           (ir, ("FallbackKernel",))):
            for n in names:
                if not hasattr(mod, n):
                    raise AttributeError(f"{mod.__name__}.{n}")
        # instance attributes: the names the constructors store (their code objects' co_names),
        # not their source (inspect.getsource would parse all of graph.py / ir.py)
        for cls, attrs in ((G.GraphLowering, ("opaque_value_type_classes", "operations")),
                           (ir.FallbackKernel, ("unflatten_args",))):
            missing = [a for a in attrs if a not in _stored_names(cls.__init__)]
            if missing:
                raise AttributeError(f"{cls.__name__} stores no {', '.join(missing)}")
        if not hasattr(ir.FallbackKernel, "python_kernel_name"):
            raise AttributeError("ir.FallbackKernel.python_kernel_name")
    except Exception as e:  # noqa: BLE001 - any API drift means "not available"
        reason = f"this torch's Inductor lacks what the direct-call lowering needs ({type(e).__name__}: {e})"
    _FEATURE_ERROR.append(reason)
    return reason


def ensure_lowering(base_op: torch._ops.OpOverload) -> str | None:
    """Register the direct-call lowering of TE base op ``base_op`` (idempotent, process-wide).

    Returns ``None`` when it is in place, else the reason it is not (torch API drift,
    :func:`feature_error`; another lowering already registered for the op). Built on
    ``torch._inductor.lowering.make_fallback(base_op, layout_constraint=...)`` with the
    constraint ``GraphLowering.call_function`` picks for a custom op without a lowering
    (``tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))``: the op's
    layout tag, else ``torch._functorch.config.custom_op_default_layout_constraint`` read now),
    so a node without a plan lowers exactly as before.
    """
    with _lock:
        if base_op in _LOWERINGS:
            return _LOWERINGS[base_op]
        reason = feature_error()
        if reason is None:
            try:
                reason = _register(base_op)
            except Exception as e:  # noqa: BLE001
                reason = f"registering the lowering failed ({type(e).__name__}: {e})"
        _LOWERINGS[base_op] = reason
        if reason is not None:
            log.info("te_passes: no direct-call lowering for %s: %s", base_op, reason)
        return reason


def install_lowerings() -> dict[str, str | None]:
    """Register the direct-call lowering of both base ops of every TE op family defined now
    (idempotent, process-wide; called by :func:`te_passes.runtime.install.install`, which the
    backend runs on every ``te_inductor`` call, so families TE registers later are picked up by
    the next call). A family is every full set of four ``transformer_engine_compile`` ops in
    ``torch._library.custom_ops.OPDEFS`` (:func:`op_family`). Returns :func:`lowering_state`."""
    prefix = TE_OP_NAMESPACE + "::"
    for qual in [q for q in _opdefs() if q.startswith(prefix) and q.endswith("_base")]:
        fam = op_family(overload(qual))
        if fam is None:
            continue
        for base_q in (fam.forward_base, fam.backward_base):
            base_op = overload(base_q)
            if base_op not in _LOWERINGS:
                ensure_lowering(base_op)
    return lowering_state()


def lowering_reason(base_op: torch._ops.OpOverload) -> str | None:
    """Why the direct-call lowering of ``base_op`` is not in place (``None``: it is). A pure
    lookup of what :func:`install_lowerings` registered: a pass asks, it never registers."""
    if base_op in _LOWERINGS:
        return _LOWERINGS[base_op]
    return (f"direct-call lowering not installed: no lowering registered for {base_op} "
            "(te_passes.runtime.install.install() registers one for each TE op family defined when it "
            "runs; the backend calls it on every te_inductor call)")


def lowering_state() -> dict[str, str | None]:
    """``{op: None | reason}`` for every base op :func:`ensure_lowering` was asked about."""
    return {str(k): v for k, v in _LOWERINGS.items()}


def _register(base_op: torch._ops.OpOverload) -> str | None:
    from torch._inductor import lowering as L
    from torch._inductor.virtualized import V
    from torch._library.utils import get_layout_constraint_tag

    if base_op in L.lowerings:
        return f"{base_op} already has an Inductor lowering that is not te_passes'"
    constraint = L.tag_to_layout_constraint(get_layout_constraint_tag(base_op, with_default=True))
    L.make_fallback(base_op, layout_constraint=constraint, warn=False)
    fallback = L.lowerings[base_op]

    def _lower_te_base_op(*args: Any, **kwargs: Any) -> Any:
        graph = V.graph
        first = len(graph.operations)
        out = fallback(*args, **kwargs)
        node = graph.current_node
        call = node.meta.get(META_KEY) if node is not None else None
        if call is not None:
            _emit_direct_call(graph, node, call, base_op, first, constraint)
        return out

    _lower_te_base_op._te_passes_direct = True  # type: ignore[attr-defined]
    _lower_te_base_op._is_fallback_handler = True  # type: ignore[attr-defined]  (it is one, plus a rename)
    L.lowerings[base_op] = _lower_te_base_op
    return None


def _emit_direct_call(graph: Any, node: torch.fx.Node, call: Any, base_op: Any, first: int, constraint: Any) -> None:
    """Name ``call`` as the kernel of the ``FallbackKernel`` Inductor just built for ``node``
    (or log why not and leave the dispatcher call)."""
    from torch._inductor import ir
    from torch._library.utils import get_layout_constraint_tag
    from torch._inductor import lowering as L

    def refuse(why: str) -> None:
        log.warning("te_passes: %s keeps its dispatcher call of %s: %s", node.name, base_op, why)
        node.meta[EMITTED_KEY] = None

    if not isinstance(call, DirectTECall):
        return refuse(f"meta[{META_KEY!r}] holds a {type(call).__name__}")
    if getattr(graph, "cpp_wrapper", False) or getattr(graph, "fx_wrapper", False):
        return refuse("the wrapper is not Inductor's Python wrapper (cpp_wrapper / fx_wrapper)")
    if getattr(graph, "parent", None) is not None:
        # a SubgraphLowering keeps its own opaque_value_type_classes, which never become globals
        return refuse("the node is lowered in an Inductor subgraph (its globals do not reach the wrapper module)")
    now = L.tag_to_layout_constraint(get_layout_constraint_tag(base_op, with_default=True))
    if now is not constraint:
        log.warning("te_passes: %s: the custom-op layout constraint changed since the lowering of %s was "
                    "registered (%s, now %s); the registered one was applied", node.name, base_op,
                    getattr(constraint, "__name__", constraint), getattr(now, "__name__", now))
    kernels = [op for op in graph.operations[first:]
               if isinstance(op, ir.FallbackKernel) and op.op_overload is base_op]
    if len(kernels) != 1:
        return refuse(f"expected one FallbackKernel for the node, Inductor built {len(kernels)}")
    kernel = kernels[0]
    args, kwargs = kernel.unflatten_args(kernel.inputs, kernel.constant_args)
    if kwargs or len(args) != call._nargs:
        return refuse(f"the kernel takes {len(args)} args / kwargs {sorted(kwargs)}; the plan has {call._nargs}")
    for i, v in call._consts:
        a = args[i]
        if not (a is v or (v is None and a is None) or (isinstance(v, list) and not v and isinstance(a, (list, tuple))
                                                        and not a)):
            return refuse(f"slot {i} is {type(a).__name__}, the plan holds another object (a later pass "
                          "replaced it?)")
    taken = graph.opaque_value_type_classes
    n = sum(1 for k in taken if k.startswith(NAME_PREFIX))
    while f"{NAME_PREFIX}{n}" in taken:
        n += 1
    name = f"{NAME_PREFIX}{n}"
    taken[name] = call
    kernel.python_kernel_name = name
    node.meta[EMITTED_KEY] = name
