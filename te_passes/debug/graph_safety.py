"""What a ``.tegraph`` file (:mod:`te_passes.debug.graph_io`) may hold, checked before anything in
it is built: the restricted unpickler (:class:`SafeUnpickler`, :func:`allowed_global`), identifier
names (:func:`check_name`), node targets resolved by their own ``__module__``
(:func:`resolve_function`) and the budgeted walk of a loaded structure (:func:`check_budget`). See
docs/cli.md, "Guarantees"."""

from __future__ import annotations

import enum
import importlib
import pickle
from typing import Any

import torch
import torch.fx

from te_passes.te import graph_constants as gconst


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
#: ones in :func:`allowed_global` (torch dtypes/layouts, TE constant classes and enums): the graph
#: file's own records, FX's ``immutable_list`` / ``immutable_dict`` (node args), TE's quantizer
#: rebuild function (TE 2.20 ``transformer_engine/pytorch/dynamo/quantizer_opaque.py``) and the
#: value types a Dynamo graph's constant arguments may hold. Checked against real dumps by
#: ``tests/debug/test_graph_io_safety.py``.
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    ("te_passes.debug.graph_io", "_NodeRef"), ("te_passes.debug.graph_io", "_OpRef"),
    ("te_passes.debug.graph_io", "_FnRef"), ("te_passes.debug.graph_io", "SymMeta"),
    ("te_passes.debug.graph_io", "TensorMeta"),
    ("torch.fx.immutable_collections", "immutable_list"), ("torch.fx.immutable_collections", "immutable_dict"),
    ("torch", "device"), ("torch", "Size"),
    ("builtins", "slice"), ("builtins", "complex"), ("builtins", "Ellipsis"),
    ("transformer_engine.pytorch.dynamo.quantizer_opaque", "_rebuild_quantizer"),
    # how a torch.layout pickles (torch/serialization.py: copyreg, a dict lookup by str(layout))
    ("torch.serialization", "_get_layout"),
})


def _is_te_module(module: str) -> bool:
    return module.split(".")[0] in ("transformer_engine", "transformer_engine_torch")


def allowed_global(module: str, name: str) -> bool:
    """Whether a ``.tegraph`` pickle may reference global ``module.name``."""
    if (module, name) in ALLOWED_GLOBALS:
        return True
    if module == "torch._utils" and name.startswith("torch.") and name.count(".") == 1:
        # a torch.memory_format pickles as its reduce string "torch.contiguous_format", found by
        # pickle's whichmodule under torch._utils (aten.clone(memory_format=...) in joint graphs)
        obj = getattr(torch, name[len("torch."):], None)
        return isinstance(obj, torch.memory_format)
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


def is_dotted_identifier(text: Any) -> bool:
    """Whether ``text`` is a ``str`` of Python identifiers joined by dots (``a``, ``a.b_1``), none
    a keyword: the only names a loaded graph may put into the code FX generates."""
    import keyword

    return isinstance(text, str) and 0 < len(text) <= 1000 and all(
        p.isidentifier() and p.isascii() and not keyword.iskeyword(p) for p in text.split("."))


def check_name(text: Any, where: str, *, dotted: bool = False) -> str:
    """``text`` when it is an identifier (``dotted``: a dotted identifier).

    Raises:
        UnsafeGraphFileError: anything else (the message names ``where`` and the text, cut).
    """
    if is_dotted_identifier(text) and (dotted or "." not in text):
        return text
    raise UnsafeGraphFileError(f"{where} {str(text)[:60]!r} is not a{' dotted' if dotted else 'n'} identifier "
                               f"(a graph file's names go into generated code; the file may be crafted)")


def allowed_target_module(module: str) -> bool:
    """Whether functions of ``module`` may be node targets of a loaded graph (:data:`TARGET_MODULE_ROOTS`)."""
    return is_dotted_identifier(module) and module.split(".")[0] in TARGET_MODULE_ROOTS


def _owner_module(obj: Any) -> str | None:
    """The module ``obj`` belongs to by its own ``__module__`` (a module: its ``__name__``)."""
    import types

    name = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", None)
    if name is None and type(obj).__name__ in ("builtin_function_or_method", "method_descriptor"):
        name = getattr(getattr(obj, "__self__", None), "__name__", None)  # bound C functions of a module
    return name if isinstance(name, str) else None


