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

Imports: the CLI sits at the top of the layers (it may import anything). It imports the rest of
te_passes inside the subcommands, the one place where function-level te_passes imports are kept:
``te-passes --help``, ``list`` and ``show`` start without importing torch (seconds on a CPU box).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import re
import sys
import traceback
from typing import Any, Callable, Iterable, Sequence

from te_passes.debug.graph_breaks import no_islands_text  # torch-free

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
class Out:
    """Terminal output: rich tables/spinner on a TTY, plain aligned text otherwise."""

    def __init__(self, *, plain: bool | None = None, quiet: bool = False) -> None:
        self.rich = None
        self.quiet = quiet
        if plain is None:
            plain = not sys.stdout.isatty() or os.environ.get("TERM") == "dumb"
        if not plain:
            try:
                from rich.console import Console

                self.rich = Console(highlight=False)
            except ImportError:  # pragma: no cover - rich is a dependency
                self.rich = None

    def line(self, text: str = "") -> None:
        if self.rich is not None:
            self.rich.print(text, markup=False, soft_wrap=True)
        else:
            print(text, flush=True)

    def heading(self, text: str) -> None:
        if self.rich is not None:
            self.rich.rule(f"[bold]{text}")
        else:
            print(f"\n== {text} ==", flush=True)

    def table(self, title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]], *,
              limit: int | None = 60) -> None:
        rows = [["" if v is None else str(v) for v in r] for r in rows]
        more = 0
        if limit is not None and len(rows) > limit:
            more = len(rows) - limit
            rows = rows[:limit]
        if self.rich is not None:
            from rich.table import Table

            t = Table(title=title, title_justify="left", show_lines=False)
            for i, c in enumerate(columns):  # names stay whole; the last column wraps
                last = i == len(columns) - 1
                whole = min(max([len(c)] + [len(r[i]) for r in rows]), 32)
                t.add_column(c, overflow="fold", no_wrap=i == 0, min_width=whole if i == 0 else None,
                             ratio=2 if last else None)
            for r in rows:
                t.add_row(*r)
            self.rich.print(t)
        else:
            if title:
                print(f"\n{title}")
            widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
            widths = [min(w, 80) for w in widths]
            print("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip())
            print("  ".join("-" * w for w in widths))
            for r in rows:
                print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
        if more:
            self.line(f"... {more} more rows (see report.json)")

    @contextlib.contextmanager
    def status(self, text: str):
        """A spinner on a TTY (stderr); a ``» text`` line otherwise; nothing when quiet."""
        if self.quiet:
            yield
        elif self.rich is not None:
            from rich.console import Console

            with Console(stderr=True).status(text):
                yield
        else:
            print(f"» {text}", flush=True)
            yield


def _error(msg: str) -> None:
    first = " ".join(str(msg).split("\n")[0].split())
    print(f"te-passes: error: {first}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- helpers
def _registry() -> tuple[list[str], list[Any]]:
    from te_passes.pipeline.registry import pass_classes, pass_names

    try:
        return pass_names(), list(pass_classes())
    except Exception as e:  # noqa: BLE001 - a broken registry entry is a clear error too
        raise CliError(f"the pass registry does not import: {type(e).__name__}: {e}", EXIT_FAIL) from e


def _check_pass_names(names: Iterable[str], where: str) -> list[str]:
    from te_passes.pipeline.registry import PASS_ALIASES

    known, _ = _registry()
    names = [n for n in names if n]
    unknown = [n for n in names if n not in known and n not in PASS_ALIASES]  # aliases: expanded when parsed
    if unknown:
        raise CliError(f"unknown pass name{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} in {where}; "
                       f"known passes: {', '.join(known) or '(none registered)'}")
    return names


def _check_mode(mode: str | None) -> None:
    if mode is None:
        return
    from te_passes.pipeline.compilation import inductor_config_patches as _inductor_config_patches

    try:
        _inductor_config_patches(mode, {})
    except Exception as e:  # noqa: BLE001 - Inductor's own message names the valid modes
        raise CliError(f"unknown --mode {mode!r}: {e}") from e


def _check_writable_dir(path: str) -> None:
    """What :func:`te_passes.debug.dump.ensure_writable_dir` checks, without importing torch."""
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


#: The list of files a dump wrote into its directory (relative paths): the only files a later
#: dump or ``replay --out`` into the same directory removes.
MANIFEST = ".te_passes_manifest.json"
MANIFEST_SCHEMA = "te_passes.dump_manifest/1"
_STAGE_DIR = r"(?:dynamo|joint|post_grad_fwd|post_grad_bwd)(?:_\d+)?"
#: Files a dump written before manifests existed holds inside a ``g<N>/`` folder (the layout of
#: :mod:`te_passes.debug.dump`): what may be removed from such a dump, nothing else.
_LEGACY_GRAPH_FILE = re.compile(rf"(?:report\.json|te_state\.json|{_STAGE_DIR}/(?:input\.py|input\.tegraph|"
                                rf"output\.py|\d\d_[A-Za-z0-9_.-]+/(?:before\.py|after\.py|diff\.patch|"
                                rf"changes\.txt)))")


def _check_old_dump(path: str) -> list[str] | None:
    """What a dump into ``path`` may replace: the relative paths of the earlier dump's files
    (its manifest, or for an older dump the files of :data:`_LEGACY_GRAPH_FILE` layout), ``None``
    when ``path`` holds no earlier dump. Removes nothing.

    Raises:
        CliError: ``path`` holds backend dump sessions, or top-level files a te_passes dump
            writes that are not from a te_passes dump (exit 2; nothing is touched).
    """
    from te_passes.debug.dump import SCHEMA, read_graph_report

    if not os.path.isdir(path):
        return None
    rp = os.path.join(path, "report.json")
    ours = ("report.json", "index.md", "session.json")
    if not os.path.isfile(rp) and os.path.isfile(os.path.join(path, "sessions.json")):
        raise CliError(f"{path} holds te_passes backend dump sessions (te_passes.dump_dir / TE_PASSES_DUMP_DIR; "
                       f"see {os.path.join(path, 'index.md')}); not mixing a te-passes dump into it: choose another "
                       f"--out")
    if not os.path.isfile(rp):
        clash = [n for n in ours if os.path.exists(os.path.join(path, n))]
        if clash:
            raise CliError(f"{path} holds {', '.join(clash)} but no te_passes report.json; not overwriting "
                           f"them: choose another --out")
        return None
    try:
        with open(rp) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        data = None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        schema = data.get("schema") if isinstance(data, dict) else None
        what = f"schema {schema!r}, this te_passes writes {SCHEMA!r}" if isinstance(schema, str) else \
            "not a te_passes dump"
        raise CliError(f"{path} holds a report.json that is not a te_passes dump of this version ({what}); not "
                       f"overwriting it: choose another --out")
    manifest = _read_manifest(path)
    if manifest is not None:
        return manifest
    files = [n for n in ours if os.path.isfile(os.path.join(path, n))]
    for name in sorted(os.listdir(path)):
        gdir = os.path.join(path, name)
        if os.path.isdir(gdir) and not os.path.islink(gdir) and read_graph_report(path, name) is not None:
            for dirpath, _dirs, names in os.walk(gdir):
                for n in names:
                    rel = os.path.relpath(os.path.join(dirpath, n), gdir).replace(os.sep, "/")
                    if _LEGACY_GRAPH_FILE.fullmatch(rel):
                        files.append(f"{name}/{rel}")
    return files


def _read_manifest(path: str) -> list[str] | None:
    p = os.path.join(path, MANIFEST)
    if not os.path.isfile(p):
        return None
    try:
        with open(p) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CliError(f"{p} is not readable ({type(e).__name__}: {e}); not overwriting {path}: remove the "
                       f"manifest or choose another --out") from None
    files = data.get("files") if isinstance(data, dict) and data.get("schema") == MANIFEST_SCHEMA else None
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise CliError(f"{p} is not a te_passes dump manifest ({MANIFEST_SCHEMA}); not overwriting {path}: "
                       f"choose another --out")
    out = []
    for f in files:  # never outside the directory
        norm = os.path.normpath(f)
        if os.path.isabs(norm) or norm.startswith(".." + os.sep) or norm == "..":
            raise CliError(f"{p} lists {f!r}, outside {path}; not overwriting it: choose another --out")
        out.append(norm)
    return out


def _remove_files(path: str, files: Iterable[str]) -> None:
    """Remove ``path/f`` for each relative ``f`` (plain files only), then the folders they
    leave empty (never ``path`` itself, never a folder still holding anything)."""
    dirs: set[str] = set()
    for rel in files:
        p = os.path.join(path, rel)
        if os.path.isfile(p) or os.path.islink(p):
            os.remove(p)
        d = os.path.dirname(rel)
        while d:
            dirs.add(d)
            d = os.path.dirname(d)
    for d in sorted(dirs, key=lambda x: x.count(os.sep), reverse=True):
        try:
            os.rmdir(os.path.join(path, d))
        except OSError:  # not empty (a user's file) or already gone
            pass


def _clear_old_dump(path: str) -> None:
    """Remove the previous te_passes dump in ``path``: only the files it wrote (its manifest,
    or :data:`_LEGACY_GRAPH_FILE` for older dumps); see :func:`_check_old_dump` for what is refused."""
    files = _check_old_dump(path)
    if files is not None:
        _remove_files(path, files + [MANIFEST])


def _commit(stage: str, path: str) -> None:
    """Move the finished dump in ``stage`` into ``path``: the earlier dump's files are removed
    (:func:`_clear_old_dump`), every new file is moved in (``os.replace``, same filesystem) and
    the manifest lists them."""
    from te_passes.debug.dump import _atomic_write

    new = []
    for dirpath, _dirs, names in os.walk(stage):
        for n in names:
            new.append(os.path.relpath(os.path.join(dirpath, n), stage))
    _clear_old_dump(path)
    for rel in sorted(new):
        dest = os.path.join(path, rel)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        os.replace(os.path.join(stage, rel), dest)
    _atomic_write(os.path.join(path, MANIFEST), json.dumps({"schema": MANIFEST_SCHEMA, "files": sorted(new)},
                                                           indent=1))


def _overlaps(a: str, b: str) -> bool:
    ra, rb = os.path.realpath(a), os.path.realpath(b)
    return ra == rb or ra.startswith(rb.rstrip(os.sep) + os.sep) or rb.startswith(ra.rstrip(os.sep) + os.sep)


@contextlib.contextmanager
def _staged_out(path: str, *, sources: Sequence[str] = ()):
    """Yield a staging folder for a dump into ``path`` (``--out``) and move it into place only
    if the body succeeds.

    Checks first (nothing touched): ``path`` is writable and holds no foreign files
    (:func:`_check_old_dump`) and does not overlap any of ``sources`` (the dump being replayed).
    Then ``path`` is locked for the whole run (:func:`te_passes.debug.dump.dir_lock`, the lock
    backend dump sessions use) and the body writes into a fresh folder next to it. On success
    the earlier dump's files (only those) are replaced by the new ones (:func:`_commit`); on any
    failure — an exception, ``SystemExit``, Ctrl-C — the staging folder is removed and ``path``
    is exactly as before (a folder this call created is removed again).

    Raises:
        CliError: overlap with a source, foreign files, not writable, locked by another run.
    """
    import shutil
    import tempfile

    from te_passes.debug.dump import DumpDirError, DumpDirLocked, dir_lock, ensure_writable_dir

    for src in sources:
        if _overlaps(path, src):
            raise CliError(f"--out {path} overlaps the dump being replayed ({src}): writing there would replace "
                           f"what is read; choose another --out")
    existed = os.path.isdir(path)
    _check_old_dump(path)
    try:
        path = ensure_writable_dir(path)
    except DumpDirError as e:
        raise CliError(str(e)) from e
    lock_file = os.path.join(path, ".te_passes_sessions.lock")
    lock_existed = os.path.exists(lock_file)
    stage = None
    ok = False
    try:
        with dir_lock(path, blocking=False):
            parent = os.path.dirname(os.path.abspath(path))
            try:
                stage = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(path))}.te_passes-tmp-",
                                         dir=parent)
            except OSError:  # a parent we cannot write to: stage inside path (same filesystem)
                stage = tempfile.mkdtemp(prefix=".te_passes-tmp-", dir=path)
            yield stage
            _commit(stage, path)
            ok = True
    except DumpDirLocked as e:
        raise CliError(str(e)) from None
    finally:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
        if not ok:
            if not lock_existed:
                with contextlib.suppress(OSError):
                    os.remove(lock_file)
            if not existed:
                with contextlib.suppress(OSError):
                    os.rmdir(path)


