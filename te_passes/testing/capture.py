"""Real Transformer Engine graphs without a GPU: the test utility behind every pass's tests.

What it gives:

* :func:`capture_dynamo` — the graph Dynamo hands a ``torch.compile`` backend for ``te.Linear``
  (``model="linear"``) or a stack of ``te.Linear`` with ``torch.nn.functional.gelu`` between
  (``model="stack"``), in bf16 / Float8CurrentScaling / MXFP8, plus its example inputs (fake
  tensors) — exactly what ``te_passes.backend.te_inductor(gm, example_inputs)`` receives;
* :func:`capture_aot` — the post-AOTAutograd ATen graphs Inductor's hooks see: the joint graph
  (``joint_custom_pre_pass``) and the partitioned forward / backward graphs
  (``post_grad_custom_pre_pass``) with ``transformer_engine_compile.linear.default`` /
  ``linear_backward.default``;
* :func:`run_pipeline` — runs te_passes' :class:`~te_passes.pipeline.manager.PassManager` on
  captured graphs at the right :class:`~te_passes.pipeline.base.Stage`.

This module is the entry (these three, the cached captures and :func:`capture_skip_reason`); the
parts: :mod:`te_passes.testing.fake_gpu` (the fake device, :class:`CaptureError`),
:mod:`te_passes.testing.captured` (:class:`CapturedGraph`, :class:`CapturedAOT`),
:mod:`te_passes.testing.dynamo_capture` and :mod:`te_passes.testing.aot_capture`.

How (TE 2.20.2, torch 2.14.1; measured on a CPU-only machine, see docs/testing-real-graphs.md):

1. *Dynamo graph.* The modules and the input are built under a ``FakeTensorMode`` on device
   ``cuda`` with ``torch.cuda.is_available`` patched to ``True`` only while constructing. TE's
   cached support flags (``transformer_engine.pytorch.quantization._FP8_SUPPORT``, ...) are
   preset and the device-capability queries (``torch.cuda.get_device_capability`` /
   ``get_device_properties`` / ``current_device``, TE's ``utils._get_device_compute_capability``)
   answer (9, 0) (bf16, fp8-cs) or (10, 0) (mxfp8) for the duration of the capture; everything
   is restored afterwards. The function is compiled with ``fullgraph=True, dynamic=False`` and a
   recording backend whose compiled callable raises instead of running the graph. The recipe is
   built outside the compiled function and the layers run inside ``te.autocast`` (as TE
   requires); bf16 runs without ``te.autocast``.
2. *AOT graphs, in process.* The Dynamo graph goes through
   ``torch._functorch.aot_autograd.aot_module_simplified`` with Inductor's decomposition table
   (``torch._inductor.decomposition.select_decomp_table``) and Inductor's ``partition_fn``
   (min-cut, what ``compile_fx`` uses). The joint trace runs the autograd
   engine, which needs a CUDA device guard on fake ``cuda`` tensors; so the inputs are fake
   ``meta`` tensors for the trace (TE's fake impls take devices from their inputs), and the
   graphs are re-propagated with ``torch.fx.passes.fake_tensor_prop.FakeTensorProp`` on fake
   ``cuda`` inputs — the joint graph before Inductor's joint passes see it (Inductor's constant
   folder treats meta values as known constants and would replace TE op outputs) — so every
   ``node.meta["val"]`` is on ``cuda:0`` as in a real compilation. Inductor's own pieces run around the recording points: ``compile_fx.partition_fn``
   (joint passes incl. the ``joint_custom_pre_pass`` hook, where the joint graph is recorded,
   then the min-cut partitioner) and, per partitioned graph, ``view_to_reshape`` and
   ``post_grad_passes`` up to the ``post_grad_custom_pre_pass`` hook, where a recording pass
   takes the graph and stops Inductor. So ``joint`` / ``forward`` / ``backward`` are the graphs
   the backend's hooks receive — checked line for line against a real H200 compilation
   (``tests/gpu/test_capture_fidelity.py``: bf16 and fp8-cs, 1 and 4 layers, identical).

Untouched ``te.LayerNormLinear`` / ``LayerNormMLP`` / ``MultiheadAttention`` /
``TransformerLayer`` (``model="layernorm_linear"``, ...) are captured through te_passes' polyfills
of TE's disabled forwards (:mod:`te_passes.runtime.untouched`; the recording backend takes them as
``te_inductor`` does; the fake GPU answers TE's fused-attention backend query with
``F16_arbitrary_seqlen``); their AOT graphs need a GPU. Userbuffers / tensor-parallel keyword arguments reach ``te.Linear`` unchanged; without a
process group TE takes ``tp_size`` as given, and UB overlap needs UB communicators: pass
``fake_ub=True`` (default when any ``ub_*`` flag is set) to install stand-ins for the lookups TE
makes while tracing (``get_ub(name, fp8).is_fp8_ubuf()``; ``ub_fp8`` chooses its answer).
Configurations TE runs eagerly (DelayedScaling, ``fuse_wgrad_accumulation``, ...) raise
:class:`CaptureError` with TE's fallback reason.
"""

