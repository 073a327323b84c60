"""Graph breaks, TE eager islands (with reasons) and recompiles of a torch.compile run.

See docs/internals.md#te_passesdebuggraph_breakspy."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from te_passes.compat.untouched.gate import island_records
from te_passes.compat.te220.fallbacks import classify_graph_break, fallback_reason_from_warning


def _short_reason(reason: str) -> str:
    """The first line plus Dynamo's ``Explanation:`` line of a graph-break text."""
    lines = [ln.strip() for ln in reason.splitlines() if ln.strip()]
    head = lines[0] if lines else reason
    expl = next((ln[len("Explanation:"):].strip() for ln in lines if ln.startswith("Explanation:")), None)
    return f"{head}: {expl}" if expl else head


_LIBRARY_DIRS = ("site-packages", "dist-packages", "/torch/", "/transformer_engine/")


def short_path(path: str) -> str:
    """``path`` relative to the working directory when inside it, from the package on for
    installed libraries (``transformer_engine/pytorch/jit.py``), else unchanged."""
    import os

    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path


def _frame(fs: Any) -> str:
    return f"{short_path(fs.filename)}:{fs.lineno} ({fs.name})"


def _location(user_stack: list[Any]) -> str | None:
    """The innermost frame of the user's own code (not torch / TE / site-packages), else the
    innermost frame."""
    if not user_stack:
        return None
    fs = next((f for f in reversed(user_stack) if not any(d in f.filename for d in _LIBRARY_DIRS)),
              user_stack[-1])
    return _frame(fs)


def graph_break_entry(reason: str, user_stack: list[Any]) -> dict[str, Any]:
    """One ``graph_breaks[]`` entry: ``reason`` (short), ``location`` (innermost user frame),
    ``user_stack`` (``file:line (func)`` strings, outermost first), ``te`` (``{"module",
    "kind", "reason"}`` when the break is a TE eager island, else ``None``), ``full_reason``."""
    inner = (user_stack[-1].filename, user_stack[-1].name) if user_stack else None
    te = classify_graph_break(reason, inner)
    return {
        "reason": _short_reason(reason),
        "location": _location(user_stack),
        "user_stack": [_frame(fs) for fs in user_stack],
        "te": dataclasses.asdict(te) if te else None,
        "full_reason": reason,
    }


def _island_reason(module: str) -> str | None:
    """The untouched-model polyfills' island records for TE ``module`` (reason and fix), joined."""
    texts = [str(i) for i in island_records() if i.te_module == module]
    return "; ".join(texts) if texts else None


def _metrics_entry(m: Any) -> dict[str, Any]:
    return {"compile_id": m.compile_id, "function": m.co_name,
            "location": f"{short_path(m.co_filename)}:{m.co_firstlineno}" if m.co_filename else None,
            "graph_op_count": m.graph_op_count, "num_graph_breaks": m.num_graph_breaks,
            "recompile_reason": m.recompile_reason, "fail_reason": m.fail_reason}


