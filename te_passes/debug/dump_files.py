"""The files of a per-pass dump (:mod:`te_passes.debug.dump`): schema and record-kind constants,
writable dump directories, atomic writes, the directory lock, markdown table helpers, and reading
dump JSON back with a field-by-field check of what this te_passes writes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import stat
import tempfile
from typing import Any

from te_passes._json import JsonBudgetError, read_json_file
from te_passes._logging import get_logger


log = get_logger()

SCHEMA = "te_passes.dump/1"
#: Record kinds listed in the summary's ``folded[]`` section: ``fold_ub_predicates``' ``folded``,
#: ``const_folded``; ``fold_recipe_lookups``' ``hoisted``; ``hoist_te_constants``' ``hoisted_constant``;
#: ``remove_quantizer_setattrs``' ``folded_setattr``.
FOLDED_KINDS = ("folded", "const_folded", "hoisted", "hoisted_constant", "folded_setattr")
#: Record kinds listed in ``frees[]`` (``insert_early_frees``).
FREE_KINDS = ("free",)
#: Record kinds listed in ``pool_check[]`` (``check_cudagraph_pool``; any kind ``pool*``).
POOL_KINDS = ("pool_leak", "pool_check")
#: Record kinds listed in ``skipped[]``: refused rewrites with their reasons.
SKIPPED_KINDS = ("skipped", "kept")
#: Record kind carrying a memory estimate (``insert_early_frees``: ``peak_before``/``peak_after``
#: symbolic, ``*_concrete`` in bytes); ``StageReport.facts["memory"]`` is read as well.
MEMORY_KINDS = ("memory",)
#: Record fields that say *what* was folded/hoisted, in preference order (for ``expr``).
WHAT_KEYS = ("api", "lookup", "field", "attr")


class DumpDirError(OSError):
    """The dump directory cannot be created or written (the message names it and why)."""


def ensure_writable_dir(path: str | os.PathLike) -> str:
    """Create ``path`` (and parents) and check a file can be written there.

    Raises:
        DumpDirError: it exists as a file, cannot be created, or is not writable.
    """
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise DumpDirError(f"dump directory {path} exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".te_passes_write_test_", dir=path)  # O_EXCL: a fresh file
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise DumpDirError(f"dump directory {path} is not writable: {e.strerror or e}") from e
    return path


def slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", s)


def atomic_write(path: str, text: str) -> None:
    """``text`` at ``path``: written to a fresh file (``O_EXCL | O_NOFOLLOW``: never through a
    planted link) and fsynced, then renamed over ``path`` (a link there is replaced, not followed)."""
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


class DumpDirLocked(DumpDirError):
    """Another process holds the dump directory's lock (:func:`dir_lock` with ``blocking=False``)."""


_SESSION_LOCK_FILE = ".te_passes_sessions.lock"

