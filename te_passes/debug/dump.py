"""Per-pass dumps: TE-aware graphs before/after every pass, diffs, report.json, index.md.

See docs/internals.md#te_passesdebugdumppy."""

from __future__ import annotations

import json
import os
from typing import Any

import torch.fx

from te_passes._logging import trace_artifact
from te_passes.debug.diff import GraphSnapshot, format_changes, graph_changes, unified_diff
from te_passes.debug.graph_io import save_graph
from te_passes.debug.printer import format_graph
from te_passes.te.graph_model import is_te_op_node
from te_passes.debug.dump_files import slug, ensure_writable_dir, log
from te_passes.debug.dump_sessions import (backend_session, claimed_into, note_write_error, session_id,
    write_sessions_index)
from te_passes.debug.dump_summary import report_json, write_summary
from te_passes.pipeline.manager import PassObserver


def tracing_enabled() -> bool:
    """Whether tlparse structured tracing (``TORCH_TRACE``) is on in this process."""
    try:
        from torch._logging._internal import trace_log
    except ImportError:  # pragma: no cover
        return False
    return bool(trace_log.handlers)


def _records_notes(run: Any) -> dict[str, list[str]]:
    notes: dict[str, list[str]] = {}
    for r in getattr(run, "records", ()):
        if r.node is None:
            continue
        data = ", ".join(f"{k}={v!r}" for k, v in r.to_json().items() if k not in ("kind", "node"))
        notes.setdefault(r.node, []).append(f"{run.name}: {r.kind}" + (f" ({data})" if data else ""))
    return notes


class DumpWriter(PassObserver):
    """Pass-manager observer writing the dump of one ``te_inductor`` call (see docs/internals.md)."""

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
        see docs/internals.md), or tlparse-only when ``path`` is ``None``.

        Raises:
            DumpDirError: ``path`` (or the session folder in it) cannot be created or written.
        """
        if path is None:
            return cls.for_dir(None)
        if (into := claimed_into(path)) is not None:
            return cls.for_dir(into)
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
            rel = os.path.join(slug(self._base_id(ctx.graph_id)), ctx.stage.value)
            n = 2
            while self.root is not None and os.path.exists(os.path.join(self.root, rel)) \
                    and rel not in self._stage_dirs.values():
                rel = os.path.join(slug(self._base_id(ctx.graph_id)), f"{ctx.stage.value}_{n}")
                n += 1
            self._stage_dirs[key] = rel
        return self._stage_dirs[key]

    def _write(self, rel: str, text: str | bytes, artifact: str | None = None) -> None:
        if artifact is not None and isinstance(text, str):
            trace_artifact("te_passes_" + slug(artifact), lambda: text)
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
            note_write_error(self.root, what, e)  # te-passes dump then fails instead of committing

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
        pdir = os.path.join(self._stage_dir(ctx), f"{self._pass_index[key]:02d}_{slug(tepass.name)}")
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
            run.dump_changes = {k: len(v) for k, v in changes.items()}
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
        gdir = slug(report.graph_id)
        text = json.dumps(data, indent=2, sort_keys=False)
        self._write(os.path.join(gdir, "report.json"), text, f"{report.graph_id}_report")
        self._write(os.path.join(gdir, "te_state.json"), json.dumps(report.te_state, indent=2), None)
        if self.root is not None:
            # A session folder (backend-only dump) gets this process's session facts; a directory
            # written straight into (te-passes dump, replay --out, run_stages) keeps the session.json
            # its owner wrote.
            # te-passes dump (a claimed directory) emits the final summary artifact itself
            write_summary(self.root, backend_session(self.source) if self.sessions_dir is not None else None,
                          emit=claimed_into(self.root) is None)
            if self.sessions_dir is not None:
                write_sessions_index(self.sessions_dir)
