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
import enum
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
FORMAT_PREFIX, FORMAT_VERSION = "te_passes.tegraph/", 1


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


# ------------------------------------------------------------- end renamed modules


class GraphFileError(Exception):
    """A graph file is missing, unreadable, not a ``.tegraph`` or needs ops not registered here."""


class UnsafeGraphFileError(GraphFileError):
    """A graph file references a global outside the allow-list (:func:`allowed_global`): refused
    before anything in it is built or run."""


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
        module = renamed_module(self.module)
        if not allowed_target_module(module) or self.qualname.rsplit(".", 1)[-1] in _REFUSED_BUILTINS:
            raise UnsafeGraphFileError(f"node target {self.module}.{self.qualname} is outside what a te_passes "
                                       f"graph may call (modules {', '.join(TARGET_MODULE_ROOTS)})")
        try:
            mod: Any = importlib.import_module(module)
        except ImportError as e:
            raise GraphFileError(f"function {self.module}.{self.qualname}: module does not import here "
                                 f"({type(e).__name__}: {e})") from None
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
    return {"format": FORMAT, "torch": str(torch.__version__), "nodes": nodes, "attrs": attrs, **info}


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


# --------------------------------------------------------------------------- safe load
#: Module roots whose functions may be FX node targets in a loaded graph (``_FnRef``): Python's
#: operators and builtins (minus :data:`_REFUSED_BUILTINS`), math, torch, TE and te_passes.
TARGET_MODULE_ROOTS = ("operator", "_operator", "builtins", "math", "torch", "transformer_engine",
                       "transformer_engine_torch", "te_passes")
#: Builtins never accepted as a node target (they run code or touch files if called).
_REFUSED_BUILTINS = frozenset({"eval", "exec", "compile", "open", "__import__", "input", "breakpoint", "exit",
                               "quit", "globals", "locals", "vars", "delattr", "setattr", "system", "popen"})

#: Exact ``(module, name)`` globals a ``.tegraph`` pickle may reference, besides the rule-based
#: ones in :func:`allowed_global` (TE constant classes, torch dtypes). Derived from the globals
#: in real dumps (``tests/test_graph_io_safety.py`` dumps every built-in example, lists the
#: globals with :func:`pickle_globals` and checks each is allowed): the graph file's own records,
#: FX's ``immutable_list`` / ``immutable_dict`` (node args), ``TorchVersion`` (the saved torch
#: version of files written before it was saved as ``str``), TE's quantizer rebuild function
#: (TE 2.20 ``transformer_engine/pytorch/dynamo/quantizer_opaque.py``); plus the value types a
#: Dynamo graph's constant arguments may hold (``slice``, ``Ellipsis``, ``complex``,
#: ``torch.device``, ``torch.Size``). The rule-based part of :func:`allowed_global` covers the
#: dtypes (``torch.bfloat16``, ``torch.uint8``, ``torch.complex32`` for TE's None sentinels) and
#: TE's constant classes (``OpaqueValueBundle``, ``_TensorOrQuantizedKind``, ``DType``,
#: ``Float8CurrentScalingQuantizer``, ``MXFP8Quantizer``, ``Float8TensorStorage``, ...).
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    ("te_passes.debug.graph_io", "_NodeRef"), ("te_passes.debug.graph_io", "_OpRef"),
    ("te_passes.debug.graph_io", "_FnRef"), ("te_passes.debug.graph_io", "SymMeta"),
    ("te_passes.debug.graph_io", "TensorMeta"),
    ("te_passes.pipeline.base", "Stage"),  # a str enum: graph files written before 2026-12-01 pickle it in their info
    ("torch.fx.immutable_collections", "immutable_list"), ("torch.fx.immutable_collections", "immutable_dict"),
    ("torch", "device"), ("torch", "Size"), ("torch.torch_version", "TorchVersion"),
    ("builtins", "slice"), ("builtins", "complex"), ("builtins", "Ellipsis"),
    ("transformer_engine.pytorch.dynamo.quantizer_opaque", "_rebuild_quantizer"),
})


def renamed_module(module: str) -> str:
    """``module`` mapped through :data:`RENAMED_MODULES` (exact name first, then the longest
    dotted prefix)."""
    if module in RENAMED_MODULES:
        return RENAMED_MODULES[module]
    parts = module.split(".")
    for i in range(len(parts) - 1, 0, -1):
        head = ".".join(parts[:i])
        if head in RENAMED_MODULES:
            return RENAMED_MODULES[head] + "." + ".".join(parts[i:])
    return module


def allowed_target_module(module: str) -> bool:
    """Whether functions of ``module`` may be node targets of a loaded graph (:data:`TARGET_MODULE_ROOTS`)."""
    return module.split(".")[0] in TARGET_MODULE_ROOTS


def _is_te_module(module: str) -> bool:
    return module.split(".")[0] in ("transformer_engine", "transformer_engine_torch")