@contextlib.contextmanager
def dir_lock(root: str, *, blocking: bool = True):
    """Hold the ``flock`` on ``root/.te_passes_sessions.lock`` (created if missing): the one lock every
    te_passes writer of a dump directory takes — the backend while it rewrites a sessions index
    (:func:`write_sessions_index`), ``te-passes dump`` / ``replay --out`` for their whole run.

    Raises:
        DumpDirLocked: ``blocking=False`` and another process holds it (the message names the
            lock file and the holder's pid when it wrote one).
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on Linux
        fcntl = None
    path = os.path.join(root, _SESSION_LOCK_FILE)
    try:  # never through a link planted there: O_NOFOLLOW, and no O_TRUNC
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as e:
        why = "it is a symbolic link" if os.path.islink(path) else (e.strerror or str(e))
        raise DumpDirError(f"cannot open the lock {path}: {why}; a dump never writes through a link: remove it "
                           f"or choose another --out") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DumpDirError(f"the lock {path} is not a regular file; remove it or choose another --out")
    with os.fdopen(fd, "a+") as lock:
        if fcntl is not None:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                lock.seek(0)
                holder = lock.read().strip()
                raise DumpDirLocked(f"{root} is being written by another te_passes process"
                                    + (f" ({holder})" if holder else "") + f" (lock {path} held); wait for it "
                                    f"to finish or choose another --out") from None
        try:
            if not blocking:  # a long holder says who it is (a backend write is short: it does not)
                lock.seek(0)
                lock.truncate()
                lock.write(f"pid {os.getpid()} on {socket.gethostname()}")
                lock.flush()
            yield path
        finally:
            if not blocking:
                lock.seek(0)
                lock.truncate()
            if fcntl is not None:
                fcntl.flock(lock, fcntl.LOCK_UN)


GRAPH_DIR_RE = re.compile(r"g\d+")


def md_table(headers: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        return str("" if v is None else v).replace("|", "\\|").replace("\n", " ")

    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def md_link(root: str, rel: str | None, text: str) -> str:
    if not rel:
        return text
    return f"[{text}]({rel})" if os.path.exists(os.path.join(root, rel)) else text


# --------------------------------------------------------------------------- reading dumps back
class DumpFormatError(ValueError):
    """A dump file (``report.json``, ``g<N>/report.json``) is not what this te_passes writes: the
    message names the file and the first field that is wrong (``passes[3].time_ms is null,
    expected a number``)."""


_NUM, _INT, _STR, _BOOL, _OBJ, _LIST = "a number", "an integer", "a string", "true/false", "an object", "a list"
_OPT = "optional"


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a bool"
    return f"a {type(v).__name__}"


def _is(v: Any, want: str) -> bool:
    if want == _NUM:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if want == _INT:
        return isinstance(v, int) and not isinstance(v, bool)
    return isinstance(v, {_STR: str, _BOOL: bool, _OBJ: dict, _LIST: list}[want])


def _check_fields(path: str, obj: Any, where: str, fields: dict[str, Any]) -> None:
    """Check ``obj`` (at ``where``) against ``fields``: ``{name: kind | (kind, _OPT) | nested}``
    where nested is ``(_LIST, {item fields})`` / ``(_LIST, kind)`` / ``(_OBJ, {fields})``."""
    if not isinstance(obj, dict):
        raise DumpFormatError(f"{path}: {where or 'the file'} is {_json_type(obj)}, expected an object")
    for name, spec in fields.items():
        optional = isinstance(spec, tuple) and spec[-1] == _OPT
        if optional:
            spec = spec[0] if len(spec) == 2 else spec[:-1]
        at = f"{where}.{name}" if where else name
        if name not in obj or (optional and obj[name] is None):
            if optional:
                continue
            raise DumpFormatError(f"{path}: {at} is missing")
        v = obj[name]
        if isinstance(spec, tuple):  # (_LIST, item spec) or (_OBJ, fields)
            kind, inner = spec
            if not _is(v, kind):
                raise DumpFormatError(f"{path}: {at} is {_json_type(v)}, expected {kind}")
            if kind == _LIST:
                for i, item in enumerate(v):
                    if isinstance(inner, dict):
                        _check_fields(path, item, f"{at}[{i}]", inner)
                    elif not _is(item, inner):
                        raise DumpFormatError(f"{path}: {at}[{i}] is {_json_type(item)}, expected {inner}")
            else:
                _check_fields(path, v, at, inner)
        elif not _is(v, spec):
            raise DumpFormatError(f"{path}: {at} is {_json_type(v)}, expected {spec}")


_ENTRY = {"graph_id": _STR, "pass": _STR}
#: What ``te-passes show`` reads from a summary ``report.json`` (:func:`build_summary`).
SUMMARY_FIELDS: dict[str, Any] = {
    "versions": (_OBJ, {}, _OPT),
    "graphs": (_LIST, {"graph_id": _STR, "stages": (_LIST, _STR), "mode": (_STR, _OPT),
                       "time_ms_passes": (_NUM, _OPT), "te_ops": (_INT, _OPT),
                       "cache_hit": (_STR, _OPT)}),
    "passes": (_LIST, {"graph_id": _STR, "stage": _STR, "name": _STR, "status": _STR, "changed": _BOOL,
                       "time_ms": _NUM, "nodes_before": _INT, "nodes_after": _INT, "records": _INT,
                       "dump": (_STR, _OPT)}),
    "folded": (_LIST, {**_ENTRY, "kind": _STR}, _OPT),
    "frees": (_LIST, {"graph_id": _STR, "bytes": (_NUM, _OPT)}, _OPT),
    "pool_check": (_LIST, {"graph_id": _STR, "kind": _STR}, _OPT),
    "skipped": (_LIST, {**_ENTRY, "kind": _STR}, _OPT),
    "failed": (_LIST, {**_ENTRY, "stage": _STR}, _OPT),
    "other_records": (_LIST, {"pass": _STR}, _OPT),
    "memory": (_OBJ, {"stages": (_LIST, {"graph_id": _STR, "stage": _STR}, _OPT)}, _OPT),
    "eager_fallbacks": (_LIST, {"module": _STR, "reason": _STR}, _OPT),
    "graph_breaks": (_LIST, {"reason": _STR}, _OPT),
    "recompiles": (_LIST, {"compile_id": _STR, "function": _STR, "reason": _STR}, _OPT),
    "warnings": (_LIST, {}, _OPT),
    "elsewhere": (_LIST, {"graph_id": _STR}, _OPT),
    "uuid": (_OBJ, {}, _OPT),
}
#: What ``te-passes replay`` compares in a graph's ``g<N>/report.json`` (``CompileReport.to_json``).
GRAPH_REPORT_FIELDS: dict[str, Any] = {
    "graph_id": (_STR, _OPT),
    "stages": (_LIST, {"graph_id": _STR, "stage": _STR,
                       "runs": (_LIST, {"name": _STR, "status": _STR, "changed": _BOOL, "nodes_before": _INT,
                                        "nodes_after": _INT, "records": (_LIST, {})})}),
}


def check_schema(path: str, data: Any) -> None:
    """``data["schema"]`` is :data:`SCHEMA`; else a :class:`DumpFormatError` saying what differs."""
    schema = data.get("schema") if isinstance(data, dict) else None
    if schema == SCHEMA:
        return
    if not isinstance(data, dict):
        raise DumpFormatError(f"{path} is not a te_passes dump summary (it holds {_json_type(data)}, not an object)")
    if schema is None:
        if "graph_id" in data and "stages" in data:  # a graph folder's g<N>/report.json
            raise DumpFormatError(f"{path} is one graph's report (a graph folder), not a dump summary: show the "
                                  f"dump directory above it ({os.path.dirname(os.path.dirname(os.path.abspath(path)))})")
        raise DumpFormatError(f"{path} is not a te_passes dump summary (no schema)")
    if str(schema).rpartition("/")[0] == SCHEMA.rpartition("/")[0]:
        raise DumpFormatError(f"{path}: schema {schema} is not supported (this te_passes reads {SCHEMA})")
    raise DumpFormatError(f"{path} is not a te_passes dump summary (schema {schema!r})")


def check_summary(path: str, data: Any) -> dict[str, Any]:
    """``data`` (a summary ``report.json``) checked: schema, then every field ``show`` reads
    (:data:`SUMMARY_FIELDS`). Returns it. Raises :class:`DumpFormatError`."""
    check_schema(path, data)
    _check_fields(path, data, "", SUMMARY_FIELDS)
    for gid, u in data.get("uuid", {}).items():
        if u is not None and not isinstance(u, dict):
            raise DumpFormatError(f"{path}: uuid.{gid} is {_json_type(u)}, expected an object")
    return data


def check_graph_report(path: str, data: Any) -> dict[str, Any]:
    """``data`` (a ``g<N>/report.json``) checked against :data:`GRAPH_REPORT_FIELDS`. Raises
    :class:`DumpFormatError`."""
    _check_fields(path, data, "", GRAPH_REPORT_FIELDS)
    return data


def read_json(path: str) -> Any:
    """``json.load`` of ``path``; a :class:`DumpFormatError` naming the file when it is not
    readable or not valid JSON."""
    try:
        return read_json_file(path)
    except json.JSONDecodeError as e:
        raise DumpFormatError(f"{path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}; "
                              f"truncated?)") from None
    except JsonBudgetError as e:
        raise DumpFormatError(f"{path} is not a te_passes dump file: {e}") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DumpFormatError(f"cannot read {path}: {type(e).__name__}: {e}") from None