def _load_target(target: str) -> tuple[str, Callable[..., Any] | None, str | None]:
    """``(kind, callable or None, file)`` for a TARGET string; see the module docstring."""
    import importlib
    import runpy

    path, sep, func = target.rpartition(":") if ":" in target else (target, "", "")
    if sep and (path.endswith(".py") or os.sep in path):
        _check_target_file(path)
        try:
            ns = runpy.run_path(path, run_name="te_passes_target")
        except Exception as e:  # noqa: BLE001
            raise CliError(f"target file {path} raised {type(e).__name__} while loading: {e}", EXIT_FAIL) from e
        fn = ns.get(func)
        if not callable(fn):
            raise CliError(f"target file {path} has no function {func!r}")
        return "callable", fn, path
    if sep:
        try:
            mod = importlib.import_module(path)
        except ModuleNotFoundError as e:
            raise CliError(f"cannot import target module {path!r}: {e}") from e
        except Exception as e:  # noqa: BLE001
            raise CliError(f"target module {path} raised {type(e).__name__} while importing: {e}", EXIT_FAIL) from e
        fn = getattr(mod, func, None)
        if not callable(fn):
            raise CliError(f"target module {path} has no function {func!r}")
        return "callable", fn, None
    _check_target_file(target)
    return "file", None, target


