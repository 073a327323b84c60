"""Dump sessions (:mod:`te_passes.debug.dump`): the per-process session a backend-only dump writes
into, the directories ``te-passes dump`` claims for its process, and the sessions index
(``sessions.json``, ``index.md``) at the top of a shared dump directory."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import threading
import time
import types
from typing import Any, Mapping

from te_passes._json import read_json_file
from te_passes.debug.graph_breaks import current_events
from te_passes.debug.dump_files import GRAPH_DIR_RE, atomic_write, md_table, slug, dir_lock, log


SESSIONS_SCHEMA = "te_passes.dump_sessions/1"
#: First line of the sessions ``index.md`` the backend writes at the top of a dump directory
#: (a top-level ``index.md`` without it is someone else's and is never overwritten).
SESSIONS_INDEX_TITLE = "# te_passes dump sessions"


@dataclasses.dataclass
class _SessionState:
    """This process's dump-session state: ``session`` ``{"pid": int, "id": str, "started": str}``, ``claimed``
    (realpath claimed by te-passes dump in this process -> where it writes), the roots whose foreign
    ``index.md`` was warned about, ``write_errors`` (realpath of a dump folder -> its write errors)."""

    session: dict[str, Any] = dataclasses.field(default_factory=dict)
    claimed: dict[str, str] = dataclasses.field(default_factory=dict)
    warned_foreign_index: set[str] = dataclasses.field(default_factory=set)
    write_errors: dict[str, list[str]] = dataclasses.field(default_factory=dict)


_session_lock = threading.Lock()
_STATE = _SessionState()
#: Realpath claimed by te-passes dump in this process -> where it writes (read-only view; :func:`claim_dir`).
claimed_dirs: Mapping[str, str] = types.MappingProxyType(_STATE.claimed)


def session_id() -> str:
    """This process's dump session id, ``<UTC start>-<host>-p<pid>`` (e.g.
    ``"20261129T213640Z-node01-p2499"``): the folder a backend-only dump writes into under its
    dump directory. Fixed on first use; a forked child gets its own."""
    with _session_lock:
        if _STATE.session.get("pid") != os.getpid():
            now = time.gmtime()
            _STATE.session.update(pid=os.getpid(), started=time.strftime("%Y-%m-%dT%H:%M:%SZ", now),
                            id=f"{time.strftime('%Y%m%dT%H%M%SZ', now)}-{slug(socket.gethostname()) or 'host'}"
                               f"-p{os.getpid()}")
        return _STATE.session["id"]


def claim_dir(path: str | os.PathLike, into: str | os.PathLike | None = None) -> None:
    """Mark ``path`` as written by ``te-passes dump`` in this process: backend writers for it
    (``TE_PASSES_DUMP_DIR`` set by the CLI) then write straight into ``into`` (default ``path``
    itself; the CLI gives its staging folder, moved into ``path`` only when the run succeeded),
    and the CLI writes the summary, instead of a session folder of their own
    (:meth:`DumpWriter.for_backend`)."""
    _STATE.claimed[os.path.realpath(os.fspath(path))] = os.fspath(into if into is not None else path)


def note_write_error(root: str | os.PathLike | None, what: str, error: BaseException) -> None:
    """Record that writing into dump folder ``root`` failed (``what``: the file or step): a
    ``te-passes dump`` of a claimed directory then fails instead of committing a partial dump
    (:func:`write_errors`). Other directories: the backend's warning is all (a dump never breaks
    a compilation)."""
    if root is not None and isinstance(error, OSError):
        _STATE.write_errors.setdefault(os.path.realpath(os.fspath(root)), []).append(
            f"{what}: {type(error).__name__}: {error}")


def write_errors(root: str | os.PathLike) -> list[str]:
    """The write errors :func:`note_write_error` recorded for ``root`` in this process."""
    return list(_STATE.write_errors.get(os.path.realpath(os.fspath(root)), []))


def unclaim_dir(path: str | os.PathLike) -> None:
    """Undo :func:`claim_dir`."""
    _STATE.claimed.pop(os.path.realpath(os.fspath(path)), None)


def is_claimed(path: str | os.PathLike) -> bool:
    """Whether ``te-passes dump`` in this process owns ``path`` (:func:`claim_dir`)."""
    return os.path.realpath(os.fspath(path)) in claimed_dirs


def backend_session(source: str | None = None) -> dict[str, Any]:
    """Session facts for a dump written by the backend alone (``te_passes.dump_dir``): the
    session id, pid, host, start time and command line, and the process's graph breaks, TE
    eager islands and recompiles so far (:func:`te_passes.debug.graph_breaks.current_events`)."""
    sid = session_id()
    return {"owner": "backend", "session": sid, "pid": os.getpid(), "host": socket.gethostname(),
            "started": _STATE.session.get("started"), "argv": list(sys.argv), "target": " ".join(sys.argv),
            "compile_path": "torch.compile(backend='te_inductor') with TE_PASSES_DUMP_DIR set" if source == "env"
                            else "torch.compile(backend='te_inductor', options={'te_passes.dump_dir': ...})",
            "note": "Graph breaks, TE eager islands and recompiles are this process's so far (Dynamo's "
                    "records), including frames not compiled by te_inductor.",
            **current_events().to_json()}


# --------------------------------------------------------------------------- sessions
def read_sessions(root: str) -> list[dict[str, Any]]:
    """The backend dump sessions in dump directory ``root``, oldest first: one entry per
    sub-folder whose ``session.json`` has ``owner == "backend"`` and a ``session`` equal to the
    folder name — ``session``, ``dir`` (the folder name), ``pid``, ``host``, ``started``,
    ``argv`` and ``graphs`` (graph ids dumped there, in compile order). Other folders are ignored."""
    out = []
    try:
        names = os.listdir(root)
    except OSError:
        return []
    for name in names:
        p = os.path.join(root, name, "session.json")
        if not os.path.isfile(p):
            continue
        try:
            data = read_json_file(p)
        except (OSError, UnicodeDecodeError, ValueError):  # not JSON, or over the budget
            continue
        if not isinstance(data, dict) or data.get("owner") != "backend" or data.get("session") != name:
            continue
        graphs = _graph_dir_names(os.path.join(root, name))
        out.append({"session": name, "dir": name, "pid": data.get("pid"), "host": data.get("host"),
                    "started": data.get("started"), "argv": data.get("argv"), "graphs": graphs})
    return sorted(out, key=lambda e: (str(e.get("started") or ""), e["session"]))


def _graph_dir_names(root: str) -> list[str]:
    """``g<N>`` folders of ``root`` holding a ``report.json``, in graph-id order (names only: the
    sessions index is rewritten after every compiled graph, so no report is parsed here)."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    out = [n for n in names if GRAPH_DIR_RE.fullmatch(n) and os.path.isfile(os.path.join(root, n, "report.json"))]
    return sorted(out, key=lambda n: int(n[1:]))


