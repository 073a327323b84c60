"""Peak live bytes of an FX graph, from node metadata: symbolic with dynamic shapes, concrete
for given sizes.

See docs/internals.md#te_passesanalysesmemorypy."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import sympy
import torch
import torch.fx
from torch.utils._pytree import tree_leaves

from te_passes.analyses.buffers import BufferOrigin, Liveness, live_intervals
from te_passes.analyses.liveness import analyze, gc_paused

__all__ = ["MemoryEstimate", "estimate", "estimate_graph", "shape_hints"]


@dataclasses.dataclass
class MemoryEstimate:
    """Peak live bytes of one graph."""

    peak: Any
    peak_concrete: int | None
    peak_node: str | None
    input_bytes: Any
    quantized_bytes_at_peak: int | None
    timeline: list[tuple[str, Any]]
    #: ``{symbol: hint}`` of the shape symbols the graph's byte counts use (the ShapeEnv may hold more:
    #: a Dynamo graph's symbols the post-grad graph no longer has; a saved graph restores only its own).
    symbols: dict[str, int]
    unknown_size: list[str]

    @property
    def symbolic(self) -> bool:
        """Whether ``peak`` depends on shape symbols."""
        return isinstance(self.peak, sympy.Basic) and bool(self.peak.free_symbols)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready summary (the timeline is left out; symbolic values as strings)."""
        return {"peak": _jsonable_bytes(self.peak), "peak_concrete": self.peak_concrete,
                "peak_node": self.peak_node, "input_bytes": _jsonable_bytes(self.input_bytes),
                "quantized_bytes_at_peak": self.quantized_bytes_at_peak,
                "symbolic": self.symbolic, "symbols": dict(self.symbols),
                "unknown_size": list(self.unknown_size)}


def _jsonable_bytes(v: Any) -> Any:
    if isinstance(v, sympy.Basic):
        return int(v) if v.is_Integer else str(v)
    return v


def shape_hints(graph: torch.fx.Graph) -> dict[sympy.Symbol, int]:
    """``{symbol: example value}`` from the ``ShapeEnv`` of the graph's fake tensors
    (``shape_env.var_to_val``), or ``{}`` with static shapes / no metadata."""
    for node in graph.nodes:
        for v in tree_leaves(node.meta.get("val")):
            if not isinstance(v, torch.Tensor):
                continue
            env = getattr(getattr(v, "fake_mode", None), "shape_env", None)
            if env is None:
                return {}  # real or static fake tensors: no symbols
            table = env.backed_var_to_val if hasattr(env, "backed_var_to_val") else getattr(env, "var_to_val", None)
            return {k: int(val) for k, val in (table or {}).items()}
    return {}


def _as_expr(n: Any) -> sympy.Expr:
    return sympy.Integer(n) if isinstance(n, int) else n


def _subs(expr: Any, sizes: Mapping[sympy.Symbol, int]) -> int | None:
    if isinstance(expr, int):
        return expr
    e = sympy.sympify(expr)
    if e.free_symbols:
        e = e.subs({s: sizes[s] for s in e.free_symbols if s in sizes})
    return int(e) if e.is_number else None


def estimate(lv: Liveness, *, sizes: Mapping[str | sympy.Symbol, int] | None = None) -> MemoryEstimate:
    """Peak live bytes of the graph ``lv`` (:func:`~te_passes.analyses.liveness.analyze`) was computed
    on; ``sizes`` (``{"s0": 4096}`` or ``{Symbol: int}``) evaluate a symbolic peak, missing symbols
    taking the shape environment's hints."""
    with gc_paused():
        return _estimate(lv, sizes)


def _estimate(lv: Liveness, sizes) -> MemoryEstimate:
    nodes = list(lv.order)
    n = len(nodes)
    hints = shape_hints(lv.graph)
    if sizes:
        by_name = {str(k): v for k, v in sizes.items()}
        syms = {s for b in lv.buffers for s in getattr(_as_expr(b.nbytes() or 0), "free_symbols", ())} | set(hints)
        hints.update({s: int(by_name[str(s)]) for s in syms if str(s) in by_name})
    intervals = live_intervals(lv)
    used: set[Any] = set()  # the symbols the byte counts use: the record's ``symbols`` (not the whole ShapeEnv's)
    # Difference arrays: static byte counts in an int list, symbolic ones in a sparse dict of lists.
    d_int = [0] * (n + 1)
    d_sym: dict[int, list[Any]] = {}
    input_bytes: Any = 0
    unknown: list[str] = []
    for b, (lo, hi) in intervals.items():
        nb = b.nbytes()
        if nb is None:
            if b.val is None:
                unknown.append(b.name)
            continue
        used.update(getattr(nb, "free_symbols", ()))
        if isinstance(nb, int):
            d_int[lo] += nb
            d_int[hi + 1] -= nb
        else:
            d_sym.setdefault(lo, []).append(nb)
            d_sym.setdefault(hi + 1, []).append(-nb)
        if b.origin is not BufferOrigin.ALLOCATED:
            input_bytes = input_bytes + nb
    live_int = 0
    live_sym: Any = sympy.Integer(0)
    per_node: list[Any] = []
    for i in range(n):
        live_int += d_int[i]
        if d_sym:
            if i in d_sym:
                live_sym = sympy.expand(live_sym + sympy.Add(*d_sym[i]))
            per_node.append(live_int + live_sym if live_sym != 0 else live_int)
        else:
            per_node.append(live_int)
    candidates = list(dict.fromkeys(per_node)) or [0]
    if all(isinstance(c, int) or (isinstance(c, sympy.Basic) and c.is_Integer) for c in candidates):
        peak: Any = int(max(int(c) for c in candidates))
    else:
        peak = sympy.Max(*[_as_expr(c) for c in candidates])
    concrete = [_subs(c, hints) for c in per_node]
    peak_concrete = peak_node = q_at_peak = None
    if concrete and all(c is not None for c in concrete):
        idx = max(range(n), key=lambda i: concrete[i])
        peak_concrete = int(concrete[idx])
        peak_node = nodes[idx].name
        q_at_peak = 0
        for b, (lo, hi) in intervals.items():
            if b.quantized is not None and lo <= idx <= hi:
                q_at_peak += _subs(b.nbytes() or 0, hints) or 0
    timeline = [(nodes[i].name, concrete[i] if concrete[i] is not None else per_node[i]) for i in range(n)]
    return MemoryEstimate(
        peak=peak,
        peak_concrete=peak_concrete,
        peak_node=peak_node,
        input_bytes=input_bytes if isinstance(input_bytes, int) else sympy.expand(input_bytes),
        quantized_bytes_at_peak=q_at_peak,
        timeline=timeline,
        symbols={str(k): v for k, v in hints.items() if k in used},
        unknown_size=unknown,
    )


def estimate_graph(graph_or_gm, *, stage: str | None = None,
                   sizes: Mapping[str | sympy.Symbol, int] | None = None) -> MemoryEstimate:
    """:func:`estimate` of :func:`~te_passes.analyses.liveness.analyze` (convenience)."""
    return estimate(analyze(graph_or_gm, stage=stage), sizes=sizes)
