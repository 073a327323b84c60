"""Guards for compiled graphs specialised on TE's Userbuffers (UB) state.

See docs/internals.md#te_passescompatubguardpy."""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
from typing import Any, Callable

import torch

from te_passes.te.ub import TE_UB_MODULE, UbConfigError, UbSnapshot
from te_passes.compat import table
from te_passes.compat.live_state import capture_ub
from te_passes.te.ub_queries import UB_QUERY_ATTR, ub_query_name



class UbStateChanged(RuntimeError):
    """A compiled graph specialised on UB state was called after that state changed, under
    ``te_passes.ub_on_change="error"`` (or it cannot be recompiled). The message names the graph,
    the folded queries whose values changed (old -> new) and the two fingerprints."""


# --------------------------------------------------------------------------- global UB state
@dataclasses.dataclass(slots=True)
class _UbGlobalState:
    """The process's UB state: the generation, the live snapshot (``None``: capture again), the registry key
    it was taken at, the frame tokens, the trace-time folds pending, ``token`` (the UB state token Dynamo
    guards on, ``"ub-<fingerprint[:16]>"``, renewed on every UB change: traced code reads ``_STATE.token``) and
    ``stats`` (the guard counters, :data:`guard_stats`)."""

    generation: int = 0
    snapshot: UbSnapshot | None = None
    registry_key: tuple | None = None
    frame_tokens: dict[int, str] = dataclasses.field(default_factory=dict)
    #: Folds made while Dynamo traced, keyed by ``str(CompileId)`` of the trace (:func:`drain_trace_folds`).
    pending_folds: dict[str, list["UbFold"]] = dataclasses.field(default_factory=dict)
    token: str = "ub-unset"
    stats: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(
        ("generation_changes", "slow_checks", "kept", "recompiles", "errors"), 0))


_STATE = _UbGlobalState()
_LOCK = threading.RLock()

#: Counters (the state's ``stats``, by its public name): ``generation_changes``, ``slow_checks`` (generation
#: mismatches examined), ``kept`` (change did not affect the graph), ``recompiles``, ``errors``.
guard_stats: dict[str, int] = _STATE.stats


def _registry_key() -> tuple | None:
    """Cheap identity of TE's registry: (id of the dict, its size, initialized, cuBLASMp)."""
    base = sys.modules.get(TE_UB_MODULE)
    if base is None:
        return None
    comms = getattr(base, "_ub_communicators", None)
    return (id(comms), len(comms) if comms else 0, bool(getattr(base, "_ub_initialized", False)),
            bool(getattr(base, "_ub_with_cublasmp", False)))


def _capture_locked() -> UbSnapshot:
    """Capture the live UB state and renew the UB state token (``_LOCK`` held)."""
    _STATE.registry_key = _registry_key()
    snap = _STATE.snapshot = capture_ub()
    _STATE.token = "ub-" + snap.fingerprint()[:16]
    return snap


def live_snapshot() -> UbSnapshot:
    """The live UB snapshot, captured once per UB generation (cached until the next change)."""
    snap = _STATE.snapshot
    if snap is None:
        with _LOCK:
            snap = _STATE.snapshot if _STATE.snapshot is not None else _capture_locked()
    return snap


def recapture() -> UbSnapshot:
    """Capture the live UB state again and renew the UB state token, without bumping the generation (the
    ``ub.*`` patch-table rows run it once they are in: the state may have changed while they were not)."""
    with _LOCK:
        _STATE.snapshot = None
        return _capture_locked()


def ub_global_state() -> _UbGlobalState:
    """The process's UB state object (``generation``, ``snapshot``) the graph guards compare against."""
    return _STATE


def ub_state_lock() -> threading.RLock:
    """The re-entrant lock held while the UB state changes and while a guard revalidates."""
    return _LOCK


def current_generation() -> int:
    """The UB generation: bumped by every ``initialize_ub``/``destroy_ub`` and :func:`on_ub_state_changed`."""
    return _STATE.generation


def on_ub_state_changed() -> None:
    """Record that TE's UB registry changed: bump the generation, re-capture, renew the token."""
    with _LOCK:
        _STATE.generation += 1
        _STATE.snapshot = None
        _STATE.stats["generation_changes"] += 1
        _capture_locked()


@torch.compiler.assume_constant_result
def sync_ub_state() -> bool:
    """Re-capture when TE's registry was replaced or resized behind te_passes' back (``module/base.py``'s
    ``_ub_communicators`` assigned directly). Called while Dynamo traces, *before* the UB state token
    (``_STATE.token``) is read, so the guard is installed on the current token. Returns ``True`` (a trace-time
    constant)."""
    if _STATE.snapshot is None or _registry_key() != _STATE.registry_key:
        on_ub_state_changed()
    return True


# --------------------------------------------------------------------------- trace-time folds
@dataclasses.dataclass(frozen=True)
class UbFold:
    """One folded UB query: ``api`` (``"get_ub_is_fp8"``, ``"get_ub.with_cublasmp"``, ...),
    constant ``args``, the ``value`` it was folded to, the FX ``node`` name (``None`` for
    trace-time folds) and ``source`` (``"fx"`` or ``"dynamo_trace"``)."""

    api: str
    args: tuple
    value: Any
    node: str | None = None
    source: str = "fx"


def _compile_key() -> str:
    from torch._guards import CompileContext

    return str(CompileContext.current_compile_id())