from __future__ import annotations

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
from te_passes.te.version import is_supported, te_version
from te_passes.testing.aot_capture import capture_aot
from te_passes.testing.captured import CapturedAOT, CapturedGraph
from te_passes.testing.dynamo_capture import capture_dynamo
from te_passes.testing.fake_gpu import CaptureError, capture_lock, fake_gpu, quiet


def capture_skip_reason() -> str | None:
    """Why real TE graphs cannot be captured in this process (for ``pytest.skip``), or ``None``.

    Checks: ``transformer_engine.pytorch`` imports (torch first, as TE requires; ImportError or
    TE's own load errors), TE's torch.compile custom-op path is on
    (``transformer_engine.pytorch.utils._compile_disabled_reason is None``; TE 2.20.2 turns it
    off on torch versions without the opaque-object API), and the TE version is one the graph
    model decodes (:func:`te_passes.te.version.is_supported`).
    """
    try:
        import transformer_engine.pytorch  # noqa: F401
        import transformer_engine.pytorch.utils as te_utils
    except Exception as e:  # noqa: BLE001
        return f"transformer_engine.pytorch does not import: {type(e).__name__}: {e}"
    reason = getattr(te_utils, "_compile_disabled_reason", "TE has no _compile_disabled_reason (not TE 2.20?)")
    if reason is not None:
        return f"TE's torch.compile custom-op path is off: {reason}"

    if not is_supported():
        return f"TE {te_version()} is not a version te_passes decodes"
    return None


_CACHE: dict[tuple, Any] = {}


def _cache_key(kind: str, args: dict[str, Any]) -> tuple | None:
    key = (kind, te_version(), torch.__version__, tuple(sorted(args.items())))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def cached_dynamo(precision: str = "fp8-cs", layers: int = 1, **kwargs: Any) -> CapturedGraph:
    """:func:`capture_dynamo` memoised per process on its arguments; returns a fresh
    :meth:`~CapturedGraph.copy` each call, so callers may rewrite it. Unhashable arguments
    (e.g. a process group) bypass the cache."""
    args = dict(kwargs, precision=precision, layers=layers)
    key = _cache_key("dynamo", args)
    if key is None:
        return capture_dynamo(**args)
    with capture_lock:
        if key not in _CACHE:
            _CACHE[key] = capture_dynamo(**args)
    return _CACHE[key].copy()


def cached_aot(precision: str = "fp8-cs", layers: int = 1, **kwargs: Any) -> CapturedAOT:
    """:func:`capture_aot` memoised per process (it reuses :func:`cached_dynamo`'s capture);
    returns a fresh :meth:`~CapturedAOT.copy` each call."""
    partitioner = kwargs.pop("partitioner", "min_cut")
    args = dict(kwargs, precision=precision, layers=layers)
    key = _cache_key("aot", dict(args, partitioner=partitioner))
    if key is None:
        return capture_aot(partitioner=partitioner, **args)
    with capture_lock:
        if key not in _CACHE:
            _CACHE[key] = capture_aot(partitioner=partitioner, dynamo=cached_dynamo(**args))
    return _CACHE[key].copy()


