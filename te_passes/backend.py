"""The ``te_inductor`` torch.compile backend: TE-aware passes, then Inductor.

Registered as the ``torch_dynamo_backends`` entry point ``te_inductor`` (pyproject.toml), so
``torch.compile(model, backend="te_inductor", mode=...)`` or ``..., options=...)`` works with no
import (torch.compile refuses both at once; ``functools.partial(te_inductor, mode=..., options=...)``
takes both, see docs/usage.md).

Pipeline for one Dynamo graph::

    Dynamo graph ── passes[stage=dynamo] ──► compile_fx(config_patches=...)
                                               ├─ joint graph ── passes[stage=joint]
                                               │    (Inductor joint_custom_pre_pass)
                                               ├─ post-grad fwd ── passes[stage=post_grad_fwd]
                                               └─ post-grad bwd ── passes[stage=post_grad_bwd]
                                                    (Inductor post_grad_custom_pre_pass)

Mirrors ``torch._TorchCompileInductorWrapper`` (torch 2.14): ``mode`` maps to Inductor config
through ``torch._inductor.list_mode_options``; non-``te_passes.*`` options are Inductor config
keys, validated the same way; everything is applied as ``compile_fx(config_patches=...)``, so
the process-global Inductor config is never mutated.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass

from te_passes._logging import get_logger
from te_passes.config import TePassesOptionError, TePassesOptions
from te_passes.debug.dump import DumpWriter, tracing_enabled
from te_passes.debug.dump_files import DumpDirError
from te_passes.pipeline.base import Stage
from te_passes.pipeline.compilation import Compilation, pipeline_uuid, post_grad_stage
from te_passes.pipeline.compilation import inductor_config_patches as _inductor_config_patches
from te_passes.pipeline.manager import PassManager, TePassError
from te_passes.pipeline.registry import PASS_ALIASES, configured_passes, pass_names
from te_passes.report import CompileReport, cache_hit_note, new_compile_report
from te_passes.runtime.cudagraph_engine import CudagraphRecorder
from te_passes.runtime.cudagraph_policy import LeanCUDAGraphPolicy
from te_passes.runtime.install import install as _install_runtime
from te_passes.runtime.recipe_state import RecipeStateError, autocast_for_graph, run_under
from te_passes.runtime.ub_guard import dynamo_stage_inputs
from te_passes.runtime.ub_graph_guard import (raise_ub_mismatches, ub_dependence_of, ub_state_reads,
                                              wrap_with_te_state_guard)
from te_passes.te.capture_state import te_capture_state
from te_passes.te.state import TEState
from te_passes.te.ub import UbConfigError, UbSnapshot

log = get_logger()


class _StagePass(CustomInferenceAwareGraphPass):
    """Runs the manager's AOT-stage passes inside Inductor (one instance per compilation).

    Installed as ``joint_custom_pre_pass`` (stage ``joint``) and ``post_grad_custom_pre_pass``
    (``post_grad_fwd`` / ``post_grad_bwd`` by :func:`te_passes.pipeline.compilation.post_grad_stage`:
    a post-grad graph with ``tangents_*`` placeholders is a backward graph); the stage runs
    through :meth:`te_passes.pipeline.compilation.Compilation.run_stage`. ``uuid()`` is the pipeline uuid, so Inductor's FX graph cache hits
    only when passes, their config and the TE state they read are unchanged (the UB snapshot
    only for a graph that reads UB state: :func:`pipeline_uuid`).
    """

    def __init__(self, manager: PassManager, options: TePassesOptions, te_state: TEState,
                 report: CompileReport, joint: bool) -> None:
        self.manager, self.options, self.te_state, self.report = manager, options, te_state, report
        self.joint = joint
        self._uuid = report.uuid["uuid"]
        self.compilation = Compilation(manager, options, te_state, report)

    def __call__(self, graph: torch.fx.Graph, is_inference: bool = False) -> None:
        gm = graph.owning_module
        if gm is None:  # pragma: no cover - Inductor always passes an owned graph
            log.warning("te_passes: post-grad graph without owning module; passes skipped")
            return
        self.compilation.run_stage(gm, Stage.JOINT if self.joint else post_grad_stage(graph))

    def uuid(self) -> str:
        return self._uuid


# --------------------------------------------------------------------------- errors users meet
_NON_TREE_CUDAGRAPHS = (
    "te_inductor refuses triton.cudagraphs=True (an option or the mode) with triton.cudagraph_trees=False: "
    "non-tree CUDA graphs (torch._inductor.cudagraph_trees off) return the same output tensors on "
    "every call, overwriting outputs a caller still holds (TE's saved quantized tensors, fp8 outputs "
    "kept for backward), and with TE fp8 modules the backward crashes inside TE GEMM "
    "(getGemmOutputShape: Invalid matrix dimensions). Use mode=\"reduce-overhead\" (CUDA graph trees) "
    "and leave triton.cudagraph_trees at its default (True)")


def _refuse_unsupported(config_patches: dict[str, Any]) -> None:
    """Refuse Inductor configurations te_inductor cannot honour (see :data:`_NON_TREE_CUDAGRAPHS`).

    Raises:
        TePassesOptionError: ``triton.cudagraphs`` on with ``triton.cudagraph_trees`` off.
    """
    from torch._inductor import config as inductor_config

    cudagraphs = config_patches.get("triton.cudagraphs", inductor_config.triton.cudagraphs)
    trees = config_patches.get("triton.cudagraph_trees", inductor_config.triton.cudagraph_trees)
    if cudagraphs and not trees:
        raise TePassesOptionError(_NON_TREE_CUDAGRAPHS)


#: Our documented exception classes -> a subclass that Dynamo re-raises unwrapped (see _unwrapped).
_UNWRAPPED: dict[type, type] = {}


def _unwrapped(e: BaseException) -> BaseException:
    """``e`` as an instance of a subclass of its own class that is also a
    ``torch._dynamo.exc.ShortenTraceback``, which Dynamo re-raises as it is instead of wrapping
    it in ``BackendCompilerFailed`` (torch 2.14 ``_dynamo/output_graph.py``
    ``OutputGraph.call_user_compiler``: ``except (..., ShortenTraceback, ...): raise``). So
    ``except te_passes.TePassesOptionError`` works around a ``torch.compile``d call; the class
    keeps the original's name and module, its message and cause."""
    from torch._dynamo.exc import ShortenTraceback

    if isinstance(e, ShortenTraceback):
        return e
    cls = type(e)
    sub = _UNWRAPPED.get(cls)
    if sub is None:
        def __init__(self, *args: Any) -> None:  # noqa: N807 - ShortenTraceback's frame argument
            Exception.__init__(self, *args)
            self.first_useful_frame = None

        sub = type(cls.__name__, (cls, ShortenTraceback), {"__init__": __init__, "__module__": cls.__module__,
                                                           "__qualname__": cls.__qualname__,
                                                           "__doc__": cls.__doc__})
        _UNWRAPPED[cls] = sub
    new = sub(*e.args)
    new.__cause__ = e.__cause__
    new.__dict__.update({k: v for k, v in vars(e).items() if k != "first_useful_frame"})
    return new


