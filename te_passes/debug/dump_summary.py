"""The summary of a dump (:mod:`te_passes.debug.dump`): ``report.json`` per graph and for the whole
dump (:func:`build_summary`, :func:`write_summary`) and ``index.md`` (:func:`render_index`)."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Iterable

import torch

from te_passes import __version__
from te_passes._json import read_json_file, read_json_or_none
from te_passes._logging import trace_artifact
from te_passes.debug.graph_breaks import no_islands_text
from te_passes.report import cache_hit_note
from te_passes.te.version import te_version
from te_passes.debug.dump_files import (FOLDED_KINDS, FREE_KINDS, GRAPH_DIR_RE, MEMORY_KINDS, POOL_KINDS, SCHEMA,
    SKIPPED_KINDS, WHAT_KEYS, md_link, md_table)


# --------------------------------------------------------------------------- reports
def report_json(report: Any, stage_dirs: dict[str, str] | None = None) -> dict[str, Any]:
    """``CompileReport.to_json()`` plus, per stage, the dump directory (``"dir"``) and per run
    its dump directory and change counts (``"dump"``, ``"changes"``)."""
    data = report.to_json()
    stage_dirs = stage_dirs or {}
    for sj, s in zip(data["stages"], report.stages):
        sj["dir"] = stage_dirs.get(f"{s.graph_id}/{s.stage}")
        for rj, r in zip(sj["runs"], s.runs):
            rj["dump"] = getattr(r, "dump_dir", None)
            rj["changes"] = getattr(r, "dump_changes", None)
    return data


def read_graph_report(root: str, name: str) -> dict[str, Any] | None:
    """The per-graph ``report.json`` of ``root/name`` when that folder is one this module wrote,
    else ``None``."""
    if not GRAPH_DIR_RE.fullmatch(name):
        return None
    p = os.path.join(root, name, "report.json")
    if not os.path.isfile(p):
        return None
    data = read_json_or_none(p)
    if not isinstance(data, dict) or data.get("graph_id") != name or not isinstance(data.get("stages"), list):
        return None
    return data


def _graph_reports(root: str) -> list[dict[str, Any]]:
    out = [d for d in (read_graph_report(root, name) for name in os.listdir(root)) if d is not None]
    return sorted(out, key=lambda d: int(d["graph_id"][1:]))


def _folded_expr(rec: dict[str, Any]) -> str | None:
    """``"get_ub_is_fp8('proj_fprop', True)"`` / ``"recipe.fp8_gemm_fprop.use_split_accumulator"``:
    the folded expression as text, from the record's own fields."""
    if rec.get("receiver") is not None and rec.get("field") is not None:
        return f"{rec['receiver']}.{rec['field']} = {rec.get('value')!r}"
    attr = rec.get("attr") or rec.get("name")
    if attr is not None and rec.get("type") is not None:
        return f"self.{attr}: {rec['type']}"
    what = next((rec[k] for k in WHAT_KEYS if rec.get(k) is not None), None)
    if what is None:
        return None
    args = rec.get("args")
    if isinstance(args, list):
        return f"{what}({', '.join(repr(a) for a in args)})"
    return str(what)


def _memory_entry(graph_id: str, stage: str, mem: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"graph_id": graph_id, "stage": stage, **(mem if isinstance(mem, dict) else {"value": mem})}
    for k in ("peak_before", "peak_after"):
        entry.setdefault(k, None)
    return entry


