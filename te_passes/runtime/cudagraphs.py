"""Lean CUDA-graph replay for te_inductor graphs: ``te_passes.cudagraphs="lean"`` (issue 14).

Under ``mode="reduce-overhead"`` Inductor wraps every compiled graph with CUDA graph trees
(``torch/_inductor/cudagraph_trees.py``, torch 2.14), which check invariants, liveness and
generations on every replay. torch 2.14 lets a backend replace that wrapping per compiled graph
through ``torch._inductor.config.cudagraph_policy`` (:class:`CUDAGraphPolicy` in
``torch/_inductor/cudagraph_utils.py``; called from ``cudagraph_post_compile`` in
``torch/_inductor/output_code.py`` with the graph's static input indices, ``is_backward``,
``is_inference``, ``mutated_input_idxs``, ``constants``, ``kernel_free_cudagraph`` ...).
:class:`LeanCUDAGraphPolicy` is that policy for te_inductor graphs; the backend installs it
(``config_patches["cudagraph_policy"]``) only when Inductor's cudagraphs are on and
``te_passes.cudagraphs="lean"`` (opt-in; the default is ``"trees"``, docs/usage.md says why).

What one :class:`LeanCUDAGraph` does (the replay model of TE's ``make_graphed_callables``,
``transformer_engine/pytorch/graph.py``, TE 2.20.2, with its hazards checked instead of assumed):

* warm-up on a side stream (the capture stream), then capture on a later call once the static
  inputs (parameters, buffers; for a backward graph also the saved tensors) sit at the same
  address as on the previous call or in a lean graph's static outputs;
* static inputs are never copied; a non-static input is copied into its static buffer only
  when its ``data_ptr`` differs from the buffer's;
* one private memory pool per forward/backward pair: the forward captures into a new pool,
  its backward (found by data flow: its saved-tensor inputs are the forward's static outputs)
  captures into the same pool afterwards, so the backward's temporaries reuse the forward's;
* outputs: a forward's user-visible outputs (``fw_metadata.num_forward`` first outputs, or on
  an AOTAutograd cache hit those its backward's warm-up did not read) are cloned (a caller may
  keep them across steps); saved tensors and backward gradients are returned as fresh aliases
  of the static outputs (``detach``), so whoever keeps one shows up in its storage's use count;
* the capture run is given other tensor objects than the ones kept for replay (TE's fp8
  backward rebinds the quantized input it owns: ``clear_tensor_data``, ``t.data = empty``).

Safety rule checked before every replay (the reason pool sharing is safe in any call order):
a replay of graph G writes only G's static outputs, G's static input buffers and blocks that
were free in G's pool when G was captured. Those blocks can hold live data only in outputs of
graphs captured later in the same pool. So G replays only when no output of G or of a graph
captured after it in its pool is referenced beyond the runners' own references
(``torch._C._storage_Use_Count`` against the references the wrappers hold themselves). Otherwise this call
runs the compiled graph without a CUDA graph (correct, slower), and the reason is recorded:

* G's saved tensors still referenced and its backward has not run since: a second forward
  before its backward (pipeline schedules, forward without backward while the graph is kept);
* a backward output still referenced at the next backward replay (AccumulateGrad kept it as
  ``.grad``: gradient accumulation without ``zero_grad(set_to_none=True)``), or at the next
  forward replay: that output is cloned from then on (TE's ``clone_param_grads_on_return``);
* a forward output still referenced after its backward ran (``retain_graph``, a kept view):
  cloned from then on;
* a static input moved: copied into the static output of the lean graph that owns the old
  address when that output is not referenced (a forward that ran without a CUDA graph), else
  run without a CUDA graph.

Static hazards, decided when the policy is called (falls back to cudagraph trees through
``super().cudagraphify``, or for a backward whose forward is lean, to no CUDA graph): dynamic
shapes, non-CUDA inputs, mutated inputs that are not static, kernel-free graphs, a graph that
reads Userbuffers state while UB is initialised (UB communicators captured into a graph);
graphs with more than one Inductor partition are not wrapped at all
(:meth:`LeanCUDAGraphPolicy.should_wrap`). After each capture, Inductor's pool-liveness check
(``_cuda_checkPoolLiveAllocations``, as cudagraph trees use it) must find exactly the pool's
outputs alive; a failed capture or a leaked pool tensor leaves that graph without a CUDA graph.
Every decision and fallback is a record in
``CompileReport.cudagraphs`` (``report.json``) and a ``te_passes`` log line.

The capture/replay engine (CUDA graphs, pools, streams) is injectable (:class:`CudaGraphEngine`),
so the policy's decisions are tested on CPU with a fake engine (tests/test_cudagraph_policy.py).
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from typing import Any, Callable, Sequence

import torch
from torch._inductor.cudagraph_utils import CUDAGraphPolicy

from te_passes._logging import get_logger

log = get_logger()

#: ``te_passes.cudagraphs`` values: ``"lean"`` (this module, opt-in) or ``"trees"`` (Inductor's, the default).
CUDAGRAPH_MODES = ("lean", "trees")

_PASS, _ALIAS, _CLONE, _CLONE_STRIDED = 0, 1, 2, 3
_SEQ = itertools.count(1)  # global call sequence: orders forward replays and backward calls


# ----------------------------------------------------------------------------------- engine
class CudaGraphEngine:
    """Real CUDA capture/replay: ``torch.cuda.CUDAGraph``, ``torch.cuda.graph_pool_handle``, one
    side stream per device for warm-up and capture (as Inductor's ``cudagraphify_impl`` and TE's
    ``make_graphed_callables`` do). Tests substitute an object with the same methods."""

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}

    def _stream(self, device_index: int):
        s = self._streams.get(device_index)
        if s is None:
            s = self._streams[device_index] = torch.cuda.Stream(device=device_index)
        return s

    def new_pool(self, device_index: int) -> Any:
        """A fresh private memory pool handle (``torch.cuda.graph_pool_handle()``)."""
        return torch.cuda.graph_pool_handle()

    def is_capturing(self) -> bool:
        """Whether the current stream is being captured by someone else's CUDA graph."""
        return torch.cuda.is_current_stream_capturing()

    def warmup(self, fn: Callable, inputs: list, device_index: int):
        """Run ``fn(inputs)`` on the side stream, ordered after and before the current stream."""
        cur = torch.cuda.current_stream(device_index)
        s = self._stream(device_index)
        s.wait_stream(cur)
        with torch.cuda.stream(s):
            out = fn(inputs)
        cur.wait_stream(s)
        return out

    def capture(self, fn: Callable, inputs: list, pool: Any, device_index: int, kept_inputs: Sequence[Any] = ()):
        """Capture ``fn(inputs)`` into a new ``CUDAGraph`` in ``pool`` on the side stream
        (RNG state preserved around the capture as Inductor's ``cudagraphify`` does).
        ``kept_inputs``: tensors at the same addresses as ``inputs`` that the caller keeps alive
        for the replays (a CUDA graph records addresses only, so this engine ignores them).
        Returns ``(graph, outputs)``; the outputs hold no values until the first replay."""
        from torch._dynamo.utils import preserve_rng_state

        cur = torch.cuda.current_stream(device_index)
        s = self._stream(device_index)
        s.wait_stream(cur)
        graph = torch.cuda.CUDAGraph()
        with preserve_rng_state():
            with torch.cuda.graph(graph, pool=pool, stream=s, capture_error_mode="thread_local"):
                out = fn(inputs)
        cur.wait_stream(s)
        return graph, out

    def replay(self, graph: Any) -> None:
        graph.replay()

    def pool_is_clean(self, device_index: int, pool: Any, live_storage_ptrs: set[int]) -> bool:
        """Whether the storages live in ``pool`` are exactly ``live_storage_ptrs`` (Inductor's
        fast check ``torch._C._cuda_checkPoolLiveAllocations``, as cudagraph trees'
        ``check_memory_pool`` calls it after recording)."""
        return bool(torch._C._cuda_checkPoolLiveAllocations(device_index, pool, live_storage_ptrs))

    def ensure_tree_manager(self, device_index: int) -> None:
        """Create Inductor's cudagraph-tree manager for the device: a backward graph that Inductor
        refuses to cudagraph looks it up (``maybe_handle_backward_generation``, output_code.py)
        and asserts it exists whenever the forward was cudagraphed."""
        from torch._inductor import cudagraph_trees

        cudagraph_trees.get_manager(device_index, create_if_none_exists=True)


