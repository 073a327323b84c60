"""The capture/replay side of lean CUDA graphs: the CUDA engine, the decision
recorder, the reference-count rules and the pool / ownership maps that
:class:`te_passes.cudagraphs.lean.LeanCUDAGraph` uses.

See docs/internals.md#te_passescudagraphsenginepy."""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from typing import Any, Callable, Sequence

import torch

from te_passes._logging import get_logger

log = get_logger()

PASS, ALIAS, CLONE, CLONE_STRIDED = 0, 1, 2, 3
#: global call sequence: orders forward replays and backward calls
SEQ = itertools.count(1)

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
        """Capture ``fn(inputs)`` into a new ``CUDAGraph`` in ``pool`` on the side stream, RNG state
        preserved as in Inductor's ``cudagraphify`` (``kept_inputs``, the tensors the caller keeps for the
        replays, are ignored: a CUDA graph records addresses). Returns ``(graph, outputs)``."""
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
        """Whether the storages live in ``pool`` are exactly ``live_storage_ptrs``
        (``torch._C._cuda_checkPoolLiveAllocations``, as cudagraph trees' ``check_memory_pool``)."""
        return bool(torch._C._cuda_checkPoolLiveAllocations(device_index, pool, live_storage_ptrs))

    def ensure_tree_manager(self, device_index: int) -> None:
        """Create Inductor's cudagraph-tree manager for the device (a backward graph Inductor refuses to
        cudagraph asserts it exists: ``maybe_handle_backward_generation``, output_code.py)."""
        from torch._inductor import cudagraph_trees

        cudagraph_trees.get_manager(device_index, create_if_none_exists=True)


use_count = torch._C._storage_Use_Count
now_ns = time.perf_counter_ns


def clone_kind(t: torch.Tensor) -> int:
    """``CLONE`` (``Tensor.clone`` keeps the strides of a dense tensor) or ``CLONE_STRIDED``
    (Inductor's ``clone_preserve_strides`` for an overlapping / non-dense output)."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false

    return CLONE if is_non_overlapping_and_dense_or_false(t) else CLONE_STRIDED


def own_references(cdatas: Any, tensors: Sequence[Any]) -> dict[int, int]:
    """Per storage ``cdata`` in ``cdatas``: the references on it we account for — one per distinct
    tensor (``TensorImpl``) of ``tensors`` on it, plus one for its Python storage object (kept for the
    storage's lifetime; cudagraph trees' ``StorageWeakRefWrapper.expired`` counts it too)."""
    counts = dict.fromkeys(cdatas, 1)
    seen: set[int] = set()
    for t in tensors:
        while isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            cd = t.untyped_storage()._cdata
            if cd in counts:
                counts[cd] += 1
            t = t._base if t._is_view() else None
    return counts


def describe_holders(storage: Any, ours: Sequence[Any], limit: int = 4) -> list[str]:
    """Who references tensors on ``storage`` besides ``ours`` (a diagnostic for the records): for each
    Python tensor ``gc`` finds in ``storage``'s address range, its referrers' types (a frame as
    ``file:line``), then the storage's use count (holders that are not Python objects are not found)."""
    import gc

    lo, hi = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    mine = {id(t) for t in ours}
    for t in list(ours):
        if isinstance(t, torch.Tensor) and t._is_view():
            mine.add(id(t._base))
    found = []
    for obj in gc.get_objects():
        if len(found) >= limit:
            break
        if type(obj) not in (torch.Tensor, torch.nn.Parameter) or id(obj) in mine:
            continue
        try:
            p = obj.data_ptr()
        except Exception:  # noqa: BLE001 - a tensor without storage (subclass, meta)
            continue
        if not (lo <= p < hi):
            continue
        kinds = []
        for r in gc.get_referrers(obj):
            if r is found or isinstance(r, list) and r is gc.garbage:
                continue
            if hasattr(r, "f_code"):
                kinds.append(f"frame {r.f_code.co_filename.rsplit('/', 1)[-1]}:{r.f_lineno} ({r.f_code.co_name})")
            else:
                kinds.append(type(r).__qualname__)
        found.append(f"tensor {tuple(obj.shape)} {obj.dtype} held by {', '.join(kinds[:4]) or 'no Python object'}")
    n = use_count(storage._cdata)
    found.append(f"storage use count {n}")
    return found


def emit(plan: list[tuple[int, Any]]) -> list:
    """The outputs one call returns, from the capture's plan (hot path)."""
    return [o if k == PASS else o.detach() if k == ALIAS else o.clone() if k == CLONE else clone_strided(o)
            for k, o in plan]


def clone_strided(t: torch.Tensor) -> torch.Tensor:
    from torch._inductor.utils import clone_preserve_strides

    return clone_preserve_strides(t)


# ------------------------------------------------------------------------------- recording
class CudagraphRecorder:
    """Collects the policy's decisions and fallbacks as dicts ``{"graph", "event", "reason", "count",
    ...}`` (one per graph, event and reason) into ``sink`` (``CompileReport.cudagraphs``), logs the first
    of each and calls ``refresh()`` then (the dump writer rewrites report.json)."""

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
class Pool:
    """One private memory pool and the lean graphs captured into it, in capture order."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.members: list[Any] = []
        self.version = 0

    def add(self, runner: "Any") -> None:
        self.members.append(runner)
        self.version += 1

    def later_or_self(self, runner: "Any") -> list["Any"]:
        i = self.members.index(runner)
        return self.members[i:]


#: data_ptr of a lean graph's static output -> (runner weakref, storage cdata, output index)
OWNERS: dict[int, tuple[Any, int, int]] = {}
#: data_ptr of an output of a forward's last call before capture -> (runner weakref, output index);
#: a backward that reads it as a static input marks that output "saved" (SAVED_BY_DATAFLOW).
RECENT: dict[int, tuple[Any, int]] = {}

#: ``num_clone_outputs`` value: tell user outputs from saved tensors by data flow (the outputs of
#: the forward's warm-up call that its backward's warm-up call reads are saved tensors).
SAVED_BY_DATAFLOW = -1


def owner(ptr: int) -> tuple["Any", int, int] | None:
    hit = OWNERS.get(ptr)
    if hit is None:
        return None
    runner = hit[0]()
    if runner is None or runner._graph is None:
        OWNERS.pop(ptr, None)
        return None
    return runner, hit[1], hit[2]


RUNNERS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def forget(ptrs: list[int], ref: Any) -> None:
    for p in ptrs:
        if OWNERS.get(p, (None,))[0] is ref:
            OWNERS.pop(p, None)