def _check_target_file(path: str) -> None:
    if os.path.isdir(path):
        raise CliError(f"target {path} is a directory, not a Python file (give FILE.py, module:function or "
                       f"FILE.py:function)")
    if not os.path.isfile(path):
        raise CliError(f"target file not found: {path}")


def _target_dir(target: str) -> str:
    """The folder ``python FILE.py`` would put first on ``sys.path`` for ``target``: the file's
    folder for file targets, the working directory for ``module:function``."""
    path, sep, _ = target.rpartition(":") if ":" in target else (target, "", "")
    if sep and not (path.endswith(".py") or os.sep in path):
        return os.getcwd()
    return os.path.dirname(os.path.realpath(path if sep else target))


@contextlib.contextmanager
def _first_on_sys_path(folder: str):
    """``folder`` at ``sys.path[0]`` while the target loads and runs (as ``python FILE.py`` and
    :mod:`runpy` callers do), removed afterwards."""
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        try:
            sys.path.remove(folder)
        except ValueError:
            pass


def _call_target(kind: str, fn: Callable[..., Any] | None, file: str | None, mode: str | None,
                 precision: str | None, target: str) -> None:
    import runpy

    if kind == "file":
        if mode is not None or precision is not None:
            raise CliError("--mode/--precision apply to module:function targets and --example; a file target "
                           "sets its own torch.compile(mode=...)")
        argv = sys.argv
        sys.argv = [file or target]
        try:
            runpy.run_path(file or target, run_name="__main__")
        finally:
            sys.argv = argv
        return
    assert fn is not None
    kwargs: dict[str, Any] = {}
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    takes_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for name, value in (("mode", mode), ("precision", precision)):
        if value is None:
            continue
        if name in params or takes_kw:
            kwargs[name] = value
        else:
            raise CliError(f"target {target} does not take {name}=; give it a '{name}' parameter or drop --{name}")
    fn(**kwargs)


