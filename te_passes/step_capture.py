"""Small batches at the kernel-time floor: the whole training step as one compiled graph
(:func:`compile_step`), or TE's own CUDA-graph capture over a te_inductor-compiled module
(:func:`make_graphed`); both keep Dynamo, its guards and the autograd engine off the per-step path.

Which one for which batch size: docs/usage.md, "Small batches"; how they work and what they
refuse: docs/design.md, "Step capture"."""

from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from te_passes.backend import te_inductor_backend
from te_passes.compat import table
from te_passes.compat.dynamo.callbacks import step_scope
from te_passes.config import PREFIX, TePassesOptionError, parse_guards_option
from te_passes.pipeline.compilation import inductor_config_patches
from te_passes.compat.te220.capture_state import te_capture_state

__all__ = ["compile_step", "make_graphed", "CompiledStep", "StepCaptureError"]


class StepCaptureError(RuntimeError):
    """:func:`compile_step` / :func:`make_graphed` cannot do what was asked; the message says
    what and why (nothing was left half-set: TE's capture state is reset before raising)."""


# ``torch._dynamo.config.trace_autograd_ops`` (read only while Dynamo traces a frame: torch/_dynamo/variables/
# tensor.py ``method_backward``, variables/torch.py ``autograd.grad``) is the patch-table row
# ``dynamo.trace_autograd_ops``, applied to the compiles that start while a step runs in this thread
# (:func:`te_passes.compat.dynamo.callbacks.step_scope`).


def _refuse_capture_state(what: str) -> None:
    reasons = te_capture_state()
    if reasons:
        raise StepCaptureError(
            f"{what}: Transformer Engine is in CUDA-graph-capture state ({'; '.join(reasons)}); Dynamo cannot "
            "trace TE modules then and would silently run the step eagerly. Reset it first "
            "(transformer_engine.pytorch.graph.set_capture_end(); a failed te.make_graphed_callables leaves it set)")