class CompileEvents:
    """Context manager recording what torch.compile did inside it."""

    def __init__(self, *, record_warnings: bool = True, reemit_warnings: bool = True,
                 ignore_warnings: tuple[str, ...] = ()) -> None:
        self.record_warnings = record_warnings
        self.reemit_warnings = reemit_warnings
        self.ignore_warnings = tuple(ignore_warnings)
        self.warnings: list[dict[str, str]] = []
        self.graph_breaks: list[dict[str, Any]] = []
        self.eager_fallbacks: list[dict[str, Any]] = []
        self.recompiles: list[dict[str, Any]] = []
        self.frames: list[dict[str, Any]] = []
        self.te_warnings: list[str] = []
        self._warn_ctx = None
        self._caught: list[warnings.WarningMessage] | None = None

    def __enter__(self) -> "CompileEvents":
        from torch._dynamo import utils as du

        self._n_breaks = len(du.graph_break_reasons)
        self._seen_metrics = {id(m) for m in du.get_compilation_metrics()}
        if self.record_warnings:
            self._warn_ctx = warnings.catch_warnings(record=True)
            self._caught = self._warn_ctx.__enter__()
            warnings.simplefilter("always")
        return self

    def __exit__(self, *exc: Any) -> None:
        from torch._dynamo import utils as du

        if self._warn_ctx is not None:
            self._warn_ctx.__exit__(None, None, None)
            seen: set[tuple[str, str]] = set()
            for w in self._caught or ():
                msg = str(w.message)
                if self.ignore_warnings and msg.startswith(self.ignore_warnings):
                    continue
                reason = fallback_reason_from_warning(msg)
                if reason is not None and reason not in self.te_warnings:
                    self.te_warnings.append(reason)
                key = (w.category.__name__, msg)
                if key not in seen:
                    seen.add(key)
                    self.warnings.append({"category": w.category.__name__, "message": msg.strip().splitlines()[0]
                                          if msg.strip() else "", "location": f"{w.filename}:{w.lineno}"})
                if self.reemit_warnings:
                    warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        breaks = du.graph_break_reasons[self._n_breaks:]
        metrics = [m for m in du.get_compilation_metrics() if id(m) not in self._seen_metrics]
        self._fill(breaks, metrics)

    def _fill(self, breaks: list[Any], metrics: list[Any]) -> None:
        merged: dict[tuple[str, str | None], dict[str, Any]] = {}
        for b in breaks:
            e = graph_break_entry(b.reason, list(b.user_stack))
            key = (e["full_reason"], e["location"])
            if key in merged:
                merged[key]["count"] += 1
            else:
                e["count"] = 1
                merged[key] = e
        self.graph_breaks = list(merged.values())
        fallbacks: dict[tuple[str, str, str | None], dict[str, Any]] = {}
        for e in self.graph_breaks:
            te = e["te"]
            if te is None:
                continue
            reason = te["reason"]
            if te["kind"] == "conditional" and self.te_warnings:
                reason = "; ".join(self.te_warnings)
            if te["kind"] == "untouched_island":
                reason = _island_reason(te["module"]) or reason
            key = (te["module"], reason, None)  # one island per module and reason, all its breaks
            if key in fallbacks:
                fallbacks[key]["count"] += e["count"]
                if e["location"] not in fallbacks[key]["locations"]:
                    fallbacks[key]["locations"].append(e["location"])
            else:
                fallbacks[key] = {"module": te["module"], "kind": te["kind"], "reason": reason,
                                  "location": e["location"], "locations": [e["location"]], "count": e["count"]}
        # the eager body of a configuration fallback belongs to that fallback's island
        for key in [k for k, f in fallbacks.items() if f["kind"] == "eager_body"]:
            body = fallbacks[key]
            owner = next((f for f in fallbacks.values() if f["module"] == body["module"]
                          and f["kind"] in ("linear_config", "conditional")), None)
            if owner is not None:
                owner["count"] += body["count"]
                owner["locations"] += [loc for loc in body["locations"] if loc not in owner["locations"]]
                del fallbacks[key]
        known = {f["reason"] for f in fallbacks.values()}
        for w in self.te_warnings:  # warnings whose break Dynamo did not record separately
            if not any(w in k for k in known):
                fallbacks[("te", w, None)] = {"module": "te", "kind": "warning", "reason": w,
                                              "location": None, "locations": [], "count": 1}
        self.eager_fallbacks = list(fallbacks.values())
        self.frames = [_metrics_entry(m) for m in metrics]
        self.recompiles = [{"compile_id": f["compile_id"], "function": f["function"],
                            "location": f["location"], "reason": f["recompile_reason"]}
                           for f in self.frames if f["recompile_reason"]]

    def to_json(self) -> dict[str, Any]:
        """``{"graph_breaks", "eager_fallbacks", "recompiles", "frames"}`` (JSON-ready)."""
        return {"graph_breaks": self.graph_breaks, "eager_fallbacks": self.eager_fallbacks,
                "recompiles": self.recompiles, "frames": self.frames, "warnings": self.warnings}


def current_events() -> CompileEvents:
    """Everything the process's Dynamo has recorded so far (no warnings), as a filled
    :class:`CompileEvents`."""
    from torch._dynamo import utils as du

    ev = CompileEvents(record_warnings=False)
    ev._fill(list(du.graph_break_reasons), list(du.get_compilation_metrics()))
    return ev


def no_islands_text(s: dict[str, Any]) -> str:
    """The 'TE eager islands' line when there are none: whether the compiled graphs held any TE op."""
    te_ops = [g.get("te_ops") for g in s.get("graphs", [])]
    if te_ops and all(n == 0 for n in te_ops):
        return "none (no TE modules in the compiled graphs)"
    return "none (every TE module ran in the compiled graph)"