def build_summary(graphs: Iterable[dict[str, Any]], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The top-level ``report.json``: flat, per-kind views over every graph's pass records."""
    graphs = list(graphs)
    s: dict[str, Any] = {"schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                         "versions": versions(), "graphs": [], "passes": [], "folded": [], "frees": [],
                         "pool_check": [], "skipped": [], "failed": [], "other_records": [],
                         "memory": {"stages": [], "peak_before": None, "peak_after": None},
                         "graph_breaks": [], "eager_fallbacks": [], "recompiles": [], "frames": [],
                         "uuid": {}}
    for g in graphs:
        gid = g.get("graph_id")
        s["graphs"].append({"graph_id": gid, "mode": g.get("mode") or "default", "te_ops": g.get("te_ops"),
                            "cache_hit": g.get("cache_hit"),
                            "stages": [f"{st['graph_id']}:{st['stage']}" for st in g.get("stages", [])],
                            "time_ms_passes": g.get("time_ms_passes"), "time_ms_total": g.get("time_ms_total"),
                            "te_version": (g.get("te_state") or {}).get("te_version")})
        s["uuid"][gid] = g.get("uuid", {})
        for st in g.get("stages", []):
            where = {"graph_id": st["graph_id"], "stage": st["stage"]}
            mem = (st.get("facts") or {}).get("memory")
            if mem is not None:
                s["memory"]["stages"].append(_memory_entry(st["graph_id"], st["stage"], mem))
            for run in st.get("runs", []):
                s["passes"].append({**where, "name": run["name"], "status": run["status"],
                                    "changed": run["changed"], "time_ms": run["time_ms"],
                                    "nodes_before": run["nodes_before"], "nodes_after": run["nodes_after"],
                                    "records": len(run.get("records", [])), "dump": run.get("dump"),
                                    "error": run.get("error")})
                if run["status"] == "failed":
                    s["failed"].append({**where, "pass": run["name"], "error": run.get("error")})
                for rec in run.get("records", []):
                    kind = rec.get("kind")
                    entry = {**where, "pass": run["name"], **rec}
                    if kind in FOLDED_KINDS:
                        for k in ("source", "args", "value"):
                            entry.setdefault(k, None)
                        entry["expr"] = _folded_expr(rec)
                        s["folded"].append(entry)
                    elif kind in FREE_KINDS:
                        for k in ("role", "bytes"):
                            entry.setdefault(k, None)
                        s["frees"].append(entry)
                    elif kind in POOL_KINDS or str(kind).startswith("pool"):
                        s["pool_check"].append(entry)
                    elif kind in SKIPPED_KINDS:
                        s["skipped"].append(entry)
                    elif kind in MEMORY_KINDS:
                        s["memory"]["stages"].append(_memory_entry(st["graph_id"], st["stage"],
                                                                   {"pass": run["name"], **rec}))
                    else:
                        s["other_records"].append(entry)
    peaks: dict[str, list[float]] = {"peak_before": [], "peak_after": []}
    for m in s["memory"]["stages"]:
        m.pop("kind", None)
        m.pop("node", None)
        for k in peaks:
            v = m.get(f"{k}_concrete", m.get(k))
            v = v.get("concrete") if isinstance(v, dict) else v
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                peaks[k].append(v)
    for k, vals in peaks.items():
        s["memory"][k] = max(vals) if vals else None
    s.update(extra or {})
    return s


def versions() -> dict[str, Any]:
    """``{"te_passes", "torch", "transformer_engine"}`` versions installed here (TE: ``None`` when absent)."""
    return {"te_passes": __version__, "torch": str(torch.__version__), "transformer_engine": te_version()}


def write_summary(root: str, extra: dict[str, Any] | None = None, *, emit: bool = True) -> dict[str, Any]:
    """(Re)write ``root/report.json`` and ``root/index.md`` from every ``root/*/report.json``."""
    session_path = os.path.join(root, "session.json")
    if extra is not None:
        with open(session_path, "w") as f:
            json.dump(extra, f, indent=2, default=repr)
    elif os.path.isfile(session_path):
        extra = read_json_file(session_path)
    summary = build_summary(_graph_reports(root), extra)
    with open(os.path.join(root, "report.json"), "w") as f:
        json.dump(summary, f, indent=2, default=repr)
    with open(os.path.join(root, "index.md"), "w") as f:
        f.write(render_index(summary, root))
    if emit:
        trace_artifact("te_passes_report", lambda: json.dumps(summary, default=repr), encoding="json")
    return summary


_ENTRY_KEYS = ("graph_id", "stage", "pass", "kind", "node")


def record_detail(entry: dict[str, Any], n: int = 120) -> str:
    """One-line text for a pool-check or other record (what ``te-passes show`` and ``index.md``
    print): ``"0 findings, 9 allocated values, cudagraphs off"`` for a ``pool_check`` summary,
    else the record's ``message``/``reason``, else its other fields as ``key=value``."""
    if entry.get("kind") == "pool_check":
        return (f"{entry.get('findings', 0)} findings, {entry.get('allocated_values', '?')} allocated values, "
                f"cudagraphs {'on' if entry.get('cudagraphs') else 'off'}")
    text = entry.get("message") or entry.get("reason")
    if not text:
        text = ", ".join(f"{k}={v if isinstance(v, str) else json.dumps(v, default=repr)}"
                         for k, v in entry.items() if k not in _ENTRY_KEYS)
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _cell(v: Any) -> Any:
    """A table cell: strings and numbers as they are, other values as JSON."""
    return v if v is None or isinstance(v, (str, int, float)) else json.dumps(v, default=repr)


def elsewhere_warnings(summary: dict[str, Any]) -> list[str]:
    """One sentence per graph whose ``torch.compile`` set its own ``te_passes.dump_dir``
    (``summary["elsewhere"]``, written by ``te-passes dump``)."""
    out = []
    for e in summary.get("elsewhere") or []:
        where = e.get("dump_dir")
        if e.get("dump_failed"):
            out.append(f"{e['graph_id']}: writing its dump failed (see the te_passes log); its report only is here")
        elif where:
            copy = "copied here" if e.get("copied") else "its report only is here"
            out.append(f"{e['graph_id']} was compiled with its own te_passes.dump_dir: its dump went to {where!r} "
                       f"({copy})")
        else:
            out.append(f"{e['graph_id']} was compiled without a dump directory (its te_passes.dump_dir option "
                       f"overrode TE_PASSES_DUMP_DIR): its report only is here, no graph files")
    return out


def render_index(summary: dict[str, Any], root: str) -> str:
    """``index.md``: what was compiled, per-pass table with links to before/after/diff, folded
    constants, early frees, memory, pool check, skipped rewrites, graph breaks and TE eager
    islands, recompiles, uuid."""
    v = summary["versions"]
    L = [f"# te_passes dump\n",
         f"te_passes {v['te_passes']} · torch {v['torch']} · Transformer Engine {v['transformer_engine']} · "
         f"{summary['created']}\n"]
    tgt = summary.get("target")
    if tgt:
        L.append(f"Target: `{tgt}`  ")
    if summary.get("session"):
        L.append(f"Session: {summary['session']} (pid {summary.get('pid')} on {summary.get('host')}, started "
                 f"{summary.get('started')})  ")
    for key in ("precision", "mode", "compile_path"):
        if summary.get(key):
            L.append(f"{key.replace('_', ' ').capitalize()}: {summary[key]}  ")
    if summary.get("note"):
        L.append(f"\n> {summary['note']}\n")
    for w in elsewhere_warnings(summary):
        L.append(f"\n> **Warning:** {w}\n")
    L.append("\nMachine-readable: [report.json](report.json) · per graph: " +
             ", ".join(md_link(root, f"{g['graph_id']}/report.json", g["graph_id"]) for g in summary["graphs"]) + "\n")

    L.append("\n## Graphs and stages\n")
    rows = []
    for g in summary["graphs"]:
        gid = g["graph_id"]
        stage_links = []
        for st in g["stages"]:
            sgid, stage = st.split(":")
            d = next((p.get("dump") for p in summary["passes"] if p["graph_id"] == sgid and p["stage"] == stage
                      and p.get("dump")), None)
            sdir = os.path.dirname(d) if d else f"{gid}/{stage}"
            stage_links.append(f"{md_link(root, f'{sdir}/input.py', stage)} "
                               f"({md_link(root, f'{sdir}/input.tegraph', 'tegraph')})")
        rows.append([gid, g["mode"] or "default", ", ".join(stage_links),
                     g["time_ms_passes"], g["time_ms_total"]])
    L.append(md_table(["graph", "mode", "stages (input graph, replayable file)", "passes ms", "total ms"], rows))
    for g in summary["graphs"]:
        if g.get("cache_hit"):
            L.append(f"\n{g['graph_id']}: {cache_hit_note(g['cache_hit'])}.\n")
    partial = [g["graph_id"] for g in summary["graphs"]
               if not any(st.endswith(":post_grad_fwd") for st in g["stages"]) and not g.get("cache_hit")]
    if partial:
        L.append(f"\nNo post-grad stages for {', '.join(partial)}: Inductor's FX-graph / AOTAutograd cache "
                 f"hit (the passes' uuid and the TE state were unchanged, so the cached result already holds "
                 f"their rewrites), or the graph was not lowered by AOTAutograd. `te-passes dump` turns the "
                 f"caches off.\n")

    L.append("\n## Passes\n")
    rows = []
    for p in summary["passes"]:
        d = p.get("dump")
        links = " · ".join(md_link(root, f"{d}/{f}", f.split('.')[0]) for f in ("before.py", "after.py", "diff.patch",
                                                                              "changes.txt")) if d else ""
        rows.append([p["graph_id"], p["stage"], p["name"], p["status"], "yes" if p["changed"] else "no",
                     f"{p['time_ms']:.2f}", f"{p['nodes_before']} → {p['nodes_after']}", p["records"], links])
    L.append(md_table(["graph", "stage", "pass", "status", "changed", "ms", "nodes", "records", "dump"], rows)
             if rows else "No passes ran (none registered for these stages).\n")

    def section(title: str, key: str, cols: list[str], empty: str) -> None:
        L.append(f"\n## {title}\n")
        items = summary.get(key) or []
        if not items:
            L.append(empty + "\n")
            return
        L.append(md_table(cols, [[it.get(c) for c in cols] for it in items]))

    section("Folded and hoisted constants", "folded", ["graph_id", "stage", "pass", "kind", "node", "expr",
                                                        "value", "source"], "None.")
    section("Early frees", "frees", ["graph_id", "stage", "pass", "node", "role", "bytes", "after"], "None.")
    L.append("\n## Memory estimate\n")
    mem = summary["memory"]
    if mem["stages"]:
        want = ("pass", "peak_before", "peak_after", "peak_before_concrete", "peak_after_concrete",
                "peak_node_before", "peak_node_after", "input_bytes")
        present = {k for m in mem["stages"] for k in m}
        cols = [c for c in want if c in present] or sorted(present - {"graph_id", "stage"})
        L.append(md_table(["graph_id", "stage", *cols],
                           [[m["graph_id"], m["stage"], *[_cell(m.get(c)) for c in cols]]
                            for m in mem["stages"]]))
    else:
        L.append("No memory estimate was recorded.\n")
    for key in ("pool_check", "other_records"):
        summary = {**summary, key: [{**e, "detail": record_detail(e)} for e in summary.get(key) or []]}
    section("Cudagraph pool check", "pool_check", ["graph_id", "stage", "pass", "kind", "node", "detail"], "Not run.")
    section("Rewrites refused (skipped / kept)", "skipped", ["graph_id", "stage", "pass", "kind", "node", "reason"],
            "None.")
    section("Other records", "other_records", ["graph_id", "stage", "pass", "kind", "node", "detail"], "None.")
    section("Failed passes (graph restored)", "failed", ["graph_id", "stage", "pass", "error"], "None.")

    section("TE eager islands and fallbacks", "eager_fallbacks", ["module", "kind", "reason", "location", "count"],
            no_islands_text(summary).capitalize() + ".")
    section("Graph breaks", "graph_breaks", ["reason", "location", "count"], "None recorded.")
    section("Recompiles", "recompiles", ["compile_id", "function", "reason"], "None recorded.")
    L.append("\n## Pipeline uuid (Inductor FX-graph-cache key part)\n")
    rows = [[gid, (u or {}).get("uuid", "")[:16], ", ".join(f"{k}={str(h)[:8]}" for k, h in
                                                          ((u or {}).get("passes") or {}).items()),
             json.dumps((u or {}).get("options")), str((u or {}).get("te_state", ""))[:16],
             {True: "yes", False: "no"}.get((u or {}).get("reads_ub"), "")]
            for gid, u in summary["uuid"].items()]
    L.append(md_table(["graph", "uuid", "passes (source+config hash)", "options", "te_state",
                        "reads UB (UB snapshot in te_state)"], rows))
    reads = [(gid, u["ub_reads"]) for gid, u in summary["uuid"].items() if (u or {}).get("ub_reads")]
    if reads:
        L.append("\nWhy a graph reads UB state (a UB change re-keys only these; te_passes.compat.ub.graph_guard.ub_state_reads):\n")
        L.extend(f"- {gid}: " + "; ".join(r) for gid, r in reads)
    return "\n".join(L)
