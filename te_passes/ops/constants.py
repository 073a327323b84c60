"""Named TE constants: value-opaque constants built once and rendered as a wrapper-global name
inside their own graph's Inductor wrapper.

See docs/internals.md#te_passesopsconstantspy and docs/passes/hoist_te_constants.md."""

from __future__ import annotations

import contextlib
import enum
import functools
import sys
import threading
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.fx

from te_passes.fx.graph import PLAIN_TYPES as _PLAIN_TYPES
from te_passes.te.graph_constants import TEConstKind, te_const_kind


def rebuild_constant(v: Any) -> Any:
    """A new object equal to the value-opaque constant ``v``, built by evaluating ``v``'s own ``__fx_repr__``
    expression with its globals, as Inductor's wrapper does on every call.

    Raises:
        RuntimeError: the rebuilt object does not compare equal to ``v``.
    """
    return rebuild_cached(v, None)


def rebuild_cached(v: Any, cache: dict[int, tuple[Any, Any, dict]] | None) -> Any:
    """:func:`rebuild_constant`; with ``cache`` (one pass run's ``{id(v): (v, code, globals)}``) ``v``'s
    expression is rendered, compiled and checked once per object, and each call evaluates it into a new
    object (TE's rebuild functions are deterministic in the value)."""
    hit = cache.get(id(v)) if cache is not None else None
    if hit is not None and hit[0] is v:
        return eval(hit[1], dict(hit[2]))  # noqa: S307 - TE's own __fx_repr__ of a graph constant
    prev = getattr(_render, "full", False)
    _render.full = True  # rendered_in_full(), inlined (hot path)
    try:
        expr, env = type(v).__fx_repr__(v)
    finally:
        _render.full = prev
    code = _compiled(expr)
    fresh = eval(code, dict(env))  # noqa: S307 - TE's own __fx_repr__ of a graph constant
    if type(fresh) is not type(v) or fresh != v:
        raise RuntimeError(f"rebuilding {type(v).__name__} from its __fx_repr__ gave a different value")
    if cache is not None:
        cache[id(v)] = (v, code, env)
    return fresh


@functools.lru_cache(maxsize=4096)
def _compiled(expr: str):
    """``compile(expr)`` once per distinct expression (a graph repeats the same ones many times)."""
    return compile(expr, "<te_passes constant>", "eval")


# --------------------------------------------------------------------------- named constants
_WRAPPED_FLAG = "_te_passes_named_fx_repr"


def is_liftable_constant(v: Any) -> bool:
    """Whether ``v`` is a TE value-opaque constant (``OpaqueValueBundle`` or a quantizer, a
    ``torch._library.opaque_object`` constant type) that Inductor would rebuild per call."""
    if isinstance(v, (torch.fx.Node, enum.Enum, type, list, tuple, dict)) or isinstance(v, _PLAIN_TYPES):
        return False
    if te_const_kind(v) not in (TEConstKind.BUNDLE, TEConstKind.QUANTIZER):
        return False
    try:
        return _liftable_class(type(v))
    except _NotLiftableYet:
        return False


class _NotLiftableYet(Exception):
    """A class :func:`_liftable_class` does not accept (now: it may still be registered as value-opaque later)."""


@functools.lru_cache(maxsize=None)
def _liftable_class(t: type) -> bool:
    """``True`` for a TE bundle / quantizer class registered as a value-opaque constant type whose instances
    take weak references (name_constant keeps names by weak reference); raises :class:`_NotLiftableYet`
    otherwise, so that only positives are cached (past the plain-type and kind checks of
    :func:`is_liftable_constant` the answer depends only on the class)."""
    from torch._library.opaque_object import is_opaque_constant_type

    if is_opaque_constant_type(t) and t.__weakrefoffset__ != 0:
        return True
    raise _NotLiftableYet(t.__qualname__)


#: ``owner.meta`` key of the :class:`NamedConstants` table of a post-grad ``GraphModule``.
NAMES_KEY = "te_passes.named_constants"
_render = threading.local()


