"""``te-passes``: dumps, tables and offline replay of what te_passes did to TE graphs
(``dump TARGET`` / ``dump --example NAME``, ``list``, ``show DIR``, ``replay PATH``, ``doctor``). Usage, output,
errors and exit codes: docs/cli.md.

Modules: :mod:`~te_passes.cli.main` (parser, :func:`main`), :mod:`~te_passes.cli.dump_cmd` (``dump``),
:mod:`~te_passes.cli.targets` (loading TARGET), :mod:`~te_passes.cli.dumpdir` (the dump directory),
:mod:`~te_passes.cli.show` (``show``, ``list``), :mod:`~te_passes.cli.replay` (``replay``), :mod:`~te_passes.cli.doctor` (``doctor``),
:mod:`~te_passes.cli._common` (``Out``, ``CliError``, checks). The CLI sits at the top of the layers and
imports the subcommand modules when one runs (:func:`~te_passes.cli.main.main`; the one place function-level
te_passes imports are kept): ``te-passes --help`` and ``--version`` import no torch (well under 1 s)."""

from te_passes.cli._common import CliError, Out
from te_passes.cli.main import build_parser, main

__all__ = ["CliError", "Out", "build_parser", "main"]
