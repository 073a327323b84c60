"""The compat fence (docs/design.md "The compat fence"): outside ``te_passes/compat/table.py`` no module
changes TE or torch. An AST scan of every package module finds

- calls of ``setattr`` / ``delattr`` / ``object.__setattr__`` / ``substitute_in_graph`` / ``register_lowering``;
- assignments into Inductor's ``lowerings`` table;
- attribute writes (``=``, ``+=``, ``del``) on a torch or Transformer Engine object: a name bound by an import
  of ``torch*`` / ``transformer_engine*`` or from an expression that reaches one (``cfg = torch._dynamo.config``,
  ``sys.modules.get("transformer_engine...")``, ``importlib.import_module``), followed through local aliases;
- attribute writes of a ``_te_passes_*`` marker (those go through ``compat.table.stamp``),

writes on a function or class the module defines itself excepted (ours, not TE's or torch's),

and allows only the named sites of :data:`ALLOWED` (objects that are the user's or our own).
"""

from __future__ import annotations

import ast
import os

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "te_passes")
TABLE = "compat/table.py"
#: (module path under te_passes/, what is written) -> why it is not a change of TE or torch.
ALLOWED: dict[tuple[str, str], str] = {
    ("compat/untouched/rewrite/compile_friendly.py", "object.__setattr__"):
        "the opt-in rewrite records what it did on the user's own model (a user-module rewrite)",
    ("cudagraphs/stable_grads.py", "setattr"):
        "the user's Parameters: a weak reference to the .grad kept outside the CUDA-graph pool, and its hook handle",
    ("debug/graph_io.py", "setattr"):
        "a GraphModule te_passes rebuilds from a saved .tegraph (our own object)",
    ("compat/lowering_rows.py", "register_lowering"):
        "Inductor's wrapper of our lowering built into a staging dict of our own (lowering_dict=); table.py registers it",
}
_CALLS = {"setattr", "delattr", "substitute_in_graph", "register_lowering"}
_FOREIGN_ROOTS = ("torch", "transformer_engine")


def _files() -> dict[str, str]:
    out = {}
    for root, _dirs, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                out[os.path.relpath(path, PKG).replace(os.sep, "/")] = path
    return out


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _reaches(value: ast.AST, names: set[str]) -> bool:
    """Whether ``value`` evaluates to an existing torch / TE object: an attribute chain from a foreign name, or
    ``getattr`` / ``sys.modules`` / ``importlib.import_module`` lookups (a constructor call makes a new object)."""
    if isinstance(value, ast.Call):
        src = ast.unparse(value.func)
        if src in ("getattr", "sys.modules.get", "importlib.import_module", "import_module"):
            return any(_reaches(a, names) or "transformer_engine" in ast.unparse(a) or "torch" in ast.unparse(a)
                       for a in value.args[:1])
        return False
    if isinstance(value, ast.Subscript) and ast.unparse(value.value) == "sys.modules":
        return True
    r = _root(value)
    return isinstance(value, (ast.Name, ast.Attribute)) and isinstance(r, ast.Name) and r.id in names


def _foreign_names(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in n.names if a.name.split(".")[0] in _FOREIGN_ROOTS}
        elif isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] in _FOREIGN_ROOTS:
            names |= {a.asname or a.name for a in n.names}
    for _ in range(3):  # aliases of aliases
        for n in ast.walk(tree):
            if isinstance(n, ast.Assign) and all(isinstance(t, ast.Name) for t in n.targets) and _reaches(n.value, names):
                names |= {t.id for t in n.targets}
    return names


def _violations(rel: str, path: str) -> list[str]:
    tree = ast.parse(open(path).read(), path)
    foreign = _foreign_names(tree)
    own = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    out = []

    def add(node: ast.AST, what: str, text: str) -> None:
        if (rel, what) not in ALLOWED:
            out.append(f"te_passes/{rel}:{node.lineno}: {what}: {text}")

    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            f = n.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in _CALLS and not (name in ("setattr", "delattr") and n.args and isinstance(n.args[0], ast.Name)
                                       and n.args[0].id in own):
                add(n, name, ast.unparse(n)[:100])
            elif name == "__setattr__" and isinstance(f, ast.Attribute) and ast.unparse(f.value) == "object":
                add(n, "object.__setattr__", ast.unparse(n)[:100])
        targets: list[ast.AST] = []
        if isinstance(n, ast.Assign):
            targets = list(n.targets)
        elif isinstance(n, (ast.AugAssign, ast.AnnAssign)):
            targets = [n.target]
        elif isinstance(n, ast.Delete):
            targets = list(n.targets)
        for t in targets:
            for x in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]):
                if isinstance(x, ast.Subscript) and "lowerings" in ast.unparse(x.value):
                    add(n, "lowerings[...] =", ast.unparse(x))
                if not isinstance(x, ast.Attribute):
                    continue
                r = _root(x)
                if isinstance(r, ast.Name) and r.id in own:
                    continue  # a function or class this module defines: ours
                if x.attr.startswith("_te_passes_"):
                    add(n, "marker attribute", ast.unparse(x))
                elif isinstance(r, ast.Name) and r.id in foreign:
                    add(n, "attribute write", ast.unparse(x))
    return out


def test_only_the_patch_table_changes_te_or_torch():
    found = []
    for rel, path in sorted(_files().items()):
        if rel != TABLE:
            found += _violations(rel, path)
    assert found == [], "changes of TE / torch outside te_passes/compat/table.py (make them patch-table rows):\n" + \
        "\n".join(found)


def test_the_allowed_sites_still_exist():
    """A stale entry in :data:`ALLOWED` would allow a future write silently."""
    files = _files()
    for (rel, what), _why in ALLOWED.items():
        src = open(files[rel]).read()
        assert what.split(".")[-1] in src, (rel, what)


def test_the_scan_sees_each_kind_of_change(tmp_path):
    """The scan itself: one of each kind of change is found."""
    src = (
        "import torch\nimport sys\nfrom transformer_engine.pytorch import module as m\n"
        "def f(x):\n"
        "    setattr(m, 'a', 1)\n"
        "    torch._dynamo.config.flag = True\n"
        "    cfg = torch._inductor.config\n"
        "    cfg.x = 1\n"
        "    base = sys.modules.get('transformer_engine.pytorch.module.base')\n"
        "    base._ub = None\n"
        "    L.lowerings[op] = fn\n"
        "    x._te_passes_mark = 1\n"
        "    torch.compiler.substitute_in_graph(f)(g)\n"
        "    own = object()\n"
        "    own.attr = 1\n"
        "    setattr(f, '_te_passes_ours', True)\n"
    )
    p = tmp_path / "mod.py"
    p.write_text(src)
    kinds = [v.split(": ")[1] for v in _violations("mod.py", str(p))]
    assert sorted(kinds) == sorted(["setattr", "attribute write", "attribute write", "attribute write",
                                    "lowerings[...] =", "marker attribute", "substitute_in_graph"]), kinds