def _documented_errors() -> tuple[type, ...]:
    return (TePassesOptionError, TePassError, UbConfigError, RecipeStateError)


def _ub_snapshot_option(opts: TePassesOptions) -> UbSnapshot | None:
    """``te_passes.ub_snapshot`` loaded (``UbSnapshot.load``: a ``UbSnapshot``, dict or JSON file
    path), or ``None`` when not given (fold against TE's live registry).

    Raises:
        te_passes.config.TePassesOptionError: the value is none of those, the file cannot be
            read, or its content is not a UB snapshot (the message names the option and why).
    """
    if opts.ub_snapshot is None:
        return None
    try:
        return UbSnapshot.load(opts.ub_snapshot)
    except (TypeError, UbConfigError) as e:
        raise TePassesOptionError(f"option te_passes.ub_snapshot: {e}") from None


def _warn_capture_state(where: str) -> bool:
    """Warn (te_passes logger and ``warnings.warn``) when TE is in CUDA-graph-capture state
    (:func:`te_passes.te.capture_state.te_capture_state`): Dynamo then cannot trace TE modules
    and the frame runs eagerly. Returns whether it warned."""
    reasons = te_capture_state()
    if not reasons:
        return False
    import warnings

    msg = (f"te_passes: Transformer Engine is in CUDA-graph-capture state ({'; '.join(reasons)}) at {where}: "
           f"torch.compile cannot trace TE modules in this state and the frame falls back to eager (no "
           f"te_inductor graph). Finish or reset the capture (transformer_engine.pytorch.graph.set_capture_end())"
           f" before compiling")
    log.warning("%s", msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=2)
    return True


