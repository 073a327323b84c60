"""Guards for compiled graphs specialised on TE's Userbuffers (UB) state.

Why: TE 2.20.2 folds ``get_ub_is_fp8(name, use_fp8)`` with
``torch.compiler.assume_constant_result`` — Dynamo installs no guard for it — and so
``destroy_ub()`` ends with a process-wide ``torch.compiler.reset()``. te_passes replaces both
with two layers of guards, so that changing the UB state recompiles exactly the graphs that
depend on it.

Layer 1 — Dynamo guards (graphs whose *Python* read UB state while Dynamo traced it).
    :func:`install_te_ub_hooks` rebinds TE's ``get_ub_is_fp8`` (in ``module/base.py`` and in
    every ``transformer_engine`` module that imported it: ``linear``, ``layernorm_linear``,
    ``layernorm_mlp``) to a guarded version (:func:`_make_guarded_get_ub_is_fp8`). While compiling, that function reads
    the module global :data:`UB_STATE_TOKEN` — Dynamo installs an ``EQUALS_MATCH`` guard
    ``G['__import_te_passes_dot_runtime_dot_ub_guard'].UB_STATE_TOKEN == 'ub-…'`` on the frame that
    traced it — and returns the value from te_passes' UB snapshot (a constant, recorded for the
    report). The token is derived from the snapshot fingerprint and is renewed by hooks on
    ``initialize_ub``/``destroy_ub`` (:func:`on_ub_state_changed`). A frame whose guard fails
    is re-traced by Dynamo and recompiled by ``te_inductor``; frames that never read UB state
    keep their compiled code. This works for any backend, not only ``te_inductor``.
    ``is_ub_initialized()`` / ``using_cublasmp_backend()`` need no hook: Dynamo traces them and
    guards TE's ``_ub_initialized`` / ``_ub_with_cublasmp`` globals itself.

Layer 2 — compiled-graph guards (:func:`wrap_with_te_state_guard`, called by
    :mod:`te_passes.backend` on every compiled graph). A graph on which
    ``fold_ub_predicates`` recorded a dependence — a folded FX query node (graphs from
    ``torch.fx.symbolic_trace`` with TE functions as leaves, hand-built graphs, offline replay)
    or a checked TE op UB configuration — is wrapped in a callable that compares one integer,
    the UB generation, per call. On a change it re-evaluates the recorded folds and checks
    against the live state: unchanged values -> keep the compiled code; a check now failing ->
    :class:`~te_passes.te.ub.UbConfigError`; changed folded values -> recompile *this* graph
    from its pre-pass copy through ``te_inductor`` (``te_passes.ub_on_change="recompile"``,
    default) or raise :class:`UbStateChanged` (``"error"``). Graphs with no UB dependence are
    returned unwrapped (zero cost).

CUDA graph trees: layer 1 runs in Dynamo's guard check, before the cudagraph-tree callable is
entered, so a stale recorded graph is never replayed; the re-traced graph gets a new function
id in the tree. Layer 2 swaps the inner compiled callable before calling it, never while a
graph is being recorded or replayed; the old callable (and its tree node) is just no longer
called. Neither layer calls ``torch.compiler.reset()``.

Limits: Dynamo keeps at most ``torch._dynamo.config.recompile_limit`` (8) variants per frame,
so more than that many distinct UB states seen by one frame fall back to eager, as for any
guard. An explicit ``te_passes.ub_snapshot`` (offline use) is not guarded against the live
registry.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
from typing import Any, Callable

import torch
import torch.fx

from te_passes.fx.graph import copy_graph
from te_passes.te import graph_model as gmod
from te_passes.te.ub import TE_UB_MODULE, UB_PREDICATE_METHODS, UbConfigError, UbSnapshot
from te_passes.te.ub_queries import ub_query_function
from te_passes.te.ub_rules import check_linear_ub_config
from te_passes.te.version import te_module

#: The UB state token Dynamo guards on (``"ub-<fingerprint[:16]>"``); renewed on every UB change.
UB_STATE_TOKEN: str = "ub-unset"


class UbStateChanged(RuntimeError):
    """A compiled graph specialised on UB state was called after that state changed, under
    ``te_passes.ub_on_change="error"`` (or it cannot be recompiled). The message names the graph,
    the folded queries whose values changed (old -> new) and the two fingerprints."""


# --------------------------------------------------------------------------- global UB state
class _UbGlobalState:
    __slots__ = ("generation", "snapshot", "registry_key", "hooks_installed", "originals", "replacements",
                 "frame_tokens")

    def __init__(self) -> None:
        self.generation = 0
        self.snapshot: UbSnapshot | None = None
        self.registry_key: tuple | None = None
        self.hooks_installed = False
        self.originals: dict[str, Callable] = {}
        self.replacements: dict[str, Callable] = {}
        self.frame_tokens: dict[int, str] = {}


_STATE = _UbGlobalState()
_LOCK = threading.RLock()

#: Counters: ``generation_changes``, ``slow_checks`` (generation mismatches examined),
#: ``kept`` (change did not affect the graph), ``recompiles``, ``errors``.
guard_stats: dict[str, int] = {"generation_changes": 0, "slow_checks": 0, "kept": 0,
                               "recompiles": 0, "errors": 0}


def _token_for(snap: UbSnapshot) -> str:
    return "ub-" + snap.fingerprint()[:16]


def _registry_key() -> tuple | None:
    """Cheap identity of TE's registry: (id of the dict, its size, initialized, cuBLASMp)."""
    base = sys.modules.get(TE_UB_MODULE)
    if base is None:
        return None
    comms = getattr(base, "_ub_communicators", None)
    return (id(comms), len(comms) if comms else 0, bool(getattr(base, "_ub_initialized", False)),
            bool(getattr(base, "_ub_with_cublasmp", False)))


