"""Alias-aware liveness of tensor storages over FX graphs (Dynamo, AOT forward, AOT backward).

See docs/internals.md#te_passesanalyseslivenesspy."""

from __future__ import annotations

import contextlib
import gc
import operator
from typing import Any

import torch
import torch.fx

from te_passes.analyses.alias_rules import (PY_STORE_FUNCS, PY_STORE_METHODS, arg_at, arg_values, is_opaque_call,
                                            name_alias_kind, nodes_in, op_rule)
from te_passes.analyses.buffers import Buffer, BufferOrigin, Escape, Liveness
from te_passes.te.graph_model import BufferRole
from te_passes.te.quantized import QUANTIZED_DTYPES, QuantizedInfo, classify_quantized

__all__ = ["analyze", "analyze_shared", "gc_paused"]


@contextlib.contextmanager
def gc_paused():
    """Pause Python's cyclic garbage collector for a bounded analysis (restored on exit)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def analyze_shared(graph: torch.fx.Graph, stage: Any, analyses: dict | None) -> Liveness:
    """:func:`analyze` of ``graph``, shared through ``analyses`` (``PassContext.analyses``, emptied
    whenever a pass changes the graph; ``None``: computed afresh). Callers must not mutate the result."""
    stage = getattr(stage, "value", stage)
    if analyses is None:
        return analyze(graph, stage=stage)
    key = ("liveness", stage)
    hit = analyses.get(key)
    if hit is not None and hit.graph is graph and len(hit.order) == len(graph.nodes):
        return hit
    lv = analyze(graph, stage=stage)
    analyses[key] = lv
    return lv


def analyze(graph_or_gm: torch.fx.Graph | torch.fx.GraphModule, *, stage: str | None = None,
            saved_roles: dict[str, QuantizedInfo] | None = None) -> Liveness:
    """Alias-aware :class:`Liveness` of every storage in an FX graph of any stage (node
    ``meta['val']`` gives sizes and dtypes; without it sizes are unknown). ``stage`` is a ``Stage``
    value (``"post_grad_bwd"`` marks non-tangent placeholders as saved); ``saved_roles``:
    ``{placeholder or output name: QuantizedInfo}`` learnt elsewhere (``te.quantized.link_saved_roles``).
    Raises ``TypeError`` unless given a ``torch.fx.Graph`` or ``GraphModule``."""
    if isinstance(graph_or_gm, torch.fx.GraphModule):
        graph = graph_or_gm.graph
    elif isinstance(graph_or_gm, torch.fx.Graph):
        graph = graph_or_gm
    else:
        raise TypeError(f"analyze() takes a torch.fx.Graph or GraphModule, got {type(graph_or_gm).__name__}")
    with gc_paused():
        return _analyze(graph, getattr(stage, "value", stage), saved_roles)


def _analyze(graph: torch.fx.Graph, stage: str | None, saved_roles) -> Liveness:
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    buffers: list[Buffer] = []
    aliases: dict[torch.fx.Node, frozenset[Buffer]] = {}
    elements: dict[torch.fx.Node, list[frozenset[Buffer]]] = {}
    holders: dict[Buffer, set[Buffer]] = {}
    escapes: list[Escape] = []
    unknown: list[torch.fx.Node] = []
    EMPTY: frozenset[Buffer] = frozenset()

    def new_buffer(node, index, origin, val, handle):
        b = Buffer(len(buffers), node, index, origin, val, handle)
        buffers.append(b)
        return b

    def node_val(n):
        return n.meta.get("val", n.meta.get("example_value"))

    def arg_set(a) -> frozenset[Buffer]:
        out: set[Buffer] = set()
        for n in nodes_in(a):
            out |= aliases.get(n, EMPTY)
        return frozenset(out)

    def fresh(node, val) -> frozenset[Buffer]:
        if isinstance(val, (list, tuple)):
            elems = elements[node] = [frozenset({new_buffer(node, i, BufferOrigin.ALLOCATED, v, None)})
                                      if isinstance(v, torch.Tensor) else EMPTY for i, v in enumerate(val)]
            return frozenset().union(*elems) if elems else EMPTY
        if isinstance(val, torch.Tensor):
            return frozenset({new_buffer(node, None, BufferOrigin.ALLOCATED, val, node)})
        if val is None and "val" not in node.meta and _looks_tensor_valued(node):
            # No metadata: assume one fresh tensor of unknown size so lifetimes are tracked.
            return frozenset({new_buffer(node, None, BufferOrigin.ALLOCATED, None, node)})
        return EMPTY

    for node in nodes:
        val = node_val(node)
        if node.op == "placeholder":
            aliases[node] = (frozenset({new_buffer(node, None, BufferOrigin.INPUT, val, node)})
                             if isinstance(val, torch.Tensor) or val is None else EMPTY)
            continue
        if node.op == "get_attr":
            aliases[node] = frozenset({new_buffer(node, None, BufferOrigin.CONSTANT, val, node)})
            continue
        if node.op == "output":
            continue
        target = node.target
        # --- getitem of a multi-output node
        if node.op == "call_function" and target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
            src, idx = node.args[0], node.args[1]
            if src in elements and isinstance(idx, int) and -len(elements[src]) <= idx < len(elements[src]):
                s = elements[src][idx]
                for b in s:
                    if b.node is src and b.index == (idx % len(elements[src])) and b.handle is None:
                        b.handle = node
                        if b.val is None:
                            b.val = val
                aliases[node] = s
            elif isinstance(node_val(src), torch.Tensor):
                # tensor indexing (Dynamo level): a view or a copy
                aliases[node] = aliases.get(src, EMPTY) | fresh(node, val)
                unknown.append(node)
            else:
                aliases[node] = aliases.get(src, EMPTY)
            continue
        # --- Python-level stores (Dynamo graphs)
        if node.op == "call_function" and target in PY_STORE_FUNCS:
            stored = node.args[-1] if target is not operator.setitem else node.args[2]
            for b in arg_set(stored):
                escapes.append(Escape(b, node, f"stored into a Python object by {getattr(target, '__name__', target)}"))
            aliases[node] = EMPTY
            continue
        if node.op == "call_method" and target in PY_STORE_METHODS and node.args and \
                not (isinstance(node.args[0], torch.fx.Node) and isinstance(node_val(node.args[0]), torch.Tensor)):
            for b in arg_set(node.args[1:]):
                escapes.append(Escape(b, node, f"stored into a Python object by .{target}()"))
            aliases[node] = EMPTY
            continue
        # --- ATen / custom op overloads
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
            rule = op_rule(target)
            if rule.fresh:
                aliases[node] = fresh(node, val)
                continue
            if rule.is_set:
                argv = arg_values(target, node)
                aliases[node] = _link_holders(node, arg_set(argv[:1]), arg_set(argv[1:]), holders, escapes)
                continue
            if rule.maybe:
                unknown.append(node)
                f = fresh(node, val)
                aliases[node] = f | arg_set(arg_values(target, node))
                continue
            aliased = [frozenset().union(*[arg_set(arg_at(node, rule, i)) for i in srcs]) if srcs else EMPTY
                       for srcs in rule.srcs]
            if len(aliased) == 1 and aliased[0]:
                if rule.returns_list:
                    n_out = len(val) if isinstance(val, (list, tuple)) else 0
                    elements[node] = [aliased[0]] * n_out
                aliases[node] = aliased[0]
                continue
            if any(aliased):
                # several returns, some aliasing inputs (e.g. in-place multi-return ops)
                vals = val if isinstance(val, (list, tuple)) else [None] * len(aliased)
                elems = elements[node] = [a or (frozenset({new_buffer(node, i, BufferOrigin.ALLOCATED, v, None)})
                                                if isinstance(v, torch.Tensor) else EMPTY)
                                          for i, (a, v) in enumerate(zip(aliased, vals))]
                aliases[node] = frozenset().union(*elems)
                continue
            aliases[node] = fresh(node, val)
            continue
        if node.op == "call_function" and isinstance(target, torch._ops.HigherOrderOperator):
            # auto_functionalized's "new" values become in-place mutations of its inputs once
            # Inductor decomposes it; with_effects / other HOPs may return inputs: assume any
            # output may alias any tensor input (and may be fresh).
            unknown.append(node)
            aliases[node] = fresh(node, val) | arg_set((node.args, node.kwargs))
            if node in elements:
                ins = arg_set((node.args, node.kwargs))
                elements[node] = [e | ins for e in elements[node]]
            continue
        # --- Dynamo-level torch functions / methods / modules
        name = target if isinstance(target, str) else getattr(target, "__name__", None)
        if node.op == "call_method" and name == "set_":
            src = arg_set(node.args[1:]) | arg_set(node.kwargs)
            aliases[node] = _link_holders(node, arg_set(node.args[0]), src, holders, escapes)
            continue
        kind = name_alias_kind(name) if isinstance(name, str) and node.op != "call_module" else "maybe"
        if isinstance(target, torch._ops.OpOverloadPacket):
            kind = "maybe" if target._qualified_op_name.split("::")[0] == "aten" else "fresh"
        if kind == "fresh":
            aliases[node] = fresh(node, val)
        elif kind == "alias":
            src_node = node.args[0] if node.args else None
            aliases[node] = arg_set(src_node) if src_node is not None else EMPTY
        else:
            unknown.append(node)
            aliases[node] = fresh(node, val) | arg_set((node.args, node.kwargs))

    # --- last uses: the last node using any alias (max over the aliasing nodes' users);
    # then extend through holders (set_)
    out_node = next((n for n in reversed(nodes) if n.op == "output"), None)
    first_def = {b: b.node for b in buffers}
    last_pos = {b: order[b.node] for b in buffers}
    for n, bs in aliases.items():
        lu = max((order[u] for u in n.users), default=-1)
        for b in bs:
            last_pos[b] = max(last_pos[b], lu)
    last_use: dict[Buffer, torch.fx.Node] = {b: nodes[p] for b, p in last_pos.items()}
    opaque_uses: dict[Buffer, list[torch.fx.Node]] = {}
    for node in filter(is_opaque_call, nodes):
        for b in arg_set(node.all_input_nodes):
            opaque_uses.setdefault(b, []).append(node)
    changed = True
    while changed:
        changed = False
        for b, hs in holders.items():
            for h in hs:
                if order[last_use[h]] > order[last_use[b]]:
                    last_use[b] = last_use[h]
                    changed = True
    output_buffers = arg_set(out_node.args) if out_node is not None else EMPTY
    saved_inputs = frozenset(n for n in graph.find_nodes(op="placeholder")
                             if stage == "post_grad_bwd" and not str(n.target).startswith("tangents"))

    lv = Liveness(graph, order, buffers, aliases, elements, first_def, last_use, holders,
                  output_buffers, escapes, saved_inputs, opaque_uses, unknown)
    _attach_quantized(lv, saved_roles)
    return lv


def _looks_tensor_valued(node: torch.fx.Node) -> bool:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return any(str(r.type).startswith("Tensor") for r in t._schema.returns)
    return node.op in ("call_function", "call_method", "call_module") and t is not operator.getitem


def _link_holders(node, dst: frozenset[Buffer], src: frozenset[Buffer], holders, escapes) -> frozenset[Buffer]:
    """Record that ``dst`` now holds ``src``'s storage (``set_``); returns ``dst | src``."""
    for s in src:
        for d in dst:
            if d is s:
                continue
            holders.setdefault(s, set()).add(d)
            # d now points at s's storage: each keeps the other's storage reachable (a free of
            # either would release the shared storage under storage-level semantics).
            holders.setdefault(d, set()).add(s)
            if d.origin is not BufferOrigin.ALLOCATED:
                escapes.append(Escape(s, node, f"set_ into graph {d.origin.value} {d.node.name}"))
    return dst | src


def _attach_quantized(lv: Liveness, saved_roles: dict[str, QuantizedInfo] | None) -> None:
    infos = classify_quantized(lv.graph, saved_roles=saved_roles)
    for node, info in infos.items():
        for b in lv.aliases.get(node, ()):
            # A slot node may be a view (detach) of the buffer: the role belongs to the storage.
            if b.quantized is None or b.quantized.confidence < info.confidence:
                b.quantized = info
    # Elements of multi-output ops that no node extracts: classify by their own dtype.
    for b in lv.buffers:
        if b.quantized is None and isinstance(b.val, torch.Tensor) and b.val.dtype in QUANTIZED_DTYPES:
            b.quantized = QuantizedInfo(BufferRole.UNKNOWN.value, "dtype", 1)