class NamedConstants:
    """The names :func:`name_constant` gave constants of one post-grad graph: per-graph state,
    kept in its owner's ``GraphModule.meta[NAMES_KEY]`` (the graph the pass rewrote and Inductor
    lowers), never in a process-global registry."""

    __slots__ = ("_by_id", "__weakref__")

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[Any, str]] = {}

    def add(self, v: Any, name: str) -> None:
        """Name ``v`` (``TypeError``: its class takes no weak reference)."""
        key = id(v)
        table = weakref.ref(self)
        self._by_id[key] = (weakref.ref(v, functools.partial(_forget, table, key)), name)

    def name(self, v: Any) -> str | None:
        """``v``'s name in this graph, or ``None``."""
        entry = self._by_id.get(id(v))
        return entry[1] if entry is not None and entry[0]() is v else None

    def names(self) -> set[str]:
        """The names of live named objects."""
        return {name for ref, name in list(self._by_id.values()) if ref() is not None}

    def __len__(self) -> int:
        return len(self.names())

    def __reduce__(self):
        return (NamedConstants, ())

    def __deepcopy__(self, memo: dict) -> "NamedConstants":
        return NamedConstants()


def _forget(table: Any, key: int, ref: Any) -> None:
    t = table()
    if t is not None:
        entry = t._by_id.get(key)
        if entry is not None and entry[0] is ref:  # not a newer object that reuses the id
            del t._by_id[key]


def named_constants(owner: Any) -> NamedConstants | None:
    """The :class:`NamedConstants` of post-grad graph ``owner`` (``None``: none named, or not a
    ``GraphModule``)."""
    meta = getattr(owner, "meta", None)
    table = meta.get(NAMES_KEY) if isinstance(meta, dict) else None
    return table if isinstance(table, NamedConstants) else None


@contextlib.contextmanager
def rendered_in_full() -> Iterator[None]:
    """Within this context (this thread; nests) every named constant's ``__fx_repr__`` is TE's
    full rebuild expression, even inside its owner's Inductor lowering."""
    prev = getattr(_render, "full", False)
    _render.full = True
    try:
        yield
    finally:
        _render.full = prev


def _current_lowering_module() -> Any:
    """The ``GraphModule`` Inductor is lowering on this thread (``V.graph.module``, the module its
    ``GraphLowering`` interprets), or ``None`` outside a lowering."""
    virtualized = sys.modules.get("torch._inductor.virtualized")
    if virtualized is None:  # Inductor not even imported: nothing is being lowered
        return None
    try:
        graph = virtualized.V.graph  # a NullHandler (no ``module``) when unset
    except Exception:  # noqa: BLE001 - a poisoned virtual (subprocess compile): not a lowering we named for
        return None
    return getattr(graph, "module", None)


def _name_in_lowering(v: Any) -> str | None:
    """``v``'s name if ``v`` is being rendered by its owner's Inductor lowering, else ``None``."""
    return None if getattr(_render, "full", False) else hoisted_name(v, _current_lowering_module())


def hoisted_name(v: Any, owner: torch.fx.GraphModule | None) -> str | None:
    """The wrapper-global name :func:`name_constant` gave ``v`` (``"_te_const_<n>"``) in post-grad
    graph ``owner``, or ``None`` (not named there, ``owner=None``). Names are kept by object
    identity: a copy of a named object is not named."""
    table = named_constants(owner)
    return table.name(v) if table is not None else None


def names_in(owner: torch.fx.GraphModule) -> set[str]:
    """The wrapper-global names :func:`name_constant` gave to live constants of post-grad graph
    ``owner`` (so a second hoisting run over the same graph picks names that are not taken)."""
    table = named_constants(owner)
    return table.names() if table is not None else set()