def live_snapshot() -> UbSnapshot:
    """The live UB snapshot, captured once per UB generation (cached until the next change)."""
    global UB_STATE_TOKEN
    snap = _STATE.snapshot
    if snap is None:
        with _LOCK:
            snap = _STATE.snapshot
            if snap is None:
                _STATE.registry_key = _registry_key()
                snap = UbSnapshot.capture()
                _STATE.snapshot = snap
                UB_STATE_TOKEN = _token_for(snap)
    return snap


def current_generation() -> int:
    """The UB generation: bumped by every ``initialize_ub``/``destroy_ub`` and :func:`on_ub_state_changed`."""
    return _STATE.generation


def on_ub_state_changed() -> None:
    """Record that TE's UB registry changed: bump the generation, re-capture, renew the token."""
    global UB_STATE_TOKEN
    with _LOCK:
        _STATE.generation += 1
        _STATE.snapshot = None
        guard_stats["generation_changes"] += 1
        _STATE.registry_key = _registry_key()
        snap = UbSnapshot.capture()
        _STATE.snapshot = snap
        UB_STATE_TOKEN = _token_for(snap)


@torch.compiler.assume_constant_result
def sync_ub_state() -> bool:
    """Re-capture when TE's registry was replaced or resized behind te_passes' back (code that
    assigns ``module/base.py``'s ``_ub_communicators`` directly instead of calling
    ``initialize_ub``). Called while Dynamo traces, *before* :data:`UB_STATE_TOKEN` is read, so
    the guard is installed on the current token. Returns ``True`` (a trace-time constant)."""
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


#: Folds made while Dynamo traced, keyed by ``str(CompileId)`` of the trace.
_PENDING_TRACE_FOLDS: dict[str, list[UbFold]] = {}


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
        pending = _PENDING_TRACE_FOLDS.setdefault(_compile_key(), [])
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
        out = _PENDING_TRACE_FOLDS.pop(_compile_key(), [])
        _PENDING_TRACE_FOLDS.clear()
    return list(out)


