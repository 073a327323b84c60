"""Layer 2 of the UB guards: compiled graphs that depend on TE's Userbuffers (UB) state are wrapped in a
guard that re-checks them when that state changes.

See docs/internals.md#te_passescompatubgraph_guardpy."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.fx

from te_passes.fx.graph import copy_graph_module
from te_passes.compat import table
from te_passes.compat.ub import rows as ub_rows
from te_passes.compat.ub.guard import (UbFold, UbStateChanged, current_generation, guard_stats, live_snapshot,
                                        ub_global_state, ub_state_lock)
from te_passes.te import graph_model as gmod
from te_passes.te.ub import UB_PREDICATE_METHODS, UbConfigError, UbSnapshot
from te_passes.te.ub_queries import ub_query_function
from te_passes.te.ub_rules import check_linear_ub_config


@dataclasses.dataclass(frozen=True)
class UbCheckSpec:
    """A TE op UB configuration check to redo when the UB state changes: op name, its config
    bundle contents and the FX node name."""

    op: str
    config: dict
    node: str


@dataclasses.dataclass(frozen=True)
class UbMismatch:
    """A UB configuration the UB state cannot satisfy (``fold_ub_predicates``' typed fact; the
    driver raises :class:`~te_passes.te.ub.UbConfigError` for it before Inductor runs)."""

    node: str | None
    message: str


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
    """Why the compilation of a Dynamo graph reads the UB state, one sentence per reason; empty when it does
    not.

    Args:
        gm: the Dynamo graph after the Dynamo-stage passes.
        dependence: :func:`ub_dependence_of` its report's Dynamo stage (``None``: none).
        trace_folds: :func:`te_passes.compat.ub.guard.drain_trace_folds` of its compilation.
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
    """Re-evaluate ``dep`` on ``snap``: ``(changed folds with their new value, problem messages)``
    (the TE ops' UB checks, then the folded queries TE would raise for)."""
    changed: list[tuple[UbFold, Any]] = []
    query_errors: list[str] = []
    for f in dep.folds:
        try:
            new = snap.query(f.api, f.args)
        except UbConfigError as e:
            query_errors.append(f"{f.api}{f.args!r}: {e}")
            continue
        if new != f.value or type(new) is not type(f.value):
            changed.append((f, new))
    problems = [msg for c in dep.checks for _, msg in check_linear_ub_config(c.op, c.config, snap).problems]
    return changed, problems + query_errors


@dataclasses.dataclass(eq=False)
class UbGuard:
    """State of one UB-guarded compiled graph (the wrapper's ``te_ub_guard`` attribute): ``compiled``
    (the inner callable), the ``dependence`` and UB ``fingerprint`` / ``generation`` it is valid for,
    ``recompile`` (``(gm, args) -> compiled``) and ``recompiles`` (count)."""

    graph_id: str
    compiled: Callable
    dependence: UbDependence
    fingerprint: str
    on_change: str
    recompile: Callable | None
    cudagraphs: bool = False
    recompiles: int = dataclasses.field(default=0, init=False)
    generation: int = dataclasses.field(default=-1, init=False)

    def __post_init__(self) -> None:
        if live_snapshot().fingerprint() == self.fingerprint:  # else UB changed while this graph compiled
            self.generation = current_generation()

    @property
    def rerecord_on_any_change(self) -> bool:
        """Whether every UB re-initialisation invalidates the compiled code: the graph runs TE ops with UB
        overlap and is replayed as a CUDA graph, whose kernels hold the addresses of the communicators'
        buffers (``destroy_ub`` frees them), even when the new UB state answers every query the same."""
        return self.cudagraphs and bool(self.dependence.checks)

    def revalidate(self, args: list) -> None:
        """Slow path, after the UB generation changed (see docs/internals.md).

        Raises:
            UbConfigError: the UB state no longer satisfies a TE op's UB configuration or a
                folded query (its buffer is gone).
            UbStateChanged: the graph must be recompiled and ``on_change="error"``, or it cannot
                be recompiled here (values folded by Dynamo at trace time, no pre-pass copy).
        """
        with ub_state_lock():
            guard_stats["slow_checks"] += 1
            gen = current_generation()
            live = live_snapshot()
            fp = live.fingerprint()
            if fp == self.fingerprint and not self.rerecord_on_any_change:
                self.generation = gen
                guard_stats["kept"] += 1
                return
            changed, problems = evaluate_dependence(self.dependence, live)
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
            gm = copy_graph_module(self.dependence.pristine)
            new = self.recompile(gm, list(args))
            inner = getattr(new, "te_ub_guard", None)
            if inner is not None:
                self.compiled, self.dependence, self.fingerprint = inner.compiled, inner.dependence, inner.fingerprint
            else:
                self.compiled, self.dependence, self.fingerprint = new, UbDependence(), fp
            self.generation = gen
            self.recompiles += 1
            guard_stats["recompiles"] += 1


