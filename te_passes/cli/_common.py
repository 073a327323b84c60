"""Shared pieces of the ``te-passes`` CLI: exit codes, :class:`CliError`, :class:`Out` (rich or plain
output) and the checks of pass names, ``--mode`` and output directories."""

from __future__ import annotations

import contextlib
import os
import re
import sys
from typing import Any, Iterable, Sequence


EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
DEFAULT_OUT = "te_passes_dump"
#: Warnings ``te-passes dump`` itself causes (``force_disable_caches``), left out of the report.
CLI_CAUSED_WARNINGS = ("dynamo_pgo force disabled by torch.compiler.config.force_disable_caches",)


class CliError(Exception):
    """A user-facing error: printed as one line, exit status ``code``."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------- output
#: What :func:`clean` removes: C0 controls but tab/newline, DEL, C1 controls (CSI, OSC, ...),
#: and the Unicode bidirectional overrides (text that reads differently than it is).
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def clean(text: Any, *, one_line: bool = False) -> str:
    """``str(text)`` safe for a terminal: control characters (escape sequences start with one)
    removed, tabs as spaces; ``one_line``: newlines as spaces too. Rich markup is not interpreted
    by :class:`Out` (it prints :class:`rich.text.Text`), so ``[red]`` stays literal."""
    t = _UNPRINTABLE.sub("", str(text)).replace("\t", " ")
    return t.replace("\n", " ") if one_line else t


class Out:
    """Terminal output: rich tables/spinner on a TTY, plain aligned text otherwise."""

    def __init__(self, *, plain: bool | None = None, quiet: bool = False) -> None:
        self.rich = None
        self.quiet = quiet
        self._printed = False  # plain output: a heading / table title gets a blank line above it, but not first
        if plain is None:
            plain = not sys.stdout.isatty() or os.environ.get("TERM") == "dumb"
        if not plain:
            try:
                from rich.console import Console

                self.rich = Console(highlight=False)
            except ImportError:  # pragma: no cover - rich is a dependency
                self.rich = None

    def line(self, text: str = "") -> None:
        text = clean(text)
        self._printed = True
        if self.rich is not None:
            self.rich.print(text, markup=False, highlight=False, emoji=False, soft_wrap=True)
        else:
            print(text, flush=True)

    def _gap(self) -> str:
        """``"\n"`` before a heading or table title, except at the very top of the output."""
        gap, self._printed = ("\n" if self._printed else ""), True
        return gap

    def heading(self, text: str) -> None:
        text = clean(text, one_line=True)
        if self.rich is not None:
            from rich.text import Text

            self.rich.rule(Text(text, style="bold"))
        else:
            print(f"{self._gap()}== {text} ==", flush=True)

    def table(self, title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]], *,
              limit: int | None = 60) -> None:
        rows = [["" if v is None else clean(v, one_line=True) for v in r] for r in rows]
        title = clean(title, one_line=True) if title is not None else None
        more = 0
        if limit is not None and len(rows) > limit:
            more = len(rows) - limit
            rows = rows[:limit]
        if self.rich is not None:
            from rich.table import Table
            from rich.text import Text

            t = Table(title=Text(title) if title is not None else None, title_justify="left", show_lines=False)
            for i, c in enumerate(columns):  # names stay whole; the last column wraps
                last = i == len(columns) - 1
                whole = min(max([len(c)] + [len(r[i]) for r in rows]), 32)
                t.add_column(Text(c), overflow="fold", no_wrap=i == 0, min_width=whole if i == 0 else None,
                             ratio=2 if last else None)
            for r in rows:
                t.add_row(*(Text(v) for v in r))
            self.rich.print(t)
        else:
            if title:
                print(f"{self._gap()}{title}")
            widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
            widths = [min(w, 80) for w in widths]
            print("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip())
            print("  ".join("-" * w for w in widths))
            for r in rows:
                print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
        self._printed = True
        if more:
            self.line(f"... {more} more rows (see report.json)")

    @contextlib.contextmanager
    def status(self, text: str):
        """A spinner on a TTY (stderr); a ``» text`` line otherwise; nothing when quiet."""
        text = clean(text, one_line=True)
        if self.quiet:
            yield
        elif self.rich is not None:
            from rich.console import Console
            from rich.text import Text

            with Console(stderr=True).status(Text(text)):
                yield
        else:
            print(f"» {text}", flush=True)
            self._printed = True
            yield


def print_error(msg: str) -> None:
    first = " ".join(clean(str(msg).split("\n")[0]).split())
    print(f"te-passes: error: {first}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- helpers
def pass_registry() -> tuple[list[str], list[Any]]:
    from te_passes.passes.order import pass_classes, pass_names

    try:
        return pass_names(), list(pass_classes())
    except Exception as e:  # noqa: BLE001 - a broken registry entry is a clear error too
        raise CliError(f"the pass registry does not import: {type(e).__name__}: {e}", EXIT_FAIL) from e


def check_pass_names(names: Iterable[str], where: str) -> list[str]:
    """The pass names of ``names`` (each may be a comma-separated list, as ``--disable a,b``), checked."""
    known, _ = pass_registry()
    names = [n.strip() for a in names for n in a.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise CliError(f"unknown pass name{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} in {where}; "
                       f"known passes: {', '.join(known) or '(none registered)'}")
    from te_passes.pipeline.facts import required_pass_refusal

    refused = required_pass_refusal(names, where)  # the backend refuses these: so do dump and replay
    if refused is not None:
        raise CliError(refused)
    return names


def check_mode(mode: str | None) -> None:
    if mode is None:
        return
    from te_passes.pipeline.compilation import inductor_config_patches

    try:
        inductor_config_patches(mode, {})
    except Exception as e:  # noqa: BLE001 - Inductor's own message names the valid modes
        raise CliError(f"unknown --mode {mode!r}: {e}") from e


def check_writable_dir(path: str) -> None:
    """What :func:`te_passes.debug.dump_files.ensure_writable_dir` checks, without importing torch."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise CliError(f"dump directory {path} exists and is not a directory")
    probe_dir = path
    while not os.path.exists(probe_dir):
        parent = os.path.dirname(probe_dir) or "."
        if parent == probe_dir:
            break
        probe_dir = parent
    if not os.path.isdir(probe_dir):
        raise CliError(f"dump directory {path} is not writable: {probe_dir} is not a directory")
    if not os.access(probe_dir, os.W_OK | os.X_OK):
        raise CliError(f"dump directory {path} is not writable: no write permission on {probe_dir}")