def te_inductor_backend(*, mode: str | None = None, options: dict[str, Any] | None = None):
    """``functools.partial(te_inductor, mode=mode, options=options)`` with every option checked
    now (``torch.compile`` passes them to the backend only at the first call): ``te_passes.*``
    keys and values, ``pass_config`` types, pass names, the mode and Inductor options, and the
    refusal of non-tree cudagraphs. Use as ``torch.compile(model, backend=te_inductor_backend(
    mode="reduce-overhead", options={...}))``.

    Raises:
        te_passes.config.TePassesOptionError: a ``te_passes.*`` key/value, a pass_config value,
            a pass name, a ``te_passes.ub_snapshot`` that cannot be loaded, or an Inductor
            configuration te_inductor refuses.
        RuntimeError: unknown mode or Inductor option (Inductor's message).
    """
    import functools

    opts, inductor_options = TePassesOptions.parse(options, known_passes=set(pass_names()),
                                                   aliases=PASS_ALIASES)
    configured_passes(opts.pass_config)
    _ub_snapshot_option(opts)
    _refuse_unsupported(_inductor_config_patches(mode, inductor_options))
    return functools.partial(te_inductor, mode=mode, options=options)


def te_inductor(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None,
                options: dict[str, Any] | None = None):
    """Compile a Dynamo graph with te_passes' TE-aware passes, then Inductor (see
    :func:`_te_inductor` for arguments, return value and the errors raised).

    ``TePassesOptionError``, ``TePassError`` and ``UbConfigError`` raised while compiling
    reach the caller of a function compiled with ``torch.compile`` as themselves (catchable with
    ``except te_passes.TePassesOptionError``), not wrapped in Dynamo's ``BackendCompilerFailed``
    (:func:`_unwrapped`).
    """
    try:
        return _te_inductor(gm, example_inputs, mode=mode, options=options)
    except _documented_errors() as e:
        raise _unwrapped(e) from e.__cause__


def _te_inductor(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None,
                 options: dict[str, Any] | None = None):
    """Compile a Dynamo graph with te_passes' TE-aware passes, then Inductor.

    Args:
        gm: the graph Dynamo captured (``torch.fx.GraphModule``).
        example_inputs: its example inputs (fake tensors / SymInts), as Dynamo passes them.
        mode: a ``torch.compile`` mode (``None``/``"default"``, ``"reduce-overhead"``,
            ``"max-autotune"``, ``"max-autotune-no-cudagraphs"``, ``"lite"``); mapped as for
            ``backend="inductor"``. ``"reduce-overhead"`` uses CUDA graph trees on CUDA graphs
            (on CPU, Inductor skips cudagraphs as it does for ``backend="inductor"``).
        options: Inductor config overrides plus ``te_passes.*`` keys
            (:data:`te_passes.config.OPTION_SPECS`). A user-given ``joint_custom_pre_pass`` /
            ``post_grad_custom_pre_pass`` runs before ours.

    Returns:
        The compiled callable (Inductor's), possibly wrapped by a TE-state guard.

    Raises:
        te_passes.config.TePassesOptionError: unknown ``te_passes.*`` key / bad value / pass name;
            non-tree cudagraphs (``triton.cudagraphs`` with ``triton.cudagraph_trees=False``).
        RuntimeError: unknown mode or Inductor option (from Inductor).
        te_passes.pipeline.manager.TePassError: a pass failed with ``te_passes.strict``.
    """
    from torch._inductor.compile_fx import compile_fx

    t_start = time.perf_counter()
    _install_te_hooks()
    opts, inductor_options = TePassesOptions.parse(options, known_passes=set(pass_names()),
                                                   aliases=PASS_ALIASES)
    config_patches = _inductor_config_patches(mode, inductor_options)
    _refuse_unsupported(config_patches)
    _warn_capture_state("te_inductor")
    te_state = TEState.capture(ub_snapshot=_ub_snapshot_option(opts))

    observers = []
    if opts.dump_dir or tracing_enabled():  # TORCH_TRACE alone: tlparse artifacts, no directory
        source = "option" if options and options.get("te_passes.dump_dir") is not None else "env"
        try:
            observers.append(DumpWriter.for_backend(opts.dump_dir, source))  # DIR/<session>/ unless te-passes dump owns DIR
        except DumpDirError as e:  # an option we cannot honour: refused, named, unwrapped
            where = "option te_passes.dump_dir" if source == "option" else "environment variable TE_PASSES_DUMP_DIR"
            raise TePassesOptionError(f"{where}: {e}") from None
    manager = PassManager(configured_passes(opts.pass_config), observers=observers)
    report = new_compile_report(mode)
    report.uuid = pipeline_uuid(manager, opts, te_state)
    report.te_state = te_state.to_json()

    autocast = autocast_for_graph(gm)  # issue 26: the te.autocast state TE's impls read at run time
    inputs = dynamo_stage_inputs()  # UB folds Dynamo made while tracing, taken from the runtime once
    Compilation(manager, opts, te_state, report).run_stage(gm, Stage.DYNAMO, example_inputs, inputs=inputs)
    # The uuid (FX-graph-cache key part) covers the UB snapshot only if this graph reads UB state.
    reads = ub_state_reads(gm, ub_dependence_of(report), trace_folds=inputs["ub_trace_folds"])
    report.uuid = pipeline_uuid(manager, opts, te_state, ub_reads=reads)
    _raise_ub_mismatches(report)
    checked = len(report.stages)  # their ub_mismatch records were just raised on: not again

    for joint, key in ((True, "joint_custom_pre_pass"), (False, "post_grad_custom_pre_pass")):
        ours = _StagePass(manager, opts, te_state, report, joint=joint)
        user = config_patches.get(key)
        config_patches[key] = ours if user is None else [*(user if isinstance(user, (list, tuple)) else [user]), ours]

    # --- issue 14: lean CUDA-graph replay under reduce-overhead (te_passes.cudagraphs) ---------
    policy = _cudagraph_policy(opts, config_patches, report, te_state, observers)
    if policy is not None:
        config_patches["cudagraph_policy"] = policy
    # ---------------------------------------------------------------------------------------------

    hits_before = _cache_hits()
    compiled = compile_fx(gm, example_inputs, config_patches=config_patches)
    _note_cache_hit(report, hits_before)
    report.time_ms_total = (time.perf_counter() - t_start) * 1e3
    for obs in observers:
        if hasattr(obs, "finish"):
            obs.finish(report)
    guarded = _maybe_guard(compiled, report, te_state, opts,
                           recompile=lambda g, args: te_inductor(g, args, mode=mode, options=options),
                           cudagraphs=bool(config_patches.get("triton.cudagraphs")), checked_stages=checked)
    return run_under(guarded, autocast)  # issue 26: that state set around each call


