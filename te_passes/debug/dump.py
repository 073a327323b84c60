"""Per-pass dumps: TE-aware graphs before/after every pass, diffs, report.json, index.md.

The backend creates one :class:`DumpWriter` per ``te_inductor`` call when
``options={"te_passes.dump_dir": DIR}`` (or ``TE_PASSES_DUMP_DIR``) is given, or when tlparse
tracing (``TORCH_TRACE``) is on, and registers it as a pass-manager observer. Layout of a
dump (``DIR`` itself under ``te-passes dump``; ``DIR/<session>`` for a backend-only dump, see
below)::

    index.md                      links to everything below, summary tables
    report.json                   all graphs of the dump: passes[], folded[], frees[], memory,
                                  pool_check[], skipped[], graph_breaks[], eager_fallbacks[],
                                  recompiles[], uuid (see build_summary)
    g0/                           one directory per compiled Dynamo graph (CompileReport.graph_id)
      report.json                 CompileReport.to_json() (every PassRun with its records)
      te_state.json               TEState.to_json() the passes read (replay uses it)
      dynamo/                     one directory per stage the passes ran at
        input.py                  the stage's input graph, TE-aware (printer.format_graph)
        input.tegraph             the same graph, loadable offline (graph_io; te-passes replay)
        01_<pass>/before.py       graph before the pass
        01_<pass>/after.py        graph after it, with the pass's records as "# <- ..." notes
        01_<pass>/diff.patch      unified diff before.py -> after.py
        01_<pass>/changes.txt     field-level changes (nodes added/removed, TE fields changed)
        output.py                 the stage's output graph
      post_grad_fwd/ ...          (g0.fwd), post_grad_bwd/ (g0.bwd), joint/ (g0.joint)

Where the backend writes (:meth:`DumpWriter.for_backend`): ``te-passes dump`` claims its
``--out`` directory for its own process (:func:`claim_dir`) and the backend writes the layout
above straight into it. A backend-only dump (``te_passes.dump_dir`` / ``TE_PASSES_DUMP_DIR``
without the CLI) writes it into a per-process *session* folder instead, so that graphs of a
previous run, or of another rank writing to the same directory at the same time, are never
overwritten or mixed into this run's summary::

    DIR/
      index.md                    the sessions in DIR, newest first, linked (written only when DIR
                                  is not itself a te-passes dump)
      sessions.json               the same as data (schema te_passes.dump_sessions/1)
      20261129T213640Z-host-p2499/   one session (session_id()): the layout above, its report.json
                                  listing every graph this process compiled into DIR, in order

With ``TORCH_TRACE`` set, every file is also emitted as a tlparse artifact named
``te_passes_<graph>_<stage>_<file>`` (:func:`te_passes._logging.trace_artifact`), whether or
not a directory was given.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
import threading
import time
from typing import Any, Iterable

import torch.fx

from te_passes import __version__
from te_passes._logging import get_logger, trace_artifact
from te_passes.debug.diff import GraphSnapshot, format_changes, graph_changes, unified_diff
from te_passes.debug.graph_breaks import current_events, no_islands_text
from te_passes.debug.graph_io import save_graph
from te_passes.report import cache_hit_note
from te_passes.debug.printer import format_graph
from te_passes.te.graph_model import is_te_op_node
from te_passes.te.version import te_version

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
_WHAT_KEYS = ("api", "lookup", "field", "attr")


class DumpDirError(OSError):
    """The dump directory cannot be created or written (the message names it and why)."""


def tracing_enabled() -> bool:
    """Whether tlparse structured tracing (``TORCH_TRACE``) is on in this process."""
    try:
        from torch._logging._internal import trace_log
    except ImportError:  # pragma: no cover
        return False
    return bool(trace_log.handlers)


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
        probe = os.path.join(path, f".te_passes_write_test_{os.getpid()}")
        with open(probe, "w") as f:
            f.write("")
        os.remove(probe)
    except OSError as e:
        raise DumpDirError(f"dump directory {path} is not writable: {e.strerror or e}") from e
    return path


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", s)


def _records_notes(run: Any) -> dict[str, list[str]]:
    notes: dict[str, list[str]] = {}
    for r in getattr(run, "records", ()):
        if r.node is None:
            continue
        data = ", ".join(f"{k}={v!r}" for k, v in r.to_json().items() if k not in ("kind", "node"))
        notes.setdefault(r.node, []).append(f"{run.name}: {r.kind}" + (f" ({data})" if data else ""))
    return notes


SESSIONS_SCHEMA = "te_passes.dump_sessions/1"
#: First line of the sessions ``index.md`` the backend writes at the top of a dump directory
#: (a top-level ``index.md`` without it is someone else's and is never overwritten).
SESSIONS_INDEX_TITLE = "# te_passes dump sessions"
_SESSION_LOCK_FILE = ".te_passes_sessions.lock"

_session_lock = threading.Lock()
_session: dict[str, Any] = {}  # {"pid": int, "id": str, "started": str}
_claimed: dict[str, str] = {}  # realpath claimed by te-passes dump in this process -> where it writes
_warned_foreign_index: set[str] = set()


def session_id() -> str:
    """This process's dump session id, ``<UTC start>-<host>-p<pid>`` (e.g.
    ``"20261129T213640Z-node01-p2499"``): the folder a backend-only dump writes into under its
    dump directory. Fixed on first use; a forked child gets its own."""
    with _session_lock:
        if _session.get("pid") != os.getpid():
            now = time.gmtime()
            _session.update(pid=os.getpid(), started=time.strftime("%Y-%m-%dT%H:%M:%SZ", now),
                            id=f"{time.strftime('%Y%m%dT%H%M%SZ', now)}-{_slug(socket.gethostname()) or 'host'}"
                               f"-p{os.getpid()}")
        return _session["id"]


def claim_dir(path: str | os.PathLike, into: str | os.PathLike | None = None) -> None:
    """Mark ``path`` as written by ``te-passes dump`` in this process: backend writers for it
    (``TE_PASSES_DUMP_DIR`` set by the CLI) then write straight into ``into`` (default ``path``
    itself; the CLI gives its staging folder, moved into ``path`` only when the run succeeded),
    and the CLI writes the summary, instead of a session folder of their own
    (:meth:`DumpWriter.for_backend`)."""
    _claimed[os.path.realpath(os.fspath(path))] = os.fspath(into if into is not None else path)


def unclaim_dir(path: str | os.PathLike) -> None:
    """Undo :func:`claim_dir`."""
    _claimed.pop(os.path.realpath(os.fspath(path)), None)


def is_claimed(path: str | os.PathLike) -> bool:
    """Whether ``te-passes dump`` in this process owns ``path`` (:func:`claim_dir`)."""
    return os.path.realpath(os.fspath(path)) in _claimed


class DumpWriter:
    """Pass-manager observer writing the dump of one ``te_inductor`` call (see module docstring).

    Build with :meth:`for_backend` (``te_inductor``: a per-process session folder unless
    ``te-passes dump`` claimed the directory) or :meth:`for_dir` (straight into a directory:
    the CLI, offline runs). Hooks (called by :class:`te_passes.pipeline.manager.PassManager`
    and :mod:`te_passes.backend`): :meth:`before_stage`, :meth:`before_pass`,
    :meth:`after_pass`, :meth:`after_stage`, :meth:`finish`. Never raises from a hook: a dump
    failure is logged and the compilation goes on (only :meth:`for_dir` raises).
    """

    def __init__(self, root: str | None, *, sessions_dir: str | None = None, source: str | None = None) -> None:
        self.root = root
        #: How the dump directory was given: ``"option"`` (``te_passes.dump_dir``), ``"env"``
        #: (``TE_PASSES_DUMP_DIR``) or ``None`` (the CLI, offline runs).
        self.source = source
        #: The dump directory holding ``root`` as a session folder (backend-only dumps), else None.
        self.sessions_dir = sessions_dir
        self._stage_dirs: dict[str, str] = {}
        self._pass_index: dict[str, int] = {}
        self._snapshot: GraphSnapshot | None = None
        self._stage_started: set[str] = set()
        self._report: Any = None
        self._te_ops: int | None = None
        self.files: list[str] = []

    @classmethod
    def for_dir(cls, path: str | os.PathLike | None) -> "DumpWriter":
        """A writer for dump directory ``path`` (created if needed), or a tlparse-only writer
        when ``path`` is ``None``.

        Raises:
            DumpDirError: ``path`` cannot be created or written.
        """
        return cls(ensure_writable_dir(path) if path is not None else None)

    @classmethod
    def for_backend(cls, path: str | os.PathLike | None, source: str | None = None) -> "DumpWriter":
        """The writer ``te_inductor`` uses for ``te_passes.dump_dir`` / ``TE_PASSES_DUMP_DIR``
        ``path``: straight into ``path`` when ``te-passes dump`` claimed it in this process
        (:func:`claim_dir`), else into ``path/<session_id()>`` (one session folder per process;
        see the module docstring), or tlparse-only when ``path`` is ``None``.

        Raises:
            DumpDirError: ``path`` (or the session folder in it) cannot be created or written.
        """
        if path is None:
            return cls.for_dir(None)
        if is_claimed(path):
            return cls.for_dir(_claimed[os.path.realpath(os.fspath(path))])
        parent = ensure_writable_dir(path)
        root = os.path.join(parent, session_id())
        first = not os.path.isdir(root)
        writer = cls(ensure_writable_dir(root), sessions_dir=parent, source=source)
        if first:
            log.info("te_passes: backend dump session %s (this process's graphs; earlier runs in %s are kept)",
                     root, parent)
        return writer

    # ------------------------------------------------------------------ paths & output
    @staticmethod
    def _base_id(graph_id: str) -> str:
        return graph_id.split(".")[0]

    def _stage_key(self, ctx: Any) -> str:
        return f"{ctx.graph_id}/{ctx.stage.value}"

    def _stage_dir(self, ctx: Any) -> str:
        key = self._stage_key(ctx)
        if key not in self._stage_dirs:
            rel = os.path.join(_slug(self._base_id(ctx.graph_id)), ctx.stage.value)
            n = 2
            while self.root is not None and os.path.exists(os.path.join(self.root, rel)) \
                    and rel not in self._stage_dirs.values():
                rel = os.path.join(_slug(self._base_id(ctx.graph_id)), f"{ctx.stage.value}_{n}")
                n += 1
            self._stage_dirs[key] = rel
        return self._stage_dirs[key]

    def _write(self, rel: str, text: str | bytes, artifact: str | None = None) -> None:
        if artifact is not None and isinstance(text, str):
            trace_artifact("te_passes_" + _slug(artifact), lambda: text)
        if self.root is None:
            return
        path = os.path.join(self.root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
        self.files.append(rel)

    def _safe(self, what: str, fn, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - a dump must never break compilation
            log.warning("te_passes dump: %s failed: %s: %s", what, type(e).__name__, e)

    # ------------------------------------------------------------------ hooks
    def before_stage(self, gm: torch.fx.GraphModule, ctx: Any) -> None:
        """Save the stage's input graph: ``input.py`` and replayable ``input.tegraph``."""
        key = self._stage_key(ctx)
        if key in self._stage_started:
            return
        self._stage_started.add(key)
        self._safe("before_stage", self._before_stage, gm, ctx)

    def _before_stage(self, gm: torch.fx.GraphModule, ctx: Any) -> None:
        d = self._stage_dir(ctx)
        if ctx.stage.value == "dynamo":
            self._te_ops = sum(1 for n in gm.graph.nodes if is_te_op_node(n))
        self._write(os.path.join(d, "input.py"), format_graph(gm), f"{ctx.graph_id}_{ctx.stage.value}_input")
        if self.root is not None:
            info = {"stage": ctx.stage.value, "graph_id": ctx.graph_id,
                    "te_state": ctx.te_state.to_json(),
                    "options": {"disable": list(ctx.options.disable), "strict": ctx.options.strict,
                                "ub_on_change": ctx.options.ub_on_change},
                    "example_inputs": list(ctx.example_inputs) if ctx.example_inputs is not None else None}
            save_graph(os.path.join(self.root, d, "input.tegraph"), gm, **info)
            self.files.append(os.path.join(d, "input.tegraph"))

    def before_pass(self, gm: torch.fx.GraphModule, tepass: Any, ctx: Any) -> None:
        """Snapshot the graph (printout + fields) before ``tepass`` runs."""
        self.before_stage(gm, ctx)
        try:
            self._snapshot = GraphSnapshot.take(gm)
        except Exception as e:  # noqa: BLE001
            self._snapshot = None
            log.warning("te_passes dump: snapshot before %s failed: %s", tepass.name, e)

    def after_pass(self, gm: torch.fx.GraphModule, tepass: Any, ctx: Any, run: Any) -> None:
        """Write ``NN_<pass>/{before.py, after.py, diff.patch, changes.txt}``."""
        self._safe(f"after_pass {tepass.name}", self._after_pass, gm, tepass, ctx, run)

    def _after_pass(self, gm: torch.fx.GraphModule, tepass: Any, ctx: Any, run: Any) -> None:
        key = self._stage_key(ctx)
        self._pass_index[key] = self._pass_index.get(key, 0) + 1
        pdir = os.path.join(self._stage_dir(ctx), f"{self._pass_index[key]:02d}_{_slug(tepass.name)}")
        run.dump_dir = pdir  # PassRun gets where its dump lives (read by the summary)
        before = self._snapshot
        after = GraphSnapshot.take(gm, notes=_records_notes(run))
        plain_after = GraphSnapshot.take(gm) if before is not None else after
        art = f"{ctx.graph_id}_{ctx.stage.value}_{self._pass_index[key]:02d}_{tepass.name}"
        if before is not None:
            self._write(os.path.join(pdir, "before.py"), before.text, None)
        self._write(os.path.join(pdir, "after.py"), after.text, f"{art}_after" if run.changed else None)
        if before is not None:
            patch = unified_diff(before.text, plain_after.text, f"a/{pdir}/before.py", f"b/{pdir}/after.py")
            changes = graph_changes(before, plain_after)
            self._write(os.path.join(pdir, "diff.patch"), patch, f"{art}_diff" if patch else None)
            header = (f"# {tepass.name} at {ctx.stage.value} on {ctx.graph_id}: status={run.status} "
                      f"changed={run.changed} nodes {run.nodes_before} -> {run.nodes_after} "
                      f"({len(changes['added'])} added, {len(changes['removed'])} removed, "
                      f"{len(changes['changed'])} fields changed)\n")
            self._write(os.path.join(pdir, "changes.txt"), header + format_changes(changes), None)
            run_changes = {k: len(v) for k, v in changes.items()}
            run.dump_changes = run_changes
        self._snapshot = None

    def after_stage(self, gm: torch.fx.GraphModule, ctx: Any, stage_report: Any = None) -> None:
        """Write the stage's ``output.py``; refresh the reports when :meth:`finish` already ran
        (AOTAutograd compiles the backward lazily, after ``te_inductor`` returned)."""
        self._safe("after_stage", lambda: self._write(
            os.path.join(self._stage_dir(ctx), "output.py"), format_graph(gm),
            f"{ctx.graph_id}_{ctx.stage.value}_output"))
        if self._report is not None:
            self._safe("late finish", self._finish, self._report)

    def finish(self, report: Any) -> None:
        """Write ``<graph>/report.json`` and ``te_state.json``, then refresh ``DIR/report.json``
        and ``DIR/index.md`` over every graph in the directory."""
        self._safe("finish", self._finish, report)

    def _finish(self, report: Any) -> None:
        self._report = report
        report.dump_dir = self.root  # where this graph's dump went (te-passes dump collects strays)
        data = report_json(report, self._stage_dirs)
        data["te_ops"] = self._te_ops  # TE op nodes in the Dynamo graph (None: stage not seen)
        gdir = _slug(report.graph_id)
        text = json.dumps(data, indent=2, sort_keys=False)
        self._write(os.path.join(gdir, "report.json"), text, f"{report.graph_id}_report")
        self._write(os.path.join(gdir, "te_state.json"), json.dumps(report.te_state, indent=2), None)
        if self.root is not None:
            # A session folder (backend-only dump) gets this process's session facts; a directory
            # written straight into (te-passes dump, replay --out, run_stages) keeps the session.json
            # its owner wrote.
            # te-passes dump (a claimed directory) emits the final summary artifact itself
            write_summary(self.root, _backend_session(self.source) if self.sessions_dir is not None else None,
                          emit=not is_claimed(self.root))
            if self.sessions_dir is not None:
                write_sessions_index(self.sessions_dir)