def _run_target(target: str, mode: str | None, precision: str | None, verbose: bool) -> None:
    with _first_on_sys_path(_target_dir(target)):
        _run_target_on_path(target, mode, precision, verbose)


def _run_target_on_path(target: str, mode: str | None, precision: str | None, verbose: bool) -> None:
    try:
        kind, fn, file = _load_target(target)
    except KeyboardInterrupt as e:
        raise CliError(f"target {target} interrupted while loading", 130) from e
    try:
        _call_target(kind, fn, file, mode, precision, target)
    except CliError:
        raise
    except KeyboardInterrupt as e:
        raise CliError(f"target {target} interrupted", 130) from e
    except SystemExit as e:
        if e.code not in (None, 0):
            raise CliError(f"target {target} exited with status {e.code}", EXIT_FAIL) from e
    except BaseException as e:  # noqa: BLE001 - any failure of user code is reported in one line
        if verbose:
            traceback.print_exc()
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CliError(f"target {target} raised {type(e).__name__}: {msg}", EXIT_FAIL) from e


# --------------------------------------------------------------------------- dump
def cmd_dump(args: argparse.Namespace, out: Out) -> int:
    if (args.target is None) == (args.example is None):
        raise CliError("give exactly one of TARGET or --example NAME")
    from te_passes.examples import EXAMPLES, PRECISIONS

    if args.example is not None and args.example not in EXAMPLES:
        raise CliError(f"unknown example {args.example!r}; examples: {', '.join(EXAMPLES)}")
    if args.precision is not None and args.precision not in PRECISIONS:
        raise CliError(f"unknown --precision {args.precision!r}; expected one of {', '.join(PRECISIONS)}")
    if args.target is not None:
        _load_target_precheck(args.target)
        if ":" not in args.target and (args.mode is not None or args.precision is not None):
            raise CliError("--mode/--precision apply to module:function targets and --example; a file target "
                           "sets its own torch.compile(mode=...)")
    _check_writable_dir(args.out)  # the cheap checks first: no torch import yet
    disable = _check_pass_names([n.strip() for a in (args.disable or []) for n in a.split(",")], "--disable")
    env_disable = [n.strip() for n in os.environ.get("TE_PASSES_DISABLE", "").split(",") if n.strip()]
    _check_pass_names(env_disable, "TE_PASSES_DISABLE")
    _check_mode(args.mode)
    with _staged_out(args.out) as stage:
        summary = _dump_into(args, out, stage, disable, env_disable)
    _print_summary(out, summary, args.out)
    return EXIT_OK


