"""Lean CUDA-graph replay for te_inductor graphs: ``te_passes.cudagraphs="lean"``.

See docs/internals.md#te_passescudagraphsleanpy and docs/usage.md."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch

from te_passes._logging import get_logger
from te_passes.cudagraphs.engine import (
    ALIAS, OWNERS, PASS, RECENT, RUNNERS, SAVED_BY_DATAFLOW, SEQ, CudaGraphEngine, CudagraphRecorder, Pool,
    clone_kind, describe_holders, emit, forget, now_ns, own_references, owner, use_count)
from te_passes.cudagraphs.hazards import ReplayHazards

log = get_logger()


def lean_runners() -> list["LeanCUDAGraph"]:
    """The live :class:`LeanCUDAGraph` wrappers of this process (tests, benchmarks, debugging:
    their ``stats`` and ``output_kinds()``), in no particular order."""
    return list(RUNNERS)


# ---------------------------------------------------------------------------------- runner
class LeanCUDAGraph(ReplayHazards):
    """The CUDA-graph wrapper of one compiled Inductor graph (boxed calling convention: ``runner(inputs: list)
    -> list``; the list is cleared, as Inductor's callables do).

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
        self._pool: Pool | None = None
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
        self.stats = {"warmup": 0, "capture": 0, "replay": 0, "eager": 0, "copies": 0, "replay_host_ns": 0,
                      "launch_host_ns": 0}
        RUNNERS.add(self)

    # -------------------------------------------------------------------------- helpers
    @property
    def captured(self) -> bool:
        return self._graph is not None

    @property
    def pool(self) -> Pool | None:
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

    def _disable(self, why: str, inputs: list, warn: bool = False):  # no CUDA graph from now on
        self._disabled = why
        self._rec.event(self.name, "disabled", why)
        if warn:
            log.warning("te_passes cudagraphs: %s: %s", self.name, why)
        return self._eager(inputs)

    # ----------------------------------------------------------------------------- call
    def __call__(self, inputs: list):
        self._last_call_seq = next(SEQ)
        if self._graph is not None:
            t0 = now_ns()
            try:
                return self._replay(inputs)
            finally:
                self.stats["replay_host_ns"] += now_ns() - t0
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
                 and all(p == q or (p is not None and owner(p) is not None) for p, q in zip(ptrs, last)))
        if self.is_backward:
            for p in ptrs:
                hit = RECENT.get(p) if p is not None else None
                fwd = hit[0]() if hit is not None else None
                if fwd is not None:
                    fwd._consumed.add(hit[1])
        if ready:
            return self._capture(inputs)
        if self._calls > self._max_unready:
            return self._disable(f"static inputs (parameters / saved tensors) changed address on each of "
                                 f"{self._calls} calls: never captured", inputs)
        self.stats["warmup"] += 1
        outs = self._engine.warmup(self._model, inputs, self.device_index)
        if self._num_clone == SAVED_BY_DATAFLOW:
            for p in self._recent:
                if RECENT.get(p, (None,))[0] is self._self_ref:
                    del RECENT[p]
            self._recent = [o.data_ptr() for o in outs if isinstance(o, torch.Tensor)]
            for j, o in enumerate(outs):
                if isinstance(o, torch.Tensor):
                    RECENT[o.data_ptr()] = (self._self_ref, j)
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
            own = owner(x.data_ptr()) if x.data_ptr() else None
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
                own = owner(static[i].data_ptr())
                if own is not None and not own[0].is_backward and own[0]._pool is not None:
                    pool = own[0]._pool
                    break
        if pool is None:
            pool = Pool(self._engine.new_pool(self.device_index))
        try:
            graph, outs = self._engine.capture(self._model, call, pool.handle, self.device_index, static)
        except Exception as exc:  # noqa: BLE001 - recorded; the graph then runs without a CUDA graph
            first = str(exc).splitlines()[0][:300] if str(exc) else ""
            return self._disable(f"capture failed ({type(exc).__name__}: {first}): runs without a CUDA graph",
                                 inputs, warn=True)
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        del call
        if [x.data_ptr() if isinstance(x, torch.Tensor) else None for x in static] != kept_ptrs:
            return self._disable("the graph re-bound the static input tensors kept for replay: runs without a "
                                 "CUDA graph", inputs)
        in_storages = {static[i].untyped_storage().data_ptr() for i in self._static_idx}
        # storage ptr of a static input that is a lean graph's output -> (owner, cdata)
        lean_in = {static[i].untyped_storage().data_ptr(): own[:2] for i in self._static_idx
                   if (own := owner(static[i].data_ptr())) is not None}
        in_storages |= {c.untyped_storage().data_ptr() for c in self._constants}
        in_storages.discard(0)
        n_clone = len(outs) if self._num_clone is None else self._num_clone
        dataflow = self._num_clone == SAVED_BY_DATAFLOW
        for p in self._recent:
            if RECENT.get(p, (None,))[0] is self._self_ref:
                del RECENT[p]
        plan: list[tuple[int, Any]] = []
        own_cdatas: dict[int, int] = {}
        ptrs: list[int] = []
        for j, o in enumerate(outs):
            if not isinstance(o, torch.Tensor):
                plan.append((PASS, o))
                continue
            st = o.untyped_storage()
            if st.nbytes() == 0:  # no memory to guard (TE's empty placeholders); not in the pool
                plan.append((ALIAS, o))
                continue
            if st.data_ptr() in in_storages:
                # a parameter / constant a forward returns (saved for backward): not ours to
                # guard. A backward output in a static input's memory (Inductor reusing a donated
                # saved tensor, which is the forward's static output): cloned, the next forward
                # replay would overwrite it.
                plan.append((clone_kind(o) if self.is_backward else PASS, o))
                if st.data_ptr() in lean_in:  # our reference to the owner's storage is expected
                    owners.append(lean_in[st.data_ptr()])
                continue
            saved = (j in self._consumed) if dataflow else j >= n_clone
            plan.append((ALIAS if saved else clone_kind(o), o))
            own_cdatas.setdefault(st._cdata, j)
            ptrs.append(o.data_ptr())
            OWNERS[o.data_ptr()] = (self._self_ref, st._cdata, j)
            del st
        del outs
        self._plan = plan
        buffers = {static[i].untyped_storage().data_ptr() for i, _ in self._copy}
        self._pool_storages = {o.untyped_storage().data_ptr() for k, o in plan
                               if k != PASS and o.untyped_storage().nbytes()} - buffers
        sizes = {o.untyped_storage().data_ptr(): o.untyped_storage().nbytes() for k, o in plan if k != PASS}
        self.held_bytes = sum(sizes[p] for p in self._pool_storages)
        # Baselines: the references we hold ourselves (one per tensor object of ours on that
        # storage), never a measured count — a transient holder at capture (a local storage
        # object, the caller's aliases) would raise it and hide a later holder for good.
        expected = own_references(own_cdatas, [o for _, o in plan] + list(static))
        self._own = [[cd, expected[cd], j] for cd, j in own_cdatas.items()]
        extra = [j for cd, j in own_cdatas.items() if use_count(cd) > expected[cd]]
        if extra:
            ours = [o for _, o in plan] + list(static)
            holders = {j: describe_holders(plan[j][1].untyped_storage(), ours) for j in extra[:4]}
            self._rec.event(self.name, "referenced", f"outputs {extra} are referenced outside the graph right "
                            "after capture: calls run without the CUDA graph while they are", outputs=extra,
                            holders=holders)
        for runner, cdata in owners:
            for item in runner._own:
                if item[0] == cdata:
                    item[1] += 1
            runner._pool.version += 1
        weakref.finalize(self, forget, ptrs, self._self_ref)
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
            return self._disable("tensors allocated in the pool during capture are still referenced but are not "
                                 "graph outputs (a reference kept inside an opaque op?): runs without a CUDA graph",
                                 inputs, warn=True)
        self._rec.event(self.name, "captured", "lean CUDA graph captured", pool=id(pool) & 0xFFFFFF,
                        pool_position=len(pool.members) - 1, static_inputs=len(self._static_idx),
                        copied_inputs=len(self._copy), outputs=self.output_kinds().count("alias"),
                        cloned_outputs=self.output_kinds().count("clone"))
        inputs.clear()
        self._engine.replay(graph)
        self.stats["replay"] += 1
        self._last_replay_seq = next(SEQ)
        return emit(plan)

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
        if list(map(use_count, cdatas)) != base and not self._resolve_held():
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
        t0 = now_ns()
        self._engine.replay(self._graph)
        self.stats["launch_host_ns"] += now_ns() - t0
        self.stats["replay"] += 1
        self._last_replay_seq = next(SEQ)
        return emit(self._plan)