def allowed_global(module: str, name: str) -> bool:
    """Whether a ``.tegraph`` pickle may reference global ``module.name`` (after :func:`renamed_module`).

    Allowed: :data:`ALLOWED_GLOBALS`; torch's dtype / layout / memory-format values
    (``torch.float32``); classes in ``transformer_engine*`` modules that are TE graph constants
    (:func:`te_passes.te.graph_model.te_const_kind`: OpaqueValueBundle, quantizers, quantized
    storages, recipes, TE enums such as ``DType``). Deciding the rule-based cases imports the
    (installed, trusted) module named; nothing from the file runs. Everything else — ``os``,
    ``subprocess``, ``builtins.eval``, any function outside the list — is refused.
    """
    if (module, name) in ALLOWED_GLOBALS:
        return True
    if "." in name or name.startswith("__"):
        return False
    if module == "torch":
        obj = getattr(torch, name, None)
        return isinstance(obj, (torch.dtype, torch.layout, torch.memory_format))
    if _is_te_module(module):
        try:
            obj = getattr(importlib.import_module(module), name, None)
        except Exception:  # noqa: BLE001 - a module that does not import is not allowed
            return False
        if isinstance(obj, type) and issubclass(obj, enum.Enum):  # TE's Python enums (_TensorOrQuantizedKind)
            return True
        return isinstance(obj, type) and gmod.te_const_kind(obj) in (
            gmod.TEConstKind.BUNDLE, gmod.TEConstKind.QUANTIZER, gmod.TEConstKind.STORAGE,
            gmod.TEConstKind.RECIPE, gmod.TEConstKind.ENUM)
    return False