def _dump_into(args: argparse.Namespace, out: Out, root: str, disable: list[str],
               env_disable: list[str]) -> dict[str, Any]:
    """Run the dump of ``args`` into staging folder ``root`` (see :func:`_staged_out`); return
    the summary."""
    import torch

    from te_passes.debug.dump import claim_dir, unclaim_dir, write_summary
    from te_passes.debug.graph_breaks import CompileEvents
    from te_passes.examples import EXAMPLES
    from te_passes.report import compile_reports

    torch._inductor.config.force_disable_caches = True  # every stage must run to be dumped
    n_before = len(compile_reports())
    extra: dict[str, Any] = {"owner": "cli", "mode": args.mode or "default", "disabled": disable + env_disable}
    # the backend's writers in this process, given TE_PASSES_DUMP_DIR=--out (or a torch.compile
    # option naming --out), write straight into the staging folder (no session folder)
    claim_dir(args.out, into=root)
    claim_dir(root)
    try:
        write_summary(root, extra, emit=False)  # the session facts are ours: the backend's writers leave them to us
        events = CompileEvents(reemit_warnings=args.verbose, ignore_warnings=CLI_CAUSED_WARNINGS)
        if args.example is not None:
            from te_passes.examples import run_example

            ex = EXAMPLES[args.example]
            from te_passes.examples import describe

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
                raise CliError(f"example {args.example} failed: {type(e).__name__}: {e}", EXIT_FAIL) from e
            extra.update(compile_path=result.compile_path, note=result.note)
        else:
            extra.update(target=args.target, precision=args.precision,
                         compile_path="torch.compile(backend='te_inductor') in this process")
            env = {"TE_PASSES_DUMP_DIR": args.out}
            if disable:
                env["TE_PASSES_DISABLE"] = ",".join(disable + env_disable)
            saved_env = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                with out.status(f"running {args.target}"), events:
                    _run_target(args.target, args.mode, args.precision, args.verbose)
            finally:
                for k, v in saved_env.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        new_reports = compile_reports()[n_before:]
        if not new_reports:
            raise CliError(f"{extra['target']} compiled nothing with backend 'te_inductor' (no te_inductor call: "
                           f"did it run a function compiled with torch.compile(..., backend='te_inductor')?)",
                           EXIT_FAIL)
        extra.update(events.to_json())
        extra["elsewhere"] = _collect_strays(root, new_reports)
        return write_summary(root, extra)
    finally:
        unclaim_dir(args.out)
        unclaim_dir(root)


