"""The ``te-passes`` argument parser and :func:`main`, the console-script entry point."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

import importlib
from typing import Any, Callable

from te_passes.cli._common import CliError, DEFAULT_OUT, EXIT_FAIL, EXIT_OK, Out, print_error


def _lazy(module: str, name: str) -> Callable[[argparse.Namespace, Out], int]:
    """The subcommand ``module.name``, imported when it runs: ``te-passes --help`` imports no torch."""
    def run(args: argparse.Namespace, out: Out) -> int:
        fn: Any = getattr(importlib.import_module(f"te_passes.cli.{module}"), name)
        return fn(args, out)
    run.__name__ = run.__qualname__ = name
    return run


cmd_dump = _lazy("dump_cmd", "cmd_dump")
cmd_list = _lazy("show", "cmd_list")
cmd_show = _lazy("show", "cmd_show")
cmd_replay = _lazy("replay", "cmd_replay")
cmd_doctor = _lazy("doctor", "cmd_doctor")


def build_parser() -> argparse.ArgumentParser:
    """The ``te-passes`` argument parser (subcommands ``dump``, ``list``, ``show``, ``replay``, ``doctor``)."""
    # --plain before or after the subcommand (SUPPRESS: a subcommand does not reset the top-level value)
    plain = argparse.ArgumentParser(add_help=False)
    plain.add_argument("--plain", action="store_true", default=argparse.SUPPRESS,
                       help="plain text output even on a terminal")
    p = argparse.ArgumentParser(
        prog="te-passes", parents=[plain],
        description="Show what te_passes (the te_inductor torch.compile backend) did to Transformer Engine "
                    "graphs: per-pass TE-aware dumps, diffs, reports, offline replay.",
        epilog="Examples:\n  te-passes dump --example linear-fp8 --out te_passes_dump\n"
               "  te-passes dump train.py:main --mode reduce-overhead --disable insert_early_frees\n"
               "  te-passes show te_passes_dump\n  te-passes replay te_passes_dump/g0 --check\n  te-passes list\n"
               "  te-passes doctor",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    from te_passes import __version__

    p.add_argument("--version", action="version", version=f"te-passes {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    d = sub.add_parser("dump", parents=[plain], help="run a target (or built-in example) and dump every pass",
                       description="Run TARGET (a Python file, module:function or file.py:function that runs a "
                                   "model under torch.compile(backend='te_inductor')) or --example NAME, and write "
                                   "per-graph, per-stage, per-pass TE-aware graphs, diffs, report.json and index.md.")
    d.add_argument("target", nargs="?", help="FILE.py, module:function or FILE.py:function")
    d.add_argument("--example", metavar="NAME", help="a built-in example: linear-fp8, linear-bf16, linear-mxfp8, "
                                                   "stack-fp8, transformer-layer-bf16, transformer-layer-fp8, "
                                                   "llama-bf16, llama-fp8")
    d.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"dump directory (default {DEFAULT_OUT})")
    d.add_argument("--mode", help="torch.compile mode (default, reduce-overhead, max-autotune, ...)")
    d.add_argument("--precision", help="bf16, fp8-cs or mxfp8 (examples; callables taking precision=)")
    d.add_argument("--disable", action="append", metavar="PASS[,PASS...]", default=[],
                   help="pass name(s) to switch off, comma-separated; repeatable (also TE_PASSES_DISABLE)")
    d.add_argument("--verbose", "-v", action="store_true", help="tracebacks and the target's warnings on stderr")
    d.set_defaults(func=cmd_dump)

    l_ = sub.add_parser("list", parents=[plain], help="the pass pipeline: passes, stages, descriptions, enabled")
    l_.add_argument("--json", action="store_true", help="print JSON")
    l_.set_defaults(func=cmd_list)

    s = sub.add_parser("show", parents=[plain], help="summary tables of a dump directory")
    s.add_argument("dir", metavar="DIR", help="a dump directory (or its report.json)")
    s.add_argument("--json", action="store_true", help="print the summary JSON")
    s.set_defaults(func=cmd_show)

    r = sub.add_parser("replay", parents=[plain], help="re-run the passes offline on saved graphs (no GPU)",
                       description="Load the graphs a dump saved (*.tegraph: a file, a graph directory like "
                                   "DIR/g0, or a whole dump directory), run the current passes on them with the "
                                   "saved TE state and options, and compare with the saved report.")
    r.add_argument("path", metavar="GRAPH_FILE", help="a .tegraph file, a graph directory or a dump directory")
    r.add_argument("--disable", action="append", metavar="PASS[,PASS...]", default=None,
                   help="pass name(s) to switch off, comma-separated; repeatable (replaces the saved list)")
    r.add_argument("--out", metavar="DIR", help="write a dump of the replay there")
    r.add_argument("--check", action="store_true", help="exit 1 when the replay differs from the saved report")
    r.add_argument("--json", action="store_true", help="print the replayed report(s) as JSON")
    r.set_defaults(func=cmd_replay)

    dr = sub.add_parser("doctor", parents=[plain], help="torch / TE versions and what te_passes changes in them",
                        description="Load the backend and print every row of te_passes' patch table (each change "
                                    "it makes to TE or torch): active, or refused with the reason; the TE / torch "
                                    "versions it was checked against; why it exists.")
    dr.add_argument("--json", action="store_true", help="print JSON (with each row's drop_when)")
    dr.add_argument("--markdown", action="store_true", help="print the table in Markdown (as docs/design.md has it)")
    dr.set_defaults(func=cmd_doctor)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``te-passes`` console script; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except BrokenPipeError:  # `te-passes --help | head -1`
        _stdout_gone()
        return EXIT_OK
    out = Out(plain=True if getattr(args, "plain", False) else None, quiet=bool(getattr(args, "json", False)))
    try:
        code = args.func(args, out)
        sys.stdout.flush()  # a closed pipe fails here, not at interpreter exit
        return code
    except BrokenPipeError:  # `te-passes list | head -1`: the reader left; not an error
        _stdout_gone()
        return EXIT_OK
    except CliError as e:
        print_error(str(e))
        return e.code
    except KeyboardInterrupt:
        print_error("interrupted")
        return 130
    except OSError as e:  # an unreadable/unwritable path found late: still one line
        print_error(f"{type(e).__name__}: {e}")
        return EXIT_FAIL


def _stdout_gone() -> None:
    """The reader of stdout left (``| head``): send what is still buffered to /dev/null so the
    interpreter's final flush does not fail too."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
