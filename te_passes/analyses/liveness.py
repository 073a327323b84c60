"""Alias-aware liveness of tensor storages over FX graphs (Dynamo, AOT forward, AOT backward).

The unit is a :class:`Buffer`: one storage a graph value may point into — a graph input
(``placeholder``), a constant (``get_attr``), or memory allocated by a node (one per tensor an
op returns; a multi-output op such as ``transformer_engine_compile.linear`` gets one buffer per
flat output). Every node's value is mapped to the set of buffers it may alias:

* ``operator.getitem`` of a multi-output node selects that output's buffers (the tuple itself
  aliases all of them: holding the tuple keeps every element alive, as at run time);
* ATen ``OpOverload``\\ s: torch's own alias annotations in ``OpOverload._schema`` — a return
  ``Tensor(a)`` aliases the arguments annotated ``(a)`` (views, ``detach``, in-place ops'
  ``Tensor(a!)``), list-returning views (``split``, ``unbind``, ``Tensor(a -> *)``) alias
  ``self``; ``aten._unsafe_view`` and ``_c10d_functional.wait_tensor`` (which return their
  argument without an annotation) alias it; ops tagged
  ``torch.Tag.maybe_aliasing_or_mutating`` may alias every tensor argument *and* allocate;
* ``aten.set_`` makes the mutated tensor hold the source storage: the source lives as long as
  the destination, and a source stored into a graph input *escapes* the graph;
* other custom ops (TE's included) follow the ``torch.library`` contract: outputs are fresh;
  higher-order ops (``auto_functionalized``, ``with_effects``, ...) may return (views of) their
  inputs — ``auto_functionalized``'s new values *are* its inputs once Inductor decomposes it —
  so their outputs may alias every tensor input;
* Dynamo-level calls (torch functions, ``call_method``) are mapped to the ATen op of the same
  name; a name with no ATen op is treated conservatively (may alias every tensor argument and
  allocate). Python-level stores of a tensor into an object (``setattr``, ``setitem``,
  ``list.append``, ...) are escapes.

The result (:class:`Liveness`) gives, per buffer, its first and last use (the last node that
touches *any* alias of it), whether a graph output aliases it, whether it escapes, and the
quantized role of the buffers that form TE quantized tensors (from
:mod:`te_passes.te.quantized`). Conservatism only ever *extends* lifetimes, so a free placed
after :attr:`Liveness.last_use` is safe for every reference the graph holds.

Mirrors the reference-counting lifetime torch's own runtimes implement for graph values
(``torch.fx`` codegen ``x = None`` after last use, ``torch.fx.Interpreter`` env GC, Inductor's
wrapper ``del buf``; torch 2.14).
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import enum
import functools
import gc
import operator
from typing import Any, Iterable, Sequence

import torch
import torch.fx
from torch._prims_common import compute_required_storage_length

from te_passes.te.graph_model import BufferRole
from te_passes.te.quantized import QUANTIZED_DTYPES, QuantizedInfo, classify_quantized

__all__ = ["Buffer", "BufferOrigin", "Escape", "Liveness", "analyze", "analyze_shared", "tensor_nbytes",
           "is_opaque_call"]


_UNSET = object()


class BufferOrigin(str, enum.Enum):
    """Who owns a buffer's storage."""

    INPUT = "input"          # a placeholder: owned by the caller for the whole call
    CONSTANT = "constant"    # a get_attr constant / parameter of the GraphModule
    ALLOCATED = "allocated"  # allocated by a node inside the graph


@dataclasses.dataclass(eq=False, slots=True)
class Buffer:
    """One storage a graph value may point into.

    * ``id`` — dense index; ``node`` — the node that creates it (placeholder, get_attr or
      call); ``index`` — output position within ``node`` (``None`` for single-output nodes);
    * ``origin`` — :class:`BufferOrigin`; ``val`` — the (fake) tensor from ``meta['val']``
      or ``None`` when the graph carries no metadata;
    * ``handle`` — the node whose value *is* this tensor (``node`` itself, or the ``getitem``
      that extracts output ``index``), ``None`` when no node extracts it;
    * ``quantized`` — :class:`~te_passes.te.quantized.QuantizedInfo` when the buffer is part
      of a quantized tensor, else ``None``.
    """

    id: int
    node: torch.fx.Node
    index: int | None
    origin: BufferOrigin
    val: Any = None
    handle: torch.fx.Node | None = None
    quantized: QuantizedInfo | None = None
    _nbytes: Any = _UNSET
    _nbytes_val: Any = None

    @property
    def name(self) -> str:
        """``node`` name, with ``[index]`` for a multi-output node's element."""
        if self.handle is not None:
            return self.handle.name
        return self.node.name if self.index is None else f"{self.node.name}[{self.index}]"

    def nbytes(self):
        """Bytes of the storage (int, or a ``sympy.Expr`` with symbolic sizes); ``None`` unknown."""
        if self._nbytes is _UNSET or self._nbytes_val is not self.val:
            self._nbytes = tensor_nbytes(self.val)
            self._nbytes_val = self.val
        return self._nbytes

    def __repr__(self) -> str:
        return f"Buffer({self.name}, {self.origin.value})"