def _collect_strays(root: str, reports: Sequence[Any]) -> list[dict[str, Any]]:
    """Graphs of this run whose dump is not under ``root``: their ``torch.compile`` set its own
    ``options={"te_passes.dump_dir": ...}``, which wins over the ``TE_PASSES_DUMP_DIR`` the CLI
    sets. Their graph folder is copied into ``root`` (or, with no dump anywhere, their report is
    written there) so the summary lists them; the returned entries (``graph_id``, ``dump_dir``,
    ``copied``) become ``report.json`` ``elsewhere[]`` and a warning."""
    import shutil

    from te_passes.debug.dump import read_graph_report, report_json

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


def _load_target_precheck(target: str) -> None:
    """Fail fast on a missing target file (before torch is imported)."""
    path, sep, _ = target.rpartition(":") if ":" in target else (target, "", "")
    if sep and (path.endswith(".py") or os.sep in path):
        _check_target_file(path)
    if not sep:
        _check_target_file(target)


# --------------------------------------------------------------------------- show
def _fmt_bytes(v: Any) -> str:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return "" if v is None else str(v)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(v) < 1024 or unit == "GiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return str(v)


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
    groups: dict[tuple, list[str]] = {}
    for it in items:
        groups.setdefault(key(it), []).append(str(it.get("node")))
    return [[*k, len(nodes), _short(", ".join(nodes), 50)] for k, nodes in groups.items()]


def _print_summary(out: Out, s: dict[str, Any], root: str) -> None:
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
        from te_passes.debug.dump import elsewhere_warnings

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
        from te_passes.debug.dump import record_detail

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


def _newest_session(path: str, out: Out, verb: str, to_stderr: bool = False) -> str:
    """``path`` itself, or its newest backend dump session folder when ``path`` is a directory
    of sessions (``te_passes.dump_dir`` without the CLI; :func:`te_passes.debug.dump.read_sessions`),
    saying which one is used."""
    if not os.path.isdir(path):
        return path
    from te_passes.debug.dump import latest_session_dir, read_sessions

    latest = latest_session_dir(path)
    if latest is None:
        return path
    n = len(read_sessions(path))
    msg = (f"{path} holds {n} backend dump session{'s' if n != 1 else ''}; {verb} the newest, {latest}"
           + (f" (others: see {os.path.join(path, 'index.md')})" if n > 1 else ""))
    if to_stderr:
        print(msg, file=sys.stderr)
    else:
        out.line(msg)
    return latest


