"""The package's layer rule, beyond what ``lint-imports`` checks (pyproject.toml
``[tool.importlinter]``, run by .ci/run): no import cycle between te_passes modules (function-level
imports included), ``te/`` never imports Inductor, and every function-level import of a
te_passes module is one the layers could not have at module level (there is none left) —
so the import graph seen by a reader is the real one.
"""

from __future__ import annotations

import ast
import os

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "te_passes")


def _modules() -> dict[str, str]:
    out = {}
    for root, _dirs, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                rel = os.path.relpath(path, os.path.dirname(PKG))[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def _imports(path: str, module: str, is_pkg: bool):
    """``(imported module, line, top_level)`` for every import statement of ``path``."""
    tree = ast.parse(open(path).read(), path)
    top = {id(n) for n in tree.body}
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                yield a.name, n.lineno, id(n) in top
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                parts = module.split(".")
                parts = parts if is_pkg else parts[:-1]
                parts = parts[: len(parts) - (n.level - 1)]
                base = ".".join(parts + ([n.module] if n.module else []))
            for a in n.names:
                yield (f"{base}.{a.name}" if base else a.name), n.lineno, id(n) in top
                yield base, n.lineno, id(n) in top


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    g: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for target, _line, _top in _imports(path, m, path.endswith("__init__.py")):
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != m and target != "te_passes":
                g[m].add(target)
    return g


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_between_modules():
    assert _cycles(_graph()) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_te_layer_never_imports_inductor_or_upper_layers():
    bad = []
    for m, path in _modules().items():
        if m == "te_passes.te" or m.startswith("te_passes.te."):
            for target, line, _top in _imports(path, m, path.endswith("__init__.py")):
                if target.startswith(("torch._inductor", "te_passes.compat", "te_passes.ops", "te_passes.cudagraphs", "te_passes.passes",
                                      "te_passes.pipeline")):
                    bad.append(f"{m}:{line} imports {target}")
    assert bad == []


def test_te_passes_imports_are_module_level():
    """A function-level import of a te_passes module hides an edge of the layer graph: every
    te_passes import is at module level, except in the CLI (``te-passes --help`` / ``list`` start
    without importing torch), the package's lazy ``te_passes.te_inductor`` and
    ``testing/gpu.py``, which benchmarks/sp_fp8_tp2.py loads as a standalone file (one import of
    the backend, inside the function that registers it)."""
    lazy = []
    for m, path in _modules().items():
        if m in ("te_passes.cli", "te_passes") or m.startswith("te_passes.cli."):
            continue
        if m == "te_passes.testing.gpu":
            assert [t for t, _line, top in _imports(path, m, False) if t.startswith("te_passes") and not top] == [
                "te_passes.backend.te_inductor", "te_passes.backend"]
            continue
        for target, line, top in _imports(path, m, path.endswith("__init__.py")):
            if not top and target.startswith("te_passes"):
                lazy.append(f"{m}:{line} {target}")
    assert sorted(set(lazy)) == []


def _underscore_imports(path: str, module: str, is_pkg: bool) -> list[str]:
    """``from <other te_passes module> import _name`` statements of ``path`` (dunder names aside)."""
    tree = ast.parse(open(path).read(), path)
    out = []
    for n in ast.walk(tree):
        if not isinstance(n, ast.ImportFrom):
            continue
        base = n.module or ""
        if n.level:
            parts = module.split(".")
            parts = parts if is_pkg else parts[:-1]
            base = ".".join(parts[: len(parts) - (n.level - 1)] + ([n.module] if n.module else []))
        if not base.startswith("te_passes") or base == module:
            continue
        out += [f"{module}:{n.lineno} from {base} import {a.name}" for a in n.names
                if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def test_no_module_imports_another_modules_underscore_names():
    """A private name is private to its module: a seam two modules share is public, or the split
    is merged back (issue 25)."""
    found = [hit for m, path in _modules().items() for hit in _underscore_imports(path, m, path.endswith("__init__.py"))]
    assert found == []


def test_underscore_check_sees_what_it_looks_for(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("from te_passes.debug.dump_files import slug, _hidden\nfrom .sibling import _x\n"
                 "from te_passes.a.m import _own\nfrom te_passes.x import __version__\n")
    assert _underscore_imports(str(p), "te_passes.a.m", False) == [
        "te_passes.a.m:1 from te_passes.debug.dump_files import _hidden", "te_passes.a.m:2 from te_passes.a.sibling import _x"]


def test_pipeline_never_imports_a_pass():
    """The framework is handed the ordered pass list (te_passes.passes.order); it imports no pass,
    by name or by string (the import-linter contract "the pass framework imports no pass" checks
    the first; this the second)."""
    for m, path in _modules().items():
        if m.startswith("te_passes.pipeline"):
            text = open(path).read()
            assert "importlib" not in text and "te_passes.passes." not in text.replace("te_passes.passes.order", ""), m