def dynamo_stage_inputs() -> dict[str, Any]:
    """What the runtime saw while Dynamo traced the graph now being compiled, for the passes'
    ``PassContext.inputs`` (the backend calls this once, before the Dynamo stage):

    * ``"ub_trace_folds"`` — :func:`drain_trace_folds` (the folds are taken out of the runtime);
    * ``"ub_prev_token"`` — ``(compile_id, old token, current token)`` when this trace folded UB
      queries and is a recompile of a frame first traced under another UB token
      (:func:`note_frame_token`), else ``None``.
    """
    folds = drain_trace_folds()
    prev = None
    if folds:
        from torch._guards import CompileContext  # noqa: PLC0415 - torch._guards: only while compiling

        compile_id = CompileContext.current_compile_id()
        old = note_frame_token(compile_id, UB_STATE_TOKEN)
        prev = (compile_id, old, UB_STATE_TOKEN) if old is not None else None
    return {"ub_trace_folds": folds, "ub_prev_token": prev}


def _make_guarded_get_ub_is_fp8(orig: Callable) -> Callable:
    """Build the drop-in for TE's ``module/base.py`` ``get_ub_is_fp8`` (see :func:`install_te_ub_hooks`).

    Eager: TE's own function (``get_ub(name, use_fp8).is_fp8_ubuf()``). While compiling: a
    constant from the live UB snapshot, guarded by Dynamo on :data:`UB_STATE_TOKEN` (TE's
    version is an unguarded ``assume_constant_result``).

    The returned function raises :class:`~te_passes.te.ub.UbConfigError` while compiling, or
    TE's ``RuntimeError``/``KeyError`` in eager, when the buffer does not exist.
    """
    def get_ub_is_fp8(name: str, use_fp8: bool) -> bool:
        if torch.compiler.is_compiling() and sync_ub_state():
            return _trace_time_query(UB_STATE_TOKEN, "get_ub_is_fp8", name, use_fp8)
        return orig(name, use_fp8)

    get_ub_is_fp8.__doc__ = _make_guarded_get_ub_is_fp8.__doc__
    get_ub_is_fp8.__wrapped__ = orig  # type: ignore[attr-defined]
    get_ub_is_fp8.__te_passes_original__ = orig  # type: ignore[attr-defined]
    return get_ub_is_fp8


def ub_query(name: str, use_fp8: bool, method: str = "is_fp8_ubuf") -> Any:
    """``get_ub(name, use_fp8).<method>()`` that Dynamo folds to a guarded constant.

    For user code: calling a pybind communicator method while Dynamo traces is a graph break;
    this returns the same value with a guard instead. ``method`` is one of
    :data:`te_passes.te.ub.UB_PREDICATE_METHODS`.
    """
    if torch.compiler.is_compiling() and sync_ub_state():
        return _trace_time_query(UB_STATE_TOKEN, f"get_ub.{method}", name, use_fp8)
    from transformer_engine.pytorch.module import base

    return getattr(base.get_ub(name, use_fp8), method)()


