"""Run the pass pipeline outside torch.compile, exactly as the backend does: examples and replay.

See docs/internals.md#te_passesdebugofflinepy."""

from __future__ import annotations

import glob
import os
from typing import Any, Collection, Iterable, Sequence

import torch.fx

from te_passes.config import TePassesOptionError, TePassesOptions, env_aliases
from te_passes.debug.dump_files import DumpFormatError, check_graph_report, read_json
from te_passes.debug.dump import DumpWriter
from te_passes.debug.dump_summary import versions
from te_passes.debug.graph_io import GraphFileError, load_graph
from te_passes.pipeline.base import Stage, TEPass
from te_passes.pipeline.compilation import STAGE_ORDER, Compilation, CompileSettings
from te_passes.pipeline.manager import PassManager, PassObserver
from te_passes.report import CompileReport
from te_passes.compat.api import capture_te_state
from te_passes.compat.install import install as install_runtime
from te_passes.te.recipes import Fp8State
from te_passes.te.state import TEState
from te_passes.te.ub import UbSnapshot

__all__ = ["STAGE_ORDER", "ReplayError", "compare_reports", "find_graph_files", "installed_versions", "replay",
           "run_stages", "te_state_from_json", "version_differences"]


class ReplayError(Exception):
    """Nothing replayable at the given path, or a saved graph could not be loaded."""


def te_state_from_json(data: dict[str, Any] | None) -> TEState:
    """Rebuild the :class:`TEState` a dump saved (``TEState.to_json()`` output)."""
    data = data or {}
    ub = data.get("ub")
    if ub is not None:
        try:
            ub = UbSnapshot.load(ub)
        except ImportError:  # pragma: no cover - UB support missing: keep the JSON
            pass
    extra = tuple(sorted((data.get("extra") or {}).items()))
    fp8 = Fp8State.from_json(data["fp8"]) if data.get("fp8") is not None else None
    return TEState(te_version=data.get("te_version"), ub=ub, extra=extra, fp8=fp8)


def run_stages(jobs: Sequence[tuple[Stage, torch.fx.GraphModule, Any]], passes: Sequence[TEPass], *,
               options: TePassesOptions | None = None, te_state: TEState | None = None, mode: str | None = None,
               dump_dir: str | None = None, observers: Sequence[PassObserver] = (),
               graph_id: str | None = None) -> CompileReport:
    """Run ``passes`` (in order; ``te_passes.passes.order.configured_passes()`` for the backend's) on ``jobs``
    = ``[(stage, gm, example_inputs), ...]`` (graphs rewritten in place) through the backend's driver, and
    return the registered :class:`CompileReport`.

    Args:
        options: parsed options (default ``TePassesOptions()``); ``options.disable`` applies.
        te_state: the TE state (default ``te_passes.compat.api.capture_te_state()``).
        mode: recorded in the report only.
        dump_dir: write a dump there (:class:`~te_passes.debug.dump.DumpWriter`); ``observers``: more.
        graph_id: force the report's graph id (replay uses the saved one); default ``g<N>``.

    Raises:
        te_passes.debug.dump_files.DumpDirError: ``dump_dir`` is not writable.
        te_passes.pipeline.manager.TePassError: a pass failed under ``options.strict``.
    """
    install_runtime()  # as the backend does before any pass runs (lowerings, constant names)
    options = options or TePassesOptions()
    observers = [*observers, *([DumpWriter.for_dir(dump_dir)] if dump_dir is not None else [])]
    comp = Compilation(PassManager(passes, observers), CompileSettings(mode, options, {}),
                       te_state or capture_te_state(), graph_id=graph_id, live=False)
    jobs = sorted(jobs, key=lambda j: STAGE_ORDER.index(j[0]))
    dynamo = [j for j in jobs if j[0] is Stage.DYNAMO]
    comp.begin(dynamo[0][1] if dynamo else None, dynamo[0][2] if dynamo else None)
    for stage, gm, inputs in jobs:
        if stage is not Stage.DYNAMO:
            comp.run_stage(gm, stage, inputs)
    comp.finish()
    return comp.report