@dataclasses.dataclass
class Escape:
    """A buffer that stays referenced past the graph's end without being a graph output.

    ``buffer`` escapes at ``node`` (an FX node) ``how``: e.g. ``"set_ into graph input
    primals_3"`` or ``"stored into a Python object by setattr"``.
    """

    buffer: Buffer
    node: torch.fx.Node
    how: str


def tensor_nbytes(val: Any):
    """Storage bytes a tensor value needs: ``required_storage_length(shape, stride, offset)``
    times the element size (``torch._prims_common.compute_required_storage_length``); with
    symbolic sizes ``numel × element size`` (no boolean test on a ``SymInt``, which would add
    guards).

    Returns an ``int`` for static shapes, a ``sympy.Expr`` when sizes are ``SymInt``\\ s, or
    ``None`` for non-tensors. Sub-byte dtypes (``float4_e2m1fn_x2``) count packed bytes.
    """
    if not isinstance(val, torch.Tensor):
        return None
    try:
        if val._has_symbolic_sizes_strides:
            # Symbolic sizes: no boolean test on SymInts (it would add guards to the ShapeEnv).
            n = val.numel()
        elif val.is_contiguous() and val.storage_offset() == 0:
            n = val.numel()
        else:
            n = compute_required_storage_length(val.shape, val.stride(), val.storage_offset())
    except Exception:  # noqa: BLE001 - sparse / nested / odd layouts
        n = val.numel()
    nbytes = n * val.element_size()
    if isinstance(nbytes, torch.SymInt):
        return nbytes.node.expr
    return int(nbytes)


# --------------------------------------------------------------------------- alias rules
#: Ops that return (a view of) their first argument at run time without an alias annotation
#: in their schema: ``_unsafe_view`` (a view hidden from autograd) and the functional
#: collectives' ``wait_tensor`` (waits, then returns the very tensor it was given).
_VIEW_EXTRA = {"aten::_unsafe_view", "_c10d_functional::wait_tensor", "c10d_functional::wait_tensor"}
_OPAQUE_SAFE_NAMESPACES = frozenset({"aten", "prims", "inductor", "te_passes", "_c10d_functional",
                                     "c10d_functional", "_quantized", "quantized"})
_PY_STORE_FUNCS = {builtins.setattr, operator.setitem, builtins.object.__setattr__}
_PY_STORE_METHODS = {"append", "extend", "insert", "add", "update", "setdefault", "__setitem__",
                     "__setattr__"}


