"""What te_passes did, as data: a :class:`CompileReport` per Dynamo graph, a :class:`StageReport` per
stage, a :class:`PassRun` per pass; kept process-wide (:func:`compile_reports`). docs/design.md "Reports".
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from typing import Any

from te_passes._json import jsonable


@dataclasses.dataclass
class PassRecord:
    """One fact a pass reports for people: ``kind`` (``"folded"``, ``"skipped"``, ...), ``node`` (the FX
    node name, ``None`` for the graph) and ``data`` (JSON-able details)."""

    kind: str
    node: str | None = None
    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "node": self.node, **{k: jsonable(v) for k, v in self.data.items()}}


@dataclasses.dataclass
class PassRun:
    """One pass run on one graph. ``status``: ``"ok"``, ``"disabled"``, ``"skipped"`` or ``"failed"``
    (the last two with their edits undone); ``changed``: its journal recorded edits."""

    name: str
    stage: str
    status: str = "ok"
    changed: bool = False
    time_ms: float = 0.0
    nodes_before: int = 0
    nodes_after: int = 0
    records: list[PassRecord] = dataclasses.field(default_factory=list)
    error: str | None = None
    #: Not in JSON: ``TEPassResult.facts``; where the dump writer wrote this run (``g0/dynamo/01_<pass>``)
    #: and its ``{"added", "removed", "changed"}`` counts.
    facts: list[Any] = dataclasses.field(default_factory=list)
    dump_dir: str | None = None
    dump_changes: dict[str, int] | None = None

    def to_json(self) -> dict[str, Any]:
        keys = ("name", "stage", "status", "changed", "nodes_before", "nodes_after", "error")
        return {**{k: getattr(self, k) for k in keys}, "time_ms": round(self.time_ms, 3),
                "records": [r.to_json() for r in self.records]}


@dataclasses.dataclass
class StageReport:
    """All pass runs of one stage on one graph (``graph_id``: ``"g0.fwd"``)."""

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
    """Everything te_passes did for one ``te_inductor`` call: ``graph_id`` (``"g<N>"``), ``mode``
    (``"default"`` for ``None``), ``uuid`` (the pipeline uuid and its parts), ``te_state``, ``stages``."""

    graph_id: str
    mode: str | None = None
    uuid: dict[str, Any] = dataclasses.field(default_factory=dict)
    te_state: dict[str, Any] = dataclasses.field(default_factory=dict)
    stages: list[StageReport] = dataclasses.field(default_factory=list)
    time_ms_passes: float = 0.0
    time_ms_total: float = 0.0
    #: The lean CUDA-graph policy's decisions (``{"graph", "event", "reason", "count"}``).
    cudagraphs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: The Inductor cache that served the compile when the AOT stages did not run.
    cache_hit: str | None = None
    #: Not in JSON: where its dump went; a replayed graph's saved torch/TE versions.
    dump_dir: str | None = None
    saved_versions: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.mode is None:
            self.mode = "default"

    def records(self, kind: str | None = None) -> list[PassRecord]:
        """All records of all runs, only ``kind``'s when given."""
        return [r for s in self.stages for run in s.runs for r in run.records
                if kind is None or r.kind == kind]

    def typed_facts(self, cls: type | None = None, stages: "list[StageReport] | None" = None) -> list[Any]:
        """The typed facts of all runs of ``stages`` (default: all), only ``cls``'s when given."""
        return [f for s in (self.stages if stages is None else stages) for run in s.runs for f in run.facts
                if cls is None or isinstance(f, cls)]

    def to_json(self) -> dict[str, Any]:
        return {"graph_id": self.graph_id, "mode": self.mode, "uuid": jsonable(self.uuid),
                "te_state": jsonable(self.te_state), "stages": [s.to_json() for s in self.stages],
                "time_ms_passes": round(self.time_ms_passes, 3), "time_ms_total": round(self.time_ms_total, 3),
                "cudagraphs": jsonable(self.cudagraphs), "cache_hit": self.cache_hit}


def cache_hit_note(cache: str) -> str:
    """What the CLI, ``index.md`` and the log say when ``cache`` skipped the AOT stages."""
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