_use_count = torch._C._storage_Use_Count
_now_ns = time.perf_counter_ns


def _clone_kind(t: torch.Tensor) -> int:
    """``_CLONE`` (``Tensor.clone`` keeps the strides of a dense tensor) or ``_CLONE_STRIDED``
    (Inductor's ``clone_preserve_strides`` for an overlapping / non-dense output)."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false

    return _CLONE if is_non_overlapping_and_dense_or_false(t) else _CLONE_STRIDED


def _own_references(cdatas: Any, tensors: Sequence[Any]) -> dict[int, int]:
    """Per storage ``cdata`` in ``cdatas``: the references on it we account for — one per distinct
    tensor object of ``tensors`` using it, plus one for its Python storage object
    (``untyped_storage()`` creates it once and PyObject preservation keeps it, and its reference,
    for the storage's lifetime; cudagraph trees' ``StorageWeakRefWrapper.expired`` counts it too)."""
    counts = dict.fromkeys(cdatas, 1)
    seen: set[int] = set()
    for t in tensors:
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            cd = t.untyped_storage()._cdata
            if cd in counts:
                counts[cd] += 1
    return counts


def _emit(plan: list[tuple[int, Any]]) -> list:
    """The outputs one call returns, from the capture's plan (hot path)."""
    return [o if k == _PASS else o.detach() if k == _ALIAS else o.clone() if k == _CLONE else _clone_strided(o)
            for k, o in plan]


def _clone_strided(t: torch.Tensor) -> torch.Tensor:
    from torch._inductor.utils import clone_preserve_strides

    return clone_preserve_strides(t)