def cmd_show(args: argparse.Namespace, out: Out) -> int:
    path = _newest_session(args.dir, out, "showing", to_stderr=args.json)
    rp = os.path.join(path, "report.json") if os.path.isdir(path) else path
    if not os.path.isfile(rp):
        raise CliError(f"no te_passes dump at {path} (no report.json); create one with te-passes dump")
    from te_passes.debug.dump import DumpFormatError, check_summary, read_json

    try:
        s = check_summary(rp, read_json(rp))
    except DumpFormatError as e:
        raise CliError(str(e)) from None
    if args.json:
        print(json.dumps(s, indent=2))
    else:
        try:
            _print_summary(out, s, os.path.dirname(rp) or ".")
        except (TypeError, AttributeError, KeyError, ValueError, IndexError) as e:  # a field check_summary lets by
            raise CliError(f"{rp}: malformed summary ({type(e).__name__}: {e})") from None
    return EXIT_OK


# --------------------------------------------------------------------------- list
def cmd_list(args: argparse.Namespace, out: Out) -> int:
    from te_passes.pipeline.registry import PASS_ALIASES

    names, classes = _registry()
    env_disable = {n.strip() for n in os.environ.get("TE_PASSES_DISABLE", "").split(",") if n.strip()}
    env_disable |= {m for n in env_disable & set(PASS_ALIASES) for m in PASS_ALIASES[n]}
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
    for old, new in PASS_ALIASES.items():
        out.line(f"deprecated: {old} (until issue 12 one pass) is now {', '.join(new)}; the old name still "
                 "disables all of them (te_passes.disable, TE_PASSES_DISABLE, --disable) until the next release")
    unknown = sorted(env_disable - set(names) - set(PASS_ALIASES))
    if unknown:
        out.line(f"warning: TE_PASSES_DISABLE names unknown passes: {', '.join(unknown)}")
    return EXIT_OK


# --------------------------------------------------------------------------- replay
def cmd_replay(args: argparse.Namespace, out: Out) -> int:
    if not os.path.exists(args.path):
        raise CliError(f"no such graph file or dump directory: {args.path}")
    disable = _check_pass_names([n.strip() for a in args.disable for n in a.split(",")], "--disable") \
        if args.disable is not None else None
    source = args.path
    args.path = _newest_session(args.path, out, "replaying", to_stderr=args.json)
    if args.out:
        with _staged_out(args.out, sources=(source, args.path)) as stage:
            results = _replay(args, out, disable, stage)
            from te_passes.debug.dump import write_summary

            write_summary(stage, {"target": f"replay {args.path}", "compile_path": "offline replay of saved graphs"})
    else:
        results = _replay(args, out, disable, None)
    from te_passes.debug.offline import compare_reports, version_differences

    mismatches = 0
    payload = []
    for report, saved in results:
        rj = report.to_json()
        diffs = compare_reports(rj, saved, require_all=os.path.isdir(args.path)) if saved is not None else None
        versions = version_differences(getattr(report, "saved_versions", None))
        payload.append({"report": rj, "differences": diffs, "versions": versions})
        if versions is not None:
            sv, iv = versions["saved"], versions["installed"]
            print(f"te-passes: warning: {report.graph_id} was saved under torch {sv['torch']}, Transformer Engine "
                  f"{sv['transformer_engine']}; installed here: torch {iv['torch']}, Transformer Engine "
                  f"{iv['transformer_engine']} (a difference below may come from that)", file=sys.stderr, flush=True)
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
    from te_passes.runtime.install import install

    import torch  # noqa: F401  (before transformer_engine)
    with contextlib.suppress(ImportError):  # TE's op families defined, as where the graphs were compiled
        import transformer_engine.pytorch  # noqa: F401
    install()  # as the backend does before any pass runs (call_te_impl_directly's lowering)
    try:
        with out.status(f"replaying {args.path}"):
            return replay(args.path, disable=disable, dump_dir=dump_dir)
    except ReplayError as e:
        raise CliError(str(e)) from e


