"""``te-passes dump``: run a target or a built-in example under a claimed dump directory, write the
summary and print it."""

from __future__ import annotations

import argparse
import json
import os
import traceback
from typing import Any, Sequence
from unittest import mock

from te_passes.cli._common import (CLI_CAUSED_WARNINGS, CliError, EXIT_FAIL, EXIT_OK, EXIT_USAGE, Out,
    check_mode, check_pass_names, check_writable_dir)
from te_passes.cli.dumpdir import staged_out
from te_passes.cli.targets import check_target_file, run_target
from te_passes.cli.show import print_summary
from te_passes.config import TePassesOptionError, env_option


def cmd_dump(args: argparse.Namespace, out: Out) -> int:
    if (args.target is None) == (args.example is None):
        raise CliError("give exactly one of TARGET or --example NAME")
    from te_passes.examples import EXAMPLES, PRECISIONS

    if args.example is not None and args.example not in EXAMPLES:
        raise CliError(f"unknown example {args.example!r}; examples: {', '.join(EXAMPLES)}")
    if args.precision is not None and args.precision not in PRECISIONS:
        raise CliError(f"unknown --precision {args.precision!r}; expected one of {', '.join(PRECISIONS)}")
    if args.target is not None:
        check_target_file(args.target)
        if ":" not in args.target and (args.mode is not None or args.precision is not None):
            raise CliError("--mode/--precision apply to module:function targets and --example; a file target "
                           "sets its own torch.compile(mode=...)")
    check_writable_dir(args.out)  # the cheap checks first: no torch import yet
    disable = check_pass_names(args.disable or [], "--disable")
    env_disable = list(env_option("disable") or ())
    check_pass_names(env_disable, "TE_PASSES_DISABLE")
    check_mode(args.mode)
    shown, args.out = args.out, os.path.abspath(args.out)  # resolved once: the target may chdir
    with staged_out(args.out) as stage:
        summary = _dump_into(args, out, stage, disable, env_disable)
    print_summary(out, summary, shown)
    return EXIT_OK


def _dump_into(args: argparse.Namespace, out: Out, root: str, disable: list[str],
               env_disable: list[str]) -> dict[str, Any]:
    """Run the dump of ``args`` into staging folder ``root`` (see :func:`staged_out`); return
    the summary."""
    import torch

    from te_passes.debug.dump_sessions import claim_dir, unclaim_dir
    from te_passes.debug.dump_summary import write_summary
    from te_passes.debug.graph_breaks import CompileEvents
    from te_passes.examples import EXAMPLES, describe, run_example
    from te_passes.report import compile_reports

    n_before = len(compile_reports())
    extra: dict[str, Any] = {"owner": "cli", "mode": args.mode or "default", "disabled": disable + env_disable}
    # the backend's writers in this process, given TE_PASSES_DUMP_DIR=--out (or a torch.compile
    # option naming --out), write straight into the staging folder (no session folder)
    claim_dir(args.out, into=root)
    claim_dir(root)
    no_caches = torch._inductor.config.patch(force_disable_caches=True)  # every stage must run to be dumped
    no_caches.__enter__()
    try:
        write_summary(root, extra, emit=False)  # the session facts are ours: the backend's writers leave them to us
        events = CompileEvents(reemit_warnings=args.verbose, ignore_warnings=CLI_CAUSED_WARNINGS)
        if args.example is not None:
            ex = EXAMPLES[args.example]
            extra.update(target=f"--example {args.example} ({describe(args.example, args.precision)})",
                         precision=args.precision or ex.precision)
            try:
                with events:
                    result = run_example(args.example, precision=args.precision, mode=args.mode, dump_dir=root,
                                         disable=disable, status=lambda m: out.line(f"» {m}") if out.rich is None
                                         else None)
            except Exception as e:  # noqa: BLE001
                if args.verbose:
                    traceback.print_exc()
                bad_input = isinstance(e, TePassesOptionError)  # an option / TE_PASSES_* value: exit 2
                raise CliError(f"example {args.example} failed: {type(e).__name__}: {e}",
                               EXIT_USAGE if bad_input else EXIT_FAIL) from e
            extra.update(compile_path=result.compile_path, note=result.note)
        else:
            extra.update(target=args.target, precision=args.precision,
                         compile_path="torch.compile(backend='te_inductor') in this process")
            env = {"TE_PASSES_DUMP_DIR": args.out}
            if disable:
                env["TE_PASSES_DISABLE"] = ",".join(disable + env_disable)
            with mock.patch.dict(os.environ, env), out.status(f"running {args.target}"), events:
                run_target(args.target, args.mode, args.precision, args.verbose)
        new_reports = compile_reports()[n_before:]
        if not new_reports:
            raise CliError(f"{extra['target']} compiled nothing with backend 'te_inductor' (no te_inductor call: "
                           f"did it run a function compiled with torch.compile(..., backend='te_inductor')?)",
                           EXIT_FAIL)
        extra.update(events.to_json())
        extra["elsewhere"] = _collect_strays(root, new_reports)
        return write_summary(root, extra)
    finally:
        no_caches.__exit__(None, None, None)
        unclaim_dir(args.out)
        unclaim_dir(root)


def _collect_strays(root: str, reports: Sequence[Any]) -> list[dict[str, Any]]:
    """Graphs of this run whose dump is not under ``root``: their ``torch.compile`` set its own
    ``options={"te_passes.dump_dir": ...}``, which wins over the ``TE_PASSES_DUMP_DIR`` the CLI
    sets. Their graph folder is copied into ``root`` (or, with no dump anywhere, their report is
    written there) so the summary lists them; the returned entries (``graph_id``, ``dump_dir``,
    ``copied``) become ``report.json`` ``elsewhere[]`` and a warning."""
    import shutil

    from te_passes.debug.dump_summary import read_graph_report, report_json

    strays = []
    for r in reports:
        gid = r.graph_id
        if read_graph_report(root, gid) is not None:
            continue
        other = getattr(r, "dump_dir", None)
        entry = {"graph_id": gid, "dump_dir": other, "copied": False}
        if other and os.path.realpath(other) == os.path.realpath(root):
            entry.update(dump_dir=None, dump_failed=True)  # our own writer failed (logged by the backend)
            other = None
        dest = os.path.join(root, gid)
        if not os.path.exists(dest):
            if other and read_graph_report(other, gid) is not None:
                shutil.copytree(os.path.join(other, gid), dest)
                entry["copied"] = True
            else:
                os.makedirs(dest)
                with open(os.path.join(dest, "report.json"), "w") as f:
                    json.dump(report_json(r), f, indent=2, default=repr)
        strays.append(entry)
    return strays
