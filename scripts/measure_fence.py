"""Issue 39's counts for the compat fence, from the source: patch bookkeeping functions and their lines,
mutable module globals, environment-only knobs, install call sites, and the patch-table rows.

Usage: python3 scripts/measure_fence.py [te_passes] [-v]   (prints one line per measure; no imports of te_passes)

- bookkeeping: functions whose name says they install, uninstall, report or gate a patch
  (``install*``, ``uninstall*``, ``installed``, ``*refused_reason``, ``*refusal*``, ``*_status``, ``revert*``,
  ``register*``, ``is_active``, ``_apply``, ``_sweep``, ``sweep``), everywhere in the package;
- mutable module globals: module-level names the module's code changes (rebound under ``global``, item or
  attribute assignment / deletion, or a mutating method call: ``append``, ``add``, ``update``, ``pop``, ...);
- env-only knobs: ``os.environ`` reads of a ``TE_PASSES_*`` name outside ``config.py``.
"""

from __future__ import annotations

import ast
import os
import re
import sys

_ARGS = [a for a in sys.argv[1:] if not a.startswith("-")]
ROOT = _ARGS[0] if _ARGS else "te_passes"
BOOK = re.compile(r"^_?(install\w*|uninstall\w*|installed|\w*refused_reason|\w*refusal\w*|\w+_status|status|revert\w*|"
                  r"is_active|_apply|_?sweep|register_backend|register_stamp|stamp)$")
MUTATORS = {"append", "add", "update", "pop", "popitem", "clear", "setdefault", "extend", "remove", "discard",
            "insert", "__setitem__"}


def _mutated(tree: ast.AST, names: set[str]) -> set[str]:
    """Module-level ``names`` that code in the module changes: rebinding under ``global``, item / attribute
    assignment or deletion, or a call of a mutating method (``append``, ``add``, ``update``, ``pop``, ...), also
    through attributes and items (``STATE.rows.append(r)`` changes ``STATE``: a state object counts as one)."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Global):
            out |= set(n.names) & names
        targets = n.targets if isinstance(n, (ast.Assign, ast.Delete)) else [n.target] \
            if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            if isinstance(t, (ast.Subscript, ast.Attribute)):
                base = t.value
                while isinstance(base, (ast.Subscript, ast.Attribute)):
                    base = base.value
                if isinstance(base, ast.Name) and base.id in names:
                    out.add(base.id)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in MUTATORS:
            base = n.func.value  # ``NAME.append(...)``, and ``NAME.field[k].append(...)`` of a state object
            while isinstance(base, (ast.Subscript, ast.Attribute)):
                base = base.value
            if isinstance(base, ast.Name) and base.id in names:
                out.add(base.id)
    return out


def mutable_globals(tree: ast.Module) -> list[str]:
    """The module-level names (assigned at module level) that the module ``tree``'s code changes, sorted."""
    module_names = set()
    for n in tree.body:
        if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None:
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                if isinstance(t, ast.Name):
                    module_names.add(t.id)
    return sorted(_mutated(tree, module_names))


def main() -> None:
    funcs, lines, globs, env = [], 0, [], []
    for d, _dirs, files in os.walk(ROOT):
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            p = os.path.join(d, f)
            rel = os.path.relpath(p, ROOT)
            tree = ast.parse(open(p).read())
            for n in ast.walk(tree):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and BOOK.match(n.name):
                    funcs.append(f"{rel}:{n.name}")
                    lines += n.end_lineno - n.lineno + 1
                if isinstance(n, ast.Call) and "environ" in ast.unparse(n.func) and rel != "config.py":
                    if any(isinstance(a, ast.Constant) and str(a.value).startswith("TE_PASSES_") for a in n.args):
                        env.append(f"{rel}:{n.lineno}")
            globs += [f"{rel}:{name}" for name in mutable_globals(tree)]
    print(f"bookkeeping functions: {len(funcs)} ({lines} lines)")
    print(f"mutable module globals: {len(globs)}")
    print(f"environment-only knobs (TE_PASSES_* read outside config.py): {len(env)} {env}")
    if "-v" in sys.argv:
        print("\n".join(["functions:"] + funcs + ["globals:"] + globs))


if __name__ == "__main__":
    main()
