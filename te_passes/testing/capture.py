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

Limits: only modules TE traces into the graph (``te.Linear``); ``te.LayerNormLinear`` /
``LayerNormMLP`` run eagerly under ``torch.compiler.disable`` and cannot be captured without a
GPU. Userbuffers / tensor-parallel keyword arguments reach ``te.Linear`` unchanged; without a
process group TE takes ``tp_size`` as given, and UB overlap needs UB communicators: pass
``fake_ub=True`` (default when any ``ub_*`` flag is set) to install stand-ins for the lookups TE
makes while tracing (``get_ub(name, fp8).is_fp8_ubuf()``; ``ub_fp8`` chooses its answer).
Configurations TE runs eagerly (DelayedScaling, ``fuse_wgrad_accumulation``, ...) raise
:class:`CaptureError` with TE's fallback reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import types
import warnings
from typing import Any, Callable, Iterable, Iterator, Sequence
from unittest import mock

import torch
import torch.fx
import torch.utils._pytree

from te_passes.config import TePassesOptions
from te_passes.fx.graph import copy_graph
from te_passes.pipeline.base import Stage
from te_passes.pipeline.compilation import Compilation
from te_passes.pipeline.manager import PassManager
from te_passes.report import CompileReport
from te_passes.te import graph_model as gmod
from te_passes.te.state import TEState
from te_passes.te.version import is_supported, te_version
from te_passes.testing.inductor_state import clear_system_info

#: Precisions :func:`capture_dynamo` / :func:`capture_aot` capture: ``"bf16"`` (bf16 params and
#: activations, no quantization, no ``te.autocast``), ``"fp8-cs"``
#: (``transformer_engine.common.recipe.Float8CurrentScaling()``, device capability (9, 0)) and
#: ``"mxfp8"`` (``MXFP8BlockScaling()``, device capability (10, 0)).
PRECISIONS: tuple[str, ...] = ("bf16", "fp8-cs", "mxfp8")

#: Models: ``"linear"`` (one ``te.Linear``) and ``"stack"`` (``layers`` ``te.Linear`` with GELU
#: between).
MODELS: tuple[str, ...] = ("linear", "stack")

#: Device capability each precision is captured under (Hopper for bf16/FP8, Blackwell for MXFP8).
DEVICE_CAPABILITY: dict[str, tuple[int, int]] = {"bf16": (9, 0), "fp8-cs": (9, 0), "mxfp8": (10, 0)}

_UB_FLAGS = ("ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad")
_TE_SUPPORT_FLAGS = ("_FP8_SUPPORT", "_MXFP8_SUPPORT", "_NVFP4_SUPPORT", "_FP8_BLOCK_SCALING_SUPPORT")

#: ``is_fp8_ubuf()`` of TE 2.20.2's default Userbuffers config in FP8 mode (measured with
#: ``initialize_ub(..., quantization_modes=[NONE, FP8])``, ../shared/notes/ub-tp2.md): the
#: reduce-scatter ``*_fprop`` and bulk ``*_wgrad`` buffers of the ag layers are not FP8; every
#: other buffer is. Names not listed answer ``True``.
DEFAULT_UB_FP8: dict[str, bool] = {
    "qkv_fprop": True, "qkv_dgrad": True, "qkv_wgrad": False,
    "proj_fprop": False, "proj_dgrad": True, "proj_wgrad": True,
    "fc1_fprop": True, "fc1_dgrad": True, "fc1_wgrad": False,
    "fc2_fprop": False, "fc2_dgrad": True, "fc2_wgrad": True,
}

_lock = threading.RLock()
_counter = itertools.count()


class CaptureError(RuntimeError):
    """Capturing failed: TE fell back to eager (graph break, message has TE's reason), a
    precision/model is unknown, or tracing raised (chained)."""


# --------------------------------------------------------------------------- results
def _te_version() -> str | None:
    return te_version()


def _te_node_summary(gm: torch.fx.GraphModule) -> list[str]:
    out = []
    for node in gm.graph.nodes:
        op = gmod.te_op_name(node)
        if op is None:
            continue
        line = f"{node.name}: {gmod.TE_OP_NAMESPACE}.{op}"
        try:
            call = gmod.decode(node)
        except gmod.UnknownTEOp as e:
            out.append(f"{line}  <undecodable: {e}>")
            continue
        parts = [f"{k}={_val_str(v)}" for k, v in call.tensors.items() if v is not None]
        for name, f in call.tq_fields.items():
            if f.kind == "storage":
                bufs = ", ".join(f"{b.inner_name}:{_val_str(b.node)}" for b in f.buffers)
                parts.append(f"{name}={f.storage_cls}[{bufs}]")
            elif f.kind == "tensor":
                parts.append(f"{name}={_val_str(f.tensor)}")
        if "fp8" in call.config:
            parts.append(f"fp8={call.config['fp8']}")
        qs = {type(q).__name__ for q in call.quantizers().values()}
        if qs:
            parts.append("quantizers=" + "/".join(sorted(qs)))
        out.append(f"{line}({', '.join(parts)})")
    return out


