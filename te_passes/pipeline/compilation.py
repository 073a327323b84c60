"""The one pipeline driver: :class:`Compilation` takes one Dynamo graph from the backend to Inductor
(also offline replay and the CPU capture); the stage map, the pipeline uuid (part of Inductor's
FX-graph-cache key) and ``mode``/options parsed once (:class:`CompileSettings`). docs/design.md
"Stages and the driver".
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import time
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass

from te_passes._logging import get_logger
from te_passes.config import TePassesOptionError, TePassesOptions
from te_passes.pipeline import base
from te_passes.pipeline.base import PassContext, Stage, TEPass
from te_passes.pipeline.manager import PassManager
from te_passes.report import CompileReport, StageReport, cache_hit_note, new_compile_report
from te_passes.cudagraphs.engine import CudagraphRecorder
from te_passes.cudagraphs.policy import LeanCUDAGraphPolicy
from te_passes.compat.api import (RecipeStateError, dynamo_stage_inputs, raise_ub_mismatches, te_state_guard,
                                   wrap_compiled)
from te_passes.pipeline.facts import AutocastState, CudagraphHazard, UbStateReads, required_pass_refusal, single_fact
from te_passes.te.state import TEState
from te_passes.te.ub import UbConfigError, UbSnapshot

log = get_logger()

#: Stage order of a compilation.
STAGE_ORDER: tuple[Stage, ...] = (Stage.DYNAMO, Stage.JOINT, Stage.POST_GRAD_FWD, Stage.POST_GRAD_BWD)


def stage_graph_id(graph_id: str, stage: Stage | str) -> str:
    """``"g0"``, ``"g0.joint"``, ``"g0.fwd"``, ``"g0.bwd"`` for ``"g0"``. Raises ``ValueError``: not a stage."""
    stage = Stage(stage)
    return graph_id if stage is Stage.DYNAMO else f"{graph_id}.{stage.value.removeprefix('post_grad_')}"


def is_backward_graph(graph: torch.fx.Graph | torch.fx.GraphModule) -> bool:
    """Whether a partitioned post-grad graph has ``tangents_*`` placeholders (AOTAutograd's naming)."""
    graph = graph.graph if isinstance(graph, torch.fx.GraphModule) else graph
    return any(str(n.target).startswith("tangents") for n in graph.find_nodes(op="placeholder"))


def post_grad_stage(graph: torch.fx.Graph | torch.fx.GraphModule) -> Stage:
    """``POST_GRAD_BWD`` for a backward graph (:func:`is_backward_graph`), else ``POST_GRAD_FWD``."""
    return Stage.POST_GRAD_BWD if is_backward_graph(graph) else Stage.POST_GRAD_FWD


def pipeline_uuid(passes: Sequence[TEPass], options: TePassesOptions, te_state: TEState,
                  ub_reads: Sequence[str] | None = None) -> dict[str, Any]:
    """The pipeline's cache identity (passes' ``uuid()``, package source, options, TE state; the UB
    snapshot unless ``ub_reads``, the :class:`UbStateReads` fact's reasons or ``None`` for unknown, is empty) and its
    sha256 under ``"uuid"``; ``"ub_reads"`` is not hashed."""
    reads_ub = ub_reads is None or bool(ub_reads)
    parts: dict[str, Any] = {"package": base.package_source_hash(base.PACKAGE_ROOT),
                             "passes": {p.name: p.uuid() for p in passes},
                             "options": options.fingerprint_data(),
                             "te_state": te_state.fingerprint(include_ub=reads_ub), "reads_ub": reads_ub}
    parts["uuid"] = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    parts["ub_reads"] = list(ub_reads) if ub_reads is not None else None
    return parts


def inductor_config_patches(mode: str | None, inductor_options: dict[str, Any]) -> dict[str, Any]:
    """Inductor config patches from ``mode`` and ``options`` as ``torch.compile`` maps them
    (``torch._TorchCompileInductorWrapper``). Raises ``RuntimeError``: Inductor's messages."""
    return dict(torch._TorchCompileInductorWrapper(mode, inductor_options, dynamic=None).config)


def _inductor_value(patches: dict[str, Any], key: str) -> Any:
    from torch._inductor import config as inductor_config

    return patches[key] if key in patches else functools.reduce(getattr, key.split("."), inductor_config)


_NON_TREE_CUDAGRAPHS = (
    "te_inductor refuses triton.cudagraphs=True (an option or the mode) with triton.cudagraph_trees=False: non-tree "
    "CUDA graphs return the same output tensors on every call, overwriting outputs a caller still holds (TE's saved "
    "quantized tensors), and TE fp8 backward crashes inside TE GEMM (getGemmOutputShape: Invalid matrix dimensions). "
    "Use mode=\"reduce-overhead\" (CUDA graph trees) and leave triton.cudagraph_trees at its default (True)")


@dataclasses.dataclass(frozen=True)
class CompileSettings:
    """``torch.compile``'s ``mode`` and ``options`` parsed once: :class:`TePassesOptions`, the Inductor
    config patches and the loaded ``te_passes.ub_snapshot``."""

    mode: str | None
    options: TePassesOptions
    config_patches: dict[str, Any]
    ub_snapshot: UbSnapshot | None = None

    @classmethod
    def parse(cls, mode: str | None, options: dict[str, Any] | None, known_passes: set[str]) -> "CompileSettings":
        """Raises ``TePassesOptionError``: a bad ``te_passes.*`` key/value, pass name or ``ub_snapshot``,
        or non-tree cudagraphs; ``RuntimeError``: unknown mode or Inductor option (Inductor's message)."""
        opts, inductor_options = TePassesOptions.parse(options, known_passes=known_passes)
        where = "te_passes.disable / TE_PASSES_DISABLE" if "disable" in opts.from_env else "te_passes.disable"
        refused = required_pass_refusal(opts.disable, where)
        if refused is not None:
            raise TePassesOptionError(refused)
        patches = inductor_config_patches(mode, inductor_options)
        if _inductor_value(patches, "triton.cudagraphs") and not _inductor_value(patches, "triton.cudagraph_trees"):
            raise TePassesOptionError(_NON_TREE_CUDAGRAPHS)
        snap = None
        if opts.ub_snapshot is not None:
            try:
                snap = UbSnapshot.load(opts.ub_snapshot)
            except (TypeError, UbConfigError) as e:
                raise TePassesOptionError(f"option te_passes.ub_snapshot: {e}") from None
        return cls(mode, opts, patches, snap)


def _cache_hits() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {"AOTAutograd cache": counters["aot_autograd"]["autograd_cache_hit"],
            "FX graph cache": counters["inductor"]["fxgraph_cache_hit"]}


class InductorStageHook(CustomInferenceAwareGraphPass):
    """A :class:`Compilation`'s ``joint_custom_pre_pass`` / ``post_grad_custom_pre_pass`` (``uuid``: the pipeline's)."""

    def __init__(self, compilation: "Compilation", joint: bool) -> None:
        self.compilation, self.joint = compilation, joint

    def __call__(self, graph: torch.fx.Graph, is_inference: bool = False) -> None:
        gm = graph.owning_module
        if gm is None:  # pragma: no cover - Inductor always passes an owned graph
            log.warning("te_passes: post-grad graph without owning module; passes skipped")
            return
        self.compilation.run_stage(gm, Stage.JOINT if self.joint else post_grad_stage(graph))

    def uuid(self) -> str:
        return self.compilation.report.uuid["uuid"]


class Compilation:
    """One compilation (one Dynamo graph): ``manager``, ``options`` (or the backend's
    :class:`CompileSettings`), ``te_state``, ``report`` (default: a new registered one), ``graph_id``,
    ``recompile`` (``(gm, args) -> compiled``, for the UB guard) and ``live`` (``False``: offline, no
    runtime facts in, no UB mismatch raised, no guard). Backend: :meth:`begin`, :meth:`inductor_hooks`,
    ``compile_fx``, :meth:`finish`."""

    def __init__(self, manager: PassManager, options: TePassesOptions | CompileSettings, te_state: TEState,
                 report: CompileReport | None = None, *, graph_id: str | None = None,
                 recompile: Callable | None = None, live: bool = True) -> None:
        self.settings = options if isinstance(options, CompileSettings) else CompileSettings(None, options, {})
        self.manager, self.options, self.te_state = manager, self.settings.options, te_state
        self.report = new_compile_report(self.settings.mode) if report is None else report
        if graph_id is not None:
            self.report.graph_id = graph_id
        self.graph_id = self.report.graph_id
        self.report.te_state = te_state.to_json()
        self.recompile, self.live = recompile, live
        self._t0 = time.perf_counter()
        self._checked_stages = 0  # stage reports whose UB mismatches were raised on
        self._hits_before: dict[str, int] = {}
        #: The Dynamo stage's :class:`AutocastState` fact (:meth:`begin`); :meth:`finish` sets its state.
        self.autocast: AutocastState | None = None

    def context(self, stage: Stage | str, example_inputs: Any = None, inputs: dict | None = None) -> PassContext:
        """The :class:`PassContext` the passes of ``stage`` get."""
        stage = Stage(stage)
        return PassContext(stage, self.options, self.te_state, example_inputs,
                           stage_graph_id(self.graph_id, stage), inputs={} if inputs is None else inputs)

    def run_stage(self, gm: torch.fx.GraphModule, stage: Stage | str, example_inputs: Any = None,
                  inputs: dict | None = None) -> StageReport:
        """Run ``stage``'s passes on ``gm`` in place; returns the (appended) stage report. Raises
        ``TePassError``: a pass failed under ``strict``."""
        t0 = time.perf_counter()
        try:
            return self.manager.run(gm, self.context(stage, example_inputs, inputs), into=self.report)
        finally:
            self.report.time_ms_passes += (time.perf_counter() - t0) * 1e3

    def begin(self, gm: torch.fx.GraphModule | None, example_inputs: Any = None) -> None:
        """The Dynamo stage on ``gm`` (``None``: none, offline), its analyses' facts read, then the pipeline uuid,
        once: :class:`AutocastState` (kept for :meth:`finish`), :class:`CudagraphHazard` (``triton.cudagraphs``
        off, with a ``RuntimeWarning``), :class:`UbStateReads` (the uuid's ``ub_reads``; ``None`` without it).

        Raises (live):
            RecipeStateError: the :class:`AutocastState` refusal, or no such fact (its analysis failed or is
                not in the pass list).
            TePassesOptionError: ``te_passes.disable`` names ``find_autocast_state``.
            UbConfigError: ``UbMismatch`` facts.
            TePassError: a pass failed under ``strict``."""
        reads = None
        if gm is not None:
            inputs = dynamo_stage_inputs() if self.live else {}
            stage = self.run_stage(gm, Stage.DYNAMO, example_inputs, inputs)
            facts = [f for r in stage.runs for f in r.facts]
            self.autocast = single_fact(facts, AutocastState)
            if self.live:
                self._check_autocast(stage)
            self._without_cudagraphs_if(single_fact(facts, CudagraphHazard))
            ub_reads = single_fact(facts, UbStateReads)
            reads = None if ub_reads is None else list(ub_reads.reasons)
        self.report.uuid = pipeline_uuid(self.manager.passes, self.options, self.te_state, ub_reads=reads)
        if self.live:
            raise_ub_mismatches(self.report)
        self._checked_stages = len(self.report.stages)

    def _check_autocast(self, stage: StageReport) -> None:
        """Raise the :class:`AutocastState` refusal, or why there is no such fact (see :meth:`begin`)."""
        if self.autocast is not None:
            if self.autocast.refusal is not None:
                raise RecipeStateError(self.autocast.refusal)
            return
        name = AutocastState.producer
        run = next((r for r in stage.runs if r.name == name), None)
        if run is not None and run.status == "disabled":
            raise TePassesOptionError(required_pass_refusal([name], "te_passes.disable"))
        why = "is not in the pass list" if run is None else f"{run.status}: {run.error or run.records}"
        raise RecipeStateError(f"te_passes: graph {self.graph_id}: analysis {name} {why}; without the te.autocast "
                               "state TE's impls read while they run, te_inductor refuses the graph")

    def _without_cudagraphs_if(self, hazard: CudagraphHazard | None) -> None:
        """``triton.cudagraphs`` off in :attr:`settings`, with a ``RuntimeWarning`` naming ``hazard``, when it is on."""
        if hazard is None or not self.settings.config_patches.get("triton.cudagraphs"):
            return
        warnings.warn(f"te_passes: mode='reduce-overhead': {hazard.reason}", RuntimeWarning, stacklevel=4)
        self.settings = dataclasses.replace(self.settings, config_patches={**self.settings.config_patches,
                                                                          "triton.cudagraphs": False})

    def inductor_hooks(self) -> dict[str, Any]:
        """The Inductor config patches plus our two :class:`InductorStageHook`\\ s (after a user's own)
        and the lean cudagraph policy (:meth:`cudagraph_policy`)."""
        patches = dict(self.settings.config_patches)
        for joint, key in ((True, "joint_custom_pre_pass"), (False, "post_grad_custom_pre_pass")):
            ours, user = InductorStageHook(self, joint), patches.get(key)
            patches[key] = ours if user is None else [*(user if isinstance(user, (list, tuple)) else [user]), ours]
        policy = self.cudagraph_policy(patches)
        if policy is not None:
            patches["cudagraph_policy"] = policy
        self._hits_before = _cache_hits()
        return patches

    def cudagraph_policy(self, patches: dict[str, Any]) -> LeanCUDAGraphPolicy | None:
        """The lean CUDA-graph policy under ``te_passes.cudagraphs="lean"`` with cudagraph trees on and no
        user ``cudagraph_policy``, else ``None``; reading initialised UB state is a static hazard."""
        on = [_inductor_value(patches, k) for k in ("triton.cudagraphs", "triton.cudagraph_trees")]
        if self.options.cudagraphs != "lean" or not all(on) or _inductor_value(patches, "cudagraph_policy") is not None:
            return None
        hazards, ub_reads = [], self.report.uuid.get("ub_reads", [])
        if self.te_state.ub is not None and getattr(self.te_state.ub, "initialized", False) and ub_reads != []:
            reads = ("; ".join(map(str, ub_reads))[:200] if ub_reads is not None
                     else f"unknown: no {UbStateReads.producer} fact")
            hazards.append(f"graph reads Userbuffers state with UB initialised ({reads}): "
                           "UB communicators captured into a CUDA graph are left to cudagraph trees")
        refresh = self._notify_finish if self.manager.observers else None
        return LeanCUDAGraphPolicy(graph_id=self.graph_id, recorder=CudagraphRecorder(self.report.cudagraphs, refresh),
                                   static_hazards=hazards)

    def _notify_finish(self) -> None:
        for obs in self.manager.observers:
            obs.finish(self.report)

    def finish(self, compiled: Callable | None = None) -> Callable | None:
        """After ``compile_fx``: note a cache hit that skipped the AOT stages, tell the observers and (live)
        return ``compiled`` in its one wrapper (``compat.api.wrap_compiled``: the :class:`AutocastState` state
        set around the call, the UB guard of ``compat.api.te_state_guard``), or ``compiled`` itself when it
        needs neither. Raises ``UbConfigError``: AOT-stage mismatches."""
        if self.live and not {s.stage for s in self.report.stages} & {Stage.JOINT.value, Stage.POST_GRAD_FWD.value}:
            hit = [k for k, n in _cache_hits().items() if n > self._hits_before.get(k, 0)]
            if hit:
                self.report.cache_hit = " and ".join(hit)
                log.info("te_passes: %s: %s", self.graph_id, cache_hit_note(self.report.cache_hit))
        self.report.time_ms_total = (time.perf_counter() - self._t0) * 1e3
        self._notify_finish()
        if not self.live or compiled is None:
            return compiled
        guard = te_state_guard(compiled, self.report, self.te_state, self.options, recompile=self.recompile,
                               cudagraphs=bool(self.settings.config_patches.get("triton.cudagraphs")),
                               checked_stages=self._checked_stages)
        return wrap_compiled(compiled, guard=guard, autocast=self.autocast.state if self.autocast else None)

    def facts(self, kind: type | None = None) -> list[Any]:
        """The typed facts of every stage run so far, only ``kind``'s when given."""
        return self.report.typed_facts(kind)