# --------------------------------------------------------------------------- replay
#: Where a directory's saved graphs are looked for, relative to it: a stage directory, a graph
#: directory (``g0/``), a dump directory, a backend dump directory of sessions.
DUMP_LAYOUTS: tuple[str, ...] = ("input.tegraph", "*/input.tegraph", "g*/*/input.tegraph", "*/g*/*/input.tegraph")


def find_graph_files(path: str) -> dict[str, list[str]]:
    """``{graph dir: [input.tegraph files in stage order]}`` under ``path`` (a ``.tegraph``
    file, or a directory in one of the :data:`DUMP_LAYOUTS`: a stage, graph, dump or sessions
    directory).

    Raises:
        ReplayError: ``path`` does not exist or holds no ``.tegraph`` file.
    """
    if not os.path.exists(path):
        raise ReplayError(f"no such file or directory: {path}")
    if os.path.isfile(path):
        files = [path]
    else:  # the dump layouts only, never a search of the whole tree under path
        # root_dir: ``path`` itself is not a pattern (a dump under ``runs/exp[1]/`` is found)
        files = sorted({os.path.join(path, f) for pat in DUMP_LAYOUTS for f in glob.glob(pat, root_dir=path)})
    if not files:
        raise ReplayError(f"no saved graphs (*.tegraph) under {path} in a dump's layout ({', '.join(DUMP_LAYOUTS)}); "
                          f"dump with te-passes dump or options={{'te_passes.dump_dir': DIR}} first")
    out: dict[str, list[str]] = {}
    for f in files:
        out.setdefault(os.path.dirname(os.path.dirname(os.path.abspath(f))), []).append(f)
    digits = {g: "".join(ch for ch in os.path.basename(g) if ch.isdigit()) for g in out}
    # g2 before g10: the order the graphs were compiled in
    return {k: out[k] for k in sorted(out, key=lambda g: (int(digits[g]) if digits[g] else -1, g))}


def replay(path: str, passes: Sequence[TEPass], *, disable: Iterable[str] | None = None,
           dump_dir: str | None = None, strict: bool | None = None) -> list[tuple[CompileReport, dict[str, Any] | None]]:
    """Re-run ``passes`` (the current ones: ``te_passes.passes.order.configured_passes()``) on the graphs
    saved under ``path``; no GPU needed.

    Raises:
        ReplayError: nothing to replay, or a graph file cannot be loaded (message names it).
    """
    results = []
    for gdir, files in find_graph_files(path).items():
        jobs = []
        payloads = []
        for f in files:
            try:
                gm, payload = load_graph(f)
            except GraphFileError as e:
                raise ReplayError(str(e)) from e
            try:
                stage = Stage(payload.get("stage"))
            except ValueError as e:
                raise ReplayError(f"{f}: unknown stage {payload.get('stage')!r}") from e
            jobs.append((stage, gm, payload.get("example_inputs_fake")))
            payloads.append(payload)
        first = payloads[0]
        saved_opts = dict(first.get("options") or {})
        if disable is not None:
            saved_opts["disable"] = list(disable)
        if strict is not None:
            saved_opts["strict"] = strict

        # TE_PASSES_DISABLE applies as in the backend (added to the saved / given list, unknown
        # names refused); the other TE_PASSES_* variables do not: the saved options are replayed
        env = env_aliases("disable")
        try:
            options, _ = TePassesOptions.parse({f"te_passes.{k}": v for k, v in saved_opts.items()
                                                if k in ("disable", "strict", "ub_on_change")},
                                               known_passes={p.name for p in passes}, environ=env)
        except TePassesOptionError as e:
            raise ReplayError(f"{files[0]}: {e}") from None
        graph_id = str(first.get("graph_id", "g0")).split(".")[0]
        report = run_stages(jobs, passes, options=options, te_state=te_state_from_json(first.get("te_state")),
                            dump_dir=dump_dir, graph_id=graph_id)
        saved = None
        rpath = os.path.join(gdir, "report.json")
        if os.path.isfile(rpath):
            try:
                saved = check_graph_report(rpath, read_json(rpath))
            except DumpFormatError as e:
                raise ReplayError(str(e)) from None
        report.saved_versions = {"torch": first.get("torch"),
                                 "transformer_engine": (first.get("te_state") or {}).get("te_version")}
        results.append((report, saved))
    return results