def _val_str(node: Any) -> str:
    v = node_value(node) if isinstance(node, torch.fx.Node) else None
    if isinstance(v, torch.Tensor):
        return f"{_dtype_abbr(v.dtype)}{list(v.shape)}"
    return getattr(node, "name", repr(node))


def node_value(node: torch.fx.Node) -> Any:
    """A node's fake value: ``meta["val"]`` (AOT graphs) or ``meta["example_value"]`` (Dynamo
    graphs), else ``None``."""
    v = node.meta.get("val")
    return node.meta.get("example_value") if v is None else v


def _dtype_abbr(dtype: torch.dtype) -> str:
    """``bf16`` / ``u8`` / ``f32`` ... as FX's ``print_readable`` writes dtypes."""
    try:
        from torch.utils._dtype_abbrs import dtype_abbrs

        return dtype_abbrs[dtype]
    except (ImportError, KeyError):  # pragma: no cover - other torch versions
        return str(dtype).removeprefix("torch.")


def te_op_names(gm: torch.fx.GraphModule) -> list[str]:
    """Names (``"linear"``, ``"linear_backward"``, ...) of the TE op nodes of ``gm``, in order."""
    return [op for op in (gmod.te_op_name(n) for n in gm.graph.nodes) if op is not None]


def _copy_gm(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A node-for-node copy of ``gm`` (TE constants and ``node.meta`` values are shared)."""
    graph = copy_graph(gm.graph)
    new = torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    for old_n, new_n in zip(gm.graph.nodes, new.graph.nodes):
        new_n.meta = dict(old_n.meta)
    return new


@dataclasses.dataclass
class CapturedGraph:
    """A Dynamo graph of a TE model, as a ``torch.compile`` backend receives it.

    Fields: ``gm`` (``torch.fx.GraphModule``: placeholders for the layers' ``weight`` bf16[N, K]
    and ``bias`` bf16[N] per layer, then the input bf16[tokens, hidden]; one
    ``transformer_engine_compile.linear`` OpOverloadPacket call per layer),
    ``example_inputs`` (Dynamo's fake tensors on ``cuda:0``, in placeholder order),
    ``precision``, ``model``, ``layers``, ``tokens``, ``hidden``, ``out_features`` (of the last
    layer), ``linear_kwargs`` (extra ``te.Linear`` arguments), ``training`` (``False``: traced under
    ``torch.no_grad()``), ``te_version``, ``torch_version``.
    """

    gm: torch.fx.GraphModule
    example_inputs: list[Any]
    precision: str
    model: str
    layers: int
    tokens: int
    hidden: int
    out_features: int
    linear_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    training: bool = True
    te_version: str | None = None
    torch_version: str = torch.__version__

    def te_nodes(self) -> list[torch.fx.Node]:
        """The ``transformer_engine_compile`` op nodes of :attr:`gm`, in order."""
        return [n for n in self.gm.graph.nodes if gmod.is_te_op_node(n)]

    def describe(self) -> str:
        """A few lines: what was captured and every TE op node with its decoded fields."""
        head = (f"dynamo graph: {self.model} x{self.layers} {self.precision} tokens={self.tokens} "
                f"hidden={self.hidden} out={self.out_features} (TE {self.te_version}, torch "
                f"{self.torch_version}), {len(self.gm.graph.nodes)} nodes")
        return "\n".join([head, *("  " + s for s in _te_node_summary(self.gm))])

    def copy(self) -> "CapturedGraph":
        """A copy whose graph can be rewritten without touching this one (TE constant objects
        and fake ``meta`` values are shared; passes replace them, never mutate them)."""
        return dataclasses.replace(self, gm=_copy_gm(self.gm), example_inputs=list(self.example_inputs),
                                   linear_kwargs=dict(self.linear_kwargs))


@dataclasses.dataclass
class CapturedAOT:
    """The AOTAutograd graphs of a TE model, as Inductor's custom-pass hooks receive them.

    Fields:
      * ``forward`` — partitioned forward (``primals_*`` placeholders; per layer one
        ``transformer_engine_compile.linear.default``; returns the output, quantizer constants
        (fp8), the saved tensors: for fp8-cs the input transpose u8[K, M], weight data u8[N, K],
        weight transpose u8[K, N] and f32[1] ``scale_inv``\\ s);
      * ``backward`` — partitioned backward (saved tensors then ``tangents_*``; per layer one
        ``linear_backward.default``; returns dW, dbias, dx per layer); ``None`` for
        ``training=False``;
      * ``joint`` — the joint forward+backward graph (``joint_custom_pre_pass``); ``None`` for
        ``training=False``;
      * ``forward_inputs`` / ``backward_inputs`` / ``joint_inputs`` — fake ``cuda`` tensors
        matching the placeholders (the joint's are ``[primals, tangents]`` flattened);
      * ``dynamo`` — the :class:`CapturedGraph` they were made from;
      * ``partitioner`` — ``"min_cut"`` (Inductor's) or ``"default"``.
    """

    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule | None
    joint: torch.fx.GraphModule | None
    forward_inputs: list[Any]
    backward_inputs: list[Any]
    joint_inputs: list[Any]
    dynamo: CapturedGraph
    partitioner: str = "min_cut"

    precision = property(lambda self: self.dynamo.precision)
    model = property(lambda self: self.dynamo.model)
    layers = property(lambda self: self.dynamo.layers)
    te_version = property(lambda self: self.dynamo.te_version)
    example_inputs = property(lambda self: self.forward_inputs)

    def graphs(self) -> dict[str, torch.fx.GraphModule]:
        """``{"joint": ..., "forward": ..., "backward": ...}`` (graphs that exist)."""
        out = {"joint": self.joint, "forward": self.forward, "backward": self.backward}
        return {k: v for k, v in out.items() if v is not None}

    def describe(self) -> str:
        """What was captured and the TE op nodes of each AOT graph with their decoded fields."""
        d = self.dynamo
        lines = [f"aot graphs: {d.model} x{d.layers} {d.precision} tokens={d.tokens} hidden={d.hidden} "
                 f"out={d.out_features} partitioner={self.partitioner} (TE {d.te_version}, torch "
                 f"{d.torch_version})"]
        for name, gm in self.graphs().items():
            lines.append(f" {name}: {len(gm.graph.nodes)} nodes")
            lines.extend("  " + s for s in _te_node_summary(gm))
        return "\n".join(lines)

    def copy(self) -> "CapturedAOT":
        """A copy whose graphs can be rewritten independently (see :meth:`CapturedGraph.copy`)."""
        return dataclasses.replace(
            self, forward=_copy_gm(self.forward),
            backward=_copy_gm(self.backward) if self.backward is not None else None,
            joint=_copy_gm(self.joint) if self.joint is not None else None,
            forward_inputs=list(self.forward_inputs), backward_inputs=list(self.backward_inputs),
            joint_inputs=list(self.joint_inputs), dynamo=self.dynamo.copy())


# --------------------------------------------------------------------------- fake GPU
class _FakeProps:
    """Stands in for ``torch.cuda.get_device_properties`` (``_CudaDeviceProperties``)."""

    def __init__(self, cap: tuple[int, int]) -> None:
        self.major, self.minor = cap
        self.name = f"te_passes fake sm_{cap[0]}{cap[1]}"
        self.total_memory = 141 * 2**30
        self.multi_processor_count = 132
        self.gcnArchName = ""
        self.L2_cache_size = 50 * 2**20
        self.warp_size = 32

    def __repr__(self) -> str:
        return f"_FakeProps({self.name})"


class _FakeUb:
    """Stands in for a Userbuffers communicator (``tex.CommOverlap``) at trace time: answers the
    predicates TE queries while tracing (``is_fp8_ubuf()``, ``with_cublasmp()``)."""

    def __init__(self, name: str, fp8_mode: bool, ub_fp8: Any) -> None:
        self.name, self.fp8_mode, self._fp8 = name, fp8_mode, ub_fp8

    def is_fp8_ubuf(self) -> bool:
        if not self.fp8_mode:
            return False
        if isinstance(self._fp8, dict):
            return bool(self._fp8.get(self.name, DEFAULT_UB_FP8.get(self.name, True)))
        if self._fp8 is None:
            return DEFAULT_UB_FP8.get(self.name, True)
        return bool(self._fp8)

    def with_cublasmp(self) -> bool:
        return False

    def is_atomic_gemm(self) -> bool:
        return False

    def is_p2p_overlap(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"_FakeUb({self.name!r}, fp8={self.fp8_mode})"


class _FakeUbTable(dict):
    """``base._ub_communicators`` stand-in: every ``(name, mode)`` key resolves to a
    :class:`_FakeUb`."""

    def __init__(self, ub_fp8: Any) -> None:
        super().__init__()
        self.ub_fp8 = ub_fp8

    def __contains__(self, key: object) -> bool:
        return isinstance(key, tuple) and len(key) == 2

    def __missing__(self, key):
        name, mode = key
        ub = _FakeUb(name, getattr(mode, "name", str(mode)) == "FP8", self.ub_fp8)
        self[key] = ub
        return ub


def _import_te():
    try:
        import transformer_engine  # noqa: F401  (torch is imported above, as TE requires)
        import transformer_engine.pytorch as te
    except Exception as e:  # noqa: BLE001 - ImportError or TE's own load errors
        raise CaptureError(f"transformer_engine is not importable: {type(e).__name__}: {e}") from e
    return te


@contextlib.contextmanager
def fake_gpu(precision: str = "fp8-cs", *, fake_ub: bool = False, ub_fp8: Any = None) -> Iterator[None]:
    """Make TE believe a GPU of ``DEVICE_CAPABILITY[precision]`` is present (no CUDA calls).

    Patches, restored on exit: TE's cached support flags (``quantization._FP8_SUPPORT``,
    ``_MXFP8_SUPPORT``, ``_NVFP4_SUPPORT``, ``_FP8_BLOCK_SCALING_SUPPORT`` = ``(True, "")``),
    ``transformer_engine.pytorch.utils._get_device_compute_capability``,
    ``torch.cuda.current_device`` / ``get_device_capability`` / ``get_device_properties`` and,
    with ``fake_ub``, TE's Userbuffers registry (``module.base._ub_communicators`` /
    ``_ub_initialized``). ``torch.cuda.is_available`` is *not* patched here (Dynamo would then
    query CUDA RNG state): patch it only around construction (:func:`_constructing`).
    Inductor's cached system info is cleared on entry and exit (:mod:`te_passes.testing.inductor_state`).
    """
    if precision not in DEVICE_CAPABILITY:
        raise CaptureError(f"unknown precision {precision!r}; expected one of {PRECISIONS}")
    _import_te()
    import transformer_engine.pytorch.module.base as te_base
    import transformer_engine.pytorch.quantization as te_quant
    import transformer_engine.pytorch.utils as te_utils

    cap = DEVICE_CAPABILITY[precision]
    props = _FakeProps(cap)
    with contextlib.ExitStack() as stack:
        stack.callback(clear_system_info)  # runs last: after the patches are undone
        for flag in _TE_SUPPORT_FLAGS:
            if hasattr(te_quant, flag):
                stack.enter_context(mock.patch.object(te_quant, flag, (True, "")))
        stack.enter_context(mock.patch.object(te_utils, "_get_device_compute_capability",
                                              lambda device=None: cap))
        stack.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: 0))
        stack.enter_context(mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: cap))
        stack.enter_context(mock.patch.object(torch.cuda, "get_device_properties", lambda device=None: props))
        if fake_ub:
            stack.enter_context(mock.patch.object(te_base, "_ub_communicators", _FakeUbTable(ub_fp8)))
            stack.enter_context(mock.patch.object(te_base, "_ub_initialized", True))
        clear_system_info()
        yield


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence the warnings every TE trace emits on torch 2.14 (Dynamo tracing through TE's
    ``functools.lru_cache``-wrapped ``_nvtx_enabled``; TE's ComplexHalf ``None`` sentinel)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Dynamo detected a call to a `functools.lru_cache`")
        warnings.filterwarnings("ignore", message=r"ComplexHalf support is experimental")
        yield


@contextlib.contextmanager
def _constructing() -> Iterator[None]:
    with mock.patch.object(torch.cuda, "is_available", lambda: True):
        yield


def _make_recipe(precision: str):
    if precision == "bf16":
        return None
    from transformer_engine.common import recipe as te_recipe

    if precision == "fp8-cs":
        return te_recipe.Float8CurrentScaling()
    if precision == "mxfp8":
        return te_recipe.MXFP8BlockScaling()
    raise CaptureError(f"unknown precision {precision!r}; expected one of {PRECISIONS}")


def _fresh_function(fn: Callable) -> Callable:
    """``fn`` with a new code object, so Dynamo's per-code cache starts empty for every capture
    (no recompiles against earlier captures' guards, no recompile limit, nothing kept alive)."""
    code = fn.__code__.replace(co_name=f"te_capture_{next(_counter)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


class _NeverRun(Exception):
    """Raised by the recording backend's compiled callable: the captured graph is never run."""


def _resolve_model(model: str | None, layers: int) -> str:
    if layers < 1:
        raise CaptureError(f"layers must be >= 1, got {layers}")
    if model is None:
        return "linear" if layers == 1 else "stack"
    if model not in MODELS:
        raise CaptureError(f"unknown model {model!r}; expected one of {MODELS}")
    if model == "linear" and layers != 1:
        return "stack"
    return model


# --------------------------------------------------------------------------- Dynamo capture
def capture_dynamo(model: str | None = "linear", precision: str = "fp8-cs", layers: int = 1,
                   tokens: int = 32, hidden: int = 64, out_features: int | None = None, *,
                   training: bool = True, fake_ub: bool | None = None, ub_fp8: Any = None,
                   **linear_kwargs: Any) -> CapturedGraph:
    """Capture the Dynamo graph of a TE model without a GPU.

    Mirrors ``torch.compile(fn, backend=..., fullgraph=True, dynamic=False)(x)`` where ``fn`` runs
    ``te.Linear`` layer(s) inside ``te.autocast(enabled=True, recipe=recipe)`` (fp8) — TE 2.20.2
    then traces each layer as ``torch.ops.transformer_engine_compile.linear``
    (``module/linear.py`` ``Linear.forward`` → ``_linear_op``).

    Args:
        model: ``"linear"`` — ``te.Linear(hidden, out_features)``; ``"stack"`` — ``layers``
            ``te.Linear`` with ``torch.nn.functional.gelu`` between, all ``hidden -> hidden``
            except the last (``hidden -> out_features``); ``None`` picks ``"linear"`` for
            ``layers == 1`` else ``"stack"``; ``"linear"`` with ``layers > 1`` means ``"stack"``.
        precision: one of :data:`PRECISIONS`.
        layers: number of ``te.Linear`` layers (1 for ``"linear"``).
        tokens, hidden: the input is bf16[tokens, hidden] with ``requires_grad=True``
            (row-parallel: bf16[tokens, hidden / tp_size], the first layer's weight width).
        out_features: the last layer's output width; default ``2 * hidden`` for ``"linear"``
            (the reference graphs' ``te.Linear(64, 128)``) and ``hidden`` for ``"stack"``.
        training: ``False`` traces under ``torch.no_grad()`` (inference graph).
        fake_ub: install fake Userbuffers communicators (see :func:`fake_gpu`); default: when
            ``linear_kwargs`` sets any ``ub_*`` overlap flag.
        ub_fp8: what the fake communicators' ``is_fp8_ubuf()`` answers in FP8 mode: ``None``
            (default) — :data:`DEFAULT_UB_FP8` (TE's default UB config); a bool for every
            buffer; or ``{"qkv_fprop": bool, ...}`` overriding the defaults per buffer.
        **linear_kwargs: passed to every ``te.Linear`` (``bias``, ``parallel_mode``,
            ``sequence_parallel``, ``tp_size``, ``ub_name``, ``ub_overlap_*``, ...). Params are
            ``params_dtype=torch.bfloat16, device="cuda"`` unless given. With ``tp_size > 1``
            and no ``tp_group`` there is no process group: the layers get
            ``set_tensor_parallel_group(None)`` (TE's required call), so the config bundles
            carry ``tp_group=None`` where a real run carries the group's name; TP collectives
            live inside the TE ops and are not in the graph either way.

    Returns:
        :class:`CapturedGraph`.

    Raises:
        CaptureError: TE not importable, unknown precision/model, or TE fell back to eager
            (``fullgraph`` graph break; the message carries TE's reason).
    """
    model = _resolve_model(model, layers)
    te = _import_te()
    from torch._subclasses.fake_tensor import FakeTensorMode

    if out_features is None:
        out_features = 2 * hidden if model == "linear" else hidden
    if fake_ub is None:
        fake_ub = any(bool(linear_kwargs.get(k)) for k in _UB_FLAGS)
    recipe = _make_recipe(precision)
    kwargs = dict(linear_kwargs)
    kwargs.setdefault("params_dtype", torch.bfloat16)
    kwargs["device"] = "cuda"

    with _lock, _quiet(), fake_gpu(precision, fake_ub=fake_ub, ub_fp8=ub_fp8):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode, _constructing():
            dims = [hidden] * layers + [out_features]
            mods = torch.nn.ModuleList(te.Linear(dims[i], dims[i + 1], **kwargs) for i in range(layers))
            for lin in mods:
                if lin.tp_size > 1 and not getattr(lin, "tp_group_initialized", False):
                    lin.set_tensor_parallel_group(kwargs.get("tp_group"))
            # Row-parallel layers take their input's shard: [tokens, in_features / tp_size].
            in_width = int(mods[0].weight.shape[-1])
            x = torch.randn(tokens, in_width, dtype=torch.bfloat16, device="cuda", requires_grad=True)

        gelu = torch.nn.functional.gelu

        def step(inp):
            with (te.autocast(enabled=True, recipe=recipe) if recipe is not None else contextlib.nullcontext()):
                for i, lin in enumerate(mods):
                    if i:
                        inp = gelu(inp)
                    inp = lin(inp)
            return inp

        recorded: list[tuple[torch.fx.GraphModule, list[Any]]] = []

        def backend(gm, example_inputs):
            recorded.append((gm, list(example_inputs)))

            def never_run(*args, **kwargs):
                raise _NeverRun()
            return never_run

        fn = torch.compile(_fresh_function(step), backend=backend, fullgraph=True, dynamic=False)
        try:
            with mode, (contextlib.nullcontext() if training else torch.no_grad()):
                fn(x)
        except _NeverRun:
            pass
        except Exception as e:  # noqa: BLE001 - re-raised with context
            raise CaptureError(f"capturing {model} x{layers} {precision} failed: {type(e).__name__}: "
                               f"{_first_line(e)}") from e
    if len(recorded) != 1:
        raise CaptureError(f"expected one Dynamo graph, got {len(recorded)}")
    gm, example_inputs = recorded[0]
    return CapturedGraph(gm=gm, example_inputs=example_inputs, precision=precision, model=model,
                         layers=layers, tokens=tokens, hidden=hidden, out_features=out_features,
                         linear_kwargs=dict(linear_kwargs), training=training, te_version=_te_version())


def _first_line(e: BaseException) -> str:
    """The informative part of a (Dynamo) exception message: TE's eager-fallback reason, the
    exception Dynamo observed, or the first line."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    for ln in lines:
        if "falling back to eager" in ln:
            return ln[ln.index("te.") if "te." in ln else 0:]
    for ln in lines:
        if ln.startswith("Developer debug context:"):
            return ln.removeprefix("Developer debug context:").strip()
    return lines[0] if lines else type(e).__name__


# --------------------------------------------------------------------------- AOT capture
def _to_device(t: Any, mode, device: str) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    with mode, (_constructing() if device == "cuda" else contextlib.nullcontext()):
        out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)
    if t.requires_grad:
        out.requires_grad_(True)
    return out


def _placeholder_vals(gm: torch.fx.GraphModule) -> list[Any]:
    return [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]


def _retarget_devices(gm: torch.fx.GraphModule) -> int:
    """Rewrite ``device=meta`` constants (none are expected) to ``cuda``; returns how many."""
    meta, cuda = torch.device("meta"), torch.device("cuda", 0)
    n_changed = 0

    def fix(a):
        nonlocal n_changed
        if isinstance(a, torch.device) and a == meta:
            n_changed += 1
            return cuda
        return a

    for node in gm.graph.nodes:
        node.args = torch.fx.node.map_aggregate(node.args, fix)
        node.kwargs = torch.fx.node.map_aggregate(node.kwargs, fix)
    if n_changed:
        gm.recompile()
    return n_changed


def _repropagate_cuda(gm: torch.fx.GraphModule, mode) -> list[Any]:
    """Re-run ``gm`` on fake ``cuda`` inputs (``FakeTensorProp``) so every ``meta["val"]`` is on
    ``cuda:0``; returns those inputs."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    _retarget_devices(gm)
    inputs = [_to_device(v, mode, "cuda") if isinstance(v, torch.Tensor) else v for v in _placeholder_vals(gm)]
    with torch.no_grad():
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
    return inputs


class _HookError(Exception):
    """Wraps an exception raised by a ``stage_hook`` (re-raised unwrapped by :func:`capture_aot`)."""


def _reraise_hook_error(e: BaseException) -> None:
    """Re-raise the ``stage_hook``'s own exception if ``e`` wraps one (at any depth)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, _HookError) and e.__cause__ is not None:
            raise e.__cause__
        e = e.__cause__ or e.__context__


class _StopAtHook(Exception):
    """Raised by the recording ``post_grad_custom_pre_pass``: nothing after the hook runs."""


#: ``stage_hook(stage, gm, example_inputs)``: called where Inductor's custom-pass hooks run, on
#: the live graph (it may rewrite it in place, as the backend's passes do); ``stage`` is
#: ``"joint"``, ``"post_grad_fwd"`` or ``"post_grad_bwd"``.
StageHook = Callable[[str, torch.fx.GraphModule, list[Any]], None]


def _recording_pass(sink: dict, key: str, stop: bool, hook: Callable[[torch.fx.GraphModule], None] | None = None):
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _Record(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            gm = graph.owning_module
            if hook is not None:
                try:
                    hook(gm)
                except Exception as e:  # noqa: BLE001 - re-raised by capture_aot
                    raise _HookError() from e
            sink[key] = gm if stop else _copy_gm(gm)
            if stop:
                raise _StopAtHook()

        def uuid(self) -> str:
            return f"te_passes.testing.capture.{key}"

    return _Record()


def _post_grad_prefix(gm: torch.fx.GraphModule, mode, is_inference: bool, stage: str,
                      stage_hook: StageHook | None = None) -> tuple[torch.fx.GraphModule, list[Any]]:
    """Bring a partitioned graph to the state Inductor's ``post_grad_custom_pre_pass`` sees it
    in: ``view_to_reshape``, fake-tensor propagation (on fake ``cuda`` inputs), then
    ``post_grad_passes`` up to the custom pre-pass hook (``eliminate_dead_code``, ...), where a
    recording pass (after ``stage_hook``) stops it (torch 2.14 ``compile_fx._compile_fx_inner``
    → ``fx_codegen_and_compile``)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.fx_passes.post_grad import post_grad_passes, view_to_reshape

    view_to_reshape(gm)
    inputs = _repropagate_cuda(gm, mode)
    sink: dict[str, Any] = {}
    hook = None if stage_hook is None else (lambda g: stage_hook(stage, g, inputs))
    try:
        with inductor_config.patch(post_grad_custom_pre_pass=_recording_pass(sink, "post_grad", True, hook)):
            post_grad_passes(gm, is_inference=is_inference)
    except _StopAtHook:
        pass
    if "post_grad" not in sink:  # pragma: no cover - Inductor without the hook
        raise CaptureError("Inductor's post_grad_passes did not reach post_grad_custom_pre_pass")
    gm = sink["post_grad"]
    gm.recompile()
    return gm, inputs


def _unflatten_like(structure: Any, flat: list[Any]) -> Any:
    """``flat`` (leaves in order) shaped like ``structure`` (AOT's joint inputs are
    ``[primals, tangents]``)."""
    leaves, spec = torch.utils._pytree.tree_flatten(structure)
    if len(leaves) != len(flat):  # pragma: no cover - placeholders always match the leaves
        raise CaptureError(f"joint graph has {len(flat)} placeholders for {len(leaves)} inputs")
    return torch.utils._pytree.tree_unflatten(flat, spec)


def capture_aot(model: str | None = "linear", precision: str = "fp8-cs", layers: int = 1,
                tokens: int = 32, hidden: int = 64, out_features: int | None = None, *,
                training: bool = True, partitioner: str = "min_cut",
                dynamo: CapturedGraph | None = None, stage_hook: StageHook | None = None,
                **kwargs: Any) -> CapturedAOT:
    """Capture the AOTAutograd graphs (joint, forward, backward) of a TE model without a GPU.

    Mirrors what ``compile_fx`` (torch 2.14.1, ``torch._inductor.compile_fx``) feeds Inductor's
    custom-pass hooks: ``aot_module_simplified(gm, example_inputs, decompositions=
    select_decomp_table(), partition_fn=compile_fx.partition_fn, keep_inference_input_mutations=
    True)`` on the Dynamo graph. ``joint`` is recorded where ``joint_custom_pre_pass`` runs
    (inside ``joint_graph_passes``, after ``canonicalize_aten_ir_passes``); Inductor's joint
    passes then run and ``min_cut_rematerialization_partition(compiler="inductor")`` splits
    the graph; ``forward`` / ``backward`` are recorded where ``post_grad_custom_pre_pass`` runs
    (after ``view_to_reshape``, fake-tensor propagation and ``eliminate_dead_code``). See the
    module docstring for how the joint trace avoids CUDA.

    Args:
        model, precision, layers, tokens, hidden, out_features, training, **kwargs: as for
            :func:`capture_dynamo` (ignored when ``dynamo`` is given: its own ``training``
            applies).
        partitioner: ``"min_cut"`` (Inductor's; default) or ``"default"``
            (``torch._functorch.partitioners.default_partition``, e.g. ``aot_eager``'s: the
            backward then re-runs a dead ``linear.default``, TE ops being side-effecting).
        dynamo: an existing :class:`CapturedGraph` to lower instead of capturing a new one (it
            is not modified).
        stage_hook: ``stage_hook(stage, gm, example_inputs)`` is called on the live graph where
            ``joint_custom_pre_pass`` (``"joint"``, before partitioning) and
            ``post_grad_custom_pre_pass`` (``"post_grad_fwd"`` / ``"post_grad_bwd"``) run, and
            may rewrite it in place — what the backend's passes do (:func:`run_pipeline` uses
            it). The recorded graphs are taken after the hook.

    Returns:
        :class:`CapturedAOT` (``backward`` / ``joint`` are ``None`` for ``training=False``).

    Raises:
        CaptureError: as :func:`capture_dynamo`, or AOTAutograd failed (chained).
    """
    if dynamo is None:
        dynamo = capture_dynamo(model, precision, layers, tokens, hidden, out_features,
                                training=training, **kwargs)
    training = dynamo.training
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import default_partition
    from torch._inductor import compile_fx as inductor_compile_fx
    from torch._inductor import config as inductor_config
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode

    if partitioner not in ("min_cut", "default"):
        raise CaptureError(f"unknown partitioner {partitioner!r}; expected 'min_cut' or 'default'")

    rec: dict[str, Any] = {}

    def joint_hook(gm):
        if stage_hook is not None:
            stage_hook("joint", gm, rec["joint_inputs"])

    def partition_fn(joint, joint_inputs, **kw):
        # Inductor's joint passes must see cuda values: its constant folder treats any
        # meta-device value as a known constant and would replace TE op outputs.
        cuda_inputs = _repropagate_cuda(joint, mode)
        rec["joint_inputs"] = cuda_inputs
        if partitioner == "default":
            kw["partitioner_fn_override"] = default_partition
        fw, bw = inductor_compile_fx.partition_fn(joint, _unflatten_like(joint_inputs, cuda_inputs), **kw)
        rec["forward"], rec["backward"] = fw, bw
        return fw, bw

    def inference_compiler(gm, example_inputs):
        rec["forward"] = gm
        return gm.forward

    gm = _copy_gm(dynamo.gm)
    fake_ub = any(bool(dynamo.linear_kwargs.get(k)) for k in _UB_FLAGS)
    with _lock, _quiet(), fake_gpu(dynamo.precision, fake_ub=fake_ub):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        meta_inputs = [_to_device(t, mode, "meta") for t in dynamo.example_inputs]
        try:
            with mode, (contextlib.nullcontext() if training else torch.no_grad()), \
                    inductor_config.patch(joint_custom_pre_pass=_recording_pass(rec, "joint", False, joint_hook)):
                aot_module_simplified(gm, meta_inputs, fw_compiler=lambda g, _: g.forward,
                                      bw_compiler=lambda g, _: g.forward,
                                      inference_compiler=inference_compiler, partition_fn=partition_fn,
                                      decompositions=select_decomp_table(),
                                      keep_inference_input_mutations=True)
        except Exception as e:  # noqa: BLE001
            _reraise_hook_error(e)
            raise CaptureError(f"AOTAutograd on {dynamo.model} x{dynamo.layers} {dynamo.precision} failed: "
                               f"{type(e).__name__}: {_first_line(e)}") from e
        fw, bw, joint = rec.get("forward"), rec.get("backward"), rec.get("joint")
        if fw is None:
            raise CaptureError("AOTAutograd produced no forward graph")
        try:
            fw, fw_inputs = _post_grad_prefix(fw, mode, bw is None, "post_grad_fwd", stage_hook)
            bw_inputs: list[Any] = []
            if bw is not None:
                bw, bw_inputs = _post_grad_prefix(bw, mode, False, "post_grad_bwd", stage_hook)
            joint_inputs = _repropagate_cuda(joint, mode) if joint is not None else []
        except CaptureError:
            raise
        except Exception as e:  # noqa: BLE001
            _reraise_hook_error(e)
            raise CaptureError(f"post-grad preparation of {dynamo.model} x{dynamo.layers} {dynamo.precision} "
                               f"failed: {type(e).__name__}: {_first_line(e)}") from e
    return CapturedAOT(forward=fw, backward=bw, joint=joint, forward_inputs=fw_inputs,
                       backward_inputs=bw_inputs, joint_inputs=joint_inputs, dynamo=dynamo,
                       partitioner=partitioner)


# --------------------------------------------------------------------------- cached access
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
        return f"TE {_te_version()} is not a version te_passes decodes"
    return None


_CACHE: dict[tuple, Any] = {}


def _cache_key(kind: str, args: dict[str, Any]) -> tuple | None:
    key = (kind, _te_version(), torch.__version__, tuple(sorted(args.items())))
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
    with _lock:
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
    with _lock:
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
        passes: pass instances (default: the registry's, ``PassManager()``; an empty registry
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
    compilation = Compilation(PassManager(passes=passes), options, te_state, CompileReport(graph_id=graph_id))
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
        with _quiet(), fake_gpu(dyn.precision):
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
    with _quiet(), fake_gpu(captured.precision):
        for stage, gm, inputs in jobs:
            run(stage, gm, inputs)
    return reports


__all__ = [
    "PRECISIONS", "MODELS", "DEVICE_CAPABILITY", "DEFAULT_UB_FP8", "CaptureError", "CapturedGraph", "CapturedAOT",
    "capture_dynamo", "capture_aot", "run_pipeline", "cached_dynamo", "cached_aot",
    "capture_skip_reason", "fake_gpu", "te_op_names", "node_value",
]