def _cudagraph_policy(opts: TePassesOptions, config_patches: dict[str, Any], report: CompileReport,
                      te_state: TEState, observers: Sequence[Any]):
    """The :class:`te_passes.runtime.cudagraph_policy.LeanCUDAGraphPolicy` for this graph, or ``None``
    (Inductor's default wrapping) unless ``te_passes.cudagraphs == "lean"`` and Inductor's
    cudagraphs are on (``triton.cudagraphs``, as ``mode="reduce-overhead"`` sets it) with trees
    (``triton.cudagraph_trees`` not switched off). A user-given ``cudagraph_policy`` wins. A graph
    that reads UB state while UB is initialised gets the policy with a static hazard (every graph
    of it falls back to cudagraph trees, recorded)."""
    from torch._inductor import config as inductor_config

    def cfg(key: str) -> Any:  # the patched value, else the process's Inductor config
        if key in config_patches:
            return config_patches[key]
        obj: Any = inductor_config
        for part in key.split("."):
            obj = getattr(obj, part)
        return obj

    if opts.cudagraphs != "lean" or not cfg("triton.cudagraphs"):
        return None
    if not cfg("triton.cudagraph_trees") or cfg("cudagraph_policy") is not None:
        return None
    hazards = []
    ub_reads = (report.uuid or {}).get("ub_reads")
    if te_state.ub is not None and getattr(te_state.ub, "initialized", False) and ub_reads:
        hazards.append(f"graph reads Userbuffers state with UB initialised ({'; '.join(map(str, ub_reads))[:200]}): "
                       "UB communicators captured into a CUDA graph are left to cudagraph trees")
    refreshers = [obs for obs in observers if hasattr(obs, "finish")]
    recorder = CudagraphRecorder(report.cudagraphs,
                                 refresh=(lambda: [obs.finish(report) for obs in refreshers]) if refreshers else None)
    return LeanCUDAGraphPolicy(graph_id=report.graph_id, recorder=recorder, static_hazards=hazards)