def pristine_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A node-for-node copy of ``gm`` sharing its parameters/submodules (kept for recompiles)."""
    return copy_graph_module(gm)


def make_guarded(guard: UbGuard) -> Callable:
    """The per-call wrapper ``fn(*args)`` (as Dynamo calls a backend's output) around ``guard.compiled``:
    one integer compare on the fast path."""
    state = ub_global_state()

    def guarded(*args):
        if state.generation != guard.generation:
            guard.revalidate(list(args))
        return guard.compiled(*args)

    guarded.te_ub_guard = guard  # type: ignore[attr-defined]
    return guarded


def raise_ub_mismatches(report: Any, stages: Any = None) -> None:
    """Raise :class:`~te_passes.te.ub.UbConfigError` listing every :class:`UbMismatch` fact of
    ``report`` (a :class:`te_passes.report.CompileReport`; ``stages``: only those stage reports, so
    each stage's mismatches are raised once); no-op when there are none."""
    mismatches = report.typed_facts(UbMismatch, stages)
    if mismatches:
        raise UbConfigError(f"te_passes: graph {report.graph_id}: UB configuration does not "
                            "match the UB state (fold_ub_predicates):\n  - "
                            + "\n  - ".join(m.message for m in mismatches))


def te_state_guard(compiled: Callable, report: Any, te_state: Any, opts: Any, recompile: Callable | None = None,
                   cudagraphs: bool = False, *, dependence: UbDependence | None = None,
                   checked_stages: int = 0) -> UbGuard | None:
    """The UB-state guard a ``te_inductor``-compiled graph needs, or ``None``.

    Args:
        compiled: Inductor's compiled callable (called ``compiled(*args)``).
        report: the graph's :class:`te_passes.report.CompileReport` (its :class:`UbMismatch` facts are raised).
        te_state: the :class:`te_passes.te.state.TEState` the passes used (``.ub``).
        opts: :class:`te_passes.config.TePassesOptions` (``ub_on_change``, ``ub_snapshot``).
        recompile: ``(gm, args) -> compiled`` for the pre-pass graph (``te_inductor``, same mode/options).
        cudagraphs: the graph is replayed as a CUDA graph: graphs with UB TE ops then recompile on
            *every* UB re-initialisation (:attr:`UbGuard.rerecord_on_any_change`).
        dependence: what the graph depends on in the UB state (default: :func:`ub_dependence_of` ``report``).
        checked_stages: how many leading stage reports' :class:`UbMismatch` facts were already raised.

    Returns:
        ``None`` when no run-time UB guard is needed (no UB dependence, only values Dynamo folded while
        tracing, which `te_passes.compat.ub.guard._STATE.token` guards, or an explicit
        ``te_passes.ub_snapshot``), else the :class:`UbGuard` (``compat.compiled_call.wrap_compiled`` calls it).

    Raises:
        UbConfigError: TE op UB configurations the UB state cannot satisfy (all listed).
    """
    table.install(ub_rows.ROWS)  # the ub.* rows bump the UB generation the guard compares
    graph_id = getattr(report, "graph_id", "g?")
    dep = ub_dependence_of(report) if dependence is None else dependence
    raise_ub_mismatches(report, report.stages[checked_stages:])
    if getattr(opts, "ub_snapshot", None) is not None:
        return None
    if not dep.checks and all(f.source == "dynamo_trace" for f in dep.folds):
        return None
    ub = getattr(te_state, "ub", None)
    fingerprint = ub.fingerprint() if ub is not None else live_snapshot().fingerprint()
    return UbGuard(graph_id, compiled, dep, fingerprint, getattr(opts, "ub_on_change", "recompile"), recompile,
                   cudagraphs=cudagraphs)


def wrap_with_te_state_guard(compiled: Callable, report: Any, te_state: Any, opts: Any,
                             recompile: Callable | None = None, cudagraphs: bool = False, *,
                             dependence: UbDependence | None = None, checked_stages: int = 0) -> Callable:
    """``compiled`` behind :func:`make_guarded` when :func:`te_state_guard` (same arguments) returns a guard,
    else ``compiled`` itself. Raises as :func:`te_state_guard`."""
    guard = te_state_guard(compiled, report, te_state, opts, recompile, cudagraphs, dependence=dependence,
                           checked_stages=checked_stages)
    return compiled if guard is None else make_guarded(guard)
