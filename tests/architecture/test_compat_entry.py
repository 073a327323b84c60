"""The compat fence has one entry (issue 39 item 3): ``te_passes.pipeline``, ``.passes``, ``.analyses``, ``.te``
and ``.fx`` import compat only as ``te_passes.compat.api``. ``lint-imports`` checks the direct imports
(pyproject.toml, the contract naming ``te_passes.compat.api``); this test keeps that contract's list of
forbidden compat modules complete and catches what it cannot see (an import of the bare package)."""

from __future__ import annotations

import ast
import os
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPAT = os.path.join(ROOT, "te_passes", "compat")
ENTRY = "te_passes.compat.api"
SOURCES = ("te_passes.pipeline", "te_passes.passes", "te_passes.analyses", "te_passes.te", "te_passes.fx")


def _contract() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    (c,) = [c for c in contracts if ENTRY in c["name"]]
    return c


def test_the_contract_forbids_every_compat_module_but_the_entry():
    children = {f"te_passes.compat.{n.removesuffix('.py')}" for n in os.listdir(COMPAT)
                if n not in ("__pycache__", "__init__.py")
                and (n.endswith(".py") or os.path.isdir(os.path.join(COMPAT, n)))}
    c = _contract()
    assert c["type"] == "forbidden" and sorted(c["source_modules"]) == sorted(SOURCES)
    assert set(c["forbidden_modules"]) == children - {ENTRY}
    assert ENTRY in children


def _compat_imports(path: str) -> list[tuple[str, int]]:
    tree = ast.parse(open(path).read(), path)
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out += [(a.name, n.lineno) for a in n.names if a.name.startswith("te_passes.compat")]
        elif isinstance(n, ast.ImportFrom) and (n.module or "").startswith("te_passes.compat"):
            mod = n.module
            out += [(f"{mod}.{a.name}" if mod == "te_passes.compat" else mod, n.lineno) for a in n.names]
    return out


def test_the_pipeline_and_passes_import_compat_only_through_api():
    bad, users = [], set()
    for pkg in SOURCES:
        top = os.path.join(ROOT, *pkg.split("."))
        for d, dirs, files in os.walk(top):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            for f in (f for f in files if f.endswith(".py")):
                path = os.path.join(d, f)
                for mod, line in _compat_imports(path):
                    rel = os.path.relpath(path, ROOT)
                    (users.add(rel) if mod == ENTRY else bad.append(f"{rel}:{line} imports {mod}"))
    assert bad == []
    # the pipeline and the passes that need the runtime's knowledge do use the entry (a test that can fail)
    assert {"te_passes/pipeline/compilation.py", "te_passes/passes/fold_ub_predicates.py",
            "te_passes/passes/find_autocast_state.py"} <= users