class _SafeUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose ``find_class`` maps through :data:`RENAMED_MODULES`, then
    accepts only :func:`allowed_global` (the restricted-unpickler pattern of Python's pickle
    docs, "Restricting Globals")."""

    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        new = renamed_module(module)
        if not allowed_global(new, name):
            raise UnsafeGraphFileError(f"{self._path}: refused to load: it references {module}.{name}, which a "
                                       f"te_passes graph file never holds (only te_passes, TE and torch value "
                                       f"types are allowed); the file may be crafted")
        return super().find_class(new, name)


def pickle_globals(data: bytes) -> list[tuple[str, str]]:
    """Every ``(module, name)`` global a pickle references (read with :mod:`pickletools`,
    nothing is built), in first-seen order."""
    import pickletools

    out: list[tuple[str, str]] = []
    pushed: list[Any] = []  # the last values pushed (strings, or None for anything else)
    memo: dict[int, Any] = {}
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8", "SHORT_BINSTRING",
                    "BINSTRING", "STRING"):
            pushed.append(arg)
        elif name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[int(arg)] = pushed[-1] if pushed else None
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            pushed.append(memo.get(int(arg)))
        elif name in ("GLOBAL", "INST"):
            mod, gname = arg.split(" ", 1)
            out.append((mod, gname))
            pushed.append(None)
        elif name == "STACK_GLOBAL":
            if len(pushed) >= 2 and isinstance(pushed[-2], str) and isinstance(pushed[-1], str):
                out.append((pushed[-2], pushed[-1]))
            else:
                out.append(("?", "?"))  # not statically known: never allowed
            pushed.append(None)
        elif op.stack_after:
            pushed.append(None)
    return list(dict.fromkeys(out))


_SYM_FUNCS = frozenset({"Max", "Min", "floor", "ceiling", "Mod", "FloorDiv", "CeilDiv", "CleanDiv", "ModularIndexing",
                        "PythonMod", "FloorToInt", "CeilToInt", "TruncToInt", "IntTrueDiv", "ToFloat", "Abs",
                        "Integer", "Rational", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "And", "Or", "Not"})


def check_sym_expr(expr: Any, where: str) -> str:
    """``expr`` when it is a sympy size expression of the kind ``str(SymInt.node.expr)`` prints
    (symbols, integers, + - * / // % **, comparisons, :data:`_SYM_FUNCS` calls): checked with
    :mod:`ast` before :func:`sympy.sympify` (which evaluates its text) ever sees it.

    Raises:
        GraphFileError: anything else (attribute access, other calls, strings, lambdas, ...).
    """
    import ast

    if not isinstance(expr, str) or len(expr) > 10_000:
        raise GraphFileError(f"{where}: symbolic size {expr!r:.80} is not a size expression")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        raise GraphFileError(f"{where}: symbolic size {expr!r:.80} is not a size expression") from None
    ok = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Compare, ast.BoolOp, ast.Name, ast.Load, ast.Constant,
          ast.operator, ast.unaryop, ast.cmpop, ast.boolop, ast.Call)
    for n in ast.walk(tree):
        bad = not isinstance(n, ok)
        bad = bad or (isinstance(n, ast.Constant) and not isinstance(n.value, (int, float)))
        bad = bad or (isinstance(n, ast.Call) and (not isinstance(n.func, ast.Name) or n.func.id not in _SYM_FUNCS
                                                   or n.keywords))
        bad = bad or (isinstance(n, ast.Name) and n.id.startswith("_"))
        if bad:
            raise GraphFileError(f"{where}: symbolic size {expr!r:.80} is not a size expression "
                                 f"({type(n).__name__} not allowed)")
    return expr


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
            raise GraphFileError(f"{path}: nodes[{i}] ({rec['name']}) has unknown op {rec['op']!r}")
        if rec["op"] == "output" and len(rec["args"]) != 1:
            raise GraphFileError(f"{path}: nodes[{i}] (output) has {len(rec['args'])} args, expected 1")
        if not isinstance(rec.get("meta", {}), dict):
            raise GraphFileError(f"{path}: nodes[{i}].meta is not a dict")
        t = rec.get("target")
        if rec["op"] in ("call_function",) and not isinstance(t, (_OpRef, _FnRef)):
            raise GraphFileError(f"{path}: nodes[{i}] ({rec['name']}) call_function target is {type(t).__name__}")
        if rec["op"] in ("placeholder", "get_attr", "call_method", "call_module", "output") \
                and not isinstance(t, str):
            raise GraphFileError(f"{path}: nodes[{i}] ({rec['name']}) target is {type(t).__name__}, expected str")
        if isinstance(t, _OpRef) and (not isinstance(t.qualname, str) or t.qualname.count("::") != 1):
            raise GraphFileError(f"{path}: nodes[{i}] ({rec['name']}) op name {t.qualname!r} is not 'ns::op'")
    for key, types in (("attrs", dict), ("options", dict), ("te_state", dict), ("example_inputs", list)):
        if payload.get(key) is not None and not isinstance(payload[key], types):
            raise GraphFileError(f"{path}: '{key}' is a {type(payload[key]).__name__}, expected {types.__name__}")
    for key in ("stage", "graph_id"):
        if payload.get(key) is not None and not isinstance(payload[key], str):
            raise GraphFileError(f"{path}: '{key}' is a {type(payload[key]).__name__}, expected str")

    def check_vals(v: Any, where: str) -> None:
        if isinstance(v, SymMeta):
            if v.kind not in ("int", "float", "bool"):
                raise GraphFileError(f"{path}: {where}: symbolic kind {v.kind!r} is not int/float/bool")
            check_sym_expr(v.expr, f"{path}: {where}")
        elif isinstance(v, TensorMeta):
            if not isinstance(v.dtype, torch.dtype) or not isinstance(v.device, str) \
                    or not isinstance(v.shape, tuple) or not isinstance(v.stride, tuple) \
                    or len(v.shape) != len(v.stride):
                raise GraphFileError(f"{path}: {where}: tensor description is malformed ({v!r:.120})")
            for x in (*v.shape, *v.stride):
                if isinstance(x, SymMeta):
                    check_vals(x, where)
                elif not isinstance(x, int) or isinstance(x, bool) or x < 0:
                    raise GraphFileError(f"{path}: {where}: tensor size/stride {x!r} is not a non-negative int")
        elif isinstance(v, (list, tuple)):
            for x in v:
                check_vals(x, where)

    for i, rec in enumerate(nodes):
        for key in ("val", "example_value"):
            check_vals(rec.get("meta", {}).get(key), f"nodes[{i}] ({rec['name']}).meta[{key!r}]")
    check_vals(payload.get("example_inputs"), "example_inputs")
    for k, v in (payload.get("attrs") or {}).items():
        check_vals(v, f"attrs[{k!r}]")
    return payload


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

        check_sym_expr(s.expr, "symbolic size")
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
        GraphFileError: missing file, not a ``.tegraph`` pickle, unsupported format version, a
            malformed field (the message names the file and the field).
        UnsafeGraphFileError: the pickle references a global outside :func:`allowed_global`
            (refused before any object in it is built; a crafted ``__reduce__`` never runs).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise GraphFileError(f"graph file not found: {path}")
    with open(path, "rb") as f:
        data = f.read()
    if b"transformer_engine" in data:
        _import_te()
    try:
        payload = _SafeUnpickler(io.BytesIO(data), path).load()
    except UnsafeGraphFileError:
        raise
    except GraphFileError:
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
    try:
        gm, ex = build_graph_module(payload)
    except GraphFileError as e:
        raise type(e)(str(e) if os.fspath(path) in str(e) else f"{os.fspath(path)}: {e}") from None
    except Exception as e:  # noqa: BLE001 - a field the checks let through that still does not build
        msg = " ".join(str(e).split())[:200]
        raise GraphFileError(f"{os.fspath(path)}: the graph does not rebuild ({type(e).__name__}: {msg})") from None
    payload["example_inputs_fake"] = ex
    return gm, payload