def _backend_session(source: str | None = None) -> dict[str, Any]:
    """Session facts for a dump written by the backend alone (``te_passes.dump_dir``): the
    session id, pid, host, start time and command line, and the process's graph breaks, TE
    eager islands and recompiles so far (:func:`te_passes.debug.graph_breaks.current_events`)."""
    sid = session_id()
    return {"owner": "backend", "session": sid, "pid": os.getpid(), "host": socket.gethostname(),
            "started": _session.get("started"), "argv": list(sys.argv), "target": " ".join(sys.argv),
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
            with open(p) as f:
                data = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
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


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class DumpDirLocked(DumpDirError):
    """Another process holds the dump directory's lock (:func:`dir_lock` with ``blocking=False``)."""


@contextlib.contextmanager
def dir_lock(root: str, *, blocking: bool = True):
    """Hold the ``flock`` on ``root/.te_passes_sessions.lock`` (created if missing): the one lock
    every te_passes writer of a dump directory takes — the backend while it rewrites a sessions
    index (:func:`write_sessions_index`), ``te-passes dump`` / ``replay --out`` for their whole
    run. Released on exit (and by the kernel if the process dies).

    Raises:
        DumpDirLocked: ``blocking=False`` and another process holds it (the message names the
            lock file and the holder's pid when it wrote one).
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on Linux
        fcntl = None
    path = os.path.join(root, _SESSION_LOCK_FILE)
    with open(path, "a+") as lock:
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


def write_sessions_index(root: str) -> list[dict[str, Any]]:
    """(Re)write ``root/sessions.json`` and, unless ``root`` is itself a te-passes dump or holds
    someone else's ``index.md``, ``root/index.md``: every backend dump session in ``root``
    (:func:`read_sessions`). Several processes may share ``root`` (ranks of one job): the listing
    and the writes run under an ``flock`` on ``root/.te_passes_sessions.lock``, and every file is
    replaced atomically. Returns the sessions."""
    with dir_lock(root):
        sessions = read_sessions(root)
        _atomic_write(os.path.join(root, "sessions.json"),
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
            _atomic_write(index, render_sessions_index(sessions))
        elif root not in _warned_foreign_index:
            _warned_foreign_index.add(root)
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
    L.append(_md_table(["session", "started (UTC)", "host", "pid", "command", "graphs"], rows))
    return "\n".join(L)


# --------------------------------------------------------------------------- reports
def report_json(report: Any, stage_dirs: dict[str, str] | None = None) -> dict[str, Any]:
    """``CompileReport.to_json()`` plus, per stage, the dump directory (``"dir"``) and per run
    its dump directory and change counts (``"dump"``, ``"changes"``)."""
    data = report.to_json()
    stage_dirs = stage_dirs or {}
    for sj, s in zip(data["stages"], report.stages):
        sj["dir"] = stage_dirs.get(f"{s.graph_id}/{s.stage}")
        for rj, r in zip(sj["runs"], s.runs):
            rj["dump"] = getattr(r, "dump_dir", None)
            rj["changes"] = getattr(r, "dump_changes", None)
    return data


GRAPH_DIR_RE = re.compile(r"g\d+")


def read_graph_report(root: str, name: str) -> dict[str, Any] | None:
    """The per-graph ``report.json`` of ``root/name`` when that folder is one this module wrote,
    else ``None``.

    A graph folder is ours only when its name is exactly ``g<N>`` (:class:`CompileReport`
    ``graph_id``), its ``report.json`` parses to an object whose ``graph_id`` equals the folder
    name and whose ``stages`` is a list. Anything else (a user's ``golden/``, a foreign
    ``report.json``) is never read, listed or deleted by ``te-passes``.
    """
    if not GRAPH_DIR_RE.fullmatch(name):
        return None
    p = os.path.join(root, name, "report.json")
    if not os.path.isfile(p):
        return None
    try:
        with open(p) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict) or data.get("graph_id") != name or not isinstance(data.get("stages"), list):
        return None
    return data


def _graph_reports(root: str) -> list[dict[str, Any]]:
    out = [d for d in (read_graph_report(root, name) for name in os.listdir(root)) if d is not None]
    return sorted(out, key=lambda d: int(d["graph_id"][1:]))


def _folded_expr(rec: dict[str, Any]) -> str | None:
    """``"get_ub_is_fp8('proj_fprop', True)"`` / ``"recipe.fp8_gemm_fprop.use_split_accumulator"``:
    the folded expression as text, from the record's own fields."""
    if rec.get("receiver") is not None and rec.get("field") is not None:
        return f"{rec['receiver']}.{rec['field']} = {rec.get('value')!r}"
    attr = rec.get("attr") or rec.get("name")
    if attr is not None and rec.get("type") is not None:
        return f"self.{attr}: {rec['type']}"
    what = next((rec[k] for k in _WHAT_KEYS if rec.get(k) is not None), None)
    if what is None:
        return None
    args = rec.get("args")
    if isinstance(args, list):
        return f"{what}({', '.join(repr(a) for a in args)})"
    return str(what)


def _memory_entry(graph_id: str, stage: str, mem: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"graph_id": graph_id, "stage": stage}
    if isinstance(mem, dict):
        entry.update(mem)
    else:
        entry["value"] = mem
    for k in ("peak_before", "peak_after"):
        entry.setdefault(k, None)
    return entry


def build_summary(graphs: Iterable[dict[str, Any]], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The top-level ``report.json``: flat, per-kind views over every graph's pass records.

    Sections (each entry also carries ``graph_id``, ``stage`` and ``pass``):

    * ``passes[]``: ``name``, ``stage``, ``status``, ``changed``, ``time_ms``, ``nodes_before``,
      ``nodes_after``, ``records`` (count), ``dump`` (directory);
    * ``folded[]``: records of kind ``folded``/``hoisted``: ``kind``, ``source``, ``args``,
      ``value``, ``node`` (+ the record's other data);
    * ``frees[]``: records of kind ``free``: ``node``, ``role``, ``bytes`` (+ data);
    * ``pool_check[]``: records of kind ``pool_*``; ``skipped[]``: refusals with reasons;
      ``failed[]``: passes that raised (graph restored);
    * ``memory``: ``{"stages": [per-stage StageReport.facts["memory"] with graph_id/stage],
      "peak_before", "peak_after"}`` (largest concrete peaks, bytes);
    * ``graph_breaks[]``, ``eager_fallbacks[]``, ``recompiles[]``, ``frames[]`` from ``extra``
      (:class:`te_passes.debug.graph_breaks.CompileEvents`);
    * ``uuid``: ``{graph_id: {"uuid", "passes", "options", "te_state", "reads_ub", "ub_reads"}}``
      — what each graph's pass-pipeline uuid was built from (:func:`te_passes.backend.pipeline_uuid`);
      ``graphs[]``: id, mode, stage list, time.
    """
    graphs = list(graphs)
    s: dict[str, Any] = {"schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                         "versions": _versions(), "graphs": [], "passes": [], "folded": [], "frees": [],
                         "pool_check": [], "skipped": [], "failed": [], "other_records": [],
                         "memory": {"stages": [], "peak_before": None, "peak_after": None},
                         "graph_breaks": [], "eager_fallbacks": [], "recompiles": [], "frames": [],
                         "uuid": {}}
    for g in graphs:
        gid = g.get("graph_id")
        s["graphs"].append({"graph_id": gid, "mode": g.get("mode") or "default", "te_ops": g.get("te_ops"),
                            "cache_hit": g.get("cache_hit"),
                            "stages": [f"{st['graph_id']}:{st['stage']}" for st in g.get("stages", [])],
                            "time_ms_passes": g.get("time_ms_passes"), "time_ms_total": g.get("time_ms_total"),
                            "te_version": (g.get("te_state") or {}).get("te_version")})
        s["uuid"][gid] = g.get("uuid", {})
        for st in g.get("stages", []):
            where = {"graph_id": st["graph_id"], "stage": st["stage"]}
            mem = (st.get("facts") or {}).get("memory")
            if mem is not None:
                s["memory"]["stages"].append(_memory_entry(st["graph_id"], st["stage"], mem))
            for run in st.get("runs", []):
                s["passes"].append({**where, "name": run["name"], "status": run["status"],
                                    "changed": run["changed"], "time_ms": run["time_ms"],
                                    "nodes_before": run["nodes_before"], "nodes_after": run["nodes_after"],
                                    "records": len(run.get("records", [])), "dump": run.get("dump"),
                                    "error": run.get("error")})
                if run["status"] == "failed":
                    s["failed"].append({**where, "pass": run["name"], "error": run.get("error")})
                for rec in run.get("records", []):
                    kind = rec.get("kind")
                    entry = {**where, "pass": run["name"], **rec}
                    if kind in FOLDED_KINDS:
                        for k in ("source", "args", "value"):
                            entry.setdefault(k, None)
                        entry["expr"] = _folded_expr(rec)
                        s["folded"].append(entry)
                    elif kind in FREE_KINDS:
                        for k in ("role", "bytes"):
                            entry.setdefault(k, None)
                        s["frees"].append(entry)
                    elif kind in POOL_KINDS or str(kind).startswith("pool"):
                        s["pool_check"].append(entry)
                    elif kind in SKIPPED_KINDS:
                        s["skipped"].append(entry)
                    elif kind in MEMORY_KINDS:
                        s["memory"]["stages"].append(_memory_entry(st["graph_id"], st["stage"],
                                                                   {"pass": run["name"], **rec}))
                    else:
                        s["other_records"].append(entry)
    peaks: dict[str, list[float]] = {"peak_before": [], "peak_after": []}
    for m in s["memory"]["stages"]:
        m.pop("kind", None)
        m.pop("node", None)
        for k in peaks:
            v = m.get(f"{k}_concrete", m.get(k))
            v = v.get("concrete") if isinstance(v, dict) else v
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                peaks[k].append(v)
    for k, vals in peaks.items():
        s["memory"][k] = max(vals) if vals else None
    for k, v in (extra or {}).items():
        s[k] = v
    return s


def _versions() -> dict[str, Any]:
    import torch

    return {"te_passes": __version__, "torch": torch.__version__, "transformer_engine": te_version()}


def write_summary(root: str, extra: dict[str, Any] | None = None, *, emit: bool = True) -> dict[str, Any]:
    """(Re)write ``root/report.json`` and ``root/index.md`` from every ``root/*/report.json``.

    ``extra`` entries (graph breaks, target, ...) are merged in and kept in
    ``root/session.json`` so later refreshes (another graph finishing) keep them. ``emit``: also
    emit the summary as the tlparse artifact ``te_passes_report`` (``te-passes dump`` emits only
    its final summary: one artifact per dump).
    """
    session_path = os.path.join(root, "session.json")
    if extra is not None:
        with open(session_path, "w") as f:
            json.dump(extra, f, indent=2, default=repr)
    elif os.path.isfile(session_path):
        with open(session_path) as f:
            extra = json.load(f)
    summary = build_summary(_graph_reports(root), extra)
    with open(os.path.join(root, "report.json"), "w") as f:
        json.dump(summary, f, indent=2, default=repr)
    with open(os.path.join(root, "index.md"), "w") as f:
        f.write(render_index(summary, root))
    if emit:
        trace_artifact("te_passes_report", lambda: json.dumps(summary, default=repr), encoding="json")
    return summary


_ENTRY_KEYS = ("graph_id", "stage", "pass", "kind", "node")


def record_detail(entry: dict[str, Any], n: int = 120) -> str:
    """One-line text for a pool-check or other record (what ``te-passes show`` and ``index.md``
    print): ``"0 findings, 9 allocated values, cudagraphs off"`` for a ``pool_check`` summary,
    else the record's ``message``/``reason``, else its other fields as ``key=value``."""
    if entry.get("kind") == "pool_check":
        return (f"{entry.get('findings', 0)} findings, {entry.get('allocated_values', '?')} allocated values, "
                f"cudagraphs {'on' if entry.get('cudagraphs') else 'off'}")
    text = entry.get("message") or entry.get("reason")
    if not text:
        text = ", ".join(f"{k}={v if isinstance(v, str) else json.dumps(v, default=repr)}"
                         for k, v in entry.items() if k not in _ENTRY_KEYS)
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _cell(v: Any) -> Any:
    """A table cell: strings and numbers as they are, other values as JSON."""
    return v if v is None or isinstance(v, (str, int, float)) else json.dumps(v, default=repr)


def elsewhere_warnings(summary: dict[str, Any]) -> list[str]:
    """One sentence per graph whose ``torch.compile`` set its own ``te_passes.dump_dir``
    (``summary["elsewhere"]``, written by ``te-passes dump``)."""
    out = []
    for e in summary.get("elsewhere") or []:
        where = e.get("dump_dir")
        if e.get("dump_failed"):
            out.append(f"{e['graph_id']}: writing its dump failed (see the te_passes log); its report only is here")
        elif where:
            copy = "copied here" if e.get("copied") else "its report only is here"
            out.append(f"{e['graph_id']} was compiled with its own te_passes.dump_dir: its dump went to {where!r} "
                       f"({copy})")
        else:
            out.append(f"{e['graph_id']} was compiled without a dump directory (its te_passes.dump_dir option "
                       f"overrode TE_PASSES_DUMP_DIR): its report only is here, no graph files")
    return out


def _md_table(headers: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        return str("" if v is None else v).replace("|", "\\|").replace("\n", " ")
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def _link(root: str, rel: str | None, text: str) -> str:
    if not rel:
        return text
    return f"[{text}]({rel})" if os.path.exists(os.path.join(root, rel)) else text


def render_index(summary: dict[str, Any], root: str) -> str:
    """``index.md``: what was compiled, per-pass table with links to before/after/diff, folded
    constants, early frees, memory, pool check, skipped rewrites, graph breaks and TE eager
    islands, recompiles, uuid."""
    v = summary["versions"]
    L = [f"# te_passes dump\n",
         f"te_passes {v['te_passes']} · torch {v['torch']} · Transformer Engine {v['transformer_engine']} · "
         f"{summary['created']}\n"]
    tgt = summary.get("target")
    if tgt:
        L.append(f"Target: `{tgt}`  ")
    if summary.get("session"):
        L.append(f"Session: {summary['session']} (pid {summary.get('pid')} on {summary.get('host')}, started "
                 f"{summary.get('started')})  ")
    for key in ("precision", "mode", "compile_path"):
        if summary.get(key):
            L.append(f"{key.replace('_', ' ').capitalize()}: {summary[key]}  ")
    if summary.get("note"):
        L.append(f"\n> {summary['note']}\n")
    for w in elsewhere_warnings(summary):
        L.append(f"\n> **Warning:** {w}\n")
    L.append("\nMachine-readable: [report.json](report.json) · per graph: " +
             ", ".join(_link(root, f"{g['graph_id']}/report.json", g["graph_id"]) for g in summary["graphs"]) + "\n")

    L.append("\n## Graphs and stages\n")
    rows = []
    for g in summary["graphs"]:
        gid = g["graph_id"]
        stage_links = []
        for st in g["stages"]:
            sgid, stage = st.split(":")
            d = next((p.get("dump") for p in summary["passes"] if p["graph_id"] == sgid and p["stage"] == stage
                      and p.get("dump")), None)
            sdir = os.path.dirname(d) if d else f"{gid}/{stage}"
            stage_links.append(f"{_link(root, f'{sdir}/input.py', stage)} "
                               f"({_link(root, f'{sdir}/input.tegraph', 'tegraph')})")
        rows.append([gid, g["mode"] or "default", ", ".join(stage_links),
                     g["time_ms_passes"], g["time_ms_total"]])
    L.append(_md_table(["graph", "mode", "stages (input graph, replayable file)", "passes ms", "total ms"], rows))
    for g in summary["graphs"]:
        if g.get("cache_hit"):
            L.append(f"\n{g['graph_id']}: {cache_hit_note(g['cache_hit'])}.\n")
    partial = [g["graph_id"] for g in summary["graphs"]
               if not any(st.endswith(":post_grad_fwd") for st in g["stages"]) and not g.get("cache_hit")]
    if partial:
        L.append(f"\nNo post-grad stages for {', '.join(partial)}: Inductor's FX-graph / AOTAutograd cache "
                 f"hit (the passes' uuid and the TE state were unchanged, so the cached result already holds "
                 f"their rewrites), or the graph was not lowered by AOTAutograd. `te-passes dump` turns the "
                 f"caches off.\n")

    L.append("\n## Passes\n")
    rows = []
    for p in summary["passes"]:
        d = p.get("dump")
        links = " · ".join(_link(root, f"{d}/{f}", f.split('.')[0]) for f in ("before.py", "after.py", "diff.patch",
                                                                              "changes.txt")) if d else ""
        rows.append([p["graph_id"], p["stage"], p["name"], p["status"], "yes" if p["changed"] else "no",
                     f"{p['time_ms']:.2f}", f"{p['nodes_before']} → {p['nodes_after']}", p["records"], links])
    L.append(_md_table(["graph", "stage", "pass", "status", "changed", "ms", "nodes", "records", "dump"], rows)
             if rows else "No passes ran (none registered for these stages).\n")

    def section(title: str, key: str, cols: list[str], empty: str) -> None:
        L.append(f"\n## {title}\n")
        items = summary.get(key) or []
        if not items:
            L.append(empty + "\n")
            return
        L.append(_md_table(cols, [[it.get(c) for c in cols] for it in items]))

    section("Folded and hoisted constants", "folded", ["graph_id", "stage", "pass", "kind", "node", "expr",
                                                        "value", "source"], "None.")
    section("Early frees", "frees", ["graph_id", "stage", "pass", "node", "role", "bytes", "after"], "None.")
    L.append("\n## Memory estimate\n")
    mem = summary["memory"]
    if mem["stages"]:
        want = ("pass", "peak_before", "peak_after", "peak_before_concrete", "peak_after_concrete",
                "peak_node_before", "peak_node_after", "input_bytes")
        present = {k for m in mem["stages"] for k in m}
        cols = [c for c in want if c in present] or sorted(present - {"graph_id", "stage"})
        L.append(_md_table(["graph_id", "stage", *cols],
                           [[m["graph_id"], m["stage"], *[_cell(m.get(c)) for c in cols]]
                            for m in mem["stages"]]))
    else:
        L.append("No memory estimate was recorded.\n")
    for key in ("pool_check", "other_records"):
        summary = {**summary, key: [{**e, "detail": record_detail(e)} for e in summary.get(key) or []]}
    section("Cudagraph pool check", "pool_check", ["graph_id", "stage", "pass", "kind", "node", "detail"], "Not run.")
    section("Rewrites refused (skipped / kept)", "skipped", ["graph_id", "stage", "pass", "kind", "node", "reason"],
            "None.")
    section("Other records", "other_records", ["graph_id", "stage", "pass", "kind", "node", "detail"], "None.")
    section("Failed passes (graph restored)", "failed", ["graph_id", "stage", "pass", "error"], "None.")

    section("TE eager islands and fallbacks", "eager_fallbacks", ["module", "kind", "reason", "location", "count"],
            no_islands_text(summary).capitalize() + ".")
    section("Graph breaks", "graph_breaks", ["reason", "location", "count"], "None recorded.")
    section("Recompiles", "recompiles", ["compile_id", "function", "reason"], "None recorded.")
    L.append("\n## Pipeline uuid (Inductor FX-graph-cache key part)\n")
    rows = [[gid, (u or {}).get("uuid", "")[:16], ", ".join(f"{k}={str(h)[:8]}" for k, h in
                                                          ((u or {}).get("passes") or {}).items()),
             json.dumps((u or {}).get("options")), str((u or {}).get("te_state", ""))[:16],
             {True: "yes", False: "no"}.get((u or {}).get("reads_ub"), "")]
            for gid, u in summary["uuid"].items()]
    L.append(_md_table(["graph", "uuid", "passes (source+config hash)", "options", "te_state",
                        "reads UB (UB snapshot in te_state)"], rows))
    reads = [(gid, u["ub_reads"]) for gid, u in summary["uuid"].items() if (u or {}).get("ub_reads")]
    if reads:
        L.append("\nWhy a graph reads UB state (a UB change re-keys only these; te_passes.runtime.ub_guard.ub_state_reads):\n")
        L.extend(f"- {gid}: " + "; ".join(r) for gid, r in reads)
    return "\n".join(L)


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
        raise DumpFormatError(f"{path} is not a te_passes dump summary (no schema)")
    name, _, version = str(schema).rpartition("/")
    if name == SCHEMA.rpartition("/")[0]:
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
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise DumpFormatError(f"{path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}; "
                              f"truncated?)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DumpFormatError(f"cannot read {path}: {e}") from None
