"""Save FX graphs of TE models to disk and load them back offline (no GPU), for ``te-passes replay``.

A ``GraphModule`` pickle (``GraphModule.__reduce__``) stores generated Python code and re-imports
globals by name; it loses ``node.meta`` (the fake-tensor ``val``\\ s passes read for shapes and
bytes) and node names are re-derived. Replay must reproduce the same report, which names nodes,
so a graph is saved node by node instead (``*.tegraph``, a pickle):

* each node's ``name``, ``op``, ``target``, ``args``/``kwargs`` (nodes as :class:`_NodeRef`),
  and ``meta['val']`` as :class:`TensorMeta` (shape/stride with symbolic sizes as sympy text,
  dtype, device) — plus ``stack_trace`` / ``nn_module_stack`` when present;
* ``OpOverload`` / ``OpOverloadPacket`` targets by qualified name (``ns::op`` + overload);
* TE constants by value through :func:`te_passes.te.graph_model.te_reduce`
  (``OpaqueValueBundle(contents)``, ``_rebuild_quantizer(cls, items)``);
* the stage, graph id, options and the TE state snapshot (``TEState.to_json``) it was compiled
  under, and the example inputs' :class:`TensorMeta`.

:func:`load_graph` rebuilds the graph with identical node names, targets, constants and fake
``meta['val']`` tensors (on their original device, under a fresh ``FakeTensorMode`` whose
``ShapeEnv`` recreates the symbols with their hints), so passes see what they saw at compile
time. Loading needs the same ops registered: it imports ``transformer_engine.pytorch`` when the
graph has ``transformer_engine_compile`` targets (TE's Python package; no GPU).
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import os
import pickle
import warnings
from typing import Any

import torch
import torch.fx

from te_passes.te import graph_model as gmod

FORMAT = "te_passes.tegraph/1"

# ------------------------------------------------------------- renamed modules (issue 12 layout)
#: Old -> new module paths of te_passes modules that moved (issue 12's layered layout). A
#: ``.tegraph`` saved before a move names the old path (pickled classes/functions, ``_FnRef``
#: targets); :class:`_Unpickler` and ``_FnRef.resolve`` look the name up here first.
RENAMED_MODULES: dict[str, str] = {
    "te_passes.te.guards": "te_passes.runtime.ub_guard",
    "te_passes.te.amax_groups": "te_passes.runtime.amax_groups",
    "te_passes.te.free_op": "te_passes.runtime.free_op",
    "te_passes.passes.base": "te_passes.pipeline.base",
    "te_passes.passes.manager": "te_passes.pipeline.manager",
    "te_passes.passes.registry": "te_passes.pipeline.registry",
    "te_passes.debug.cli": "te_passes.cli",
}


def renamed_module(module: str) -> str:
    """``module``'s current path (:data:`RENAMED_MODULES`), or ``module`` itself."""
    return RENAMED_MODULES.get(module, module)


