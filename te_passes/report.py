"""What te_passes did, as data: per pass run, per stage, per compiled graph.

Every ``te_inductor`` call (one Dynamo graph) creates a :class:`CompileReport`; each stage the
pass manager runs on it (Dynamo, joint, post-grad forward/backward) appends a
:class:`StageReport` of :class:`PassRun`\\ s. Reports are kept in a process-wide list
(:func:`compile_reports`) that the CLI and tests read; the dump writer serialises them to
``report.json``.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from typing import Any

from te_passes._json import jsonable


@dataclasses.dataclass
class PassRecord:
    """One structured fact a pass reports: what it folded, freed, found, or refused to do.

    ``kind`` is a short word naming the record type (``"folded"``, ``"hoisted"``, ``"free"``,
    ``"check"``, ``"pool_leak"``, ``"skipped"``, ...); ``node`` the FX node name it concerns
    (``None`` for graph-level facts); ``data`` JSON-serialisable details (values are rendered
    with ``repr`` when they are not JSON types). Dump reports (``report.json``) list records
    grouped by ``kind``.
    """

    kind: str
    node: str | None = None
    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-ready dict: ``{"kind", "node", **data}`` with non-JSON values repr'd."""
        out: dict[str, Any] = {"kind": self.kind, "node": self.node}
        for k, v in self.data.items():
            out[k] = jsonable(v)
        return out


@dataclasses.dataclass
class PassRun:
    """One pass applied to one graph at one stage.

    ``status``: ``"ok"`` (ran), ``"disabled"`` (switched off by option/env), ``"skipped"``
    (refused: could not prove the rewrite safe, graph untouched), ``"failed"`` (raised; the
    graph was restored). ``time_ms`` is wall time in milliseconds; ``nodes_before/after`` node
    counts of the graph.
    """

    name: str
    stage: str
    status: str = "ok"
    changed: bool = False
    time_ms: float = 0.0
    nodes_before: int = 0
    nodes_after: int = 0
    records: list[PassRecord] = dataclasses.field(default_factory=list)
    error: str | None = None
    #: Typed facts the pass returned for the pipeline (``TEPassResult.facts``, e.g. a
    #: ``te_passes.runtime.ub_graph_guard.UbDependence``); empty unless the run succeeded. Not in JSON.
    facts: list[Any] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("name", "stage", "status", "changed", "nodes_before",
                                            "nodes_after", "error")}
        d["time_ms"] = round(self.time_ms, 3)
        d["records"] = [r.to_json() for r in self.records]
        return d


@dataclasses.dataclass
class StageReport:
    """All pass runs of one stage on one graph (``graph_id`` e.g. ``"g0"``, ``"g0.fwd"``)."""

    graph_id: str
    stage: str
    runs: list[PassRun] = dataclasses.field(default_factory=list)
    #: Extra graph-level facts (e.g. the memory estimate) keyed by producer.
    facts: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"graph_id": self.graph_id, "stage": self.stage,
                "runs": [r.to_json() for r in self.runs], "facts": jsonable(self.facts)}


@dataclasses.dataclass
class CompileReport:
    """Everything te_passes did for one ``te_inductor`` call (one Dynamo graph).

    ``graph_id``: ``"g<N>"`` in call order within the process; ``mode``: the torch.compile mode,
    ``"default"`` for ``None`` (``torch.compile`` passes no mode for ``mode="default"``), as in
    every report, summary and printout;
    ``uuid``: the pass-pipeline uuid and what it was built from; ``te_state``: the TE state
    snapshot (JSON); ``stages``: :class:`StageReport`\\ s in the order they ran.
    """

    graph_id: str
    mode: str | None = None
    uuid: dict[str, Any] = dataclasses.field(default_factory=dict)
    te_state: dict[str, Any] = dataclasses.field(default_factory=dict)
    stages: list[StageReport] = dataclasses.field(default_factory=list)
    time_ms_passes: float = 0.0
    time_ms_total: float = 0.0
    #: CUDA-graph decisions and fallbacks of the lean policy (te_passes/runtime/cudagraph_policy.py):
    #: ``{"graph", "event", "reason", "count", ...}``; appended at compile time and at run time.
    cudagraphs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: Which Inductor cache served the compile when the joint / post-grad stages did not run
    #: (``"AOTAutograd cache"``, ``"FX graph cache"``), else ``None`` (te_passes.backend).
    cache_hit: str | None = None

    def __post_init__(self) -> None:
        if self.mode is None:
            self.mode = "default"

    def records(self, kind: str | None = None) -> list[PassRecord]:
        """All records of all runs, optionally only those of ``kind``."""
        return [r for s in self.stages for run in s.runs for r in run.records
                if kind is None or r.kind == kind]

    def typed_facts(self, cls: type | None = None, stages: "list[StageReport] | None" = None) -> list[Any]:
        """The typed facts (:attr:`PassRun.facts`) of all runs of ``stages`` (default: every
        stage so far), optionally only instances of ``cls``."""
        return [f for s in (self.stages if stages is None else stages) for run in s.runs for f in run.facts
                if cls is None or isinstance(f, cls)]

    def to_json(self) -> dict[str, Any]:
        return {"graph_id": self.graph_id, "mode": self.mode, "uuid": jsonable(self.uuid),
                "te_state": jsonable(self.te_state), "stages": [s.to_json() for s in self.stages],
                "time_ms_passes": round(self.time_ms_passes, 3),
                "time_ms_total": round(self.time_ms_total, 3),
                "cudagraphs": jsonable(self.cudagraphs), "cache_hit": self.cache_hit}


def cache_hit_note(cache: str) -> str:
    """The sentence ``te-passes show``, ``index.md`` and the te_passes log print for a compile
    whose joint / post-grad stages did not run because ``cache`` (:attr:`CompileReport.cache_hit`) hit."""
    return (f"{cache} hit: the joint and post-grad passes did not run (Inductor reused code compiled "
            f"earlier with the same pass-pipeline uuid, which already holds their rewrites)")


_lock = threading.Lock()
_reports: list[CompileReport] = []
_ids = itertools.count()


def new_compile_report(mode: str | None) -> CompileReport:
    """Create, register and return the report for a new ``te_inductor`` call."""
    with _lock:
        rep = CompileReport(graph_id=f"g{next(_ids)}", mode=mode)
        _reports.append(rep)
    return rep


def compile_reports() -> list[CompileReport]:
    """Reports of every ``te_inductor`` call in this process so far (oldest first)."""
    with _lock:
        return list(_reports)


def clear_compile_reports() -> None:
    """Forget all reports (tests; the CLI between targets). Graph ids keep counting."""
    with _lock:
        _reports.clear()