# ------------------------------------------------------------------------------- recording
class CudagraphRecorder:
    """Collects the policy's decisions and fallbacks as dicts ``{"graph", "event", "reason",
    "count", ...}`` (one per graph, event and reason; ``count`` counts repeats) into ``sink``
    (``CompileReport.cudagraphs``), logs the first of each and calls ``refresh()`` then (the
    dump writer rewrites report.json)."""

    def __init__(self, sink: list | None = None, refresh: Callable[[], Any] | None = None) -> None:
        self.records: list[dict[str, Any]] = sink if sink is not None else []
        self._refresh = refresh
        self._index: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._lock = threading.Lock()

    def event(self, graph: str, event: str, reason: str, **data: Any) -> dict[str, Any]:
        key = (graph, event, reason)
        with self._lock:
            rec = self._index.get(key)
            if rec is not None:
                rec["count"] += 1
                return rec
            rec = {"graph": graph, "event": event, "reason": reason, "count": 1, **data}
            self._index[key] = rec
            self.records.append(rec)
        log.info("te_passes cudagraphs: %s %s: %s", graph, event, reason)
        if self._refresh is not None:
            try:
                self._refresh()
            except Exception as exc:  # noqa: BLE001 - a dump failure must not break a training step
                log.warning("te_passes cudagraphs: report refresh failed: %s", exc)
        return rec