# --------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    """The ``te-passes`` argument parser (subcommands ``dump``, ``list``, ``show``, ``replay``)."""
    p = argparse.ArgumentParser(
        prog="te-passes",
        description="Show what te_passes (the te_inductor torch.compile backend) did to Transformer Engine "
                    "graphs: per-pass TE-aware dumps, diffs, reports, offline replay.",
        epilog="Examples:\n  te-passes dump --example linear-fp8 --out te_passes_dump\n"
               "  te-passes dump train.py:main --mode reduce-overhead --disable insert_early_frees\n"
               "  te-passes show te_passes_dump\n  te-passes replay te_passes_dump/g0 --check\n  te-passes list",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plain", action="store_true", help="plain text output even on a terminal")
    from te_passes import __version__

    p.add_argument("--version", action="version", version=f"te-passes {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    d = sub.add_parser("dump", help="run a target (or built-in example) and dump every pass",
                       description="Run TARGET (a Python file, module:function or file.py:function that runs a "
                                   "model under torch.compile(backend='te_inductor')) or --example NAME, and write "
                                   "per-graph, per-stage, per-pass TE-aware graphs, diffs, report.json and index.md.")
    d.add_argument("target", nargs="?", help="FILE.py, module:function or FILE.py:function")
    d.add_argument("--example", metavar="NAME", help="a built-in example: linear-fp8, linear-bf16, linear-mxfp8, "
                                                   "stack-fp8")
    d.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"dump directory (default {DEFAULT_OUT})")
    d.add_argument("--mode", help="torch.compile mode (default, reduce-overhead, max-autotune, ...)")
    d.add_argument("--precision", help="bf16, fp8-cs or mxfp8 (examples; callables taking precision=)")
    d.add_argument("--disable", action="append", metavar="PASS[,PASS...]", default=[],
                   help="pass name(s) to switch off, comma-separated; repeatable (also TE_PASSES_DISABLE)")
    d.add_argument("--verbose", "-v", action="store_true", help="tracebacks and the target's warnings on stderr")
    d.set_defaults(func=cmd_dump)
    for sp in (d,):
        sp.add_argument("--plain", action="store_true", default=argparse.SUPPRESS,
                        help="plain text output even on a terminal")

    l_ = sub.add_parser("list", help="the pass pipeline: passes, stages, descriptions, enabled")
    l_.add_argument("--json", action="store_true", help="print JSON")
    l_.set_defaults(func=cmd_list)
    l_.add_argument("--plain", action="store_true", default=argparse.SUPPRESS,
                    help="plain text output even on a terminal")

    s = sub.add_parser("show", help="summary tables of a dump directory")
    s.add_argument("dir", metavar="DIR", help="a dump directory (or its report.json)")
    s.add_argument("--json", action="store_true", help="print the summary JSON")
    s.set_defaults(func=cmd_show)
    s.add_argument("--plain", action="store_true", default=argparse.SUPPRESS,
                    help="plain text output even on a terminal")

    r = sub.add_parser("replay", help="re-run the passes offline on saved graphs (no GPU)",
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
    r.add_argument("--plain", action="store_true", default=argparse.SUPPRESS,
                    help="plain text output even on a terminal")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``te-passes`` console script; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except BrokenPipeError:  # `te-passes --help | head -1`
        _stdout_gone()
        return EXIT_OK
    out = Out(plain=True if args.plain else None, quiet=bool(getattr(args, "json", False)))
    try:
        code = args.func(args, out)
        sys.stdout.flush()  # a closed pipe fails here, not at interpreter exit
        return code
    except BrokenPipeError:  # `te-passes list | head -1`: the reader left; not an error
        _stdout_gone()
        return EXIT_OK
    except CliError as e:
        _error(str(e))
        return e.code
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    except OSError as e:  # an unreadable/unwritable path found late: still one line
        _error(f"{type(e).__name__}: {e}")
        return EXIT_FAIL


def _stdout_gone() -> None:
    """The reader of stdout left (``| head``): send what is still buffered to /dev/null so the
    interpreter's final flush does not fail too."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