def resolve_function(module: str, qualname: str) -> Any:
    """The function ``module.qualname`` a ``.tegraph`` node target names (``_FnRef``): the module
    must be under :data:`TARGET_MODULE_ROOTS`, and every attribute step (``torch.nn.functional.gelu``)
    must land on an object whose own ``__module__`` is under them too (``torch.os.system`` stops at ``os``).

    Raises:
        UnsafeGraphFileError: the module or a step leaves the allowed modules, a name is not an
            identifier, or the name is a refused builtin (``eval``, ``open``, ...).
        GraphFileError: the module does not import here or has no such function.
    """
    refuse = UnsafeGraphFileError(f"node target {str(module)[:80]}.{str(qualname)[:80]} is outside what a "
                                  f"te_passes graph may call (modules {', '.join(TARGET_MODULE_ROOTS)})")
    if not is_dotted_identifier(module) or not is_dotted_identifier(qualname):
        raise refuse
    if not allowed_target_module(module) or any(p in _REFUSED_BUILTINS for p in qualname.split(".")):
        raise refuse
    try:
        mod: Any = importlib.import_module(module)
    except ImportError as e:
        raise GraphFileError(f"function {module}.{qualname}: module does not import here "
                             f"({type(e).__name__}: {e})") from None
    def walk(parts: list[str]) -> Any:
        obj = mod
        for part in parts:
            obj = getattr(obj, part, None)
            if obj is None:
                return None
            owner = _owner_module(obj)
            if owner is not None and not allowed_target_module("operator" if owner == "_operator" else owner):
                raise refuse
        return obj

    parts = qualname.split(".")
    # builtins bound from a C class: torch.relu has __qualname__ "_VariableFunctionsClass.relu"
    # but lives at torch.relu
    obj = walk(parts) if hasattr(mod, parts[0]) else None
    if obj is None and len(parts) > 1:
        obj = walk(parts[-1:])
    if obj is None:
        raise GraphFileError(f"function {module}.{qualname} does not exist in this process")
    owner = _owner_module(obj)
    owner = "operator" if owner == "_operator" else owner
    if not callable(obj) or owner is None or not allowed_target_module(owner) \
            or getattr(obj, "__name__", "") in _REFUSED_BUILTINS:
        raise refuse
    return obj


# --------------------------------------------------------------------------- budgets
#: Limits of a loaded structure (graph file payload, dump JSON): nested containers at most
#: ``depth`` deep, at most ``items`` elements counting shared references once per use (a list
#: referenced twice counts twice), integers at most ``digits`` digits. Real dumps stay far below.
BUDGET = {"depth": 100, "items": 2_000_000, "digits": 100, "str_chars": 10_000_000}


class BudgetError(GraphFileError):
    """A loaded structure exceeds :data:`BUDGET` (too deep, too many items, too large a number)."""


