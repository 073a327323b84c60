"""The patch table: every change te_passes makes to Transformer Engine or torch is one :class:`Row`.

A row names what it changes, the TE and torch versions it was checked against, why it exists and when to
drop it; its ``plan`` builds the replacement objects and returns the :data:`Change`\\ s to make (or raises
:class:`Refused` with the reason). Only this module applies them (``setattr`` on a foreign object,
``torch.compiler.substitute_in_graph``, Inductor's ``lowerings`` table, Dynamo config toggles), under one
lock, at one moment (:func:`install`); :func:`revert` undoes them newest first; :func:`status` says for
every row whether it is active or why it was refused. Marker attributes te_passes stamps on foreign
objects at run time go through :func:`stamp` (their names are registered in :data:`STAMPS`).

The rows themselves live in :mod:`te_passes.compat.rows` (one ordered registry, by capability).
docs/design.md "The compat fence" prints the table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import types
from typing import Any, Callable, Iterator, Mapping, Sequence, Union

import torch
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from te_passes._logging import get_logger
from te_passes.te.version import te_version, torch_version_string

log = get_logger()


class Refused(Exception):
    """Raised by a row's ``plan`` when the installed TE / torch does not have what the row was checked
    against; the message is the reason :func:`status` reports."""


@dataclasses.dataclass(frozen=True)
class Rebind:
    """``setattr(owner, attr, new)``; reverted by putting the previous value back (only while ``new`` is still
    there). ``owner``: a module, class or object of TE / torch."""

    owner: Any
    attr: str
    new: Any


@dataclasses.dataclass(frozen=True)
class Substitute:
    """``torch.compiler.substitute_in_graph(original, skip_signature_check=True)(polyfill)``: Dynamo traces
    ``polyfill`` wherever it meets ``original``. Reverted with torch >= 2.15's
    ``torch._dynamo.decorators._unregister_substitute_in_graph``; on torch 2.14 it stays (status says so)."""

    original: Callable[..., Any]
    polyfill: Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class Lowering:
    """``torch._inductor.lowering.lowerings[op] = fn`` (Inductor's lowering table); reverted by restoring the
    previous entry (or removing it). ``realized_inputs`` / ``layout_constraint``: what Inductor's
    ``make_fallback`` records besides the lowering (``add_needs_realized_inputs``, ``add_layout_constraint``,
    read by ``GraphLowering.run_node``); removed again on revert when this change added them."""

    op: Any
    fn: Callable[..., Any]
    realized_inputs: bool = False
    layout_constraint: Any = None


@dataclasses.dataclass(frozen=True)
class Toggle:
    """``setattr(config, attr, value)`` while Dynamo traces a frame of ``scope`` (:func:`apply_toggles`), not at
    install. ``config``: a torch config module (e.g. ``torch._dynamo.config``); ``scope``: ``"te_inductor"``
    (a frame te_inductor compiles) or ``"step"`` (a frame compiled while a ``compile_step`` step runs)."""

    config: Any
    attr: str
    value: Any
    scope: str = "te_inductor"


Change = Union[Rebind, Substitute, Lowering, Toggle]


@dataclasses.dataclass(frozen=True)
class Row:
    """One change of TE or torch behaviour.

    Attributes:
        name: ``"<capability>.<what>"``, unique (e.g. ``"ub.initialize_ub"``).
        target: what it changes, as a person reads it (``"transformer_engine.pytorch.module.base.initialize_ub"``).
        kind: ``"rebind"``, ``"substitute"``, ``"lowering"``, ``"toggle"`` (the :data:`Change` types it makes).
        why: why te_passes needs it.
        drop_when: the upstream issue / release that makes it unnecessary.
        te: the TE versions it was checked against (a PEP 440 specifier; ``""``: touches no TE object).
        torch: the torch versions it was checked against (PEP 440 specifier).
        plan: builds and returns the changes; raises :class:`Refused` (or ``ImportError``) with the reason.
        after: runs after the changes are made (e.g. a sweep of live TE modules); its errors are logged.
        sweep: ``plan`` runs again at every :func:`install` while the row is active, and the changes not yet
            made are made (TE classes / op families defined after the first install; a :class:`Lowering`
            even inside a trace, other changes only outside one).
    """

    name: str
    target: str
    kind: str
    why: str
    drop_when: str
    te: str
    torch: str
    plan: Callable[[], Sequence[Change]]
    after: Callable[[], None] | None = None
    sweep: bool = False

    def version_refusal(self, te: str | None, torch_v: str) -> str | None:
        """Why this row does not apply to TE ``te`` / torch ``torch_v`` (``None``: it does)."""
        for what, spec, have in (("torch", self.torch, torch_v), ("TE", self.te, te)):
            try:
                if spec and (have is None or not SpecifierSet(spec).contains(Version(have).base_version,
                                                                             prereleases=True)):
                    return f"checked against {what} {spec}, installed {what} is {have or 'not importable'}"
            except (InvalidSpecifier, ValueError) as e:
                return f"bad version range {spec!r} / {have!r}: {e}"
        return None


@dataclasses.dataclass(frozen=True)
class RowStatus:
    """What :func:`install` did with a row: ``active`` with the number of ``changes`` made, or the ``reason``
    it was refused (``"not installed yet"`` before :func:`install`)."""

    name: str
    active: bool
    changes: int = 0
    reason: str | None = None


@dataclasses.dataclass
class _TableState:
    """The table's process state (changed under ``_LOCK``): the registered rows in order, their status, the
    undos ((row name, undo), oldest first), each row's toggles and the keys of its changes (for sweeps), and
    the registered stamps (name -> why)."""

    rows: list[Row] = dataclasses.field(default_factory=list)
    status: dict[str, RowStatus] = dataclasses.field(default_factory=dict)
    undo: list[tuple[str, Callable[[], None]]] = dataclasses.field(default_factory=list)
    toggles: dict[str, list[Toggle]] = dataclasses.field(default_factory=dict)
    made: dict[str, set[tuple[Any, ...]]] = dataclasses.field(default_factory=dict)
    stamps: dict[str, str] = dataclasses.field(default_factory=dict)


_LOCK = threading.RLock()
_TABLE = _TableState()
#: Marker attributes te_passes stamps on foreign objects at run time (through :func:`stamp`): name -> why
#: (a read-only view; :func:`register_stamp` adds).
STAMPS: Mapping[str, str] = types.MappingProxyType(_TABLE.stamps)


def _key(change: Change) -> tuple[Any, ...]:
    if isinstance(change, (Rebind, Toggle)):
        return (type(change).__name__, id(change.owner if isinstance(change, Rebind) else change.config), change.attr)
    return (type(change).__name__, id(change.original if isinstance(change, Substitute) else change.op))


def register_stamp(name: str, why: str) -> str:
    """Register marker attribute ``name`` (must start with ``_te_passes_``) with ``why``; returns ``name``.

    Raises:
        ValueError: the name does not start with ``_te_passes_`` or is registered with another reason."""
    if not name.startswith("_te_passes_"):
        raise ValueError(f"stamp {name!r}: te_passes' marker attributes start with '_te_passes_'")
    if _TABLE.stamps.setdefault(name, why) != why:
        raise ValueError(f"stamp {name!r} is already registered for: {STAMPS[name]}")
    return name


def stamp(obj: Any, name: str, value: Any) -> None:
    """``setattr(obj, name, value)`` for a registered marker (:func:`register_stamp`).

    Raises:
        KeyError: ``name`` is not registered. AttributeError / TypeError: ``obj`` takes no attributes."""
    if name not in STAMPS:
        raise KeyError(f"te_passes marker {name!r} is not registered (compat.table.register_stamp)")
    setattr(obj, name, value)


def _apply(change: Change) -> Callable[[], None]:
    """Make one change; return its undo (which leaves a name someone else changed after us alone)."""
    if isinstance(change, Rebind):
        o, a = change.owner, change.attr  # a class: its own __dict__ (an inherited value is not ours to put back)
        read = (lambda: o.__dict__.get(a, MISSING)) if isinstance(o, type) else (lambda: getattr(o, a, MISSING))
        old = read()
        setattr(o, a, change.new)

        def undo() -> None:
            if read() is change.new:
                set_state(o, a, old)
        return undo
    if isinstance(change, Substitute):
        torch.compiler.substitute_in_graph(change.original, skip_signature_check=True)(change.polyfill)
        unregister = getattr(torch._dynamo.decorators, "_unregister_substitute_in_graph", None)
        return (lambda: unregister(change.original)) if unregister is not None else (lambda: None)
    if isinstance(change, Lowering):
        from torch._inductor import lowering as L

        op, old = change.op, L.lowerings.get(change.op, MISSING)
        added_realized = change.realized_inputs and op not in L.needs_realized_inputs
        constraints = getattr(L, "_maybe_layout_constraints", {})
        added_constraint = change.layout_constraint is not None and op not in constraints
        if added_realized:
            L.add_needs_realized_inputs(op)
        if added_constraint:
            L.add_layout_constraint(op, change.layout_constraint)
        L.lowerings[op] = change.fn

        def undo_lowering() -> None:
            if L.lowerings.get(op) is not change.fn:
                return
            if old is MISSING:
                del L.lowerings[op]
            else:
                L.lowerings[op] = old
            if added_realized:
                L.needs_realized_inputs.discard(op)
            if added_constraint:
                constraints.pop(op, None)
        return undo_lowering
    raise TypeError(f"not a patch-table change: {change!r}")


def _in_trace() -> bool:
    return torch._guards.TracingContext.try_get() is not None


def install(rows: Sequence[Row]) -> list[RowStatus]:
    """Apply every row not yet active whose versions match (idempotent, thread-safe), and make the new changes of
    the active sweep rows (:func:`sweep`); refused rows keep their reason. ``rows``: the registry
    (:data:`te_passes.compat.rows.ROWS`, through :func:`te_passes.compat.install.install`). While Dynamo compiles
    a frame (a trace may have read and guarded on the names) only Inductor lowerings are registered; the
    other rows wait ("pending") for the next call outside a trace. Returns the status of ``rows``.

    Raises:
        ValueError: two rows share a name."""
    with _LOCK:
        names = [r.name for r in rows]
        if len(set(names)) != len(names):
            raise ValueError(f"patch table: duplicate row names {sorted({n for n in names if names.count(n) > 1})}")
        known = {r.name for r in _TABLE.rows}
        _TABLE.rows.extend(r for r in rows if r.name not in known)
        active_sweeps = [r for r in rows if r.sweep and refusal(r.name) is None]
        for row in rows:
            st = _TABLE.status.get(row.name)
            if st is not None and (st.active or not st.reason.startswith("pending")):
                continue
            why, changes = row.version_refusal(te_version(), torch_version_string()), []
            try:
                changes = [] if why else list(row.plan())
            except (Refused, ImportError, AttributeError) as e:
                why = str(e) if isinstance(e, Refused) else f"{type(e).__name__}: {e}"
                log.info("te_passes: patch %s refused: %s", row.name, why)
            if not why and _in_trace() and not all(isinstance(c, Lowering) for c in changes):
                why = "pending: install() was called inside a trace"
            done: list[Callable[[], None]] = []
            try:
                for c in [] if why else changes:
                    if not isinstance(c, Toggle):
                        done.append(_apply(c))
            except (TypeError, ValueError, AttributeError) as e:  # substitute_in_graph: someone registered one
                for undo in reversed(done):
                    undo()
                why = f"{type(e).__name__}: {e}"
            if why:
                _TABLE.status[row.name] = RowStatus(row.name, False, reason=why)
                continue
            _TABLE.undo.extend((row.name, u) for u in done)
            _TABLE.made[row.name] = {_key(c) for c in changes}
            _TABLE.toggles[row.name] = [c for c in changes if isinstance(c, Toggle)]
            _TABLE.status[row.name] = RowStatus(row.name, True, len(changes))
            if row.after is not None:
                try:
                    row.after()
                except Exception as e:  # noqa: BLE001 - a sweep must not undo an install
                    log.warning("te_passes: patch %s: after-install step failed: %s: %s", row.name, type(e).__name__, e)
        sweep(active_sweeps)
        return [_TABLE.status[r.name] for r in rows]


def sweep(rows: Sequence[Row] | None = None) -> None:
    """Make the changes not made yet of every active sweep row of ``rows`` (default: every known row; see
    :attr:`Row.sweep`); rows that are not active stay so (a reverted row is applied again only by
    :func:`install`). A failing ``plan`` or change is logged, the rest is made."""
    with _LOCK:
        for row in _TABLE.rows if rows is None else rows:
            if not (row.sweep and refusal(row.name) is None):
                continue
            try:
                changes = list(row.plan())
            except (Refused, ImportError, AttributeError) as e:
                log.info("te_passes: patch %s: sweep refused: %s", row.name, e)
                continue
            made = _TABLE.made.setdefault(row.name, set())
            for c in changes:
                if _key(c) in made or (_in_trace() and not isinstance(c, Lowering)):
                    continue
                try:
                    if isinstance(c, Toggle):
                        _TABLE.toggles.setdefault(row.name, []).append(c)
                    else:
                        _TABLE.undo.append((row.name, _apply(c)))
                except (TypeError, ValueError, AttributeError) as e:
                    log.warning("te_passes: patch %s: sweep change %r failed: %s", row.name, c, e)
                    continue
                made.add(_key(c))
            _TABLE.status[row.name] = RowStatus(row.name, True, len(made))


def revert(names: Sequence[str] | None = None) -> None:
    """Undo the changes of the rows ``names`` (default: every row), newest first; those rows read
    ``"reverted"`` in :func:`status` and :func:`install` applies them again."""
    with _LOCK:
        keep = []
        for name, undo in reversed(_TABLE.undo):
            if names is None or name in names:
                undo()
            else:
                keep.append((name, undo))
        _TABLE.undo[:] = list(reversed(keep))
        for row in _TABLE.rows:
            if names is None or row.name in names:
                _TABLE.status[row.name] = RowStatus(row.name, False, reason="pending: reverted")
                _TABLE.toggles.pop(row.name, None)
                _TABLE.made.pop(row.name, None)


def status() -> list[RowStatus]:
    """Every known row, in registry order: active, or why not."""
    with _LOCK:
        return [_TABLE.status.get(r.name, RowStatus(r.name, False, reason="pending: not installed yet"))
                for r in _TABLE.rows]


def refusal(name: str) -> str | None:
    """Why row ``name`` is not active (``None``: it is in effect)."""
    st = _TABLE.status.get(name)
    return None if st and st.active else (st.reason if st else "pending: not installed yet")


def rows() -> list[Row]:
    """The rows :func:`install` has seen, in registry order."""
    with _LOCK:
        return list(_TABLE.rows)


def apply_toggles(scope: str = "te_inductor") -> Callable[[], None]:
    """Set the :class:`Toggle` changes of ``scope`` of every active row; returns the function that puts the previous
    values back."""
    with _LOCK:
        toggles = [t for row in _TABLE.rows for t in _TABLE.toggles.get(row.name, ()) if t.scope == scope]
    old = []
    for t in toggles:
        old.append((t, getattr(t.config, t.attr)))
        setattr(t.config, t.attr, t.value)

    def restore() -> None:
        for t, v in reversed(old):
            setattr(t.config, t.attr, v)
    return restore


#: :func:`set_state`'s ``value`` that deletes the attribute.
MISSING: Any = object()


def set_state(obj: Any, attr: str, value: Any) -> None:
    """``obj.attr = value`` (:data:`MISSING`: delete it) for run-time *state* of TE or torch, not behaviour: putting
    back what a failed ``te.make_graphed_callables`` left on a module class, a test's stand-in UB registry.
    Every such write goes through here or :func:`scoped_attr` so the fence test can see them."""
    if value is MISSING:
        if attr in getattr(obj, "__dict__", {}):
            delattr(obj, attr)
    else:
        setattr(obj, attr, value)


@contextlib.contextmanager
def scoped_attr(obj: Any, attr: str, value: Any) -> Iterator[None]:
    """``obj.attr = value`` for the ``with`` block, then the previous value again (also on an exception):
    run-time state of TE that one call must see differently (e.g. TE's CUDA-graph capture flag)."""
    old = getattr(obj, attr)
    setattr(obj, attr, value)
    try:
        yield
    finally:
        setattr(obj, attr, old)


def swap_state(obj: Any, attrs: Sequence[str], values: Sequence[Any]) -> tuple[Any, ...]:
    """Set ``obj``'s ``attrs`` to ``values`` (run-time state of TE, as :func:`set_state`) and return their previous
    values (call again with them to put them back); for a per-call path where a context manager costs too much
    (the te.autocast state around a compiled call)."""
    old = tuple(getattr(obj, a) for a in attrs)
    for a, v in zip(attrs, values):
        setattr(obj, a, v)
    return old
