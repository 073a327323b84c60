"""Issue 39's fence measures that hold from now on (docs/design.md "Where issue 39 stands"):

- ``te/`` holds TE tables and pure functions about the graph model: no bytecode / code-object / closure
  introspection and no module that imports ``dis`` or ``inspect`` (the TE-version audits that do are in
  ``compat/te220/``);
- ``te/`` reads no live TE process state: TE's UB registry and te.autocast state are read by
  ``compat/live_state.py`` (``capture_ub`` / ``capture_fp8`` / ``capture_te_state``), ``te/`` holds their data types;
- at most 20 mutable module globals in the package, counted by ``scripts/measure_fence.py`` (a state
  object changed through its fields counts as one, so bundling cannot hide one).
"""

from __future__ import annotations

import ast
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "te_passes")
MAX_MUTABLE_GLOBALS = 20
#: Attribute names that introspect code objects, frames or closures.
INTROSPECTION_ATTRS = frozenset({"__code__", "__closure__", "co_code", "co_consts", "co_names", "co_firstlineno",
                                 "co_lines", "co_positions", "f_lineno", "f_code", "f_back"})
INTROSPECTION_MODULES = frozenset({"dis", "inspect"})


def _measure_fence():
    spec = importlib.util.spec_from_file_location("measure_fence", os.path.join(ROOT, "scripts", "measure_fence.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _introspection(source: str) -> list[str]:
    """What in ``source`` introspects code: ``import dis`` / ``inspect``, or one of :data:`INTROSPECTION_ATTRS`."""
    out = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Import):
            out += [f"import {a.name}" for a in n.names if a.name.split(".")[0] in INTROSPECTION_MODULES]
        elif isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] in INTROSPECTION_MODULES:
            out.append(f"from {n.module} import ...")
        elif isinstance(n, ast.Attribute) and n.attr in INTROSPECTION_ATTRS:
            out.append(f"line {n.lineno}: .{n.attr}")
        elif isinstance(n, ast.Constant) and n.value in INTROSPECTION_ATTRS:
            out.append(f"line {n.lineno}: {n.value!r}")  # getattr(fn, "__code__")
    return out


def test_te_has_no_code_introspection():
    te_dir = os.path.join(PKG, "te")
    found = {f: hits for f in sorted(os.listdir(te_dir)) if f.endswith(".py")
             if (hits := _introspection(open(os.path.join(te_dir, f)).read()))}
    assert found == {}, f"te/ introspects code (move it to compat/te220/): {found}"


def test_the_introspection_scan_sees_each_kind():
    assert _introspection("import dis\n") == ["import dis"]
    assert _introspection("from inspect import getsource\n") == ["from inspect import ..."]
    assert _introspection("x = f.__closure__\n") == ["line 1: .__closure__"]
    assert _introspection("y = getattr(f, '__code__', None)\n") == ["line 1: '__code__'"]
    assert _introspection("def f(node):\n    return node.args\n") == []


#: Names of TE's live process state (``module/base.py``'s UB registry, ``quantization.py``'s te.autocast state).
LIVE_TE_STATE = frozenset({"_ub_communicators", "_ub_initialized", "_ub_with_cublasmp", "FP8GlobalStateManager",
                           "quantization_state"})


def _live_state_reads(source: str) -> list[str]:
    """Code in ``source`` reading one of :data:`LIVE_TE_STATE`: a name, an attribute, an imported name or a
    ``getattr`` / ``hasattr`` string (docstrings, comments and a class-name comparison read nothing)."""
    out = []
    for n in ast.walk(ast.parse(source)):
        name = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else None
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr") and \
                len(n.args) > 1 and isinstance(n.args[1], ast.Constant):
            name = n.args[1].value
        if isinstance(n, ast.ImportFrom):
            out += [f"line {n.lineno}: import {a.name}" for a in n.names if a.name in LIVE_TE_STATE]
        elif name in LIVE_TE_STATE:
            out.append(f"line {n.lineno}: {name}")
    return out


def test_te_reads_no_live_te_state():
    te_dir = os.path.join(PKG, "te")
    found = {f: hits for f in sorted(os.listdir(te_dir)) if f.endswith(".py")
             if (hits := _live_state_reads(open(os.path.join(te_dir, f)).read()))}
    assert found == {}, f"te/ reads live TE state (move the read to compat/live_state.py): {found}"


def test_the_live_state_scan_sees_each_kind():
    assert _live_state_reads("from transformer_engine.pytorch.quantization import FP8GlobalStateManager as M\n") \
        == ["line 1: import FP8GlobalStateManager"]
    assert _live_state_reads("x = base._ub_communicators\n") == ["line 1: _ub_communicators"]
    assert _live_state_reads("x = getattr(base, '_ub_initialized', False)\n") == ["line 1: _ub_initialized"]
    assert _live_state_reads('"""reads FP8GlobalStateManager"""\nok = cls.__name__ == "FP8GlobalStateManager"\n') == []
    assert _live_state_reads("x = M.quantization_state.fp8_recipe\n") == ["line 1: quantization_state"]


def test_mutable_module_globals_stay_at_most_20():
    mf = _measure_fence()
    found = []
    for d, dirs, files in os.walk(PKG):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        for f in sorted(files):
            if f.endswith(".py"):
                p = os.path.join(d, f)
                found += [f"{os.path.relpath(p, PKG)}:{g}" for g in mf.mutable_globals(ast.parse(open(p).read()))]
    assert len(found) <= MAX_MUTABLE_GLOBALS, "\n".join(found)


def test_a_state_object_counts_as_one_mutable_global():
    mf = _measure_fence()

    def count(src: str) -> list[str]:
        return mf.mutable_globals(ast.parse(src))

    state = "import dataclasses\n@dataclasses.dataclass\nclass S:\n    rows: list\n_S = S([])\nFIXED = (1, 2)\n"
    assert count(state + "def f(r):\n    _S.rows.append(r)\n") == ["_S"]  # through a field: counted
    assert count(state + "def f(r):\n    _S.rows[0] = r\n") == ["_S"]
    assert count(state + "def f():\n    global FIXED\n    FIXED = ()\n") == ["FIXED"]
    assert count(state + "def f():\n    return _S.rows[0], FIXED\n") == []