# --------------------------------------------------------------------------- pipeline
def run_pipeline(captured: CapturedGraph | CapturedAOT, stages: Iterable[Any] | None = None, *,
                 passes: Sequence[Any] | None = None, options: Any = None, te_state: Any = None,
                 relower: bool = False, copy: bool = True, graph_id: str = "g0") -> list[Any]:
    """Run te_passes' pass pipeline on captured graphs, stage by stage, as the backend does.

    :class:`CapturedGraph` → ``Stage.DYNAMO`` on ``gm`` (with its example inputs).

    :class:`CapturedAOT` (default) — each stage's passes run on (a copy of) the captured graph
    of that stage, independently: DYNAMO on the Dynamo graph, JOINT on ``joint``,
    POST_GRAD_FWD on ``forward``, POST_GRAD_BWD on ``backward``; later stages do not see
    earlier stages' rewrites (what ``te-passes dump --example`` does offline).

    :class:`CapturedAOT` with ``relower=True`` — the backend's order exactly: the DYNAMO passes
    rewrite (a copy of) the Dynamo graph, which is then lowered again by :func:`capture_aot`
    with the JOINT passes run at the ``joint_custom_pre_pass`` point (before partitioning, so
    their rewrites reach the forward/backward graphs) and the POST_GRAD_FWD / POST_GRAD_BWD
    passes at the ``post_grad_custom_pre_pass`` point. Costs one AOT trace (~1–2 s).

    Args:
        captured: what :func:`capture_dynamo` / :func:`capture_aot` returned.
        stages: the :class:`~te_passes.pipeline.base.Stage`\\ s (or their values) whose passes
            run; default all. Unselected stages' graphs are still produced (relower).
        passes: pass instances (default: the registry's, ``configured_passes()``; an empty list
            gives reports with no runs).
        options: ``TePassesOptions`` (default: ``TePassesOptions()``).
        te_state: ``TEState`` (default: ``TEState.capture()``).
        relower: see above (``CapturedAOT`` only).
        copy: rewrite copies (default) so ``captured`` — e.g. a cached fixture — stays intact;
            ``False`` rewrites ``captured``'s graphs in place (without ``relower`` only).
        graph_id: the id stage reports carry (``"g0"``, ``"g0.joint"``, ``"g0.fwd"``, ``"g0.bwd"``).

    Returns:
        ``list[StageReport]`` in stage order; each report's ``gm`` attribute is the graph the
        passes ran on (after them).

    Raises:
        te_passes.pipeline.manager.TePassError: a pass failed under ``options.strict``.
    """
    if not isinstance(captured, (CapturedGraph, CapturedAOT)):
        raise TypeError(f"run_pipeline takes a CapturedGraph or CapturedAOT, not {type(captured).__name__}")
    options = TePassesOptions() if options is None else options
    te_state = TEState.capture() if te_state is None else te_state
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
    if isinstance(captured, CapturedAOT):
        d = captured.dynamo
        jobs = [(Stage.DYNAMO, d.gm, d.example_inputs)]
        if captured.joint is not None:
            jobs.append((Stage.JOINT, captured.joint, captured.joint_inputs))
        jobs.append((Stage.POST_GRAD_FWD, captured.forward, captured.forward_inputs))
        if captured.backward is not None:
            jobs.append((Stage.POST_GRAD_BWD, captured.backward, captured.backward_inputs))
    else:
        jobs = [(Stage.DYNAMO, captured.gm, captured.example_inputs)]
    with quiet(), fake_gpu(captured.precision):
        for stage, gm, inputs in jobs:
            run(stage, gm, inputs)
    return reports


__all__ = [
    "CaptureError", "CapturedGraph", "CapturedAOT", "capture_dynamo", "capture_aot", "run_pipeline", "cached_dynamo",
    "cached_aot", "capture_skip_reason",
]
