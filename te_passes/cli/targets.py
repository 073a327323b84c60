"""``te-passes dump TARGET``: load a TARGET (``FILE.py``, ``module:function``, ``FILE.py:function``)
and run it with ``mode=`` / ``precision=`` when it takes them."""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import traceback
from typing import Any, Callable

from te_passes.cli._common import CliError, EXIT_FAIL


def _load_target(target: str) -> tuple[str, Callable[..., Any] | None, str | None]:
    """``(kind, callable or None, file)`` for a TARGET string; see the module docstring."""
    import importlib
    import runpy

    path, sep, func = target.rpartition(":") if ":" in target else (target, "", "")
    if sep and (path.endswith(".py") or os.sep in path):
        check_target_file(path)
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
    check_target_file(target)
    return "file", None, target


def check_target_file(path: str) -> None:
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


def run_target(target: str, mode: str | None, precision: str | None, verbose: bool) -> None:
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
