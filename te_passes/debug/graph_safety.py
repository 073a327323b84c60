"""What a ``.tegraph`` file (:mod:`te_passes.debug.graph_io`) may reference, checked before anything
in it is built: the restricted unpickler (:class:`SafeUnpickler`, the allow-list
:data:`ALLOWED_GLOBALS` / :func:`allowed_global`), the module paths that moved
(:data:`RENAMED_MODULES`), the allowed node-target modules, a static list of a pickle's globals
(:func:`pickle_globals`) and the check of symbolic size expressions (:func:`check_sym_expr`).
All of it is importable from :mod:`te_passes.debug.graph_io` as well."""

from __future__ import annotations

import enum
import importlib
import pickle
from typing import Any

import torch
import torch.fx

from te_passes.te import graph_constants as gconst


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

def import_te() -> None:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means the ops are missing
        raise GraphFileError(f"the graph has Transformer Engine ops but transformer_engine.pytorch "
                             f"does not import here ({type(e).__name__}: {e})") from e


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
    (:func:`te_passes.te.graph_constants.te_const_kind`: OpaqueValueBundle, quantizers, quantized
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
        return isinstance(obj, type) and gconst.te_const_kind(obj) in (
            gconst.TEConstKind.BUNDLE, gconst.TEConstKind.QUANTIZER, gconst.TEConstKind.STORAGE,
            gconst.TEConstKind.RECIPE, gconst.TEConstKind.ENUM)
    return False


def resolve_function(module_name: str, qualname: str) -> Any:
    """The function ``module_name.qualname`` a ``.tegraph`` node target names (``_FnRef``), after
    :func:`renamed_module`, imported only from :data:`TARGET_MODULE_ROOTS` modules.

    Raises:
        UnsafeGraphFileError: the module is outside :data:`TARGET_MODULE_ROOTS` or the name is a
            refused builtin (``eval``, ``open``, ...).
        GraphFileError: the module does not import here or has no such function.
    """
    module = renamed_module(module_name)
    if not allowed_target_module(module) or qualname.rsplit(".", 1)[-1] in _REFUSED_BUILTINS:
        raise UnsafeGraphFileError(f"node target {module_name}.{qualname} is outside what a te_passes "
                                   f"graph may call (modules {', '.join(TARGET_MODULE_ROOTS)})")
    try:
        mod: Any = importlib.import_module(module)
    except ImportError as e:
        raise GraphFileError(f"function {module_name}.{qualname}: module does not import here "
                             f"({type(e).__name__}: {e})") from None
    obj = mod
    try:
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        # builtins bound from a C class: torch.relu has __qualname__
        # "_VariableFunctionsClass.relu" but lives at torch.relu
        obj = getattr(mod, qualname.rsplit(".", 1)[-1], None)
        if obj is None:
            raise GraphFileError(f"function {module_name}.{qualname} does not exist in this "
                                 f"process") from None
    return obj


class SafeUnpickler(pickle.Unpickler):
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

def symbol_names(expr: str) -> list[str]:
    import re

    return sorted(set(re.findall(r"\b[a-zA-Z_]\w*\b", expr)) - {"Max", "Min", "floor", "ceiling",
                                                                 "Mod", "FloorDiv", "CeilDiv"})