def latest_session_dir(root: str) -> str | None:
    """``root/<newest session>`` when ``root`` holds backend dump sessions (:func:`read_sessions`)
    and no summary of its own (``root/report.json``), else ``None``."""
    if os.path.isfile(os.path.join(root, "report.json")):
        return None
    sessions = read_sessions(root)
    return os.path.join(root, sessions[-1]["dir"]) if sessions else None


def write_sessions_index(root: str) -> list[dict[str, Any]]:
    """(Re)write ``root/sessions.json`` and, unless ``root`` is itself a te-passes dump or holds
    someone else's ``index.md``, ``root/index.md``: every backend dump session in ``root``
    (:func:`read_sessions`). Several processes may share ``root`` (ranks of one job): the listing
    and the writes run under an ``flock`` on ``root/.te_passes_sessions.lock``, and every file is
    replaced atomically. Returns the sessions."""
    with dir_lock(root):
        sessions = read_sessions(root)
        atomic_write(os.path.join(root, "sessions.json"),
                      json.dumps({"schema": SESSIONS_SCHEMA, "sessions": sessions}, indent=2, default=repr))
        index = os.path.join(root, "index.md")
        ours = True
        if os.path.isfile(os.path.join(root, "report.json")):
            ours = False
        elif os.path.exists(index):
            try:
                with open(index) as f:
                    ours = f.readline().rstrip("\n") == SESSIONS_INDEX_TITLE
            except (OSError, UnicodeDecodeError):
                ours = False
        if ours:
            atomic_write(index, render_sessions_index(sessions))
        elif root not in _STATE.warned_foreign_index:
            _STATE.warned_foreign_index.add(root)
            log.warning("te_passes dump: %s already holds a te-passes dump or an index.md of its own; this "
                        "process's dump is in %s (the top-level index.md is left alone)",
                        root, os.path.join(root, session_id()))
    return sessions


def render_sessions_index(sessions: list[dict[str, Any]]) -> str:
    """The top-level ``index.md`` of a directory of backend dump sessions (newest first)."""
    L = [SESSIONS_INDEX_TITLE, "",
         "One folder per process that compiled with `torch.compile(backend=\"te_inductor\")` and "
         "`te_passes.dump_dir` / `TE_PASSES_DUMP_DIR` set to this directory; each is a complete dump "
         "(`te-passes show <folder>`, `te-passes replay <folder>`). `te-passes show` on this directory "
         "shows the newest.", ""]
    rows = [[f"[{e['session']}]({e['dir']}/index.md)", e.get("started"), e.get("host"), e.get("pid"),
             " ".join(e.get("argv") or []), ", ".join(e["graphs"])] for e in reversed(sessions)]
    L.append(md_table(["session", "started (UTC)", "host", "pid", "command", "graphs"], rows))
    return "\n".join(L)
