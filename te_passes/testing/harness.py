"""The shared pass-test harness: run a pass (or the configured pipeline) on a real FX graph
through the path the backend takes, with before/after snapshots and op counts.

See docs/internals.md#te_passestestingharnesspy."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Sequence

import torch.fx

from te_passes.config import TePassesOptions
from te_passes.pipeline.base import PassContext, Stage, TEPass
from te_passes.pipeline.compilation import Compilation
from te_passes.passes.order import configured_passes
from te_passes.pipeline.manager import PassManager, PassObserver
from te_passes.report import CompileReport, StageReport
from te_passes.compat.install import install as install_runtime
from te_passes.te.state import TEState

__all__ = ["HarnessRun", "count_ops", "diff", "op_name", "pass_context", "run_passes"]


def op_name(target: Any) -> str:
    """A stable name for a ``call_function`` target: ``str(OpOverload)`` (``"aten.mm.default"``,
    ``"transformer_engine_compile.linear.default"``) for ATen/custom ops, else the callable's
    qualified name as FX prints it (``torch.fx.node._get_qualified_name``, torch 2.14:
    ``"_operator.add"``, ``"torch.relu"``)."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    try:
        return torch.fx.node._get_qualified_name(target)
    except Exception:  # noqa: BLE001 - a callable FX cannot name (a lambda, a bound method)
        return getattr(target, "__qualname__", None) or repr(target)


def count_ops(gm: torch.fx.GraphModule | torch.fx.Graph) -> collections.Counter:
    """``Counter`` of :func:`op_name` of every ``call_function`` node of ``gm`` (a module or graph)."""
    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    return collections.Counter(op_name(n.target) for n in graph.nodes if n.op == "call_function")


def diff(before: collections.Counter | dict, after: collections.Counter | dict) -> dict[str, int]:
    """``{op name: count after - count before}`` for every op whose count changed (sorted by name;
    negative: removed)."""
    keys = sorted(set(before) | set(after))
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys if after.get(k, 0) != before.get(k, 0)}


def _options(fn: str, options: TePassesOptions | None, opts: dict[str, Any]) -> TePassesOptions:
    if options is not None and opts:
        raise TypeError(f"{fn}: give options= or option keywords ({sorted(opts)}), not both")
    return TePassesOptions(**opts) if options is None else options


def pass_context(stage: Stage | str = Stage.DYNAMO, *, te_state: TEState | None = None,
                 example_inputs: Any = None, graph_id: str = "g0", options: TePassesOptions | None = None,
                 inputs: dict | None = None, **opts: Any) -> PassContext:
    """The context ``stage``'s passes (a :class:`Stage` or its value) get in a compilation named
    ``graph_id`` (:meth:`Compilation.context`: ``graph_id`` + ``".joint"``/``".fwd"``/``".bwd"``).
    ``te_state`` defaults to ``TEState()`` (no TE state); ``options`` to ``TePassesOptions(**opts)``
    (e.g. ``strict=True, disable=("x",)``); ``inputs``: :attr:`PassContext.inputs`.

    Raises:
        TypeError: both ``options`` and option keywords given, or an unknown option keyword.
    """
    comp = Compilation(PassManager([]), _options("pass_context", options, opts), TEState() if te_state is None else te_state,
                       CompileReport(graph_id=graph_id), live=False)
    return comp.context(stage, example_inputs, inputs)


@dataclasses.dataclass
class HarnessRun:
    """What :func:`run_passes` saw: the graph code (``gm.code``) and :func:`count_ops` before and
    after, the :class:`~te_passes.report.StageReport`, the typed facts the passes returned, and
    the :class:`PassContext` the stage's passes got (``ctx.analyses`` as the stage left it)."""

    before_code: str
    after_code: str
    before_ops: collections.Counter
    after_ops: collections.Counter
    report: StageReport
    facts: list[Any]
    ctx: PassContext | None = None

    @property
    def changed(self) -> bool:
        """Whether any pass reported a change."""
        return any(r.changed for r in self.report.runs)

    def diff(self) -> dict[str, int]:
        """:func:`diff` of the op counts before and after."""
        return diff(self.before_ops, self.after_ops)

    def records(self, kind: str | None = None) -> list[Any]:
        """Every pass's records (``kind``: only those of that kind)."""
        out = [rec for r in self.report.runs for rec in r.records]
        return out if kind is None else [rec for rec in out if rec.kind == kind]


def run_passes(gm: torch.fx.GraphModule, passes: TEPass | Sequence[TEPass] | None = None,
               stage: Stage | str = Stage.DYNAMO, *, example_inputs: Any = None, te_state: TEState | None = None,
               options: TePassesOptions | None = None, graph_id: str = "g0", inputs: dict | None = None,
               observers: Sequence[Any] = (), install: bool = True, **opts: Any) -> HarnessRun:
    """Run ``passes`` (one pass, a list, or ``None``: the configured pipeline,
    :func:`te_passes.passes.order.configured_passes` of ``options.pass_config``) for ``stage`` on ``gm`` in
    place, through :class:`PassManager` and :meth:`Compilation.run_stage` as the backend does.

    Raises:
        TypeError: as :func:`pass_context`.
        te_passes.pipeline.manager.TePassError: a pass failed under ``strict``.
    """
    options = _options("run_passes", options, opts)
    if passes is None:
        passes = configured_passes(options.pass_config)
    elif isinstance(passes, TEPass):
        passes = [passes]
    if install:
        install_runtime()
    seen: list[PassContext] = []
    comp = Compilation(PassManager(list(passes), observers=[*observers, _ContextSpy(seen)]), options,
                       TEState() if te_state is None else te_state, CompileReport(graph_id=graph_id), live=False)
    before_code, before_ops = gm.code, count_ops(gm)
    report = comp.run_stage(gm, stage, example_inputs, inputs)
    return HarnessRun(before_code, gm.code, before_ops, count_ops(gm), report, comp.facts(),
                      seen[-1] if seen else None)


class _ContextSpy(PassObserver):
    """An observer that keeps the stage's :class:`PassContext` (``after_stage`` hook)."""

    def __init__(self, out: list[PassContext]) -> None:
        self.out = out

    def after_stage(self, gm: torch.fx.GraphModule, ctx: PassContext, report: StageReport) -> None:
        self.out.append(ctx)