@torch.compiler.assume_constant_result
def _trace_time_query(token: str, api: str, name: str, use_fp8: bool) -> Any:
    """Evaluate a UB query on the live snapshot while Dynamo traces (``token`` only ties the
    call to the guarded global). Records the fold for ``fold_ub_predicates``' report."""
    try:
        value = live_snapshot().query(api, (name, bool(use_fp8)))
    except UbConfigError:
        # A registry that creates communicators on first lookup (a dict subclass with
        # __missing__, as test harnesses use) is not in the snapshot: ask TE, then re-capture.
        value = _live_query(api, name, bool(use_fp8))
        on_ub_state_changed()
    fold = UbFold(api, (name, bool(use_fp8)), value, None, "dynamo_trace")
    with _LOCK:
        pending = _STATE.pending_folds.setdefault(_compile_key(), [])
        if fold not in pending:
            pending.append(fold)
    return value


def _live_query(api: str, name: str, use_fp8: bool) -> Any:
    base = sys.modules.get(TE_UB_MODULE)
    get_ub = getattr(base, "get_ub", None)
    if get_ub is None:
        raise UbConfigError(f"{api}({name!r}, {use_fp8}): Transformer Engine is not loaded")
    method = "is_fp8_ubuf" if api == "get_ub_is_fp8" else api.split(".", 1)[1]
    try:
        return getattr(get_ub(name, use_fp8), method)()
    except (RuntimeError, KeyError) as e:
        raise UbConfigError(f"{api}({name!r}, use_fp8={use_fp8}): {e}") from None


def drain_trace_folds() -> list[UbFold]:
    """Take the UB folds Dynamo made while tracing the graph now being compiled (the current
    ``CompileId``); folds left over from other traces (a backend that never ran passes) are
    dropped."""
    with _LOCK:
        out = _STATE.pending_folds.pop(_compile_key(), [])
        _STATE.pending_folds.clear()
    return list(out)


def dynamo_stage_inputs() -> dict[str, Any]:
    """What the runtime saw while Dynamo traced the graph now being compiled (``ub_trace_folds``,
    ``ub_prev_token``), for the passes' ``PassContext.inputs`` (the backend calls this once)."""
    folds = drain_trace_folds()
    prev = None
    if folds:
        from torch._guards import CompileContext  # noqa: PLC0415 - torch._guards: only while compiling

        compile_id = CompileContext.current_compile_id()
        old = note_frame_token(compile_id, _STATE.token)
        prev = (compile_id, old, _STATE.token) if old is not None else None
    return {"ub_trace_folds": folds, "ub_prev_token": prev}


def guarded_get_ub_is_fp8(orig: Callable) -> Callable:
    """The drop-in for TE's ``module/base.py`` ``get_ub_is_fp8(name: str, use_fp8: bool) -> bool`` (``orig``) that
    row ``ub.get_ub_is_fp8`` (:mod:`te_passes.compat.ub.rows`) binds: while Dynamo traces, the value comes from the
    UB snapshot through :func:`_trace_time_query` (a constant guarded by the UB state token, ``_STATE.token``);
    otherwise ``orig(name, use_fp8)``, raising what it raises."""
    def get_ub_is_fp8(name: str, use_fp8: bool) -> bool:
        if torch.compiler.is_compiling() and sync_ub_state():
            return _trace_time_query(_STATE.token, "get_ub_is_fp8", name, use_fp8)
        return orig(name, use_fp8)

    get_ub_is_fp8.__doc__ = guarded_get_ub_is_fp8.__doc__
    get_ub_is_fp8.__wrapped__ = orig  # type: ignore[attr-defined]
    get_ub_is_fp8.__te_passes_original__ = orig  # type: ignore[attr-defined]
    return get_ub_is_fp8


def ub_query(name: str, use_fp8: bool, method: str = "is_fp8_ubuf") -> Any:
    """``get_ub(name, use_fp8).<method>()`` (``method``: one of :data:`te_passes.te.ub.UB_PREDICATE_METHODS`)
    that Dynamo folds to a guarded constant, for user code (the pybind call is a graph break)."""
    if torch.compiler.is_compiling() and sync_ub_state():
        return _trace_time_query(_STATE.token, f"get_ub.{method}", name, use_fp8)
    from transformer_engine.pytorch.module import base

    return getattr(base.get_ub(name, use_fp8), method)()


table.stamp(ub_query, table.register_stamp(UB_QUERY_ATTR, "a te_passes function te.ub_queries takes for a UB query "
                                          "(the value: the query's name)"), ub_query_name("ub_query"))


# --------------------------------------------------------------------------- TE hooks (rows: compat/ub/rows.py)
def state_change_hook(orig: Callable) -> Callable:
    """The drop-in for TE's ``module/base.py`` ``initialize_ub`` / ``destroy_ub`` (``orig``, same signature) that
    rows ``ub.initialize_ub`` / ``ub.destroy_ub`` bind: calls ``orig`` and then, also when it raises,
    :func:`on_ub_state_changed`. ``__te_passes_original__``: ``orig``."""
    @functools.wraps(orig)
    def hooked(*args: Any, **kwargs: Any) -> Any:
        try:
            return orig(*args, **kwargs)
        finally:
            on_ub_state_changed()

    hooked.__te_passes_original__ = orig  # type: ignore[attr-defined]
    return hooked


def note_frame_token(compile_id: Any, token: str) -> str | None:
    """Remember the UB token a Dynamo frame was traced with (``compile_id``: Dynamo's
    ``CompileId``); return the earlier, different token when this trace is a *recompile* of the
    same frame (``frame_compile_id > 0``), else ``None``."""
    frame_id = getattr(compile_id, "frame_id", None)
    if frame_id is None:
        return None
    with _LOCK:
        prev = _STATE.frame_tokens.get(frame_id)
        _STATE.frame_tokens[frame_id] = token
    if not getattr(compile_id, "frame_compile_id", 0):
        return None  # first compile of this frame (frame ids restart after torch._dynamo.reset())
    return prev if prev is not None and prev != token else None
