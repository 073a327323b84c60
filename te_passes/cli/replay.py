"""``te-passes replay``: re-run the passes offline on saved graphs and compare with the saved
report."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from te_passes.cli._common import CliError, EXIT_FAIL, EXIT_OK, Out, check_pass_names, clean
from te_passes.cli.dumpdir import staged_out, settle_for_reading
from te_passes.cli.show import newest_session


def cmd_replay(args: argparse.Namespace, out: Out) -> int:
    if not os.path.exists(args.path):
        raise CliError(f"no such graph file or dump directory: {args.path}")
    disable = check_pass_names(args.disable, "--disable") if args.disable is not None else None
    source = args.path
    args.path = newest_session(args.path, out, "replaying", to_stderr=args.json)
    settle_for_reading(args.path)
    if args.out:
        with staged_out(args.out, sources=(source, args.path)) as stage:
            results = _replay(args, out, disable, stage)
            from te_passes.debug.dump_summary import write_summary

            write_summary(stage, {"target": f"replay {args.path}", "compile_path": "offline replay of saved graphs"})
    else:
        results = _replay(args, out, disable, None)
    from te_passes.debug.offline import compare_reports, version_differences
    from te_passes.passes.order import pass_classes

    unreplayable = {c.name for c in pass_classes() if not c.replayable}

    mismatches = 0
    payload = []
    for report, saved in results:
        rj = report.to_json()
        # a dump or graph directory replays every saved stage; a stage directory (g0/dynamo, holding
        # input.tegraph) or one .tegraph file only its own
        whole = os.path.isdir(args.path) and not os.path.isfile(os.path.join(args.path, "input.tegraph"))
        diffs = compare_reports(rj, saved, require_all=whole, unreplayable=unreplayable) if saved is not None else None
        versions = version_differences(getattr(report, "saved_versions", None))
        payload.append({"report": rj, "differences": diffs, "versions": versions})
        if versions is not None:
            sv, iv = versions["saved"], versions["installed"]
            print(clean(f"te-passes: warning: {report.graph_id} was saved under torch {sv['torch']}, Transformer "
                        f"Engine {sv['transformer_engine']}; installed here: torch {iv['torch']}, Transformer Engine "
                        f"{iv['transformer_engine']} (a difference below may come from that)", one_line=True),
                  file=sys.stderr, flush=True)
        if args.json:
            continue
        out.heading(f"replay of {report.graph_id} ({len(report.stages)} stages)")
        out.table(None, ["stage", "pass", "status", "changed", "ms", "nodes", "records"],
                  [[st.stage, r.name, r.status, "yes" if r.changed else "no", f"{r.time_ms:.2f}",
                    f"{r.nodes_before} -> {r.nodes_after}", len(r.records)] for st in report.stages for r in st.runs],
                  limit=None)
        if diffs is None:
            out.line("no saved report.json next to the graphs: nothing to compare with")
        elif diffs:
            mismatches += 1
            out.line(f"differs from the saved report ({len(diffs)} differences):")
            for d in diffs[:40]:
                out.line(f"  {d}")
        else:
            out.line("reproduces the saved report: same passes, statuses, node counts and records")
    if args.json:
        print(json.dumps(payload, indent=2, default=repr))
    if args.check and mismatches:
        raise CliError(f"replay differs from the saved report for {mismatches} graph(s)", EXIT_FAIL)
    unchecked = [p["report"]["graph_id"] for p in payload if p["differences"] is None]
    if args.check and unchecked:  # --check asked for a comparison that could not be made
        raise CliError(f"--check: no saved report.json to compare with for {', '.join(unchecked)} (the graph "
                       f"folder's report.json is missing)")
    return EXIT_OK


def _replay(args: argparse.Namespace, out: Out, disable: list[str] | None, dump_dir: str | None) -> list:
    from te_passes.debug.offline import ReplayError, replay
    from te_passes.passes.order import configured_passes
    from te_passes.compat.install import install

    import torch  # noqa: F401  (before transformer_engine)
    with contextlib.suppress(ImportError):  # TE's op families defined, as where the graphs were compiled
        import transformer_engine.pytorch  # noqa: F401
    install()  # as the backend does before any pass runs (call_te_impl_directly's lowering)
    try:
        with out.status(f"replaying {args.path}"):
            return replay(args.path, configured_passes(), disable=disable, dump_dir=dump_dir)
    except ReplayError as e:
        raise CliError(str(e)) from e
