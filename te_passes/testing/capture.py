"""Real Transformer Engine graphs without a GPU: the test utility behind every pass's tests.

See docs/internals.md#te_passestestingcapturepy and docs/testing-real-graphs.md."""

from __future__ import annotations

import functools
from typing import Any, Iterable, Sequence

import torch
import torch.fx

from te_passes.config import TePassesOptions
from te_passes.pipeline.base import Stage
from te_passes.passes.order import configured_passes
from te_passes.pipeline.compilation import Compilation
from te_passes.pipeline.manager import PassManager
from te_passes.report import CompileReport
from te_passes.te.state import TEState
from te_passes.compat.api import capture_te_state
from te_passes.te.version import is_supported, te_version
from te_passes.testing.aot_capture import capture_aot
from te_passes.testing.captured import CapturedAOT, CapturedGraph
from te_passes.testing.dynamo_capture import capture_dynamo
from te_passes.testing.fake_gpu import CaptureError, capture_lock, fake_gpu, quiet
from te_passes.testing.gpu import te_compile_skip_reason


def capture_skip_reason() -> str | None:
    """Why real TE graphs cannot be captured in this process (for ``pytest.skip``), or ``None``."""
    reason = te_compile_skip_reason()
    if reason is None and not is_supported():
        return f"TE {te_version()} is not a version te_passes decodes"
    return reason


def _captured(kind: str, args: dict[str, Any]) -> Any:
    """A fresh copy of the ``kind`` capture of ``args``, memoised per process (:func:`_memo`); unhashable
    arguments (e.g. a process group) are captured anew."""
    key = tuple(sorted(args.items()))
    try:
        hash(key)
    except TypeError:
        return _memo.__wrapped__(kind, "", "", key)
    with capture_lock:
        return _memo(kind, te_version(), torch.__version__, key).copy()


@functools.cache
def _memo(kind: str, _te: str, _torch: str, key: tuple) -> Any:
    args = dict(key)
    if kind == "dynamo":
        return capture_dynamo(**args)
    partitioner = args.pop("partitioner")
    return capture_aot(partitioner=partitioner, dynamo=cached_dynamo(**args))


def cached_dynamo(precision: str = "fp8-cs", layers: int = 1, **kwargs: Any) -> CapturedGraph:
    """:func:`capture_dynamo` memoised per process on its arguments; returns a fresh
    :meth:`~CapturedGraph.copy` each call, so callers may rewrite it. Unhashable arguments
    (e.g. a process group) bypass the cache."""
    return _captured("dynamo", dict(kwargs, precision=precision, layers=layers))


def cached_aot(precision: str = "fp8-cs", layers: int = 1, **kwargs: Any) -> CapturedAOT:
    """:func:`capture_aot` memoised per process (it reuses :func:`cached_dynamo`'s capture);
    returns a fresh :meth:`~CapturedAOT.copy` each call."""
    return _captured("aot", {"partitioner": "min_cut", **kwargs, "precision": precision, "layers": layers})


# --------------------------------------------------------------------------- pipeline
def run_pipeline(captured: CapturedGraph | CapturedAOT, stages: Iterable[Any] | None = None, *,
                 passes: Sequence[Any] | None = None, options: Any = None, te_state: Any = None,
                 relower: bool = False, copy: bool = True, graph_id: str = "g0") -> list[Any]:
    """Run te_passes' pass pipeline on captured graphs, stage by stage, as the backend does
    (docs/internals.md#run_pipeline).

    Args:
        captured: what :func:`capture_dynamo` / :func:`capture_aot` returned.
        stages: the :class:`~te_passes.pipeline.base.Stage`\\ s (or values) whose passes run;
            default all.
        passes: pass instances (default ``configured_passes()``; ``[]``: reports with no runs).
        options: ``TePassesOptions`` (default ``TePassesOptions()``).
        te_state: ``TEState`` (default ``capture_te_state()``).
        relower: (``CapturedAOT`` only) re-lower the rewritten Dynamo graph with the later
            stages' passes at Inductor's hooks; unselected stages' graphs are still produced.
        copy: rewrite copies (default) so ``captured`` stays intact; ``False`` rewrites
            ``captured``'s graphs in place (without ``relower`` only).
        graph_id: the id stage reports carry (``"g0"`` -> ``"g0.joint"``, ``"g0.fwd"``, ``"g0.bwd"``).

    Returns:
        ``list[StageReport]`` in stage order; each report's ``gm`` is the graph the passes ran on.

    Raises:
        TypeError: ``captured`` is neither a ``CapturedGraph`` nor a ``CapturedAOT``.
        te_passes.pipeline.manager.TePassError: a pass failed under ``options.strict``.
    """
    if not isinstance(captured, (CapturedGraph, CapturedAOT)):
        raise TypeError(f"run_pipeline takes a CapturedGraph or CapturedAOT, not {type(captured).__name__}")
    options = TePassesOptions() if options is None else options
    te_state = capture_te_state() if te_state is None else te_state
    # The backend's driver, on an unregistered report (not in te_passes.report.compile_reports()).
    compilation = Compilation(PassManager(configured_passes() if passes is None else passes), options, te_state,
                              CompileReport(graph_id=graph_id), live=False)
    wanted = None if stages is None else {Stage(s) for s in stages}
    reports: list[Any] = []

    def run(stage: Stage, gm: torch.fx.GraphModule, inputs: list[Any]) -> None:
        if wanted is not None and stage not in wanted:
            return
        report = compilation.run_stage(gm, stage, inputs)
        report.gm = gm  # type: ignore[attr-defined]
        reports.append(report)

    if isinstance(captured, CapturedAOT) and relower:
        dyn = captured.dynamo.copy()
        with quiet(), fake_gpu(dyn.precision):
            run(Stage.DYNAMO, dyn.gm, dyn.example_inputs)
        capture_aot(dynamo=dyn, partitioner=captured.partitioner,
                    stage_hook=lambda stage, gm, inputs: run(Stage(stage), gm, inputs))
        return reports

    if copy:
        captured = captured.copy()
    with quiet(), fake_gpu(captured.precision):
        for job in captured.stage_jobs():
            run(*job)
    return reports


__all__ = [
    "CaptureError", "CapturedGraph", "CapturedAOT", "capture_dynamo", "capture_aot", "run_pipeline", "cached_dynamo",
    "cached_aot", "capture_skip_reason",
]