def _signature(args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> tuple:
    """Shape / dtype / device / requires_grad of every tensor argument (top level and kwargs),
    plus the type of every other argument: what a recompile follows most often."""
    return tuple((tuple(a.shape), a.dtype, a.device, a.requires_grad) if isinstance(a, torch.Tensor) else type(a)
                 for a in (*args, *(kwargs or {}).values()))


def _optimizer_hint(msg: str) -> str | None:
    """What to do about a graph break inside a torch.optim optimizer (``fullgraph=True``), or ``None``."""
    if "Optimizer.zero_grad" in msg:
        return ("the step calls optimizer.zero_grad(), which Dynamo never traces (torch/_dynamo skips "
                "Optimizer.zero_grad: a graph break, refused under fullgraph=True). Call zero_grad() outside the "
                "compiled step, before it")
    if "torch/optim/optimizer.py" in msg and "graph_break" in msg:
        return ("the step calls optimizer.step(), which breaks the graph on purpose in torch 2.14 "
                "(torch/optim/optimizer.py _use_grad: torch._dynamo.graph_break() before and after the update, "
                "refused under fullgraph=True). Call optimizer.step() outside the compiled step "
                "(fullgraph=False does not help: a graph break after loss.backward() deadlocks in torch 2.14.1)")
    return None


def _split_guard_option(options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """``(guards mode, a copy of options without te_passes.guards)``; the backend itself refuses
    the key (``te_passes.config.REFUSED_OPTIONS``), so it never reaches it."""
    if not options:
        return "all", {}
    if not isinstance(options, dict):
        raise TePassesOptionError(f"options must be a dict, got {type(options).__name__}")
    rest = dict(options)
    mode = parse_guards_option(rest.pop(PREFIX + "guards", "all"))
    return mode, rest


# --------------------------------------------------------------------------- compile_step
class CompiledStep:
    """What :func:`compile_step` returns: ``step(*args, **kwargs)`` runs the compiled step; its outputs are
    detached (under CUDA graphs cloned out of the graph's pool unless ``clone_outputs=False``).

    Attributes:
        compiled: the ``torch.compile``\\ d step (Dynamo's wrapper of the traced function).
        cudagraphs: whether the step is replayed as a CUDA graph (``mode="reduce-overhead"``).
        guards: the ``te_passes.guards`` mode (``"all"`` or ``"skip_unsafe"``).
    """

    def __init__(self, step_fn: Callable[..., Any], compiled: Callable[..., Any], *, cudagraphs: bool,
                 clone_outputs: bool, guards: str, guard_warmup: int) -> None:
        self.step_fn = step_fn
        self.compiled = compiled
        self.cudagraphs = cudagraphs
        self.guards = guards
        self._clone = clone_outputs and cudagraphs
        self._warmup = int(guard_warmup)
        self._seen: dict[tuple, int] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if te_capture_state():
            _refuse_capture_state("compile_step")
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        try:
            with step_scope():
                if self.guards == "skip_unsafe":
                    out = self._call_skipping_guards(args, kwargs)
                else:
                    out = self.compiled(*args, **kwargs)
        except torch._dynamo.exc.Unsupported as e:
            hint = _optimizer_hint(str(e))
            if hint is None:
                raise
            raise StepCaptureError(f"compile_step: {hint}") from e
        return tree_map_only(torch.Tensor, lambda t: t.clone(), out) if self._clone else out

    def _call_skipping_guards(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        """Dynamo's guards are skipped (``skip_guard_eval_unsafe``) only for argument signatures
        already run ``guard_warmup`` times; a new shape / dtype / device / requires_grad runs with
        full guards, so it recompiles instead of replaying a graph built for other inputs."""
        sig = _signature(args, kwargs)
        n = self._seen.get(sig, 0)
        if n < self._warmup:
            self._seen[sig] = n + 1
            return self.compiled(*args, **kwargs)
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return self.compiled(*args, **kwargs)

    def __repr__(self) -> str:
        name = getattr(self.step_fn, "__qualname__", type(self.step_fn).__name__)
        return f"CompiledStep({name}, cudagraphs={self.cudagraphs}, guards={self.guards!r})"


def compile_step(step_fn: Callable[..., Any], *, mode: str | None = "reduce-overhead",
                 options: dict[str, Any] | None = None, fullgraph: bool = True, dynamic: bool | None = False,
                 clone_outputs: bool = True, guard_warmup: int = 2, backend: Any = None) -> CompiledStep:
    """Compile a whole training step — forward, ``loss.backward()``, optionally an optimizer step — as one
    Dynamo graph, compiled by te_inductor and (``mode="reduce-overhead"``) replayed as one CUDA graph.

    Args:
        step_fn: the step; another set of ``.grad`` tensors present (``zero_grad()`` with
            ``set_to_none=True`` vs ``False``), shape, dtype or recipe recompiles (Dynamo's guards).
        mode: a ``torch.compile`` mode for te_inductor (``"reduce-overhead"``: CUDA graph trees;
            ``None`` / ``"default"``: Inductor's kernels, no CUDA graphs).
        options: te_inductor options (``te_passes.*`` and Inductor config keys), plus
            ``te_passes.guards`` (``"all"``, the default, or ``"skip_unsafe"``: skip Dynamo's
            guard evaluation for argument signatures seen ``guard_warmup`` times; a changed
            global state (recipe, ``.grad`` presence, module attributes) is then NOT detected)
            and ``guard_filter_fn`` (torch.compile's).
        fullgraph: must be ``True`` (the default): a graph break inside the step is an error
            naming the break (Dynamo's ``Unsupported``).
        dynamic: passed to ``torch.compile`` (default ``False``: every shape its own graph).
        clone_outputs: under CUDA graphs, clone returned tensors out of the graph pool (one small
            copy per output per step), so a loss kept across steps stays valid.
        guard_warmup: calls per argument signature with full guards before ``skip_unsafe``.
        backend: the ``torch.compile`` backend (default ``te_inductor_backend(mode=..., options=...)``);
            another one (tests, debugging) ignores ``mode`` / ``options``.

    Returns:
        :class:`CompiledStep` (call it like ``step_fn``).

    Raises:
        TypeError: ``step_fn`` is not callable, or already a :class:`CompiledStep`.
        te_passes.TePassesOptionError: a bad option (te_inductor's checks), ``te_passes.guards``
            value, or ``guard_warmup < 1``.
        StepCaptureError: ``fullgraph=False``; when called while TE is in CUDA-graph-capture state.
    """
    if not callable(step_fn):
        raise TypeError(f"compile_step: step_fn must be callable, got {type(step_fn).__name__}")
    if isinstance(step_fn, CompiledStep):
        raise TypeError("compile_step: step_fn is already a compiled step")
    if fullgraph is not True:
        raise StepCaptureError(
            "compile_step: fullgraph=False is refused: in torch 2.14.1 a graph break after loss.backward() "
            "(optimizer.step() inside the step is one) deadlocks the process with no message (the eager "
            "backward left in the gap compiles AOTAutograd's backward lazily, which runs Dynamo's start "
            "callbacks under callback_handler's non-reentrant lock). Remove the break (keep optimizer.step() "
            "and zero_grad() outside the step), or compile the step with torch.compile(..., backend='te_inductor') "
            "yourself")
    guards, rest = _split_guard_option(options)
    if not isinstance(guard_warmup, int) or guard_warmup < 1:
        raise TePassesOptionError(f"compile_step: guard_warmup must be an int >= 1, got {guard_warmup!r}")
    guard_filter_fn = rest.pop("guard_filter_fn", None)
    if backend is None:
        inductor_options = {k: v for k, v in rest.items() if not k.startswith(PREFIX)}
        backend = te_inductor_backend(mode=mode, options=rest or None)
        cudagraphs = bool(inductor_config_patches(mode, inductor_options).get("triton.cudagraphs"))
    else:
        cudagraphs = False

    def te_passes_step(*args: Any, **kwargs: Any) -> Any:
        # detached in the traced step: no output requires grad, so one inference graph holds fwd + bwd
        return tree_map_only(torch.Tensor, lambda t: t.detach(), step_fn(*args, **kwargs))

    te_passes_step.__qualname__ = f"te_passes_step[{getattr(step_fn, '__qualname__', type(step_fn).__name__)}]"
    compiled = torch.compile(te_passes_step, backend=backend, fullgraph=fullgraph, dynamic=dynamic,
                             options={"guard_filter_fn": guard_filter_fn} if guard_filter_fn else None)
    return CompiledStep(step_fn, compiled, cudagraphs=cudagraphs, clone_outputs=clone_outputs, guards=guards,
                        guard_warmup=guard_warmup)


# --------------------------------------------------------------------------- make_graphed
#: ``te.make_graphed_callables`` keywords make_graphed refuses, and why.
REFUSED_MGC_KWARGS: dict[str, str] = {
    "_order": "pipeline-parallel schedules (several callables captured in one order) are not supported: "
              "make_graphed captures one module",
    "_num_layers_per_chunk": "pipeline-parallel schedules are not supported: make_graphed captures one module",
    "_reuse_graph_input_output_buffers": "buffer reuse needs a pipeline-parallel _order, which make_graphed "
                                         "does not support",
    "cache_quantized_params": "TE's cached quantized weights (is_first_microbatch) depend on TE's capture "
                              "state, which the compiled module cannot see (TE's compiled forward asserts it is "
                              "not capturing); not supported",
    "fp8_weight_caching": "deprecated spelling of cache_quantized_params, which is not supported",
}


class GraphedModule(torch.nn.Module):
    """What :func:`make_graphed` returns: holds the te_inductor-compiled module (``.compiled``; the
    user's is ``.compiled._orig_mod``); after capture ``forward`` is TE's graphed forward (set by
    ``te.make_graphed_callables``) behind a check of the captured argument signature."""

    def __init__(self, compiled: torch.nn.Module) -> None:
        super().__init__()
        self.compiled = compiled

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # TE's compiled forward asserts it is not capturing: run it with TE's capture flag off
        mgr = getattr(sys.modules.get("transformer_engine.pytorch.quantization"), "FP8GlobalStateManager", None)
        qstate = getattr(mgr, "quantization_state", None)
        if qstate is None or not qstate.fp8_graph_capturing:
            return self.compiled(*args, **kwargs)
        with table.scoped_attr(qstate, "fp8_graph_capturing", False):
            return self.compiled(*args, **kwargs)


class _TEState:
    """What a failed ``te.make_graphed_callables`` leaves behind, snapshotted before and put back
    after a failure: ``graph._IS_GRAPH_CAPTURING`` (set_capture_end), the FP8 autocast state
    (``FP8GlobalStateManager.get_autocast_state`` / ``set_autocast_state``), the module class's
    ``__call__`` (mgc's autocast wrapper) and the module's ``forward`` attribute."""

    def __init__(self, module: torch.nn.Module) -> None:
        import transformer_engine.pytorch.graph as te_graph
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        self._graph, self._mgr, self._module = te_graph, FP8GlobalStateManager, module
        self.capturing = te_graph.is_graph_capturing()
        self.autocast = FP8GlobalStateManager.get_autocast_state()
        self.depth = FP8GlobalStateManager.quantization_state.autocast_depth
        self.cls_call = type(module).__dict__.get("__call__")
        self.forward = module.__dict__.get("forward")

    def restore(self) -> list[str]:
        """Put everything back; returns what had to be reset (for the error message)."""
        fixed = []
        if self._graph.is_graph_capturing() and not self.capturing:
            self._graph.set_capture_end()
            fixed.append("TE's graph-capture flag")
        if self._mgr.get_autocast_state() != self.autocast or \
                self._mgr.quantization_state.autocast_depth != self.depth:
            self._mgr.set_autocast_state(self.autocast)
            table.set_state(self._mgr.quantization_state, "autocast_depth", self.depth)
            fixed.append("TE's FP8 autocast state")
        cls = type(self._module)
        if cls.__dict__.get("__call__") is not self.cls_call:
            table.set_state(cls, "__call__", table.MISSING if self.cls_call is None else self.cls_call)
            fixed.append(f"{cls.__name__}.__call__")
        if self._module.__dict__.get("forward") is not self.forward:
            table.set_state(self._module, "forward", table.MISSING if self.forward is None else self.forward)
            fixed.append("the module's forward")
        return fixed


def _check_make_graphed_args(module: Any, sample_args: Any, options: Any, mgc_kwargs: dict[str, Any]) -> tuple:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"make_graphed: module must be a torch.nn.Module, got {type(module).__name__}")
    if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        raise StepCaptureError("make_graphed: module is already torch.compile'd; pass the plain module "
                               "(make_graphed compiles it with te_inductor itself)")
    if isinstance(sample_args, torch.Tensor):
        sample_args = (sample_args,)
    if not isinstance(sample_args, (tuple, list)) or not all(isinstance(a, torch.Tensor) for a in sample_args):
        raise TypeError("make_graphed: sample_args must be a tensor or a tuple of tensors "
                        f"(one module is captured), got {type(sample_args).__name__}")
    sample_args = tuple(sample_args)
    for k, why in REFUSED_MGC_KWARGS.items():
        if mgc_kwargs.get(k) not in (None, False):
            raise StepCaptureError(f"make_graphed: {k}={mgc_kwargs[k]!r} refused: {why}")
    recipe = mgc_kwargs.get("recipe", mgc_kwargs.get("fp8_recipe"))
    enabled = mgc_kwargs.get("enabled", mgc_kwargs.get("fp8_enabled"))
    if recipe is not None and not enabled:
        raise StepCaptureError("make_graphed: a recipe was given but enabled is not True: TE would capture "
                               "without quantization and drop the recipe; pass enabled=True")
    if recipe is not None and type(recipe).__name__ == "DelayedScaling":
        raise StepCaptureError("make_graphed: DelayedScaling is not supported: its amax history / scale update "
                               "depends on TE's capture state, which the compiled module cannot see")
    opts = dict(options or {})
    if inductor_config_patches(None, {k: v for k, v in opts.items() if not k.startswith(PREFIX)}).get(
            "triton.cudagraphs"):
        raise StepCaptureError("make_graphed: options turn Inductor's CUDA graphs on (triton.cudagraphs); the "
                               "CUDA graphs come from te.make_graphed_callables here, and a cudagraph-trees "
                               "recording inside TE's capture is not possible. Leave triton.cudagraphs off")
    if PREFIX + "guards" in opts:
        raise StepCaptureError("make_graphed: te_passes.guards does not apply: a captured module's replay runs "
                               "no Dynamo guards at all")
    if not torch.cuda.is_available():
        raise StepCaptureError("make_graphed: no CUDA device (torch.cuda.is_available() is False); "
                               "te.make_graphed_callables captures CUDA graphs")
    off = [i for i, a in enumerate(sample_args) if a.device.type != "cuda"]
    if off:
        raise StepCaptureError(f"make_graphed: sample_args {off} are not CUDA tensors "
                               f"({[str(sample_args[i].device) for i in off]}); CUDA graphs need CUDA inputs")
    return sample_args, opts


def make_graphed(module: torch.nn.Module, sample_args: Any, *, options: dict[str, Any] | None = None,
                 warmup: bool = True, **mgc_kwargs: Any) -> GraphedModule:
    """``te.make_graphed_callables`` over ``torch.compile(module, backend=te_inductor)``: Inductor's kernels
    (default mode, no Inductor CUDA graphs) replayed by TE's CUDA graphs, forward and backward
    (transformer_engine/pytorch/graph.py ``make_graphed_callables``).

    Args:
        module: the plain (not yet compiled) module, in training mode for a training capture.
        sample_args: a tensor or a tuple of CUDA tensors, the shapes every call must have.
        options: te_inductor options (``te_passes.*`` and Inductor keys; Inductor's CUDA graphs
            are refused).
        warmup: run one forward + backward of the compiled module (``.grad`` untouched, RNG state
            restored) under the autocast TE captures with, so Dynamo and AOTAutograd compile
            before TE's warm-up and capture. ``False`` only for debugging.
        **mgc_kwargs: ``te.make_graphed_callables`` keywords (``num_warmup_iters``, ``enabled``,
            ``recipe``, ``sample_kwargs``, ``pool``, ...) but :data:`REFUSED_MGC_KWARGS`.

    Returns:
        :class:`GraphedModule`; call it like ``module`` (inside ``te.autocast`` for fp8). A call
        in the captured training mode whose tensor arguments differ in shape, dtype or device
        from ``sample_args`` raises :class:`StepCaptureError`.

    Raises:
        TypeError: not a module, or sample_args not tensors.
        StepCaptureError: no CUDA device, non-CUDA sample args, an already compiled module, TE
            in capture state already, a refused keyword / recipe / option, or
            ``te.make_graphed_callables`` failed (TE's capture state is reset first; the
            cause is chained).
        te_passes.TePassesOptionError: bad te_inductor options.
    """
    sample_args, opts = _check_make_graphed_args(module, sample_args, options, mgc_kwargs)
    _refuse_capture_state("make_graphed")
    import transformer_engine.pytorch as te

    backend = te_inductor_backend(options=opts or None)
    graphed = GraphedModule(torch.compile(module, backend=backend, dynamic=False))
    graphed.train(module.training)
    if warmup:
        _warm_up(graphed, sample_args, mgc_kwargs)
    snapshot = _TEState(graphed)
    try:
        te.make_graphed_callables(graphed, sample_args, **mgc_kwargs)
    except BaseException as e:
        fixed = snapshot.restore()
        raise StepCaptureError(
            f"make_graphed: te.make_graphed_callables failed over the te_inductor-compiled "
            f"{type(module).__name__}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            f"{'; reset ' + ', '.join(fixed) if fixed else ''}") from e
    captured_fwd = graphed.forward
    sig = _signature(sample_args, mgc_kwargs.get("sample_kwargs") or {})
    training = graphed.training

    def forward(*args: Any, **kwargs: Any) -> Any:
        if graphed.training == training and _signature(args, kwargs) != sig:
            raise StepCaptureError(
                f"make_graphed: called with {_describe(args, kwargs)} but captured for {_describe(sample_args, {})}: "
                "TE's CUDA graph replays fixed shapes. Call make_graphed again with sample_args of this shape "
                "(or use te_passes.compile_step, which recompiles)")
        return captured_fwd(*args, **kwargs)

    graphed.forward = forward
    return graphed


def _describe(args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    def one(a: Any) -> str:
        if isinstance(a, torch.Tensor):
            return f"{str(a.dtype).replace('torch.', '')}{list(a.shape)}@{a.device}" + ("(grad)" if a.requires_grad else "")
        return type(a).__name__
    return "(" + ", ".join([one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]) + ")"


def _warm_up(graphed: GraphedModule, sample_args: tuple, mgc_kwargs: dict[str, Any]) -> None:
    """One forward + ``autograd.grad`` of ``graphed`` under the autocast TE's capture enters
    (``autocast(enabled, calibrating, recipe, amax_reduction_group, _graph=True)``), RNG state
    restored, ``.grad`` untouched: Dynamo and AOTAutograd compile here, outside TE's capture."""
    import transformer_engine.pytorch as te

    enabled = bool(mgc_kwargs.get("enabled", mgc_kwargs.get("fp8_enabled")) or False)
    recipe = mgc_kwargs.get("recipe", mgc_kwargs.get("fp8_recipe"))
    kwargs = dict(mgc_kwargs.get("sample_kwargs") or {})
    with torch.random.fork_rng(devices=[torch.cuda.current_device()], device_type="cuda"):  # RNG restored
        with te.autocast(enabled=enabled, calibrating=bool(mgc_kwargs.get("calibrating") or False),
                         recipe=recipe if enabled else None,
                         amax_reduction_group=mgc_kwargs.get("amax_reduction_group"), _graph=True):
            out = graphed(*sample_args, **kwargs)
        if graphed.training:
            outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
            inputs = [a for a in sample_args if a.requires_grad] + [p for p in graphed.parameters() if p.requires_grad]
            if outs and inputs:
                torch.autograd.grad(outs, inputs, grad_outputs=[torch.ones_like(o) for o in outs],
                                    allow_unused=True)
        torch.cuda.synchronize()