def can_name(v: Any) -> str | None:
    """Why :func:`name_constant` cannot name ``v`` (``None``: it can): its class's
    ``__fx_repr__`` must already be :func:`named_fx_repr`'s (``te_passes.compat.install.install()``
    rebinds it), since a pass changes no class while it runs."""
    cls = type(v)
    for klass in cls.__mro__:
        if "__fx_repr__" in klass.__dict__:
            if is_named_fx_repr(klass.__dict__["__fx_repr__"]):
                return None
            return (f"{cls.__qualname__}.__fx_repr__ is not wrapped: te_passes.compat.install.install() wraps "
                    "TE's constant classes (the backend's import calls it)")
    return f"{cls.__qualname__} has no __fx_repr__: not a value-opaque constant"


def name_constant(v: Any, name: str, owner: torch.fx.GraphModule) -> None:
    """Make ``v`` render as the bare name ``name``, with ``{name: v}`` as its globals, in the Python wrapper
    Inductor generates for the post-grad graph ``owner`` — and only there.

    Raises:
        TypeError: ``owner`` is not a ``torch.fx.GraphModule``, ``v``'s class has no
            ``__fx_repr__`` (not a value-opaque constant) or takes no weak reference.
        RuntimeError: ``v``'s class is not wrapped yet (``te_passes.compat.install.install()`` has not run since
            it was loaded; :func:`can_name` says so beforehand).
    """
    if not isinstance(owner, torch.fx.GraphModule):
        raise TypeError(f"name_constant: owner must be the post-grad torch.fx.GraphModule whose wrapper holds "
                        f"{name!r}, got {type(owner).__name__}")
    why = can_name(v)
    if why is not None:
        raise (TypeError if "no __fx_repr__" in why else RuntimeError)(f"name_constant: {why}")
    table = named_constants(owner)
    if table is None:
        table = owner.meta[NAMES_KEY] = NamedConstants()
    table.add(v, name)  # TypeError: no weak references


def named_fx_repr(orig: Callable) -> Callable:
    """The ``__fx_repr__`` a TE constant class gets in place of its own ``orig`` (the patch-table row
    ``lowering.named_constants`` of :mod:`te_passes.compat.lowering_rows` rebinds it): inside the Inductor
    lowering of the graph that named the object (:func:`name_constant`), ``(name, {name: obj})``;
    everywhere else ``orig(obj)``. Marked (:func:`is_named_fx_repr`)."""
    def __fx_repr__(self, _orig=orig):  # noqa: N807 - the protocol name
        name = _name_in_lowering(self)
        return (name, {name: self}) if name is not None else _orig(self)

    setattr(__fx_repr__, _WRAPPED_FLAG, True)
    __fx_repr__.__doc__ = getattr(orig, "__doc__", None)
    return __fx_repr__


def is_named_fx_repr(fn: Any) -> bool:
    """Whether ``fn`` (a class's ``__fx_repr__``) is :func:`named_fx_repr`'s."""
    return bool(getattr(fn, _WRAPPED_FLAG, False))


#: Where TE defines its value-opaque constant classes: the op-argument bundle and the base of every
#: quantizer (each registered quantizer class has its own ``__fx_repr__``, ``dynamo/quantizer_opaque.py``).
TE_CONSTANT_ROOTS: tuple[tuple[str, str], ...] = (
    ("transformer_engine.pytorch.dynamo.custom_op", "OpaqueValueBundle"),
    ("transformer_engine.pytorch.quantized_tensor", "Quantizer"),
)


def te_constant_classes() -> list[type]:
    """The loaded TE classes under :data:`TE_CONSTANT_ROOTS` (subclasses included) whose instances
    :func:`name_constant` can name: they define ``__fx_repr__``, are opaque constant types and take
    weak references. Empty while TE is not imported."""
    from torch._library.opaque_object import is_opaque_constant_type

    out: list[type] = []
    seen: set[type] = set()
    stack = [getattr(sys.modules.get(m), n, None) for m, n in TE_CONSTANT_ROOTS]
    while stack:
        cls = stack.pop()
        if not isinstance(cls, type) or cls in seen:
            continue
        seen.add(cls)
        stack.extend(cls.__subclasses__())
        if "__fx_repr__" in cls.__dict__ and cls.__weakrefoffset__ != 0 and is_opaque_constant_type(cls):
            out.append(cls)
    return sorted(out, key=lambda c: (c.__module__, c.__qualname__))
