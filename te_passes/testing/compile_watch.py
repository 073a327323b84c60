"""The torch-only part of the GPU harness (:mod:`te_passes.testing.gpu` re-exports it).

See docs/internals.md#te_passestestingcompile_watchpy."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from typing import Any, Iterator

import torch


_COMPILE_ID = re.compile(r"^(\d+)/(\d+)")


@dataclasses.dataclass
class CompileStats:
    """Counts over one :class:`CompileWatch` region."""

    graphs: int = 0
    graph_breaks: int = 0
    break_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    recompiles: int = 0
    cudagraph_skips: int = 0
    cudagraph_recordings: int = 0
    lazy_backward_compiles: int = 0
    compile_ids: list[str] = dataclasses.field(default_factory=list)
    #: ``"<compile id> <function>: <failed guard>"`` per recompile (Dynamo's ``CompilationMetrics``).
    recompile_reasons: list[str] = dataclasses.field(default_factory=list)
    #: ``"<compile id> <function> (<file>:<line>) ops <n>"`` per frame Dynamo compiled in the region (its
    #: ``CompilationMetrics``; ``ops`` is the graph's op count, ``-`` for a frame that gave no graph): which
    #: frames make up ``graphs``.
    frames: list[str] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class CompileWatch:
    """Context manager: clears ``torch._dynamo.utils.counters`` on entry, reads them on exit.

    Also registers a Dynamo compile-start callback (``torch._dynamo.callback_handler``) to count
    recompiles, cudagraph recordings and lazy backward compiles. ``stats`` is filled on exit
    and may be read (live) inside the region through :meth:`snapshot`.
    """

    def __init__(self) -> None:
        self.stats = CompileStats()
        self._events: list[tuple[str, str]] = []

    def _on_start(self, args) -> None:
        self._events.append((args.callback_trigger.name, str(args.compile_id)))

    def __enter__(self) -> "CompileWatch":
        from torch._dynamo.utils import counters

        counters.clear()
        self._seen_metrics = {id(m) for m in torch._dynamo.utils.get_compilation_metrics()}
        torch._dynamo.callback_handler.register_start_callback(self._on_start)
        return self

    def snapshot(self) -> CompileStats:
        """The counts so far (also what ``__exit__`` stores in ``stats``)."""
        from torch._dynamo.utils import counters

        st = CompileStats()
        st.graphs = int(counters["stats"].get("unique_graphs", 0))
        st.break_reasons = {str(k): int(v) for k, v in counters["graph_break"].items()}
        st.graph_breaks = sum(st.break_reasons.values())
        st.cudagraph_skips = int(counters["inductor"].get("cudagraph_skips", 0))
        seen: set[str] = set()
        for trigger, cid in self._events:
            if trigger == "DYNAMO":
                m = _COMPILE_ID.match(cid)
                key = m.group(0) if m else cid
                if key in seen:  # a retried attempt ("0/1_1") of the same compile
                    continue
                seen.add(key)
                st.compile_ids.append(cid)
                if m and int(m.group(2)) > 0:
                    st.recompiles += 1
            elif trigger == "CUDAGRAPH_RECORDING":
                st.cudagraph_recordings += 1
            elif trigger == "LAZY_BACKWARD":
                st.lazy_backward_compiles += 1
        metrics = [m for m in torch._dynamo.utils.get_compilation_metrics()
                   if id(m) not in getattr(self, "_seen_metrics", ())]
        st.recompile_reasons = [f"{m.compile_id} {m.co_name}: {m.recompile_reason}" for m in metrics
                                if m.recompile_reason]
        st.frames = [f"{m.compile_id} {m.co_name} ({os.path.basename(m.co_filename or '?')}:{m.co_firstlineno}) "
                     f"ops {'-' if m.graph_op_count is None else m.graph_op_count}" for m in metrics]
        return st

    def __exit__(self, *exc) -> None:
        self.stats = self.snapshot()
        try:
            torch._dynamo.callback_handler.remove_start_callback(self._on_start)
        except ValueError:  # torch._dynamo.reset() inside the region already cleared the callbacks
            pass


def cudagraph_tree_nodes(device_index: int | None = None) -> int:
    """Number of recorded CUDA graphs in the cudagraph tree of ``device_index`` (0 when none).

    Mirrors ``torch._inductor.cudagraph_trees.CUDAGraphTreeManager.roots`` / ``CUDAGraphNode.children``
    (torch 2.14.1).
    """
    from torch._inductor import cudagraph_trees

    mgr = cudagraph_trees.get_manager(device_index, create_if_none_exists=False)
    if mgr is None:
        return 0

    def count(nodes) -> int:
        return sum(1 + count([c for cs in n.children.values() for c in cs]) for n in nodes)

    return count([n for ns in mgr.roots.values() for n in ns])


def te_inductor_backend_listed() -> bool:
    """Whether ``backend="te_inductor"`` resolves without registering it by hand: the installed
    distribution's ``torch_dynamo_backends`` entry point (``pip install -e .``) or an earlier
    registration (``torch._dynamo.backends.registry`` ``_BACKENDS`` / ``_COMPILER_FNS`` after
    ``list_backends`` ran entry-point discovery). Imports no te_passes module: with the entry
    point, te_passes is loaded by ``torch.compile``'s backend lookup."""
    from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS, list_backends

    list_backends(exclude_tags=())  # runs entry-point discovery
    return "te_inductor" in _BACKENDS or "te_inductor" in _COMPILER_FNS


@contextlib.contextmanager
def fresh_compile_state() -> Iterator[None]:
    """``torch._dynamo.reset()`` (drops compiled code and cudagraph trees) before and after, and
    frees cached GPU memory after, so one configuration's compiled graphs and pools do not leak
    into the next one's timings or peak memory."""
    import gc

    torch._dynamo.reset()
    try:
        yield
    finally:
        torch._dynamo.reset()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def assert_one_graph(st: CompileStats, first: CompileStats, *, cudagraphs: bool) -> None:
    """Assert what a fully traceable model compiles to over a :class:`CompileWatch` region: one
    Dynamo graph, no graph break, no recompile (``first``: the snapshot after the first step,
    none there either) and, with ``cudagraphs``, no cudagraph skip. Raises ``AssertionError``
    with the stats."""
    assert st.graphs == 1 and st.graph_breaks == 0, st.to_json()
    assert st.recompiles == first.recompiles == 0, st.recompile_reasons
    if cudagraphs:
        assert st.cudagraph_skips == 0, st.to_json()
