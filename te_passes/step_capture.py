"""Small batches at the kernel-time floor: the whole training step as one compiled graph
(:func:`compile_step`), or TE's own CUDA-graph capture over a te_inductor-compiled module
(:func:`make_graphed`).

Both keep Dynamo, its guards and the autograd engine off the per-step path as far as torch
allows; which one to use for which batch size: docs/usage.md, "Small batches"; how they work and
what they refuse: docs/design.md, "Step capture".
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch

from te_passes._logging import get_logger
from te_passes.backend import te_inductor_backend
from te_passes.config import PREFIX, TePassesOptionError, parse_guards_option
from te_passes.pipeline.compilation import inductor_config_patches
from te_passes.te.capture_state import te_capture_state

log = get_logger()

__all__ = ["compile_step", "make_graphed", "CompiledStep", "StepCaptureError"]


class StepCaptureError(RuntimeError):
    """:func:`compile_step` / :func:`make_graphed` cannot do what was asked; the message says
    what and why (nothing was left half-set: TE's capture state is reset before raising)."""


# --------------------------------------------------------------------------- trace_autograd_ops, scoped
# ``torch._dynamo.config.trace_autograd_ops`` is read only while Dynamo traces a frame
# (torch/_dynamo/variables/tensor.py ``method_backward``, variables/torch.py ``autograd.grad``).
# Setting it on every step call costs ~8 us (ConfigModule.__setattr__ twice), so it is set by a
# Dynamo compile-start callback, only for compiles that start while a compiled step is running
# in this thread, and restored by the matching end callback (torch/_dynamo/callback.py: start
# callbacks run before tracing, end callbacks in a ``finally``).
# ``torch._dynamo.reset()`` clears every callback (``callback_handler.clear()``), so each step call
# checks that ours are still registered (a list membership test).
_step_state = threading.local()
_scope_lock = threading.Lock()
_scope: dict[str, Any] = {"restore": None}
_handler = torch._dynamo.callback_handler


def _in_step() -> bool:
    return getattr(_step_state, "depth", 0) > 0


def _on_compile_start(_args: Any) -> None:
    if not _in_step() or _scope["restore"] is not None:
        return
    cfg = torch._dynamo.config
    _scope["restore"] = (cfg.trace_autograd_ops,)
    cfg.trace_autograd_ops = True


def _on_compile_end(_args: Any) -> None:
    restore = _scope["restore"]
    if restore is not None:
        _scope["restore"] = None
        torch._dynamo.config.trace_autograd_ops = restore[0]


def _install_scope() -> None:
    with _scope_lock:
        if _on_compile_start not in _handler.start_callbacks:
            _handler.register_start_callback(_on_compile_start)
        if _on_compile_end not in _handler.end_callbacks:
            _handler.register_end_callback(_on_compile_end)


def _refuse_capture_state(what: str) -> None:
    reasons = te_capture_state()
    if reasons:
        raise StepCaptureError(
            f"{what}: Transformer Engine is in CUDA-graph-capture state ({'; '.join(reasons)}); Dynamo cannot "
            "trace TE modules then and would silently run the step eagerly. Reset it first "
            "(transformer_engine.pytorch.graph.set_capture_end(); a failed te.make_graphed_callables leaves it set)")


def _detach_outputs(out: Any) -> Any:
    """``out`` with every tensor detached (inside the traced step: the AOT graph then has no
    output that requires grad, so it is one inference graph holding forward and backward)."""
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.detach(), out)


def _clone_outputs(out: Any) -> Any:
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.clone(), out)


def _signature(args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> tuple:
    """Shape / dtype / device / requires_grad of every tensor argument (top level and kwargs),
    plus the type of every other argument: what a recompile follows most often."""
    parts = []
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, torch.Tensor):
            parts.append((tuple(a.shape), a.dtype, a.device, a.requires_grad))
        else:
            parts.append(type(a))
    return tuple(parts)


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


def _split_guard_option(options: dict[str, Any] | None) -> tuple[str, dict[str, Any] | None]:
    """``(guards mode, options without te_passes.guards)``; the backend itself refuses the key
    (``te_passes.config.REFUSED_OPTIONS``), so it never reaches it."""
    if not options:
        return "all", options
    if not isinstance(options, dict):
        raise TePassesOptionError(f"options must be a dict, got {type(options).__name__}")
    rest = dict(options)
    mode = parse_guards_option(rest.pop(PREFIX + "guards", "all"))
    return mode, rest