# --------------------------------------------------------------------- pools and ownership
class _Pool:
    """One private memory pool and the lean graphs captured into it, in capture order."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.members: list[LeanCUDAGraph] = []
        self.version = 0

    def add(self, runner: "LeanCUDAGraph") -> None:
        self.members.append(runner)
        self.version += 1

    def later_or_self(self, runner: "LeanCUDAGraph") -> list["LeanCUDAGraph"]:
        i = self.members.index(runner)
        return self.members[i:]


#: data_ptr of a lean graph's static output -> (runner weakref, storage cdata, output index)
_OWNERS: dict[int, tuple[Any, int, int]] = {}
#: data_ptr of an output of a forward's last call before capture -> (runner weakref, output index);
#: a backward that reads it as a static input marks that output "saved" (SAVED_BY_DATAFLOW).
_RECENT: dict[int, tuple[Any, int]] = {}

#: ``num_clone_outputs`` value: tell user outputs from saved tensors by data flow (the outputs of
#: the forward's warm-up call that its backward's warm-up call reads are saved tensors).
SAVED_BY_DATAFLOW = -1


def _owner(ptr: int) -> tuple["LeanCUDAGraph", int, int] | None:
    hit = _OWNERS.get(ptr)
    if hit is None:
        return None
    runner = hit[0]()
    if runner is None or runner._graph is None:
        _OWNERS.pop(ptr, None)
        return None
    return runner, hit[1], hit[2]


_RUNNERS: "weakref.WeakSet[LeanCUDAGraph]" = weakref.WeakSet()


def lean_runners() -> list["LeanCUDAGraph"]:
    """The live :class:`LeanCUDAGraph` wrappers of this process (tests, benchmarks, debugging:
    their ``stats`` and ``output_kinds()``), in no particular order."""
    return list(_RUNNERS)


def _forget(ptrs: list[int], ref: Any) -> None:
    for p in ptrs:
        if _OWNERS.get(p, (None,))[0] is ref:
            _OWNERS.pop(p, None)


# ---------------------------------------------------------------------------------- runner
class LeanCUDAGraph:
    """The CUDA-graph wrapper of one compiled Inductor graph (boxed calling convention:
    ``runner(inputs: list) -> list``; the list is cleared, as Inductor's callables do).

    Args:
        model: Inductor's compiled callable (``CompiledFxGraph.current_callable``).
        static_input_idxs: inputs at a fixed address (parameters, buffers; for a backward graph
            every non-tangent input, i.e. saved tensors too: ``compile_fx_backward``).
        name: graph name for records (``"g0.fwd"``).
        device_index: CUDA device.
        is_backward / is_inference: as Inductor passes them.
        mutated_input_idxs: inputs the graph mutates (must be static; checked by the policy).
        num_clone_outputs: outputs ``[0, n)`` are cloned on return (a forward's user-visible
            outputs; every output of an inference graph); ``None``: all;
            :data:`SAVED_BY_DATAFLOW`: every output but those a backward read before capture.
        constants: Inductor's tensor constants (outputs aliasing them are returned as they are).
        engine: capture/replay engine (:class:`CudaGraphEngine` or a test double).
        recorder: where decisions and fallbacks go.
        warmup_calls: calls run (on the side stream) before the first capture.
        max_unready_calls: calls after which a graph whose static inputs never settle is run
            without a CUDA graph for good (recorded).

    ``stats`` counts ``warmup``, ``capture``, ``replay``, ``eager`` (calls run without the CUDA
    graph) and ``copies`` (non-static inputs copied); ``replay_host_ns`` sums the host time of the
    calls that took the replay path (checks, copies, the replay launch, building the outputs;
    nanoseconds, ``time.perf_counter_ns``; a call that fell back from there includes running the
    compiled graph). Per-reason counts of the fallbacks are the records' ``count``.
    """

    def __init__(self, model: Callable, static_input_idxs: Sequence[int], *, name: str, device_index: int,
                 is_backward: bool, is_inference: bool, mutated_input_idxs: Sequence[int] = (),
                 num_clone_outputs: int | None = None, constants: Sequence[torch.Tensor] = (),
                 engine: Any = None, recorder: CudagraphRecorder | None = None, warmup_calls: int = 1,
                 max_unready_calls: int = 8) -> None:
        self._model = model
        self._static_idx: tuple[int, ...] = tuple(sorted(set(int(i) for i in static_input_idxs)))
        self._mutated = frozenset(mutated_input_idxs)
        self.name = name
        self.device_index = device_index
        self.is_backward = is_backward
        self.is_inference = is_inference
        self._num_clone = num_clone_outputs
        self._constants = tuple(c for c in constants if isinstance(c, torch.Tensor))
        self._engine = engine if engine is not None else CudaGraphEngine()
        self._rec = recorder if recorder is not None else CudagraphRecorder()
        self._warmup_calls = warmup_calls
        self._max_unready = max_unready_calls
        self._graph: Any = None
        self._pool: _Pool | None = None
        self._calls = 0
        self._last_ptrs: list[int | None] | None = None
        self._disabled: str | None = None
        self._static_inputs: list = []
        self._static_ptrs: list[int] = []
        self._copy: list[tuple[int, list[int]]] = []
        self._plan: list[tuple[int, Any]] = []
        self._own: list[list] = []           # [cdata, baseline use count, output index]
        self._pool_storages: set[int] = set()  # storages of outputs allocated in the pool
        #: bytes of pool memory this graph's outputs hold from its capture on (distinct storages):
        #: for a forward, its saved tensors, which its backward cannot reuse (cudagraph trees can)
        self.held_bytes = 0
        self._check_cache: tuple[int, tuple, list, list] | None = None
        self._last_replay_seq = 0
        self._last_call_seq = 0
        self._consumed: set[int] = set()     # outputs a backward read (SAVED_BY_DATAFLOW)
        self._recent: list[int] = []
        self._self_ref = weakref.ref(self)
        self.stats = {"warmup": 0, "capture": 0, "replay": 0, "eager": 0, "copies": 0, "replay_host_ns": 0}
        _RUNNERS.add(self)

    # -------------------------------------------------------------------------- helpers
    @property
    def captured(self) -> bool:
        return self._graph is not None

    @property
    def pool(self) -> _Pool | None:
        return self._pool

    def output_kinds(self) -> list[str]:
        """Per output: ``"pass"`` (not pool memory: a parameter, constant or non-tensor),
        ``"alias"`` or ``"clone"`` (empty before capture)."""
        return [("pass", "alias", "clone", "clone")[k] for k, _ in self._plan]

    def _ptrs(self, inputs: Sequence[Any]) -> list[int | None]:
        return [inputs[i].data_ptr() if isinstance(inputs[i], torch.Tensor) else None for i in self._static_idx]

    def _eager(self, inputs: list):
        self.stats["eager"] += 1
        return self._model(inputs)

    # ----------------------------------------------------------------------------- call
    def __call__(self, inputs: list):
        self._last_call_seq = next(_SEQ)
        if self._graph is not None:
            t0 = _now_ns()
            try:
                return self._replay(inputs)
            finally:
                self.stats["replay_host_ns"] += _now_ns() - t0
        if self._disabled is not None:
            return self._eager(inputs)
        return self._prepare(inputs)

    def _prepare(self, inputs: list):
        self._calls += 1
        if self._engine.is_capturing():
            self._rec.event(self.name, "eager", "called while the current stream is captured by another "
                            "CUDA graph: run inside that capture")
            return self._eager(inputs)
        ptrs = self._ptrs(inputs)
        last, self._last_ptrs = self._last_ptrs, ptrs
        ready = (self._calls > self._warmup_calls and last is not None
                 and all(p == q or (p is not None and _owner(p) is not None) for p, q in zip(ptrs, last)))
        if self.is_backward:
            for p in ptrs:
                hit = _RECENT.get(p) if p is not None else None
                fwd = hit[0]() if hit is not None else None
                if fwd is not None:
                    fwd._consumed.add(hit[1])
        if ready:
            return self._capture(inputs)
        if self._calls > self._max_unready:
            self._disabled = (f"static inputs (parameters / saved tensors) changed address on each of "
                              f"{self._calls} calls: never captured")
            self._rec.event(self.name, "disabled", self._disabled)
            return self._eager(inputs)
        self.stats["warmup"] += 1
        outs = self._engine.warmup(self._model, inputs, self.device_index)
        if self._num_clone == SAVED_BY_DATAFLOW:
            for p in self._recent:
                if _RECENT.get(p, (None,))[0] is self._self_ref:
                    del _RECENT[p]
            self._recent = [o.data_ptr() for o in outs if isinstance(o, torch.Tensor)]
            for j, o in enumerate(outs):
                if isinstance(o, torch.Tensor):
                    _RECENT[o.data_ptr()] = (self._self_ref, j)
        return outs

    def _capture(self, inputs: list):
        from torch._inductor.compile_fx import index_expanded_dims_and_copy_, static_input
        from torch._inductor.output_code import get_expanded_dims
        from torch._inductor.utils import tensor_is_aligned

        # ``call``: what the capture run gets; ``static``: what we keep. Never the same tensor
        # objects: a TE op may rebind the Python tensors it is given (``clear_tensor_data``:
        # ``t.data = empty`` on the quantized input it owns, in the fp8 backward) — harmless for
        # the caller's objects, fatal for the objects whose memory the graph replays into.
        call = list(inputs)
        static = list(inputs)
        static_set = {i for i in self._static_idx
                      if isinstance(static[i], torch.Tensor) and tensor_is_aligned(static[i])}
        self._static_idx = tuple(sorted(static_set))
        # A static input that is a lean graph's static output is held as that graph's own tensor
        # (no extra reference on its storage); else as our own alias (the owner, if any, is told
        # to expect that reference).
        owners: list[tuple[LeanCUDAGraph, int]] = []
        for i in self._static_idx:
            x = static[i]
            own = _owner(x.data_ptr()) if x.data_ptr() else None
            o = own[0]._plan[own[2]][1] if own is not None else None
            if o is not None and o.shape == x.shape and o.stride() == x.stride() and o.dtype == x.dtype:
                static[i] = o
                continue
            static[i] = x.detach()
            if own is not None:
                owners.append((own[0], own[1]))
        self._copy = []
        for i, x in enumerate(static):
            if i in static_set or not isinstance(x, torch.Tensor):
                continue
            dims = get_expanded_dims(x)
            buf = static_input(x)
            index_expanded_dims_and_copy_(buf, x, dims)
            static[i] = buf
            call[i] = buf.detach()
            self._copy.append((i, dims))
        kept_ptrs = [x.data_ptr() if isinstance(x, torch.Tensor) else None for x in static]
        # pool: a backward joins the pool of the forward whose static outputs it reads
        pool = None
        if self.is_backward:
            for i in self._static_idx:
                own = _owner(static[i].data_ptr())
                if own is not None and not own[0].is_backward and own[0]._pool is not None:
                    pool = own[0]._pool
                    break
        if pool is None:
            pool = _Pool(self._engine.new_pool(self.device_index))
        try:
            graph, outs = self._engine.capture(self._model, call, pool.handle, self.device_index, static)
        except Exception as exc:  # noqa: BLE001 - recorded; the graph then runs without a CUDA graph
            first = str(exc).splitlines()[0][:300] if str(exc) else ""
            self._disabled = f"capture failed ({type(exc).__name__}: {first}): runs without a CUDA graph"
            self._rec.event(self.name, "disabled", self._disabled)
            log.warning("te_passes cudagraphs: %s: %s", self.name, self._disabled)
            return self._eager(inputs)
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        del call
        if [x.data_ptr() if isinstance(x, torch.Tensor) else None for x in static] != kept_ptrs:
            self._disabled = "the graph re-bound the static input tensors kept for replay: runs without a CUDA graph"
            self._rec.event(self.name, "disabled", self._disabled)
            return self._eager(inputs)
        in_storages = {static[i].untyped_storage().data_ptr() for i in self._static_idx}
        lean_in = {}  # storage ptr of a static input that is a lean graph's output -> (owner, cdata)
        for i in self._static_idx:
            own = _owner(static[i].data_ptr())
            if own is not None:
                lean_in[static[i].untyped_storage().data_ptr()] = (own[0], own[1])
        in_storages |= {c.untyped_storage().data_ptr() for c in self._constants}
        in_storages.discard(0)
        n_clone = len(outs) if self._num_clone is None else self._num_clone
        dataflow = self._num_clone == SAVED_BY_DATAFLOW
        for p in self._recent:
            if _RECENT.get(p, (None,))[0] is self._self_ref:
                del _RECENT[p]
        plan: list[tuple[int, Any]] = []
        own_cdatas: dict[int, int] = {}
        ptrs: list[int] = []
        for j, o in enumerate(outs):
            if not isinstance(o, torch.Tensor):
                plan.append((_PASS, o))
                continue
            st = o.untyped_storage()
            if st.nbytes() == 0:  # no memory to guard (TE's empty placeholders); not in the pool
                plan.append((_ALIAS, o))
                continue
            if st.data_ptr() in in_storages:
                # a parameter / constant a forward returns (saved for backward): not ours to
                # guard. A backward output in a static input's memory (Inductor reusing a donated
                # saved tensor, which is the forward's static output): cloned, the next forward
                # replay would overwrite it.
                plan.append((_clone_kind(o) if self.is_backward else _PASS, o))
                if st.data_ptr() in lean_in:  # our reference to the owner's storage is expected
                    owners.append(lean_in[st.data_ptr()])
                continue
            saved = (j in self._consumed) if dataflow else j >= n_clone
            plan.append((_ALIAS if saved else _clone_kind(o), o))
            own_cdatas.setdefault(st._cdata, j)
            ptrs.append(o.data_ptr())
            _OWNERS[o.data_ptr()] = (self._self_ref, st._cdata, j)
            del st
        del outs
        self._plan = plan
        buffers = {static[i].untyped_storage().data_ptr() for i, _ in self._copy}
        self._pool_storages = {o.untyped_storage().data_ptr() for k, o in plan
                               if k != _PASS and o.untyped_storage().nbytes()} - buffers
        sizes = {o.untyped_storage().data_ptr(): o.untyped_storage().nbytes() for k, o in plan if k != _PASS}
        self.held_bytes = sum(sizes[p] for p in self._pool_storages)
        # Baselines: the references we hold ourselves (one per tensor object of ours on that
        # storage), never a measured count — a transient holder at capture (a local storage
        # object, the caller's aliases) would raise it and hide a later holder for good.
        expected = _own_references(own_cdatas, [o for _, o in plan] + list(static))
        self._own = [[cd, expected[cd], j] for cd, j in own_cdatas.items()]
        extra = [j for cd, j in own_cdatas.items() if _use_count(cd) > expected[cd]]
        if extra:
            self._rec.event(self.name, "referenced", f"outputs {extra} are referenced outside the graph right "
                            "after capture: calls run without the CUDA graph while they are", outputs=extra)
        for runner, cdata in owners:
            for item in runner._own:
                if item[0] == cdata:
                    item[1] += 1
            runner._pool.version += 1
        weakref.finalize(self, _forget, ptrs, self._self_ref)
        self._static_inputs = static
        self._static_ptrs = [static[i].data_ptr() for i in self._static_idx]
        self._graph = graph
        self._pool = pool
        pool.add(self)
        self.stats["capture"] += 1
        clean = getattr(self._engine, "pool_is_clean", None)
        if clean is not None and not clean(self.device_index, pool.handle,
                                           set().union(*(m._pool_storages for m in pool.members))):
            # what trees reports as "Detected N tensor(s) in the cudagraph pool not tracked as
            # outputs": a replay would overwrite memory someone still holds. Never replay it.
            self._graph = None
            self._disabled = ("tensors allocated in the pool during capture are still referenced but are not "
                              "graph outputs (a reference kept inside an opaque op?): runs without a CUDA graph")
            self._rec.event(self.name, "disabled", self._disabled)
            log.warning("te_passes cudagraphs: %s: %s", self.name, self._disabled)
            return self._eager(inputs)
        self._rec.event(self.name, "captured", "lean CUDA graph captured", pool=id(pool) & 0xFFFFFF,
                        pool_position=len(pool.members) - 1, static_inputs=len(self._static_idx),
                        copied_inputs=len(self._copy), outputs=self.output_kinds().count("alias"),
                        cloned_outputs=self.output_kinds().count("clone"))
        inputs.clear()
        self._engine.replay(graph)
        self.stats["replay"] += 1
        self._last_replay_seq = next(_SEQ)
        return _emit(plan)

    # ---------------------------------------------------------------------------- replay
    def _checks(self) -> tuple[tuple, list]:
        pool = self._pool
        cache = self._check_cache
        if cache is None or cache[0] != pool.version:
            items = [(m, item) for m in pool.later_or_self(self) for item in m._own]
            cache = self._check_cache = (pool.version, tuple(it[0] for _, it in items),
                                         [it[1] for _, it in items], items)
        return cache[1], cache[2]

    def _replay(self, inputs: list):
        if self._static_idx:
            ptrs = [inputs[i].data_ptr() for i in self._static_idx]
            if ptrs != self._static_ptrs and not self._fix_moved(inputs, ptrs):
                return self._eager(inputs)
        cdatas, base = self._checks()
        if list(map(_use_count, cdatas)) != base and not self._resolve_held():
            return self._eager(inputs)
        static = self._static_inputs
        for i, dims in self._copy:
            src, dst = inputs[i], static[i]
            if src.data_ptr() != dst.data_ptr():
                if dims:
                    from torch._inductor.compile_fx import index_expanded_dims_and_copy_

                    index_expanded_dims_and_copy_(dst, src, dims)
                else:
                    dst.copy_(src)
                self.stats["copies"] += 1
        inputs.clear()
        self._engine.replay(self._graph)
        self.stats["replay"] += 1
        self._last_replay_seq = next(_SEQ)
        return _emit(self._plan)

    def _fix_moved(self, inputs: list, ptrs: list[int]) -> bool:
        """Static inputs at a new address: copy each into the old one when the old one is a
        lean graph's static output nobody references (its forward ran without the CUDA graph)
        and the graph does not mutate it; else ``False`` (this call runs without the graph)."""
        fixes = []
        for i, p, q in zip(self._static_idx, ptrs, self._static_ptrs):
            if p == q:
                continue
            own = _owner(q)
            ok = own is not None and i not in self._mutated
            if ok:
                runner, cdata, _ = own
                ok = all(_use_count(it[0]) <= it[1] for it in runner._own if it[0] == cdata)
            if not ok:
                why = ("a saved tensor that is an output of a lean graph still referenced" if own is not None
                       else "a parameter / buffer re-assigned, or a saved tensor produced outside a lean graph")
                self._rec.event(self.name, "eager", f"static input {i} moved ({why}): this call runs without "
                                "the CUDA graph", input=i)
                return False
            fixes.append(i)
        for i in fixes:
            self._static_inputs[i].copy_(inputs[i])
            self.stats["copies"] += 1
        if fixes:
            self._rec.event(self.name, "copied", "saved tensors from a forward that ran without its CUDA graph "
                            "copied into the forward's static outputs", inputs=len(fixes))
        return True

    def _resolve_held(self) -> bool:
        """A use count differs from its baseline: find what is referenced and decide. Returns
        ``True`` when nothing is (counts only dropped: baselines re-taken) and the replay may go on."""
        held = []
        for member, item in self._check_cache[3]:
            now = _use_count(item[0])
            if now > item[1]:
                held.append((member, item))
        if not held:
            for _, item in self._check_cache[3]:
                item[1] = _use_count(item[0])
            self._pool.version += 1
            return True
        for member, item in held:
            j = item[2]
            kind, o = member._plan[j]
            if member.is_backward:
                if kind == _ALIAS:
                    member._plan[j] = (_clone_kind(o), o)
                where = ("its next replay" if member is self
                         else f"a replay of {self.name} (captured before it in the pool)")
                self._rec.event(member.name, "clone", f"backward output {j} still referenced at {where} "
                                "(kept as .grad: gradient accumulation, or zero_grad after forward): "
                                "cloned on return from now on", output=j)
                whose = "its previous replay" if member is self else member.name
                self._rec.event(self.name, "eager", f"an output of {whose} is still referenced: this call "
                                "runs without the CUDA graph")
            elif member is self and self._backward_ran_since_replay():
                if kind == _ALIAS:
                    member._plan[j] = (_clone_kind(o), o)
                self._rec.event(self.name, "clone", f"output {j} still referenced after its backward ran "
                                "(retain_graph, or a kept view): cloned on return from now on", output=j)
                self._rec.event(self.name, "eager", "an output of the previous replay is still referenced: this "
                                "call runs without the CUDA graph")
            elif member is self:
                self._rec.event(self.name, "eager", "saved tensors of the previous replay are still referenced "
                                "and its backward has not run (a second forward before its backward: gradient "
                                "accumulation over pending graphs, pipeline schedules): this call runs without "
                                "the CUDA graph", output=j)
            else:
                self._rec.event(self.name, "eager", f"output {j} of {member.name} (captured later in the same "
                                "pool) is still referenced: this call runs without the CUDA graph", output=j)
        return False

    def _backward_ran_since_replay(self) -> bool:
        return any(m.is_backward and m._last_call_seq > self._last_replay_seq for m in self._pool.members)


# ---------------------------------------------------------------------------------- policy
def forward_user_output_count() -> int | None:
    """How many leading outputs of the forward graph being compiled go back to the caller
    (mutated inputs, user outputs, intermediate bases, rng offset: AOTAutograd's
    ``ViewAndMutationMeta.num_forward``, torch/_functorch/_aot_autograd/schemas.py, torch 2.14);
    the rest are saved tensors. ``None`` when no AOTAutograd metadata is in the tracing context."""
    ctx = torch._guards.TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
    n = getattr(meta, "num_forward", None)
    return int(n) if isinstance(n, int) else None


def static_hazard(example_inputs: Sequence[Any], static_input_idxs: Sequence[int], *,
                  mutated_input_idxs: Sequence[int] = (), kernel_free: bool = False,
                  device_type: str = "cuda") -> str | None:
    """Why a graph cannot be replayed by :class:`LeanCUDAGraph`, or ``None``.

    Checks: kernel-free graph; dynamic shapes (a ``SymInt`` input or symbolic tensor size:
    lean replay is one graph per compiled graph); a tensor input not on ``device_type``; an
    input the graph mutates that is not static (the copy into the static buffer would take the
    mutation away from the caller's tensor).
    """
    if kernel_free:
        return "kernel-free graph (nothing to capture)"
    for i, x in enumerate(example_inputs):
        if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return f"dynamic shapes: input {i} is a symbolic scalar"
        if isinstance(x, torch.Tensor):
            if any(isinstance(s, torch.SymInt) for s in (*x.shape, *x.stride())):
                return f"dynamic shapes: input {i} has a symbolic size or stride"
            if x.device.type != device_type:
                return f"input {i} is on {x.device}, not {device_type}"
    bad = sorted(set(mutated_input_idxs) - set(static_input_idxs))
    if bad:
        return f"mutates non-static input(s) {bad}"
    return None


class LeanCUDAGraphPolicy(CUDAGraphPolicy):
    """``CUDAGraphPolicy`` (torch/_inductor/cudagraph_utils.py, torch 2.14) of one te_inductor
    call: wraps its forward and backward graphs in :class:`LeanCUDAGraph`, or falls back.

    Args:
        graph_id: the compile report's graph id (records name ``"<graph_id>.fwd"`` / ``.bwd`` /
            ``.inference``).
        recorder: where decisions go (the backend passes one writing ``CompileReport.cudagraphs``).
        static_hazards: reasons found by the backend (e.g. the graph reads UB state); any makes
            every graph of this call fall back to cudagraph trees.
        engine: capture/replay engine (default :class:`CudaGraphEngine`).
        device_type: device of the graphs' inputs (``"cuda"``; tests with a fake engine: ``"cpu"``).
        warmup_calls: passed to :class:`LeanCUDAGraph`.

    Fallbacks: to cudagraph trees (``super().cudagraphify``) for a static hazard of a forward or
    inference graph, and for a backward whose forward went to trees; a backward with a static
    hazard whose forward is lean runs without a CUDA graph (a lean forward and a tree backward
    are not mixed). :meth:`should_wrap` declines graphs with several Inductor partitions.
    """

    def __init__(self, *, graph_id: str = "g?", recorder: CudagraphRecorder | None = None,
                 static_hazards: Sequence[str] = (), engine: Any = None, device_type: str = "cuda",
                 warmup_calls: int = 1) -> None:
        self.graph_id = graph_id
        self.recorder = recorder if recorder is not None else CudagraphRecorder()
        self.static_hazards = tuple(static_hazards)
        self.engine = engine if engine is not None else CudaGraphEngine()
        self.device_type = device_type
        self.warmup_calls = warmup_calls
        self.forward_mode: str | None = None  # "lean" / "trees" once the forward was wrapped
        self.runners: list[LeanCUDAGraph] = []

    def _name(self, is_backward: bool, is_inference: bool) -> str:
        return f"{self.graph_id}.{'bwd' if is_backward else 'inference' if is_inference else 'fwd'}"

    def should_wrap(self, compiled_graph: Any) -> bool:
        """``False`` (no CUDA graph for this graph, recorded) when Inductor split it into several
        partitions: with a policy set, Inductor hands the whole graph to :meth:`cudagraphify`
        (cudagraph_utils.py), and what lies between partitions must not be captured."""
        pm = getattr(compiled_graph, "partition_maps", None)
        if pm and len(pm) > 1:
            fx = getattr(compiled_graph, "fx_kwargs", None) or {}
            name = self._name(bool(fx.get("is_backward")), bool(fx.get("is_inference")))
            self.recorder.event(name, "not_captured", f"{len(pm)} Inductor graph partitions (cudagraph-unsafe "
                                "ops between them): no CUDA graph for this graph; te_passes.cudagraphs='trees' "
                                "wraps each partition in cudagraph trees")
            return False
        return True

    def cudagraphify(self, model: Callable[..., Any], example_inputs: Sequence[Any], static_input_idxs: Sequence[int],
                     *, device_index: int, is_backward: bool, is_inference: bool, **kwargs: Any) -> Callable[..., Any]:
        name = self._name(is_backward, is_inference)
        mutated = tuple(kwargs.get("mutated_input_idxs", ()) or ())
        reason = self.static_hazards[0] if self.static_hazards else None
        reason = reason or static_hazard(example_inputs, static_input_idxs, mutated_input_idxs=mutated,
                                         kernel_free=bool(kwargs.get("kernel_free_cudagraph")),
                                         device_type=self.device_type)
        n_clone: int | None = 0 if is_backward else None
        if reason is None and not is_backward and not is_inference:
            n_clone = forward_user_output_count()
            if n_clone is None:  # e.g. an AOTAutograd cache hit: no metadata in the tracing context
                n_clone = SAVED_BY_DATAFLOW
                self.recorder.event(name, "dataflow", "AOTAutograd forward metadata not available: saved tensors "
                                    "are the outputs its backward reads before capture; the others are cloned")
        if reason is None and is_backward and self.forward_mode == "trees":
            reason = "its forward graph uses cudagraph trees"
        if reason is not None:
            if is_backward and self.forward_mode == "lean":
                self.recorder.event(name, "no_cudagraph", f"{reason}; its forward is lean, so this graph runs "
                                    "without a CUDA graph")
                return model
            if not is_backward:
                self.forward_mode = "trees"
            self.recorder.event(name, "trees", reason)
            return super().cudagraphify(model, example_inputs, static_input_idxs, device_index=device_index,
                                        is_backward=is_backward, is_inference=is_inference, **kwargs)
        if not is_backward:
            self.forward_mode = "lean"
            ensure = getattr(self.engine, "ensure_tree_manager", None)
            if ensure is not None:
                ensure(device_index)
        runner = LeanCUDAGraph(model, static_input_idxs, name=name, device_index=device_index,
                               is_backward=is_backward, is_inference=is_inference, mutated_input_idxs=mutated,
                               num_clone_outputs=n_clone, constants=kwargs.get("constants", ()) or (),
                               engine=self.engine, recorder=self.recorder, warmup_calls=self.warmup_calls)
        self.runners.append(runner)
        self.recorder.event(name, "lean", "wrapped for lean replay", static_inputs=len(runner._static_idx),
                            cloned_outputs="all" if n_clone is None else "by data flow" if n_clone < 0 else n_clone)
        return runner