class _Unpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that maps moved te_passes modules (:data:`RENAMED_MODULES`)."""

    def find_class(self, module: str, name: str) -> Any:
        return super().find_class(renamed_module(module), name)
# ------------------------------------------------------------- end renamed modules


class GraphFileError(Exception):
    """A graph file is missing, unreadable, not a ``.tegraph`` or needs ops not registered here."""


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
            _import_te()
        try:
            packet = getattr(getattr(torch.ops, ns), name)
        except (AttributeError, RuntimeError) as e:
            raise GraphFileError(f"op {self.qualname} is not registered in this process ({e})") from e
        return packet if self.overload is None else getattr(packet, self.overload)


@dataclasses.dataclass(frozen=True)
class _FnRef:
    module: str
    qualname: str

    def resolve(self) -> Any:
        mod: Any = importlib.import_module(renamed_module(self.module))
        obj = mod
        try:
            for part in self.qualname.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            # builtins bound from a C class: torch.relu has __qualname__
            # "_VariableFunctionsClass.relu" but lives at torch.relu
            obj = getattr(mod, self.qualname.rsplit(".", 1)[-1], None)
            if obj is None:
                raise GraphFileError(f"function {self.module}.{self.qualname} does not exist in this "
                                     f"process") from None
        return obj


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


def _import_te() -> None:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means the ops are missing
        raise GraphFileError(f"the graph has Transformer Engine ops but transformer_engine.pytorch "
                             f"does not import here ({type(e).__name__}: {e})") from e


# --------------------------------------------------------------------------- save
def _sym(s: Any) -> Any:
    if isinstance(s, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        node = s.node
        hint = None
        try:
            hint = node.hint
        except Exception:  # noqa: BLE001
            pass
        kind = "int" if isinstance(s, torch.SymInt) else "float" if isinstance(s, torch.SymFloat) else "bool"
        return SymMeta(str(node.expr), hint, kind)
    return s


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
    if val is None or isinstance(val, (bool, int, float, str)) or gmod.te_const_kind(val) is not None:
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
        red = gmod.te_reduce(obj)
        if red is not None:
            return red
        if isinstance(obj, torch.Tensor):
            raise pickle.PicklingError("tensor constants are saved as TensorMeta only")
        return NotImplemented


def graph_payload(gm: torch.fx.GraphModule | torch.fx.Graph, **info: Any) -> dict[str, Any]:
    """The picklable description of ``gm`` (see the module docstring) plus ``info``."""
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
    return {"format": FORMAT, "torch": torch.__version__, "nodes": nodes, "attrs": attrs, **info}


def save_graph(path: str | os.PathLike, gm: torch.fx.GraphModule | torch.fx.Graph, **info: Any) -> None:
    """Write ``gm`` to ``path`` as a ``.tegraph`` pickle; ``info`` (JSON-able or picklable:
    ``stage``, ``graph_id``, ``te_state``, ``options``, ``example_inputs``) is stored with it.

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


# --------------------------------------------------------------------------- load
def _has_sym(v: Any) -> bool:
    if isinstance(v, SymMeta):
        return True
    if isinstance(v, TensorMeta):
        return any(isinstance(x, SymMeta) for x in (*v.shape, *v.stride))
    if isinstance(v, (list, tuple)):
        return any(_has_sym(x) for x in v)
    if isinstance(v, dict):
        return any(_has_sym(x) for x in v.values())
    return False


class _Builder:
    """Rebuilds fake values; a ``ShapeEnv`` only when the graph has symbolic sizes (its sympy
    machinery costs seconds on first use)."""

    def __init__(self, symbolic: bool = True) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        self.shape_env = ShapeEnv() if symbolic else None
        self.mode = FakeTensorMode(shape_env=self.shape_env, allow_non_fake_inputs=True)

    def sym(self, s: Any) -> Any:
        if not isinstance(s, SymMeta):
            return s
        import sympy

        expr = sympy.sympify(s.expr, locals={name: sympy.Symbol(name, integer=True, positive=True)
                                             for name in _symbol_names(s.expr)})
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


def _symbol_names(expr: str) -> list[str]:
    import re

    return sorted(set(re.findall(r"\b[a-zA-Z_]\w*\b", expr)) - {"Max", "Min", "floor", "ceiling",
                                                                 "Mod", "FloorDiv", "CeilDiv"})


def load_payload(path: str | os.PathLike) -> dict[str, Any]:
    """Read a ``.tegraph`` file's payload (TE constants are rebuilt, so TE is imported when the
    file holds any).

    Raises:
        GraphFileError: missing file, not a ``.tegraph`` pickle, wrong format version.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise GraphFileError(f"graph file not found: {path}")
    with open(path, "rb") as f:
        data = f.read()
    if b"transformer_engine" in data:
        _import_te()
    try:
        payload = _Unpickler(io.BytesIO(data)).load()
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
        raise GraphFileError(f"{path} is not a te_passes graph file ({type(e).__name__}: {e})") from e
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise GraphFileError(f"{path} is not a te_passes graph file (expected format {FORMAT})")
    return payload


def build_graph_module(payload: dict[str, Any]) -> tuple[torch.fx.GraphModule, list[Any] | None]:
    """Rebuild ``(GraphModule, example_inputs)`` from a payload; node names are preserved.

    Raises:
        GraphFileError: an op is not registered here or a node refers to an unknown node.
    """
    b = _Builder(symbolic=any(_has_sym(rec.get("meta")) for rec in payload["nodes"])
                 or _has_sym(payload.get("example_inputs")))
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
        node.meta.update({k: v for k, v in meta.items() if k == "stack_trace"})
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
    gm, ex = build_graph_module(payload)
    payload["example_inputs_fake"] = ex
    return gm, payload