# --------------------------------------------------------------------------- TE hooks
def _wrap_state_change(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def hooked(*args: Any, **kwargs: Any) -> Any:
        try:
            return orig(*args, **kwargs)
        finally:
            on_ub_state_changed()

    hooked.__te_passes_original__ = orig  # type: ignore[attr-defined]
    return hooked


def install_te_ub_hooks(*, import_te: bool = False) -> bool:
    """Hook TE's UB functions (idempotent). Returns whether hooks are installed.

    Rebinds, in ``transformer_engine.pytorch.module.base`` and in every loaded
    ``transformer_engine.*`` module holding the same function object: ``initialize_ub`` and
    ``destroy_ub`` (call TE's, then :func:`on_ub_state_changed`), and ``get_ub_is_fp8``
    (a guarded fold while compiling, TE's function in eager). TE's ``destroy_ub`` still calls ``torch.compiler.reset()``;
    use :func:`te_passes.runtime.ub.reinitialize_ub` to avoid it.

    Without ``import_te``, does nothing unless TE is already imported (``te_inductor`` calls
    this on import and on every compile, so the first trace after TE is imported is covered).
    """
    global UB_STATE_TOKEN
    if _STATE.hooks_installed:
        return True
    base = te_module(TE_UB_MODULE, import_te=import_te)
    if base is None:
        return False
    with _LOCK:
        if _STATE.hooks_installed:
            return True
        origs = {n: getattr(base, n) for n in ("initialize_ub", "destroy_ub", "get_ub_is_fp8")}
        repl = {"initialize_ub": _wrap_state_change(origs["initialize_ub"]),
                "destroy_ub": _wrap_state_change(origs["destroy_ub"]),
                "get_ub_is_fp8": _make_guarded_get_ub_is_fp8(origs["get_ub_is_fp8"])}
        _STATE.originals = origs
        _STATE.replacements = repl
        for mod_name, mod in list(sys.modules.items()):
            if mod is None or not mod_name.startswith("transformer_engine"):
                continue
            for n, orig in origs.items():
                if getattr(mod, n, None) is orig:
                    setattr(mod, n, repl[n])
        _STATE.hooks_installed = True
        _STATE.snapshot = None
    live_snapshot()
    return True


def uninstall_te_ub_hooks() -> None:
    """Restore TE's original functions everywhere :func:`install_te_ub_hooks` rebound them."""
    with _LOCK:
        if not _STATE.hooks_installed:
            return
        for mod_name, mod in list(sys.modules.items()):
            if mod is None or not mod_name.startswith("transformer_engine"):
                continue
            for n, orig in _STATE.originals.items():
                if getattr(mod, n, None) is _STATE.replacements.get(n):
                    setattr(mod, n, orig)
        _STATE.hooks_installed = False
        _STATE.originals = {}


def te_ub_hooks_installed() -> bool:
    """Whether :func:`install_te_ub_hooks` is in effect."""
    return _STATE.hooks_installed


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


# --------------------------------------------------------------------------- dependences
@dataclasses.dataclass(frozen=True)
class UbCheckSpec:
    """A TE op UB configuration check to redo when the UB state changes: op name, its config
    bundle contents and the FX node name."""

    op: str
    config: dict
    node: str


@dataclasses.dataclass
class UbDependence:
    """What one compiled graph (``graph_id`` ``"g<N>"``) depends on in the UB state."""

    folds: list[UbFold] = dataclasses.field(default_factory=list)
    checks: list[UbCheckSpec] = dataclasses.field(default_factory=list)
    pristine: torch.fx.GraphModule | None = None

    def __bool__(self) -> bool:
        return bool(self.folds or self.checks)

    @classmethod
    def merged(cls, deps: Any) -> "UbDependence":
        """One dependence holding every fold (once) and check of ``deps`` (an iterable of
        :class:`UbDependence`), and the first pre-pass copy."""
        out = cls()
        for d in deps:
            out.folds.extend(f for f in d.folds if f not in out.folds)
            out.checks.extend(d.checks)
            if out.pristine is None:
                out.pristine = d.pristine
        return out


def ub_dependence_of(report: Any, stages: Any = None) -> UbDependence:
    """The UB dependence ``fold_ub_predicates`` returned (as :class:`UbDependence` facts) for
    ``report`` (a :class:`te_passes.report.CompileReport`; ``stages``: only those stage reports),
    merged; empty when it returned none."""
    return UbDependence.merged(report.typed_facts(UbDependence, stages))


def ub_state_reads(gm: torch.fx.GraphModule, dependence: UbDependence | None = None, *,
                   trace_folds: Any = ()) -> list[str]:
    """Why the compilation of a Dynamo graph reads the UB state, one sentence per
    reason; empty when it does not. ``te_inductor`` calls it after the Dynamo-stage passes and
    before ``compile_fx``, and puts the UB snapshot into the pipeline uuid (Inductor's FX graph
    cache key) only when the list is non-empty (:func:`te_passes.backend.pipeline_uuid`), so a
    UB change does not make graphs that never look at UB state miss the cache.

    Conservative: any of these counts as a read —

    * the dependence ``fold_ub_predicates`` returned at the Dynamo stage (``dependence``, its
      :class:`UbDependence` fact: folded query nodes, folds Dynamo made while tracing TE's
      ``get_ub_is_fp8``, checked TE op UB configurations);
    * folds Dynamo made while tracing this graph (``trace_folds``, which the backend took from the
      runtime before the passes ran) that no pass collected (the pass disabled);
    * a UB query node left in ``gm`` (a later stage could fold it): a ``call_function`` of a TE
      UB function (``get_ub`` included) or :func:`ub_query`, or a ``call_method`` in
      :data:`te_passes.te.ub.UB_PREDICATE_METHODS` on a ``get_ub`` node;
    * a TE op whose config bundle sets a UB overlap flag
      (:data:`te_passes.te.graph_model.UB_CONFIG_KEYS`; ``fold_ub_predicates`` checks its buffers
      at the post-grad stages too), or a TE op that cannot be decoded (its UB use is unknown).

    Args:
        gm: the Dynamo graph after the Dynamo-stage passes.
        dependence: :func:`ub_dependence_of` its report's Dynamo stage (``None``: none).
        trace_folds: :func:`drain_trace_folds` of its compilation.
    """
    reasons: list[str] = []
    dep = dependence
    pending = [f for f in trace_folds if dep is None or f not in dep.folds]
    if dep is not None and dep.folds:
        what = sorted({f"{f.api}{tuple(f.args)!r}" for f in dep.folds})
        reasons.append(f"fold_ub_predicates folded UB queries: {', '.join(what)}")
    if dep is not None and dep.checks:
        reasons.append("fold_ub_predicates checked the UB configuration of TE ops "
                       + ", ".join(sorted({c.node for c in dep.checks})))
    if pending:
        reasons.append(f"Dynamo folded {len(pending)} UB quer{'y' if len(pending) == 1 else 'ies'} while tracing")
    for node in gm.graph.nodes:
        fn = ub_query_function(node.target) if node.op == "call_function" else None
        if fn is not None:  # get_ub itself too (conservative: a communicator in the graph)
            reasons.append(f"UB query node {node.name} ({fn})")
        elif node.op == "call_method" and node.target in UB_PREDICATE_METHODS and node.args \
                and isinstance(node.args[0], torch.fx.Node) and node.args[0].op == "call_function" \
                and ub_query_function(node.args[0].target) == "get_ub":
            reasons.append(f"UB query node {node.name} (get_ub.{node.target})")
    unknown: list[str] = []
    for call in gmod.te_op_calls(gm.graph, unknown=unknown):
        flags = [k for k in gmod.UB_CONFIG_KEYS if call.config.get(k)]
        if flags:
            reasons.append(f"TE op {call.node.name} ({call.op}) sets {', '.join(flags)}")
    reasons.extend(f"TE op not decoded, UB use unknown: {msg}" for msg in unknown)
    return reasons


def evaluate_dependence(dep: UbDependence, snap: UbSnapshot) -> tuple[list[tuple[UbFold, Any]], list[str]]:
    """Re-evaluate ``dep`` on ``snap``: ``(changed folds with their new value or error text,
    check problem messages)``."""
    changed: list[tuple[UbFold, Any]] = []
    for f in dep.folds:
        try:
            new = snap.query(f.api, f.args)
        except UbConfigError as e:
            changed.append((f, f"<error: {e}>"))
            continue
        if new != f.value or type(new) is not type(f.value):
            changed.append((f, new))
    problems = [msg for c in dep.checks for _, msg in check_linear_ub_config(c.op, c.config, snap).problems]
    return changed, problems


class UbGuard:
    """State of one UB-guarded compiled graph (the wrapper's ``te_ub_guard`` attribute).

    Fields: ``graph_id``, ``compiled`` (the inner callable), ``dependence``
    (:class:`UbDependence`), ``generation`` / ``fingerprint`` it is valid for, ``on_change``,
    ``recompile`` (``(gm, args) -> compiled``) and ``recompiles`` (count).
    """

    def __init__(self, graph_id: str, compiled: Callable, dependence: UbDependence, fingerprint: str,
                 on_change: str, recompile: Callable | None, cudagraphs: bool = False) -> None:
        self.graph_id = graph_id
        self.compiled = compiled
        self.dependence = dependence
        self.fingerprint = fingerprint
        self.on_change = on_change
        self.recompile = recompile
        self.cudagraphs = cudagraphs
        self.recompiles = 0
        live = live_snapshot()
        # UB changed while this graph compiled: examine on the first call.
        self.generation = _STATE.generation if live.fingerprint() == fingerprint else -1

    @property
    def rerecord_on_any_change(self) -> bool:
        """Whether every UB re-initialisation invalidates the compiled code: the graph runs TE ops
        with UB overlap and is replayed as a CUDA graph, whose recorded kernels hold the addresses
        of the communicators' buffers (``destroy_ub`` frees them), even when the new UB state
        answers every query the same."""
        return self.cudagraphs and bool(self.dependence.checks)

    def revalidate(self, args: list) -> None:
        """Slow path, after the UB generation changed (see the module docstring).

        Raises:
            UbConfigError: the UB state no longer satisfies a TE op's UB configuration or a
                folded query (its buffer is gone).
            UbStateChanged: the graph must be recompiled and ``on_change="error"``, or it cannot
                be recompiled here (values folded by Dynamo at trace time, no pre-pass copy).
        """
        with _LOCK:
            guard_stats["slow_checks"] += 1
            gen = _STATE.generation
            live = live_snapshot()
            fp = live.fingerprint()
            if fp == self.fingerprint and not self.rerecord_on_any_change:
                self.generation = gen
                guard_stats["kept"] += 1
                return
            changed, problems = evaluate_dependence(self.dependence, live)
            problems += [f"{f.api}{f.args!r}: {new[len('<error: '):-1]}" for f, new in changed
                         if isinstance(new, str) and new.startswith("<error: ")]
            if problems:
                guard_stats["errors"] += 1
                raise UbConfigError(f"te_passes: UB state changed since graph {self.graph_id} was compiled "
                                    "and no longer satisfies what it was compiled against:\n  - "
                                    + "\n  - ".join(problems))
            if not changed and not self.rerecord_on_any_change:
                self.generation, self.fingerprint = gen, fp
                guard_stats["kept"] += 1
                return
            if changed:
                diff = "; ".join(f"{f.api}{f.args!r}: {f.value!r} -> {new!r}" for f, new in changed)
            else:
                diff = ("UB was re-initialised and the graph replays TE ops with UB overlap as a CUDA graph "
                        "(its recorded kernels use the old communicators' buffers)")
            where = (f"graph {self.graph_id} was compiled against UB state {self.fingerprint[:16]}, "
                     f"now {fp[:16]}: {diff}")
            if self.on_change == "error":
                guard_stats["errors"] += 1
                raise UbStateChanged(f"te_passes: {where} (te_passes.ub_on_change='error'; use "
                                     "'recompile' to recompile the graph)")
            if any(f.source != "fx" for f, _ in changed) or self.recompile is None or self.dependence.pristine is None:
                guard_stats["errors"] += 1
                raise UbStateChanged(f"te_passes: {where}; this graph cannot be recompiled here "
                                     "(values were folded while Dynamo traced it, or no pre-pass copy "
                                     "was kept) — re-run torch.compile")
            gm = _copy_gm(self.dependence.pristine)
            new = self.recompile(gm, list(args))
            inner = getattr(new, "te_ub_guard", None)
            if inner is not None:
                self.compiled, self.dependence, self.fingerprint = inner.compiled, inner.dependence, inner.fingerprint
            else:
                self.compiled, self.dependence, self.fingerprint = new, UbDependence(), fp
            self.generation = gen
            self.recompiles += 1
            guard_stats["recompiles"] += 1


def _copy_gm(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    new = torch.fx.GraphModule(gm, copy_graph(gm.graph))
    new.meta = dict(getattr(gm, "meta", {}))
    return new


def pristine_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A node-for-node copy of ``gm`` sharing its parameters/submodules (kept for recompiles)."""
    return _copy_gm(gm)


def make_guarded(guard: UbGuard) -> Callable:
    """The per-call wrapper around ``guard.compiled``: one integer compare on the fast path.

    Called as Dynamo calls a backend's output, ``fn(*args)`` (Dynamo ignores ``_boxed_call`` on
    backend outputs; Inductor's ``compile_fx`` result takes ``*args`` although it carries one).
    """
    state = _STATE

    def guarded(*args):
        if state.generation != guard.generation:
            guard.revalidate(list(args))
        return guard.compiled(*args)

    guarded.te_ub_guard = guard  # type: ignore[attr-defined]
    return guarded


def raise_ub_mismatches(report: Any, stages: Any = None) -> None:
    """Raise :class:`~te_passes.te.ub.UbConfigError` listing every ``"ub_mismatch"`` record of
    ``report`` (a :class:`te_passes.report.CompileReport`; ``stages``: only the records of those
    stage reports, so that each stage's records are turned into an error once); no-op when there
    are none."""
    stages = getattr(report, "stages", []) if stages is None else stages
    mismatches = [r for s in stages for run in s.runs for r in run.records if r.kind == "ub_mismatch"]
    if mismatches:
        raise UbConfigError(f"te_passes: graph {getattr(report, 'graph_id', 'g?')}: UB configuration does not "
                            "match the UB state (fold_ub_predicates):\n  - "
                            + "\n  - ".join(str(r.data.get("message")) for r in mismatches))


def wrap_with_te_state_guard(compiled: Callable, report: Any, te_state: Any, opts: Any,
                             recompile: Callable | None = None, cudagraphs: bool = False, *,
                             dependence: UbDependence | None = None, checked_stages: int = 0) -> Callable:
    """Wrap a ``te_inductor``-compiled graph with a UB-state guard when it depends on UB state.

    Args:
        compiled: Inductor's compiled callable (called ``compiled(*args)``).
        report: the graph's :class:`te_passes.report.CompileReport` (``graph_id``; its
            ``"ub_mismatch"`` records are raised here).
        te_state: the :class:`te_passes.te.state.TEState` the passes used (``.ub``).
        opts: :class:`te_passes.config.TePassesOptions` (``ub_on_change``, ``ub_snapshot``).
        recompile: ``(gm, args) -> compiled`` used to recompile the pre-pass graph (the backend
            passes ``te_inductor`` with the same mode/options).
        cudagraphs: the graph is replayed as a CUDA graph (``triton.cudagraphs``, e.g.
            ``mode="reduce-overhead"``): graphs with UB TE ops then recompile on *every* UB
            re-initialisation (see :attr:`UbGuard.rerecord_on_any_change`).
        dependence: what the graph depends on in the UB state (default: :func:`ub_dependence_of`
            ``report``, the facts ``fold_ub_predicates`` returned at every stage so far).
        checked_stages: the first ``checked_stages`` stage reports' ``"ub_mismatch"`` records
            were already raised on (the backend does so after the Dynamo stage): only later
            stages' records are raised here.

    Returns:
        ``compiled`` itself when the graph needs no run-time UB guard — no UB dependence, only
        values Dynamo folded while tracing (Dynamo's own guard on :data:`UB_STATE_TOKEN` covers
        them), or an explicit ``te_passes.ub_snapshot`` (offline use) — else the guarded callable
        (``fn(*args)``, attribute ``te_ub_guard``: :class:`UbGuard`).

    Raises:
        UbConfigError: the passes found TE op UB configurations that the UB state cannot
            satisfy (all messages listed) — instead of a ``KeyError`` at run time.
    """
    install_te_ub_hooks()
    graph_id = getattr(report, "graph_id", "g?")
    dep = ub_dependence_of(report) if dependence is None else dependence
    raise_ub_mismatches(report, getattr(report, "stages", [])[checked_stages:])
    if getattr(opts, "ub_snapshot", None) is not None:
        return compiled
    if not dep.checks and all(f.source == "dynamo_trace" for f in dep.folds):
        return compiled
    ub = getattr(te_state, "ub", None)
    fingerprint = ub.fingerprint() if ub is not None else live_snapshot().fingerprint()
    guard = UbGuard(graph_id, compiled, dep, fingerprint, getattr(opts, "ub_on_change", "recompile"), recompile,
                    cudagraphs=cudagraphs)
    return make_guarded(guard)
