"""``te-passes``: dumps, tables and offline replay of what te_passes did to TE graphs.

Subcommands::

    te-passes dump TARGET [--out DIR] [--mode MODE] [--precision P] [--disable PASS[,PASS]] ...
    te-passes dump --example NAME [--out DIR] [--mode MODE] [--precision P] [--disable PASS[,PASS]] ...
    te-passes list
    te-passes show DIR
    te-passes replay PATH [--disable PASS[,PASS]] ... [--out DIR] [--check] [--json]

``TARGET`` is a Python file (run as ``__main__``), ``module:function`` or ``file.py:function``
(a callable that builds a model and runs it under ``torch.compile(backend="te_inductor")``;
it receives ``mode=`` / ``precision=`` when its signature takes them). The dump directory holds
per-graph, per-stage, per-pass TE-aware graphs, diffs, ``report.json`` and ``index.md``
(:mod:`te_passes.debug.dump`); graph breaks, TE eager islands and recompiles come from
:mod:`te_passes.debug.graph_breaks`.

Output is rich tables on a terminal and plain aligned text otherwise (pipes, CI logs). Bad
input — a missing file, a target that raises or compiles nothing, an unknown pass or example
name, an unwritable output directory — prints one ``te-passes: error: ...`` line on stderr and
exits non-zero (2 for bad arguments, 1 for a failing target or a replay mismatch with
``--check``).

Modules: :mod:`~te_passes.cli.main` (parser, :func:`main`), :mod:`~te_passes.cli.dump_cmd`
(``dump``), :mod:`~te_passes.cli.targets` (loading TARGET), :mod:`~te_passes.cli.dumpdir` (the dump
directory: manifest, staging), :mod:`~te_passes.cli.show` (``show``, ``list``),
:mod:`~te_passes.cli.replay` (``replay``), :mod:`~te_passes.cli._common` (``Out``, ``CliError``, checks).

Imports: the CLI sits at the top of the layers (it may import anything). It imports the rest of
te_passes inside the subcommands, the one place where function-level te_passes imports are kept:
``te-passes --help``, ``list`` and ``show`` start without importing torch (seconds on a CPU box).
"""

from te_passes.cli._common import CliError, Out
from te_passes.cli.main import build_parser, main

__all__ = ["CliError", "Out", "build_parser", "main"]