def check_budget(obj: Any, where: str, budget: dict[str, int] | None = None) -> None:
    """Walk ``obj`` once without recursion (memoized by identity: a shared sub-structure is sized once, then
    counted per use) and refuse it when it exceeds ``budget`` (default :data:`BUDGET`) or holds a cycle.

    Raises:
        BudgetError: naming ``where`` and the limit.
    """
    import dataclasses

    b = {**BUDGET, **(budget or {})}
    sizes: dict[int, tuple[int, int]] = {}  # id -> (items, depth) of a finished sub-structure
    keep: list[Any] = []  # holds walked objects so ids stay unique

    def children(o: Any) -> Any:
        if isinstance(o, dict):
            return [*o.keys(), *o.values()]
        if isinstance(o, (list, tuple, set, frozenset)):
            return o
        if isinstance(o, slice):
            return (o.start, o.stop, o.step)
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            names = [f.name for f in dataclasses.fields(o)]
            if type(o).__module__.startswith("te_passes.") and set(vars(o)) != set(names):
                # pickle builds a dataclass by NEWOBJ + BUILD(state): a file can drop or rename fields
                got = sorted(repr(k)[:40] for k in vars(o))[:12]  # keys of any type: a crafted state dict
                raise GraphFileError(f"{where}: a {type(o).__name__} with fields {', '.join(got)}, not {names}")
            return [getattr(o, n, None) for n in names]
        return None

    def leaf(o: Any) -> None:
        if isinstance(o, int) and not isinstance(o, bool) and o.bit_length() > b["digits"] * 3.33:
            raise BudgetError(f"{where}: an integer with more than {b['digits']} digits")
        if isinstance(o, (str, bytes)) and len(o) > b["str_chars"]:
            raise BudgetError(f"{where}: a string of more than {b['str_chars']} characters")

    stack: list[tuple[Any, int]] = [(obj, 0)]  # (object, state): 0 = enter, 1 = children done
    on_path: set[int] = set()
    while stack:
        o, state = stack.pop()
        k = id(o)
        if state == 0:
            if k in sizes:
                continue
            kids = children(o)
            if kids is None:
                leaf(o)
                sizes[k] = (1, 0)
                keep.append(o)
                continue
            if k in on_path:
                raise BudgetError(f"{where}: a structure that contains itself")
            if len(on_path) >= b["depth"]:
                raise BudgetError(f"{where}: nested more than {b['depth']} levels deep")
            on_path.add(k)
            keep.append(o)
            stack.append((o, 1))
            for c in kids:
                if id(c) in on_path:
                    raise BudgetError(f"{where}: a structure that contains itself")
                if id(c) not in sizes:
                    stack.append((c, 0))
        else:
            on_path.discard(k)
            n, d = 1, 0
            for c in children(o):
                cn, cd = sizes[id(c)]
                n += cn
                d = max(d, cd + 1)
            if n > b["items"]:
                raise BudgetError(f"{where}: more than {b['items']} items (counting shared references "
                                  f"per use)")
            if d > b["depth"]:
                raise BudgetError(f"{where}: nested more than {b['depth']} levels deep")
            sizes[k] = (n, d)


class _Checked:
    """A TE constructor a graph file calls while it is unpickled (``OpaqueValueBundle``,
    ``_rebuild_quantizer``): its arguments pass :func:`check_budget` first (TE walks them
    recursively)."""

    def __init__(self, fn: Any, path: str) -> None:
        self.fn, self.path = fn, path

    def __call__(self, *args: Any) -> Any:
        check_budget(args, f"{self.path}: arguments of {getattr(self.fn, '__name__', 'a TE constant')}")
        return self.fn(*args)


class SafeUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose ``find_class`` accepts only :func:`allowed_global` (the
    restricted-unpickler pattern of Python's pickle docs, "Restricting Globals")."""

    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if not allowed_global(module, name):
            raise UnsafeGraphFileError(f"{self._path}: refused to load: it references {module}.{name}, which a "
                                       f"te_passes graph file never holds (only te_passes, TE and torch value "
                                       f"types are allowed); the file may be crafted")
        obj = super().find_class(module, name)
        if name == "_rebuild_quantizer" or (isinstance(obj, type) and _is_te_module(module)
                                            and gconst.te_const_kind(obj) is gconst.TEConstKind.BUNDLE):
            return _Checked(obj, self._path)
        return obj


def check_memo_indices(data: bytes, path: str) -> None:
    """Refuse a pickle that writes its memo past its own length, before it is unpickled: the C
    unpickler sizes its memo array to the largest index it is given, so one ``LONG_BINPUT`` of
    ``2**30`` in a 7 KB file allocates gigabytes (a single byte inserted into a string of a real
    dump does it; found by the long fuzz profile). Reads opcodes with :mod:`pickletools`, builds
    nothing.

    Raises:
        BudgetError: naming ``path``, the index and its byte offset.
        ValueError: ``data`` is not a pickle (``pickletools``' own error).
    """
    import pickletools

    for op, arg, pos in pickletools.genops(data):
        if op.name in ("PUT", "BINPUT", "LONG_BINPUT") and int(arg) > len(data):
            raise BudgetError(f"{path}: a pickle memo index of {int(arg)} at byte {pos}, past the file's "
                              f"{len(data)} bytes; the file is damaged or crafted")