# --------------------------------------------------------------------------- compile_step
class CompiledStep:
    """The callable :func:`compile_step` returns: ``step(*args, **kwargs)`` runs the compiled step and returns
    its outputs (tensors detached; under CUDA graphs cloned out of the graph's memory pool unless
    ``clone_outputs=False``).

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
        if _on_compile_start not in _handler.start_callbacks or _on_compile_end not in _handler.end_callbacks:
            _install_scope()
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        state = _step_state
        state.depth = getattr(state, "depth", 0) + 1
        try:
            if self.guards == "skip_unsafe":
                out = self._call_skipping_guards(args, kwargs)
            else:
                out = self.compiled(*args, **kwargs)
        except torch._dynamo.exc.Unsupported as e:
            hint = _optimizer_hint(str(e))
            if hint is None:
                raise
            raise StepCaptureError(f"compile_step: {hint}") from e
        finally:
            state.depth -= 1
        return _clone_outputs(out) if self._clone else out

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
        step_fn: the step; a different set of ``.grad`` tensors present (``zero_grad()`` with
            ``set_to_none=True`` vs ``False``), another shape, dtype or recipe recompiles
            (Dynamo's guards), as for any compiled function.
        mode: a ``torch.compile`` mode for te_inductor (``"reduce-overhead"``: CUDA graph trees;
            ``None`` / ``"default"``: Inductor's kernels, no CUDA graphs).
        options: te_inductor options (``te_passes.*`` keys and Inductor config keys), plus
            ``te_passes.guards`` (``"all"``, the default, or ``"skip_unsafe"``: skip Dynamo's
            guard evaluation for argument signatures seen ``guard_warmup`` times; a changed
            global state (recipe, ``.grad`` presence, module attributes) is then NOT detected)
            and ``guard_filter_fn`` (torch.compile's).
        fullgraph: must be ``True`` (the default): a graph break inside the step is an error
            naming the break (Dynamo's ``Unsupported``); ``False`` is refused (a break after the
            backward deadlocks in torch 2.14.1).
        dynamic: passed to ``torch.compile`` (default ``False``: every shape its own graph).
        clone_outputs: under CUDA graphs, clone returned tensors out of the graph pool, so a
            loss kept across steps stays valid (one small copy per output per step).
        guard_warmup: calls per argument signature with full guards before ``skip_unsafe``
            skips them.
        backend: the ``torch.compile`` backend; default ``te_passes.te_inductor_backend(mode=...,
            options=...)``. Another backend is for tests and debugging (``mode`` / ``options``
            are then not used).

    Returns:
        :class:`CompiledStep` (call it like ``step_fn``).

    Raises:
        TypeError: ``step_fn`` is not callable.
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
    rest = dict(rest or {})
    guard_filter_fn = rest.pop("guard_filter_fn", None)
    if backend is None:
        inductor_options = {k: v for k, v in rest.items() if not k.startswith(PREFIX)}
        backend = te_inductor_backend(mode=mode, options=rest or None)
        cudagraphs = bool(inductor_config_patches(mode, inductor_options).get("triton.cudagraphs"))
    else:
        cudagraphs = False
    _install_scope()

    def te_passes_step(*args: Any, **kwargs: Any) -> Any:
        return _detach_outputs(step_fn(*args, **kwargs))

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
    """The module :func:`make_graphed` returns: holds the te_inductor-compiled module
    (``.compiled``; the user's module is ``.compiled._orig_mod``) and, after capture, TE's
    graphed forward as ``forward`` (set by ``te.make_graphed_callables``), wrapped by a check of
    the argument signature captured."""

    def __init__(self, compiled: torch.nn.Module) -> None:
        super().__init__()
        self.compiled = compiled

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        qstate = _quantization_state()
        if qstate is None or not qstate.fp8_graph_capturing:
            return self.compiled(*args, **kwargs)
        qstate.fp8_graph_capturing = False
        try:
            return self.compiled(*args, **kwargs)
        finally:
            qstate.fp8_graph_capturing = True


def _quantization_state() -> Any:
    import sys

    quant = sys.modules.get("transformer_engine.pytorch.quantization")
    mgr = getattr(quant, "FP8GlobalStateManager", None) if quant is not None else None
    return getattr(mgr, "quantization_state", None) if mgr is not None else None


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
            self._mgr.quantization_state.autocast_depth = self.depth
            fixed.append("TE's FP8 autocast state")
        cls = type(self._module)
        if cls.__dict__.get("__call__") is not self.cls_call:
            if self.cls_call is None:
                delattr(cls, "__call__")
            else:
                cls.__call__ = self.cls_call
            fixed.append(f"{cls.__name__}.__call__")
        if self._module.__dict__.get("forward") is not self.forward:
            if self.forward is None:
                self._module.__dict__.pop("forward", None)
            else:
                self._module.forward = self.forward
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
        warmup: run one forward + backward of the compiled module (gradients not written to
            ``.grad``; RNG state restored) under the autocast state TE captures with, before
            TE's capture, so Dynamo and AOTAutograd compile outside it (a compile inside TE's
            warm-up would trace with TE's forward hooks in place, and one inside the capture is
            not possible). ``False`` only for debugging.
        **mgc_kwargs: ``te.make_graphed_callables`` keywords (``num_warmup_iters``, ``enabled``,
            ``recipe``, ``clone_param_grads_on_return``, ``sample_kwargs``, ``pool``, ...); those
            in :data:`REFUSED_MGC_KWARGS` are refused.

    Returns:
        :class:`GraphedModule`; call it like ``module`` (inside ``te.autocast`` for fp8, as with
        TE's own ``make_graphed_callables``). A call whose tensor arguments differ in shape,
        dtype or device from ``sample_args`` while the module is in the captured training mode
        raises :class:`StepCaptureError` (TE's replay would copy them into the captured buffers).

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
    rng = torch.cuda.get_rng_state()
    cpu_rng = torch.get_rng_state()
    try:
        with te.autocast(enabled=enabled, calibrating=bool(mgc_kwargs.get("calibrating") or False),
                         recipe=recipe if enabled else None,
                         amax_reduction_group=mgc_kwargs.get("amax_reduction_group"), _graph=True):
            out = graphed(*sample_args, **kwargs)
        if graphed.training:
            from torch.utils._pytree import tree_flatten

            outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
            inputs = [a for a in sample_args if a.requires_grad] + [p for p in graphed.parameters() if p.requires_grad]
            if outs and inputs:
                torch.autograd.grad(outs, inputs, grad_outputs=[torch.ones_like(o) for o in outs],
                                    allow_unused=True)
        torch.cuda.synchronize()
    finally:
        torch.cuda.set_rng_state(rng)
        torch.set_rng_state(cpu_rng)
