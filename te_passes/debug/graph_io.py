"""Save FX graphs of TE models to disk and load them back offline (no GPU), for ``te-passes replay``.

See docs/internals.md#te_passesdebuggraph_iopy."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import warnings
from typing import Any

import torch
import torch.fx

from te_passes.te import graph_model as gmod
from te_passes.te import graph_constants as gconst
from te_passes.debug.graph_safety import (BudgetError, GraphFileError, UnsafeGraphFileError, SafeUnpickler,
    import_te, check_budget, check_memo_indices, check_name, resolve_function)
from te_passes.debug.sym_expr import check_sym_expr, check_symbols, graph_symbols, parse_sym_expr, restore_symbols
from te_passes.debug.graph_safety import (  # noqa: F401 re-exported: part of graph_io's interface
    ALLOWED_GLOBALS, allowed_global)


FORMAT_PREFIX, FORMAT_VERSION = "te_passes.tegraph/", 1
FORMAT = f"{FORMAT_PREFIX}{FORMAT_VERSION}"
#: The largest ``.tegraph`` file :func:`load_payload` reads.
MAX_FILE_BYTES = 512 * 2**20


@dataclasses.dataclass(frozen=True)
class _NodeRef:
    name: str


@dataclasses.dataclass(frozen=True)
class _OpRef:
    qualname: str            # "ns::op"
    overload: str | None     # None for an OpOverloadPacket

    def resolve(self) -> Any:
        ns, name = self.qualname.split("::")
        if ns == gmod.TE_OP_NAMESPACE:
            import_te()
        try:
            packet = getattr(getattr(torch.ops, ns), name)
            op = packet if self.overload is None else getattr(packet, self.overload)
        except (AttributeError, RuntimeError) as e:
            raise GraphFileError(f"op {self.qualname} is not registered in this process ({e})") from e
        if not isinstance(op, torch._ops.OpOverloadPacket if self.overload is None else torch._ops.OpOverload):
            raise UnsafeGraphFileError(f"op {self.qualname}.{self.overload} is not an operator")
        return op


@dataclasses.dataclass(frozen=True)
class _FnRef:
    module: str
    qualname: str

    def resolve(self) -> Any:
        return resolve_function(self.module, self.qualname)


@dataclasses.dataclass(frozen=True)
class SymMeta:
    """A ``SymInt``/``SymFloat``/``SymBool`` as text (``"s0*64"``) with its hint (or ``None``)."""

    expr: str
    hint: Any
    kind: str = "int"


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """A fake tensor's geometry: ``shape``/``stride`` (ints or :class:`SymMeta`), ``dtype``,
    ``device`` (str), ``requires_grad``."""

    shape: tuple[Any, ...]
    stride: tuple[Any, ...]
    dtype: torch.dtype
    device: str
    requires_grad: bool = False


# --------------------------------------------------------------------------- save
def _sym(s: Any) -> Any:
    if not isinstance(s, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return s
    try:
        hint = s.node.hint
    except Exception:  # noqa: BLE001 - no hint (an unbacked symbol)
        hint = None
    kind = "int" if isinstance(s, torch.SymInt) else "float" if isinstance(s, torch.SymFloat) else "bool"
    return SymMeta(str(s.node.expr), hint, kind)


def encode_val(val: Any) -> Any:
    """``meta['val']`` -> picklable description (tensors -> :class:`TensorMeta`, sym values ->
    :class:`SymMeta`, containers recursively, TE constants kept, anything else ``None``)."""
    if isinstance(val, torch.Tensor):
        return TensorMeta(tuple(_sym(s) for s in val.shape), tuple(_sym(s) for s in val.stride()),
                          val.dtype, str(val.device), bool(val.requires_grad))
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return _sym(val)
    if isinstance(val, (list, tuple)):
        return type(val)(encode_val(v) for v in val) if isinstance(val, list) else tuple(encode_val(v) for v in val)
    if val is None or isinstance(val, (bool, int, float, str)) or gconst.te_const_kind(val) is not None:
        return val
    return None


def _encode_target(node: torch.fx.Node) -> Any:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return _OpRef(t._schema.name, t._overloadname)
    if isinstance(t, torch._ops.OpOverloadPacket):
        return _OpRef(t._qualified_op_name, None)
    if isinstance(t, str):
        return t
    mod = getattr(t, "__module__", None)
    qual = getattr(t, "__qualname__", None) or getattr(t, "__name__", None)
    if mod == "_operator":
        mod = "operator"
    if mod is None or qual is None:
        raise GraphFileError(f"node {node.name}: cannot save target {t!r}")
    return _FnRef(mod, qual)


def _encode_arg(a: Any) -> Any:
    return torch.fx.node.map_aggregate(a, lambda x: _NodeRef(x.name) if isinstance(x, torch.fx.Node) else x)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        red = gconst.te_reduce(obj)
        if red is not None:
            return red
        if isinstance(obj, torch.Tensor):
            raise pickle.PicklingError("tensor constants are saved as TensorMeta only")
        return NotImplemented


def graph_payload(gm: torch.fx.GraphModule | torch.fx.Graph, **info: Any) -> dict[str, Any]:
    """The picklable description of ``gm`` (see docs/internals.md) plus ``info``."""
    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    nodes = []
    for n in graph.nodes:
        meta = {"val": encode_val(n.meta.get("val"))}
        if "example_value" in n.meta:  # Dynamo graphs keep fake values here
            meta["example_value"] = encode_val(n.meta["example_value"])
        for k in ("stack_trace", "nn_module_stack", "source_fn_stack", "original_aten"):
            if k in n.meta:
                meta[k] = n.meta[k] if k == "stack_trace" else repr(n.meta[k])
        nodes.append({"name": n.name, "op": n.op, "target": _encode_target(n),
                      "args": _encode_arg(n.args), "kwargs": _encode_arg(n.kwargs), "meta": meta})
    attrs = {}
    owner = graph.owning_module
    for n in graph.find_nodes(op="get_attr"):
        try:
            v: Any = owner
            for part in str(n.target).split("."):
                v = getattr(v, part)
        except AttributeError:
            continue
        attrs[str(n.target)] = encode_val(v) if isinstance(v, torch.Tensor) else v
    return {"format": FORMAT, "torch": str(torch.__version__), "nodes": nodes, "attrs": attrs,
            "symbols": graph_symbols(graph), **info}


def save_graph(path: str | os.PathLike, gm: torch.fx.GraphModule | torch.fx.Graph, **info: Any) -> None:
    """Write ``gm`` to ``path`` as a ``.tegraph`` pickle; ``info`` (JSON-able or picklable: ``stage``,
    ``graph_id``, ``te_state``, ``options``, ``example_inputs``) is stored with it.

    Raises:
        GraphFileError: a node target or constant cannot be saved (the message names it).
        OSError: ``path`` cannot be written.
    """
    if "example_inputs" in info and info["example_inputs"] is not None:
        info["example_inputs"] = [encode_val(x) for x in info["example_inputs"]]
    buf = io.BytesIO()
    try:
        _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(graph_payload(gm, **info))
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise GraphFileError(f"cannot save graph to {path}: {e}") from e
    with open(path, "wb") as f:
        f.write(buf.getvalue())


def _check_payload(payload: Any, path: str) -> dict[str, Any]:
    """The payload's structure, checked field by field (what :func:`build_graph_module` reads).

    Raises:
        GraphFileError: naming ``path`` and the first field that is wrong.
    """
    if not isinstance(payload, dict):
        raise GraphFileError(f"{path} is not a te_passes graph file (its pickle holds a "
                             f"{type(payload).__name__}, not a graph record)")
    fmt = payload.get("format")
    if isinstance(fmt, str) and fmt.startswith(FORMAT_PREFIX) and fmt != FORMAT:
        raise GraphFileError(f"{path}: unsupported graph file format {fmt[len(FORMAT_PREFIX):]} (this te_passes "
                             f"reads {FORMAT_VERSION})")
    if fmt != FORMAT:
        raise GraphFileError(f"{path} is not a te_passes graph file (format {fmt!r}, expected {FORMAT})")
    check_budget(payload, path)
    nodes = payload.get("nodes")
    if not isinstance(nodes, list):
        raise GraphFileError(f"{path}: 'nodes' is a {type(nodes).__name__}, not a list")
    for i, rec in enumerate(nodes):
        if not isinstance(rec, dict):
            raise GraphFileError(f"{path}: nodes[{i}] is a {type(rec).__name__}, not a node record")
        for key, types in (("name", str), ("op", str), ("args", tuple), ("kwargs", dict)):
            if not isinstance(rec.get(key), types):
                raise GraphFileError(f"{path}: nodes[{i}].{key} is {type(rec.get(key)).__name__}, expected "
                                     f"{types.__name__}")
        if rec["op"] not in ("placeholder", "get_attr", "call_function", "call_method", "call_module", "output"):
            raise GraphFileError(f"{path}: nodes[{i}] has unknown op {rec['op']!r:.40}")
        check_name(rec["name"], f"{path}: nodes[{i}].name")
        for k in rec["kwargs"]:
            check_name(k, f"{path}: nodes[{i}] ({rec['name']}) keyword")
        if rec["op"] == "output" and len(rec["args"]) != 1:
            raise GraphFileError(f"{path}: nodes[{i}] (output) has {len(rec['args'])} args, expected 1")
        if not isinstance(rec.get("meta", {}), dict):
            raise GraphFileError(f"{path}: nodes[{i}].meta is not a dict")
        if not isinstance(rec.get("meta", {}).get("stack_trace", ""), (str, type(None))):
            raise GraphFileError(f"{path}: nodes[{i}].meta['stack_trace'] is not a str")
        t, at = rec.get("target"), f"{path}: nodes[{i}] ({rec['name']})"
        if rec["op"] == "call_function" and not isinstance(t, (_OpRef, _FnRef)):
            raise GraphFileError(f"{at} call_function target is {type(t).__name__}")
        if rec["op"] != "call_function":
            if not isinstance(t, str):
                raise GraphFileError(f"{at} target is {type(t).__name__}, expected str")
            check_name(t, f"{at} target", dotted=rec["op"] in ("get_attr", "call_module"))
        if isinstance(t, _OpRef):
            if not isinstance(t.qualname, str) or t.qualname.count("::") != 1:
                raise GraphFileError(f"{at} op name {str(t.qualname)[:60]!r} is not 'ns::op'")
            for part in t.qualname.split("::"):
                check_name(part, f"{at} op name")
            if t.overload is not None:
                check_name(t.overload, f"{at} op overload")
        if isinstance(t, _FnRef):
            check_name(t.module, f"{at} function module", dotted=True)
            check_name(t.qualname, f"{at} function name", dotted=True)
    for key, types in (("attrs", dict), ("options", dict), ("te_state", dict), ("example_inputs", list),
                       ("stage", str), ("graph_id", str)):
        if payload.get(key) is not None and not isinstance(payload[key], types):
            raise GraphFileError(f"{path}: '{key}' is a {type(payload[key]).__name__}, expected {types.__name__}")
    for k in payload.get("attrs") or {}:
        check_name(k, f"{path}: attrs key", dotted=True)
    check_symbols(payload.get("symbols"), path)

    def check_vals(v: Any, where: str) -> None:
        for m in _metas(v):
            if isinstance(m, TensorMeta) and (
                    not isinstance(m.dtype, torch.dtype) or not isinstance(m.device, str)
                    or not isinstance(m.shape, tuple) or not isinstance(m.stride, tuple)
                    or len(m.shape) != len(m.stride)):
                raise GraphFileError(f"{path}: {where}: tensor description is malformed ({m!r:.120})")
            for x in (*m.shape, *m.stride) if isinstance(m, TensorMeta) else (m,):
                if isinstance(x, SymMeta):
                    if x.kind not in ("int", "float", "bool"):
                        raise GraphFileError(f"{path}: {where}: symbolic kind {x.kind!r} is not int/float/bool")
                    check_sym_expr(x.expr, f"{path}: {where}")
                elif not isinstance(x, int) or isinstance(x, bool) or x < 0:
                    raise GraphFileError(f"{path}: {where}: tensor size/stride {x!r} is not a non-negative int")

    for i, rec in enumerate(nodes):
        for key in ("val", "example_value"):
            check_vals(rec.get("meta", {}).get(key), f"nodes[{i}] ({rec['name']}).meta[{key!r}]")
    check_vals(payload.get("example_inputs"), "example_inputs")
    for k, v in (payload.get("attrs") or {}).items():
        check_vals(v, f"attrs[{k!r}]")
    return payload


# --------------------------------------------------------------------------- load
def _metas(v: Any) -> Any:
    """The :class:`TensorMeta` / :class:`SymMeta` in ``v`` (nested in lists, tuples and dict values)."""
    if isinstance(v, (SymMeta, TensorMeta)):
        yield v
    elif isinstance(v, (list, tuple, dict)):
        for x in v.values() if isinstance(v, dict) else v:
            yield from _metas(x)


def _has_sym(v: Any) -> bool:
    return any(isinstance(x, SymMeta) for m in _metas(v) for x in ((*m.shape, *m.stride)
                                                                   if isinstance(m, TensorMeta) else (m,)))


class _Builder:
    """Rebuilds fake values; a ``ShapeEnv`` only when the graph has symbolic sizes (its sympy
    machinery costs seconds on first use)."""

    def __init__(self, symbolic: bool = True, symbols: dict[str, dict[str, Any]] | None = None) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        self.shape_env = ShapeEnv() if symbolic else None
        self.mode = FakeTensorMode(shape_env=self.shape_env, allow_non_fake_inputs=True)
        self.symbols = restore_symbols(self.shape_env, symbols or {}) if self.shape_env is not None else {}

    def sym(self, s: Any) -> Any:
        import sympy

        if not isinstance(s, SymMeta):
            return s
        expr = parse_sym_expr(s.expr, "symbolic size", self.symbols)
        for sym in getattr(expr, "free_symbols", ()):
            self.symbols.setdefault(str(sym), sym)
        if s.kind == "bool" and s.hint is None and isinstance(expr, sympy.logic.boolalg.Boolean) \
                and not isinstance(expr, sympy.logic.boolalg.BooleanAtom):
            # an unbacked comparison (``u0 >= 0`` of a runtime assert) has no hint to stand for it
            return self.shape_env.create_symboolnode(expr)
        if s.kind != "int":
            return s.hint
        return self.shape_env.create_symintnode(expr, hint=s.hint)

    def val(self, v: Any) -> Any:
        if isinstance(v, TensorMeta):
            with self.mode, warnings.catch_warnings():
                # TE's None sentinel outputs are complex32 (custom_op._NONE_SENTINEL_DTYPE)
                warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")
                t = torch.empty_strided([self.sym(x) for x in v.shape], [self.sym(x) for x in v.stride],
                                        dtype=v.dtype, device=v.device)
            if v.requires_grad and (t.is_floating_point() or t.is_complex()):
                t.requires_grad_(True)
            return t
        if isinstance(v, SymMeta):
            return self.sym(v)
        if isinstance(v, list):
            return [self.val(x) for x in v]
        if isinstance(v, tuple):
            return tuple(self.val(x) for x in v)
        return v


def load_payload(path: str | os.PathLike) -> dict[str, Any]:
    """Read a ``.tegraph`` file's payload (TE constants are rebuilt, so TE is imported when the
    file holds any).

    Raises:
        GraphFileError: missing file, not a ``.tegraph`` pickle, unsupported format version, a
            malformed field (the message names the file and the field).
        UnsafeGraphFileError: the pickle references a global outside :func:`allowed_global`
            (refused before any object in it is built; a crafted ``__reduce__`` never runs).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise GraphFileError(f"graph file not found: {path}")
    if os.path.getsize(path) > MAX_FILE_BYTES:
        raise BudgetError(f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB; not a graph file this te_passes wrote")
    with open(path, "rb") as f:
        data = f.read()
    if b"transformer_engine" in data:
        import_te()
    try:
        check_memo_indices(data, path)
        payload = SafeUnpickler(io.BytesIO(data), path).load()
    except GraphFileError:  # UnsafeGraphFileError and BudgetError included: already named
        raise
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
        msg = " ".join(str(e).split())[:200]
        raise GraphFileError(f"{path} is not a te_passes graph file ({type(e).__name__}: {msg})") from None
    return _check_payload(payload, path)


def build_graph_module(payload: dict[str, Any]) -> tuple[torch.fx.GraphModule, list[Any] | None]:
    """Rebuild ``(GraphModule, example_inputs)`` from a payload; node names are preserved.

    Raises:
        GraphFileError: an op is not registered here or a node refers to an unknown node.
    """
    b = _Builder(symbolic=any(_has_sym(rec.get("meta")) for rec in payload["nodes"])
                 or _has_sym(payload.get("example_inputs")), symbols=payload.get("symbols"))
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}

    def arg(a: Any) -> Any:
        def m(x: Any) -> Any:
            if isinstance(x, _NodeRef):
                if x.name not in env:
                    raise GraphFileError(f"graph file refers to undefined node {x.name}")
                return env[x.name]
            return x
        return torch.fx.node.map_aggregate(a, m)

    for rec in payload["nodes"]:
        target = rec["target"]
        if isinstance(target, (_OpRef, _FnRef)):
            target = target.resolve()
        if rec["op"] == "output":
            node = graph.output(arg(rec["args"][0]))
        else:
            node = graph.create_node(rec["op"], target, arg(rec["args"]), arg(rec["kwargs"]), name=rec["name"])
            if node.name != rec["name"]:
                raise GraphFileError(f"node name {rec['name']} could not be preserved (got {node.name})")
        meta = dict(rec.get("meta", {}))
        for key in ("val", "example_value"):
            if key in meta:
                val = b.val(meta.pop(key))
                if val is not None:
                    node.meta[key] = val
        if isinstance(meta.get("stack_trace"), str):  # printed in generated code's comments: one line each
            node.meta["stack_trace"] = "".join(c for c in meta["stack_trace"] if c == "\n" or c >= " ")
        env[node.name] = node
    root = torch.nn.Module()
    for target, v in payload.get("attrs", {}).items():
        obj = root
        *path, last = target.split(".")
        for part in path:
            if not hasattr(obj, part):
                obj.add_module(part, torch.nn.Module())
            obj = getattr(obj, part)
        setattr(obj, last, b.val(v))
    gm = torch.fx.GraphModule(root, graph)
    ex = payload.get("example_inputs")
    example_inputs = [b.val(x) for x in ex] if ex is not None else None
    return gm, example_inputs


def load_graph(path: str | os.PathLike) -> tuple[torch.fx.GraphModule, dict[str, Any]]:
    """``(GraphModule, payload)`` for a ``.tegraph`` file; ``payload["example_inputs_fake"]``
    holds the rebuilt example inputs (fake tensors) or ``None``.

    Raises:
        GraphFileError: see :func:`load_payload` / :func:`build_graph_module`.
    """
    payload = load_payload(path)
    try:
        gm, ex = build_graph_module(payload)
    except GraphFileError as e:
        raise type(e)(str(e) if os.fspath(path) in str(e) else f"{os.fspath(path)}: {e}") from None
    except Exception as e:  # noqa: BLE001 - a field the checks let through that still does not build
        msg = " ".join(str(e).split())[:200]
        raise GraphFileError(f"{os.fspath(path)}: the graph does not rebuild ({type(e).__name__}: {msg})") from None
    payload["example_inputs_fake"] = ex
    return gm, payload