def _cache_hits() -> dict[str, int]:
    """Inductor's FX-graph-cache and AOTAutograd-cache hit counters (``torch._dynamo.utils.counters``,
    torch 2.14: ``inductor.fxgraph_cache_hit``, ``aot_autograd.autograd_cache_hit``)."""
    from torch._dynamo.utils import counters

    return {"AOTAutograd cache": counters["aot_autograd"]["autograd_cache_hit"],
            "FX graph cache": counters["inductor"]["fxgraph_cache_hit"]}


def _note_cache_hit(report: CompileReport, before: dict[str, int]) -> None:
    """When ``compile_fx`` hit a cache and the joint / post-grad stages did not run, say so:
    ``report.cache_hit`` (``"AOTAutograd cache"`` / ``"FX graph cache"``, shown by ``te-passes
    show`` and ``index.md``) and a te_passes log line (``TORCH_LOGS=+te_passes``)."""
    ran = {s.stage for s in report.stages}
    if ran & {Stage.JOINT.value, Stage.POST_GRAD_FWD.value}:
        return
    hit = [name for name, n in _cache_hits().items() if n > before.get(name, 0)]
    if not hit:
        return
    report.cache_hit = " and ".join(hit)
    log.info("te_passes: %s: %s", report.graph_id, cache_hit_note(report.cache_hit))


def _maybe_guard(compiled, report: CompileReport, te_state: TEState, opts: TePassesOptions, recompile=None,
                 cudagraphs: bool = False, checked_stages: int = 0):
    """Wrap ``compiled`` with a TE-state guard when a pass specialised it on UB state.

    ``recompile(gm, args)`` recompiles a pre-pass copy of the graph with the same mode/options
    (used by the UB guard when the UB state changed; see :mod:`te_passes.runtime.ub_guard`);
    ``cudagraphs``: the graph is replayed as a CUDA graph (UB buffers recorded into it);
    ``checked_stages``: stage reports whose ``ub_mismatch`` records were already raised on.
    """
    return wrap_with_te_state_guard(compiled, report, te_state, opts, recompile=recompile, cudagraphs=cudagraphs,
                                    checked_stages=checked_stages)


def _raise_ub_mismatches(report: CompileReport) -> None:
    """Fail the compilation now (before Inductor) when the Dynamo-stage passes found UB
    configurations the UB state cannot satisfy (:class:`te_passes.te.ub.UbConfigError`)."""
    raise_ub_mismatches(report)


def _install_te_hooks(*_args: Any) -> bool:
    """Install te_passes' TE integration hooks (:func:`te_passes.runtime.install.install`;
    idempotent; returns whether all are in place):

    * :func:`te_passes.runtime.ub_guard.install_te_ub_hooks` — guarded ``get_ub_is_fp8``, generation
      bump on ``initialize_ub`` / ``destroy_ub``;
    * :func:`te_passes.runtime.amax_groups.install_amax_group_hooks` — TE Linear's per-call amax
      reduction groups released after each eager call, and a one-time sweep of live modules, so
      the first trace after an eager step of a sequence-parallel fp8 te.Linear compiles (issue 8).

    Called when the backend is looked up (this module's import, i.e. ``torch.compile``), at the
    start of every Dynamo compile (a start callback, for TE imported after te_passes) and on every
    ``te_inductor`` call. Both need TE imported; until then they are no-ops.
    """
    return _install_runtime()


def _on_dynamo_compile_start(_args: Any) -> None:
    if not _install_te_hooks():
        return
    try:  # everything in place: stop paying for the callback
        torch._dynamo.callback_handler.remove_start_callback(_on_dynamo_compile_start)
    except ValueError:  # pragma: no cover - already removed
        pass


_capture_warned = [False]


def _on_dynamo_compile_start_capture(_args: Any) -> None:
    """Every Dynamo compile: warn once per capture-state episode when TE is in CUDA-graph-capture
    state (:func:`_warn_capture_state`; te_inductor itself is then never called). Two dict
    lookups when TE is not capturing."""
    if not te_capture_state():
        _capture_warned[0] = False
    elif not _capture_warned[0]:
        _capture_warned[0] = _warn_capture_state("the start of a Dynamo compile")


if not _install_te_hooks():
    torch._dynamo.callback_handler.register_start_callback(_on_dynamo_compile_start)
torch._dynamo.callback_handler.register_start_callback(_on_dynamo_compile_start_capture)
