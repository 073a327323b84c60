"""``te-passes show`` and ``te-passes list``: the summary tables of a dump directory and of the pass
pipeline."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable

from te_passes.debug.graph_breaks import no_islands_text
from te_passes.cli._common import CliError, EXIT_OK, Out, check_pass_names, pass_registry, clean
from te_passes.config import env_option


def _fmt_bytes(v: Any) -> str:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return "" if v is None else str(v)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(v) < 1024 or unit == "GiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024


def _short(v: Any, n: int = 70) -> str:
    s = "" if v is None else (v if isinstance(v, str) else repr(v) if isinstance(v, (bool, int, float))
                              else json.dumps(v, default=repr))
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 1] + "…"


def _short_left(v: Any, n: int = 50) -> str:
    """Like :func:`_short` but cut from the left, keeping the end (``file.py:LINE (fn)``)."""
    s = _short(v, 10**9)
    return s if len(s) <= n else "…" + s[len(s) - n + 1:]


def _grouped(items: list[dict[str, Any]], key: Callable[[dict[str, Any]], tuple]) -> list[list[Any]]:
    """Rows ``[*key, count, nodes]`` grouping ``items`` with equal ``key`` (first-seen order)."""
    groups: dict[tuple, list[Any]] = {}
    for it in items:
        group = groups.setdefault(key(it), [0, []])
        group[0] += 1
        if it.get("node") is not None:  # a graph-level record (a skipped pass) names no node
            group[1].append(str(it["node"]))
    return [[*k, n, _short(", ".join(nodes), 50)] for k, (n, nodes) in groups.items()]


def print_summary(out: Out, s: dict[str, Any], root: str) -> None:
    v = s.get("versions", {})
    out.heading("te_passes dump")
    out.line(f"target:       {s.get('target', '')}")
    if s.get("precision"):
        out.line(f"precision:    {s['precision']}")
    # a backend session has no mode of its own: its graphs' modes (each "default" when none)
    modes = s.get("mode") or ", ".join(dict.fromkeys(g.get("mode") or "default" for g in s.get("graphs", [])))
    out.line(f"mode:         {modes or 'default'}")
    if s.get("compile_path"):
        out.line(f"compile path: {s['compile_path']}")
    out.line(f"versions:     te_passes {v.get('te_passes')}, torch {v.get('torch')}, "
             f"Transformer Engine {v.get('transformer_engine')}")
    if s.get("note"):
        out.line(f"note:         {s['note']}")
    for g in s.get("graphs", []):
        if g.get("cache_hit"):
            from te_passes.report import cache_hit_note

            out.line(f"note:         {g['graph_id']}: {cache_hit_note(g['cache_hit'])}")
    if s.get("elsewhere"):
        from te_passes.debug.dump_summary import elsewhere_warnings

        for w in elsewhere_warnings(s):
            out.line(f"warning:      {w}")
    out.table("Graphs", ["graph", "mode", "stages", "passes ms", "uuid"],
              [[g["graph_id"], g.get("mode") or "default", " ".join(x.split(":")[1] for x in g["stages"]),
                g.get("time_ms_passes"), ((s.get("uuid") or {}).get(g["graph_id"]) or {}).get("uuid", "")[:16]]
               for g in s.get("graphs", [])])
    out.table("Passes", ["graph", "stage", "pass", "status", "changed", "ms", "nodes", "records"],
              [[p["graph_id"], p["stage"], p["name"], p["status"], "yes" if p["changed"] else "no",
                f"{p['time_ms']:.2f}", f"{p['nodes_before']} -> {p['nodes_after']}", p["records"]]
               for p in s.get("passes", [])], limit=None)
    if s.get("folded"):
        rows = _grouped(s["folded"], lambda f: (f["graph_id"], f["pass"], f["kind"], _short(f.get("expr"), 60),
                                                _short(f.get("value"), 30)))
        out.table(f"Folded / hoisted constants ({len(s['folded'])} records)",
                  ["graph", "pass", "kind", "what", "value", "n", "nodes"], rows, limit=25)
    if s.get("frees"):
        out.table(f"Early frees ({len(s['frees'])})", ["graph", "node", "role", "bytes", "after"],
                  [[f["graph_id"], f.get("node"), f.get("role"), _fmt_bytes(f.get("bytes")), f.get("after")]
                   for f in s["frees"]])
    mem = s.get("memory") or {}
    if mem.get("stages"):
        rows = []
        for m in mem["stages"]:
            b, a = m.get("peak_before_concrete", m.get("peak_before")), m.get("peak_after_concrete", m.get("peak_after"))
            saved = b - a if isinstance(a, (int, float)) and isinstance(b, (int, float)) else None
            sym = "" if not m.get("symbolic") else f"{_short(m.get('peak_before'), 30)} -> {_short(m.get('peak_after'), 30)}"
            rows.append([m["graph_id"], m["stage"], _fmt_bytes(b), _fmt_bytes(a), _fmt_bytes(saved), m.get("peak_node_after"),
                         sym])
        out.table("Memory estimate (peak bytes of live tensors)", ["graph", "stage", "before", "after", "saved",
                                                                  "peak at", "symbolic"], rows)
    if s.get("pool_check"):
        from te_passes.debug.dump_summary import record_detail

        rows = [[p["graph_id"], p["kind"], p.get("node"), record_detail(p, 90)] for p in s["pool_check"]]
        out.table("Cudagraph pool check", ["graph", "kind", "node", "detail"], rows)
    if s.get("skipped"):
        rows = _grouped(s["skipped"], lambda k: (k["graph_id"], k["pass"], k["kind"], _short(k.get("reason"), 80)))
        out.table(f"Rewrites refused ({len(s['skipped'])} records)", ["graph", "pass", "kind", "reason", "n", "nodes"],
                  rows, limit=20)
    if s.get("other_records"):
        counts: dict[tuple[str, str], int] = {}
        for r in s["other_records"]:
            counts[(r["pass"], str(r["kind"]))] = counts.get((r["pass"], str(r["kind"])), 0) + 1
        out.line("other records: " + ", ".join(f"{p}: {k} x{n}" for (p, k), n in counts.items())
                 + " (report.json other_records[])")
    if s.get("failed"):
        out.table("Failed passes (graph restored)", ["graph", "stage", "pass", "error"],
                  [[f["graph_id"], f["stage"], f["pass"], _short(f.get("error"), 90)] for f in s["failed"]])
    if s.get("eager_fallbacks"):
        out.table("TE eager islands and fallbacks", ["module", "reason", "where", "count"],
                  [[e["module"], _short(e["reason"], 90), _short_left(e.get("location"), 50), e.get("count")]
                   for e in s["eager_fallbacks"]])
    else:
        out.line(f"\nTE eager islands: {no_islands_text(s)}")
    if s.get("graph_breaks"):
        out.table(f"Graph breaks ({len(s['graph_breaks'])})", ["reason", "where", "count"],
                  [[_short(g["reason"], 90), _short_left(g.get("location"), 50), g.get("count")]
                   for g in s["graph_breaks"]])
    else:
        out.line("graph breaks: none recorded")
    if s.get("recompiles"):
        out.table(f"Recompiles ({len(s['recompiles'])})", ["compile id", "function", "reason"],
                  [[r["compile_id"], r["function"], _short(r["reason"], 90)] for r in s["recompiles"]])
    else:
        out.line("recompiles: none recorded")
    if s.get("warnings"):
        out.line(f"warnings: {len(s['warnings'])} distinct warnings while running the target "
                 f"(report.json warnings[]; dump --verbose prints them)")
    out.line(f"\ndump: {os.path.join(root, 'index.md')}  (report: {os.path.join(root, 'report.json')})")


def newest_session(path: str, out: Out, verb: str, to_stderr: bool = False) -> str:
    """``path`` itself, or its newest backend dump session folder when ``path`` is a directory
    of sessions (``te_passes.dump_dir`` without the CLI; :func:`te_passes.debug.dump_sessions.read_sessions`),
    saying which one is used."""
    if not os.path.isdir(path):
        return path
    from te_passes.debug.dump_sessions import latest_session_dir, read_sessions

    latest = latest_session_dir(path)
    if latest is None:
        return path
    n = len(read_sessions(path))
    msg = (f"{path} holds {n} backend dump session{'s' if n != 1 else ''}; {verb} the newest, {latest}"
           + (f" (others: see {os.path.join(path, 'index.md')})" if n > 1 else ""))
    if to_stderr:
        print(clean(msg), file=sys.stderr)
    else:
        out.line(msg)
    return latest


def cmd_show(args: argparse.Namespace, out: Out) -> int:
    from te_passes.cli.dumpdir import settle_for_reading

    path = newest_session(args.dir, out, "showing", to_stderr=args.json)
    settle_for_reading(path)
    rp = os.path.join(path, "report.json") if os.path.isdir(path) else path
    if not os.path.isfile(rp):
        hint = ""
        if not os.path.exists(path):  # `te-passes show fold_ub_predicates`: a pass name, not a dump
            from te_passes.passes.order import pass_names

            if path in pass_names():
                hint = (f"; {path} is a pass name: te-passes show takes a dump directory (te-passes list "
                        f"describes the passes, docs/passes/{path}.md documents this one)")
        raise CliError(f"no te_passes dump at {path} (no report.json); create one with te-passes dump{hint}")
    from te_passes.debug.dump_files import DumpFormatError, check_summary, read_json

    try:
        s = check_summary(rp, read_json(rp))
    except DumpFormatError as e:
        raise CliError(str(e)) from None
    if args.json:
        print(json.dumps(s, indent=2))
    else:
        try:
            print_summary(out, s, os.path.dirname(rp) or ".")
        except (TypeError, AttributeError, KeyError, ValueError, IndexError) as e:  # a field check_summary lets by
            raise CliError(f"{rp}: malformed summary ({type(e).__name__}: {e})") from None
    return EXIT_OK


# --------------------------------------------------------------------------- list
def cmd_list(args: argparse.Namespace, out: Out) -> int:
    names, classes = pass_registry()
    env_disable = set(env_option("disable") or ())
    check_pass_names(sorted(env_disable & set(names)), "TE_PASSES_DISABLE")  # refused as the backend refuses it
    rows = []
    for cls in classes:
        order = {"dynamo": 0, "joint": 1, "post_grad_fwd": 2, "post_grad_bwd": 3}
        stages = sorted((s.value for s in cls.stages), key=order.get)
        rows.append([cls.name, stages, "analysis" if cls.analysis_only else "rewrite", cls.name not in env_disable,
                     cls.description])
    if args.json:  # stages: a list; enabled: a bool (False when TE_PASSES_DISABLE names the pass)
        print(json.dumps([dict(zip(["name", "stages", "kind", "enabled", "description"], r)) for r in rows], indent=2))
        return EXIT_OK
    rows = [[n, ", ".join(st), k, "yes" if en else "no (TE_PASSES_DISABLE)", d] for n, st, k, en, d in rows]
    out.table(f"te_passes pipeline ({len(rows)} passes, in order)", ["pass", "stages", "kind", "enabled",
                                                                     "description"], rows, limit=None)
    unknown = sorted(env_disable - set(names))
    if unknown:
        out.line(f"warning: TE_PASSES_DISABLE names unknown passes: {', '.join(unknown)}")
    return EXIT_OK