def is_opaque_call(node: torch.fx.Node) -> bool:
    """Whether ``node`` calls code whose references the compiler cannot see: a custom op
    outside ATen/prims (TE's ``transformer_engine_compile`` ops included), a higher-order op,
    or any non-torch Python callable. Such a callee may keep a reference to its arguments."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return False
    if node.op == "call_module":
        return True
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return _op_rule(t).opaque
    if isinstance(t, torch._ops.OpOverloadPacket):
        return t._qualified_op_name.split("::")[0] not in _OPAQUE_SAFE_NAMESPACES
    if isinstance(t, torch._ops.HigherOrderOperator):
        return True
    if t is operator.getitem:
        return False
    if node.op == "call_method":
        return False
    mod = getattr(t, "__module__", "") or ""
    return not (mod.startswith("torch") or mod in ("_operator", "operator", "builtins", "math"))


def _schema_alias_sources(op: torch._ops.OpOverload, node: torch.fx.Node) -> tuple[list[list[int]], bool]:
    """For each return of ``op``: positions (in the flattened schema args) it aliases; and
    whether the op may also allocate (``maybe_aliasing_or_mutating``)."""
    schema = op._schema
    args = schema.arguments
    out: list[list[int]] = []
    for r in schema.returns:
        ai = r.alias_info
        srcs: list[int] = []
        if ai is not None and ai.before_set:
            srcs = [i for i, a in enumerate(args) if a.alias_info is not None
                    and a.alias_info.before_set & ai.before_set]
        elif ai is not None or (op.is_view and "[]" in str(r.type)):
            # list-returning views: Tensor(a -> *) self -> Tensor(a)[]
            srcs = [i for i, a in enumerate(args) if a.alias_info is not None
                    and ("*" in a.alias_info.after_set or a.alias_info.before_set)]
        out.append(srcs)
    if schema.name in _VIEW_EXTRA and out:
        out[0] = [0]
    maybe = torch.Tag.maybe_aliasing_or_mutating in op.tags
    return out, maybe


@dataclasses.dataclass(frozen=True)
class _OpRule:
    """Alias behaviour of one ``OpOverload``, derived once from its schema."""

    is_set: bool
    srcs: tuple[tuple[int, ...], ...]   # per return: aliased argument positions
    maybe: bool                         # maybe_aliasing_or_mutating
    returns_list: bool                  # a single ``Tensor[]`` return
    arg_names: tuple[str, ...]
    opaque: bool = False                # outside ATen/prims/...: may keep references

    @property
    def fresh(self) -> bool:
        return not self.is_set and not self.maybe and not any(self.srcs)


#: ``id(op) -> (op, rule)``: keyed by identity because ``OpOverload.__hash__`` is Python-level
#: and showed up in profiles of 100k-node graphs; the op is kept to make the id stable.
_RULES: dict[int, tuple[torch._ops.OpOverload, _OpRule]] = {}


def _op_rule(op: torch._ops.OpOverload) -> _OpRule:
    hit = _RULES.get(id(op))
    if hit is not None and hit[0] is op:
        return hit[1]
    schema = op._schema
    srcs, maybe = _schema_alias_sources(op, None)  # type: ignore[arg-type]
    rule = _OpRule(is_set=schema.name.startswith("aten::set_"), srcs=tuple(tuple(s) for s in srcs),
                   maybe=maybe,
                   returns_list=len(schema.returns) == 1 and "[]" in str(schema.returns[0].type),
                   arg_names=tuple(a.name for a in schema.arguments),
                   opaque=op.namespace not in _OPAQUE_SAFE_NAMESPACES)
    _RULES[id(op)] = (op, rule)
    return rule


def _arg_at(node: torch.fx.Node, rule: _OpRule, i: int) -> Any:
    if i < len(node.args):
        return node.args[i]
    return node.kwargs.get(rule.arg_names[i]) if i < len(rule.arg_names) else None


def _arg_values(op: torch._ops.OpOverload, node: torch.fx.Node) -> list[Any]:
    args = op._schema.arguments
    vals = list(node.args) + [None] * max(0, len(args) - len(node.args))
    for i, a in enumerate(args):
        if a.name in node.kwargs:
            vals[i] = node.kwargs[a.name]
    return vals[: len(args)]


def _nodes_in(obj: Any) -> list[torch.fx.Node]:
    if isinstance(obj, torch.fx.Node):
        return [obj]
    if obj is None or isinstance(obj, (int, float, bool, str, torch.dtype, torch.device)):
        return []
    out: list[torch.fx.Node] = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.fx.Node):
            out.append(o)
        elif isinstance(o, (list, tuple)):
            stack.extend(reversed(o))
        elif isinstance(o, dict):
            stack.extend(reversed(list(o.values())))
        elif isinstance(o, slice):
            stack.extend((o.stop, o.step, o.start))
    return out


def _aten_packet_for_name(name: str):
    name = name.removeprefix("__").removesuffix("__") if name.startswith("__") else name
    return getattr(torch.ops.aten, name, None) if hasattr(torch.ops.aten, name) else None


@functools.lru_cache(maxsize=4096)
def _name_alias_kind(name: str) -> str:
    """``"alias"`` (pure view / in-place), ``"fresh"`` or ``"maybe"`` for a torch-level name."""
    if name in ("contiguous", "reshape", "flatten", "reshape_as", "to", "type", "type_as", "cuda",
                "cpu", "float", "half", "bfloat16", "double", "int", "long", "view_as", "expand_as",
                "__getitem__", "getitem"):
        return "alias" if name in ("view_as", "expand_as") else "maybe"
    if name.endswith("_") and not name.startswith("_"):
        return "alias"
    pkt = _aten_packet_for_name(name)
    if pkt is None:
        return "maybe"
    kinds = set()
    for ov in pkt.overloads():
        op = getattr(pkt, ov)
        if any(a.is_out for a in op._schema.arguments):
            continue  # out= variants alias their out argument, not the inputs
        srcs, maybe = _schema_alias_sources(op, None)  # type: ignore[arg-type]
        kinds.add("maybe" if maybe else ("alias" if any(srcs) else "fresh"))
    if not kinds:
        return "maybe"
    if kinds == {"alias"}:
        return "alias"
    if kinds == {"fresh"}:
        return "fresh"
    return "maybe"


# --------------------------------------------------------------------------- the analysis
@dataclasses.dataclass
class Liveness:
    """Result of :func:`analyze` (see the module docstring).

    * ``order`` — ``{node: position}`` in graph order;
    * ``buffers`` — every :class:`Buffer`;
    * ``aliases`` — ``{node: frozenset[Buffer]}``: the buffers a node's value may point into
      (the union over elements for multi-output nodes; empty for non-tensor values);
    * ``elements`` — ``{node: [frozenset[Buffer], ...]}`` per output of multi-output nodes;
    * ``first_def`` / ``last_use`` — ``{buffer: node}``: where it is created, and the last
      node using any alias of it (the ``output`` node for graph outputs);
    * ``holders`` — ``{buffer: set[Buffer]}`` buffers whose storage now also holds it
      (``aten.set_`` destinations);
    * ``output_buffers`` — buffers a graph output aliases;
    * ``escapes`` — :class:`Escape`\\ s (referenced past the end without being outputs);
    * ``saved_inputs`` — placeholders of an AOT backward that are saved tensors (``stage``
      ``post_grad_bwd``: every non-``tangents_*`` placeholder);
    * ``opaque_uses`` — ``{buffer: [node]}`` opaque calls (:func:`is_opaque_call`) using it;
    * ``unknown_alias_nodes`` — nodes whose alias behaviour was guessed conservatively.
    """

    graph: torch.fx.Graph
    order: dict[torch.fx.Node, int]
    buffers: list[Buffer]
    aliases: dict[torch.fx.Node, frozenset[Buffer]]
    elements: dict[torch.fx.Node, list[frozenset[Buffer]]]
    first_def: dict[Buffer, torch.fx.Node]
    last_use: dict[Buffer, torch.fx.Node]
    holders: dict[Buffer, set[Buffer]]
    output_buffers: frozenset[Buffer]
    escapes: list[Escape]
    saved_inputs: frozenset[torch.fx.Node]
    opaque_uses: dict[Buffer, list[torch.fx.Node]]
    unknown_alias_nodes: list[torch.fx.Node]

    def buffers_of(self, node: torch.fx.Node) -> frozenset[Buffer]:
        """The buffers ``node``'s value may alias."""
        return self.aliases.get(node, frozenset())

    def owned_buffer(self, node: torch.fx.Node) -> Buffer | None:
        """The buffer ``node`` is the handle of (its value *is* that storage's base), else None."""
        bufs = self.aliases.get(node, frozenset())
        if len(bufs) == 1:
            (b,) = bufs
            if b.handle is node:
                return b
        return None

    def escaped(self, buf: Buffer) -> list[Escape]:
        """Escapes of ``buf`` (directly, or through a buffer that holds it)."""
        if not self.escapes:
            return []
        seen = self._holder_closure(buf)
        return [e for e in self.escapes if e.buffer in seen]

    def is_output(self, buf: Buffer) -> bool:
        """Whether a graph output aliases ``buf`` or a buffer holding it."""
        if buf in self.output_buffers:
            return True
        if not self.holders:
            return False
        return any(b in self.output_buffers for b in self._holder_closure(buf))

    def live_at_end(self, buf: Buffer) -> bool:
        """Whether ``buf``'s storage is still referenced when the graph returns."""
        return buf.origin is not BufferOrigin.ALLOCATED or self.is_output(buf) or bool(self.escaped(buf))

    def _holder_closure(self, buf: Buffer) -> set[Buffer]:
        seen = {buf}
        stack = [buf]
        while stack:
            for h in self.holders.get(stack.pop(), ()):
                if h not in seen:
                    seen.add(h)
                    stack.append(h)
        return seen

    def quantized_buffers(self) -> list[Buffer]:
        """Buffers classified as parts of quantized tensors, in graph order."""
        return [b for b in self.buffers if b.quantized is not None]

    def users_of(self, buf: Buffer) -> list[torch.fx.Node]:
        """Nodes that use a value aliasing ``buf`` (graph order). O(nodes): for reports and
        tests, not for per-buffer loops."""
        return sorted({u for n, bs in self.aliases.items() if buf in bs for u in n.users},
                      key=self.order.__getitem__)