def installed_versions() -> dict[str, Any]:
    """``{"torch", "transformer_engine"}`` versions installed here (:func:`~te_passes.debug.dump_summary.versions`)."""
    return {k: v for k, v in versions().items() if k != "te_passes"}


def version_differences(saved: dict[str, Any] | None) -> dict[str, Any] | None:
    """``{"saved", "installed"}`` when a replayed graph was saved under other torch / TE versions
    than the installed ones (a saved ``None``, unknown, is not a difference), else ``None``."""
    installed = installed_versions()
    saved = {k: v for k, v in (saved or {}).items() if v is not None}
    if all(installed.get(k) == v for k, v in saved.items()):
        return None
    return {"saved": {k: saved.get(k) for k in installed}, "installed": installed}


def _norm_run(run: dict[str, Any]) -> dict[str, Any]:
    return {k: run.get(k) for k in ("name", "stage", "status", "changed", "nodes_before", "nodes_after",
                                    "records", "error")}


def compare_reports(new: dict[str, Any], saved: dict[str, Any], *, require_all: bool = True,
                    unreplayable: Collection[str] = ()) -> list[str]:
    """Differences between two ``CompileReport.to_json()`` dicts that matter for reproduction:
    per stage (matched by graph id and stage), each pass run's name, status, changed flag,
    node counts, error and records (timings ignored; not the records of the ``unreplayable`` pass
    names: ``TEPass.replayable``). ``[]`` means reproduced."""
    diffs: list[str] = []
    saved_stages = {(s["graph_id"], s["stage"]): s for s in saved.get("stages", [])}
    new_stages = {(s["graph_id"], s["stage"]): s for s in new.get("stages", [])}
    for key, ns in new_stages.items():
        ss = saved_stages.get(key)
        if ss is None:
            diffs.append(f"{key[0]}:{key[1]}: stage not in the saved report")
            continue
        nr = [_norm_run(r) for r in ns.get("runs", [])]
        sr = [_norm_run(r) for r in ss.get("runs", [])]
        if [r["name"] for r in nr] != [r["name"] for r in sr]:
            diffs.append(f"{key[0]}:{key[1]}: passes {[r['name'] for r in sr]} -> {[r['name'] for r in nr]}")
            continue
        for a, b in zip(sr, nr):
            for field in ("status", "changed", "nodes_before", "nodes_after", "error"):
                if a[field] != b[field]:
                    diffs.append(f"{key[0]}:{key[1]}:{a['name']}: {field} {a[field]!r} -> {b[field]!r}")
            if a["records"] != b["records"] and a["name"] not in unreplayable:
                diffs.append(f"{key[0]}:{key[1]}:{a['name']}: records differ ({len(a['records'])} saved, "
                             f"{len(b['records'])} replayed){_first_record_difference(a['records'], b['records'])}")
    for key in saved_stages if require_all else ():
        if key not in new_stages:
            diffs.append(f"{key[0]}:{key[1]}: saved stage has no replayable graph file")
    return diffs


def _first_record_difference(saved: list[Any], new: list[Any]) -> str:
    """``": <kind> record <i>: <field> <saved> -> <replayed>"`` for the first differing field of two record
    lists of equal length (``""`` otherwise, or when no single field differs)."""
    if len(saved) != len(new):
        return ""
    for i, (a, b) in enumerate(zip(saved, new)):
        if a == b or not (isinstance(a, dict) and isinstance(b, dict)):
            continue
        for k in list(dict.fromkeys([*a, *b])):
            if a.get(k) != b.get(k):
                shown = [repr(v) if len(repr(v)) <= 60 else repr(v)[:59] + "…" for v in (a.get(k), b.get(k))]
                return f": {a.get('kind', 'record')} record {i}: {k} {shown[0]} -> {shown[1]}"
    return ""
