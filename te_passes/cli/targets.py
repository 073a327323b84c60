"""``te-passes dump TARGET``: load a TARGET (``FILE.py``, ``module:function``, ``FILE.py:function``)
and run it with ``mode=`` / ``precision=`` when it takes them."""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import traceback
from typing import Any, Callable
from unittest import mock

from te_passes.cli._common import CliError, EXIT_FAIL


def split_target(target: str) -> tuple[str, str | None, bool]:
    """``(path, function or None, is_file)`` of a TARGET: ``FILE.py`` -> ``(FILE.py, None, True)``,
    ``FILE.py:fn`` -> ``(FILE.py, "fn", True)``, ``module:fn`` -> ``(module, "fn", False)``."""
    path, sep, func = target.rpartition(":")
    if not sep:
        return target, None, True
    return path, func, path.endswith(".py") or os.sep in path


def check_target_file(target: str) -> None:
    """Fail fast (before torch is imported) when TARGET names a file that is missing or a directory."""
    path, _, is_file = split_target(target)
    if is_file and os.path.isdir(path):
        raise CliError(f"target {path} is a directory, not a Python file (give FILE.py, module:function or "
                       f"FILE.py:function)")
    if is_file and not os.path.isfile(path):
        raise CliError(f"target file not found: {path}")


def _load_target(target: str) -> Callable[..., Any] | None:
    """The function TARGET names (``None`` for a plain ``FILE.py``, run as ``__main__``)."""
    import importlib
    import runpy

    check_target_file(target)
    path, func, is_file = split_target(target)
    if func is None:
        return None
    if is_file:
        try:
            ns = runpy.run_path(path, run_name="te_passes_target")
        except Exception as e:  # noqa: BLE001
            raise CliError(f"target file {path} raised {type(e).__name__} while loading: {e}", EXIT_FAIL) from e
        fn = ns.get(func)
        if not callable(fn):
            raise CliError(f"target file {path} has no function {func!r}")
        return fn
    try:
        mod = importlib.import_module(path)
    except ModuleNotFoundError as e:
        raise CliError(f"cannot import target module {path!r}: {e}") from e
    except Exception as e:  # noqa: BLE001
        raise CliError(f"target module {path} raised {type(e).__name__} while importing: {e}", EXIT_FAIL) from e
    fn = getattr(mod, func, None)
    if not callable(fn):
        raise CliError(f"target module {path} has no function {func!r}")
    return fn


@contextlib.contextmanager
def _first_on_sys_path(target: str):
    """The folder ``python FILE.py`` would put first on ``sys.path`` (the file's folder; the working
    directory for ``module:function``) at ``sys.path[0]`` while the target loads and runs (as
    :mod:`runpy` callers do), removed afterwards."""
    path, _, is_file = split_target(target)
    folder = os.path.dirname(os.path.realpath(path)) if is_file else os.getcwd()
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(folder)


def _call_target(fn: Callable[..., Any] | None, mode: str | None, precision: str | None, target: str) -> None:
    import runpy

    if fn is None:  # a plain FILE.py: cmd_dump refused --mode / --precision for it
        with mock.patch.object(sys, "argv", [target]):
            runpy.run_path(target, run_name="__main__")
        return
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
    """Load and run TARGET with its folder first on ``sys.path``; any failure is one :class:`CliError`."""
    with _first_on_sys_path(target):
        try:
            fn = _load_target(target)
        except KeyboardInterrupt as e:
            raise CliError(f"target {target} interrupted while loading", 130) from e
        try:
            _call_target(fn, mode, precision, target)
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