@contextlib.contextmanager
def gc_paused():
    """Pause Python's cyclic garbage collector for a bounded analysis (restored on exit).

    An analysis allocates a few objects per node while the heap holds the whole graph and its
    fake tensors; every automatic collection would rescan that heap, which made analyses of
    100k-node graphs superlinear (measured: 1.3 s of a 3.6 s estimate was collector time).
    The objects created are acyclic, so nothing is lost by collecting later.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def analyze_shared(graph: torch.fx.Graph, stage: Any, analyses: dict | None) -> Liveness:
    """:func:`analyze` of ``graph``, shared through ``analyses`` (a pass context's
    ``PassContext.analyses``, which the pass manager empties whenever a pass changes the graph):
    the first pass of a stage that needs liveness computes it, later passes reuse it.

    Callers must not mutate the result. ``analyses=None`` always computes afresh.
    """
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
    """Compute alias-aware liveness of every storage in an FX graph.

    Args:
        graph_or_gm: the graph (any stage). Node ``meta['val']`` (fake tensors) gives buffer
            sizes and dtypes; without it buffers are still tracked, with unknown sizes.
        stage: ``"dynamo"``, ``"post_grad_fwd"``, ``"post_grad_bwd"``, ... (a
            :class:`~te_passes.pipeline.base.Stage` value); ``"post_grad_bwd"`` marks the
            non-tangent placeholders as saved tensors.
        saved_roles: ``{placeholder or output name: QuantizedInfo}`` roles learnt elsewhere
            (e.g. from the paired backward graph, :func:`te_passes.te.quantized.link_saved_roles`).

    Returns:
        :class:`Liveness`.

    Raises:
        TypeError: ``graph_or_gm`` is neither a ``torch.fx.Graph`` nor a ``GraphModule``.
    """
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

    def is_tensor_val(v):
        return isinstance(v, torch.Tensor)

    def node_val(n):
        return n.meta.get("val", n.meta.get("example_value"))

    def arg_set(a) -> frozenset[Buffer]:
        out: set[Buffer] = set()
        for n in _nodes_in(a):
            out |= aliases.get(n, EMPTY)
        return frozenset(out)

    def fresh(node, val) -> frozenset[Buffer]:
        if isinstance(val, (list, tuple)):
            elems = []
            for i, v in enumerate(val):
                if is_tensor_val(v):
                    elems.append(frozenset({new_buffer(node, i, BufferOrigin.ALLOCATED, v, None)}))
                else:
                    elems.append(EMPTY)
            elements[node] = elems
            return frozenset().union(*elems) if elems else EMPTY
        if is_tensor_val(val):
            return frozenset({new_buffer(node, None, BufferOrigin.ALLOCATED, val, node)})
        if val is None and "val" not in node.meta and _looks_tensor_valued(node):
            # No metadata: assume one fresh tensor of unknown size so lifetimes are tracked.
            return frozenset({new_buffer(node, None, BufferOrigin.ALLOCATED, None, node)})
        return EMPTY

    for node in nodes:
        val = node_val(node)
        if node.op == "placeholder":
            aliases[node] = (frozenset({new_buffer(node, None, BufferOrigin.INPUT, val, node)})
                             if is_tensor_val(val) or val is None else EMPTY)
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
            elif is_tensor_val(node_val(src)):
                # tensor indexing (Dynamo level): a view or a copy
                aliases[node] = aliases.get(src, EMPTY) | fresh(node, val)
                unknown.append(node)
            else:
                aliases[node] = aliases.get(src, EMPTY)
            continue
        # --- Python-level stores (Dynamo graphs)
        if node.op == "call_function" and target in _PY_STORE_FUNCS:
            stored = node.args[-1] if target is not operator.setitem else node.args[2]
            for b in arg_set(stored):
                escapes.append(Escape(b, node, f"stored into a Python object by {getattr(target, '__name__', target)}"))
            aliases[node] = EMPTY
            continue
        if node.op == "call_method" and target in _PY_STORE_METHODS and node.args and \
                not (isinstance(node.args[0], torch.fx.Node) and is_tensor_val(node_val(node.args[0]))):
            for b in arg_set(node.args[1:]):
                escapes.append(Escape(b, node, f"stored into a Python object by .{target}()"))
            aliases[node] = EMPTY
            continue
        # --- ATen / custom op overloads
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
            rule = _op_rule(target)
            if rule.fresh:
                aliases[node] = fresh(node, val)
                continue
            if rule.is_set:
                argv = _arg_values(target, node)
                dst = arg_set(argv[0]) if argv else EMPTY
                src = arg_set(argv[1:]) if len(argv) > 1 else EMPTY
                _link_holders(node, dst, src, holders, escapes)
                aliases[node] = dst | src
                continue
            if rule.maybe:
                unknown.append(node)
                f = fresh(node, val)
                aliases[node] = f | arg_set(_arg_values(target, node))
                continue
            aliased = [frozenset().union(*[arg_set(_arg_at(node, rule, i)) for i in srcs]) if srcs else EMPTY
                       for srcs in rule.srcs]
            if len(aliased) == 1 and aliased[0]:
                if rule.returns_list:
                    n_out = len(val) if isinstance(val, (list, tuple)) else 0
                    elements[node] = [aliased[0]] * n_out
                aliases[node] = aliased[0]
                continue
            if any(aliased):
                # several returns, some aliasing inputs (e.g. in-place multi-return ops)
                elems = []
                vals = val if isinstance(val, (list, tuple)) else [None] * len(aliased)
                for i, (a, v) in enumerate(zip(aliased, vals)):
                    elems.append(a if a else (frozenset({new_buffer(node, i, BufferOrigin.ALLOCATED, v, None)})
                                              if is_tensor_val(v) else EMPTY))
                elements[node] = elems
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
            dst = arg_set(node.args[0])
            src = arg_set(node.args[1:]) | arg_set(node.kwargs)
            _link_holders(node, dst, src, holders, escapes)
            aliases[node] = dst | src
            continue
        kind = _name_alias_kind(name) if isinstance(name, str) and node.op != "call_module" else "maybe"
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
        if not bs or not n.users:
            continue
        lu = max(order[u] for u in n.users)
        for b in bs:
            if lu > last_pos[b]:
                last_pos[b] = lu
    last_use: dict[Buffer, torch.fx.Node] = {b: nodes[p] for b, p in last_pos.items()}
    opaque_uses: dict[Buffer, list[torch.fx.Node]] = {}
    for node in nodes:
        if is_opaque_call(node):
            seen: set[Buffer] = set()
            for a in node.all_input_nodes:
                for b in aliases.get(a, EMPTY):
                    if b not in seen:
                        seen.add(b)
                        opaque_uses.setdefault(b, []).append(node)
    changed = True
    while changed:
        changed = False
        for b, hs in holders.items():
            for h in hs:
                if order[last_use[h]] > order[last_use[b]]:
                    last_use[b] = last_use[h]
                    changed = True
    output_buffers: frozenset[Buffer] = EMPTY
    if out_node is not None:
        output_buffers = arg_set(out_node.args)

    saved_inputs = frozenset()
    if stage == "post_grad_bwd":
        saved_inputs = frozenset(n for n in nodes if n.op == "placeholder"
                                 and not str(n.target).startswith("tangents"))

    lv = Liveness(graph, order, buffers, aliases, elements, first_def, last_use, holders,
                  output_buffers, escapes, saved_inputs, opaque_uses, unknown)
    _attach_quantized(lv, saved_roles)
    return lv


def _looks_tensor_valued(node: torch.fx.Node) -> bool:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return any(str(r.type).startswith("Tensor") for r in t._schema.returns)
    return node.op in ("call_function", "call_method", "call_module") and t is not operator.getitem


def _link_holders(node, dst: frozenset[Buffer], src: frozenset[Buffer], holders, escapes) -> None:
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


def live_intervals(lv: Liveness, buffers: Iterable[Buffer] | None = None) -> dict[Buffer, tuple[int, int]]:
    """``{buffer: (def position, last-use position)}``; graph outputs and escapes extend to the
    output node, inputs/constants span the whole graph."""
    end = len(lv.order) - 1
    out = {}
    for b in (lv.buffers if buffers is None else buffers):
        if b.origin is not BufferOrigin.ALLOCATED:
            out[b] = (0, end)
        elif lv.live_at_end(b):
            out[b] = (lv.order[b.node], end)
        else:
            out[b] = (lv.order[b.node], lv.order[lv.last_use[b]])
    return out


def names(bufs: Sequence[Buffer]) -> list[str]:
    """Buffer names (for messages and tests)."""
    return [b.name for b in bufs]
