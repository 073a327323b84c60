"""Package size: lines per folder and the docstring fraction (ast: docstring lines / all lines).

Usage: python scripts/measure_size.py [te_passes] [-v per module] [-d longest docstrings]."""

import ast
import collections
import os
import sys

root = sys.argv[1] if len(sys.argv) > 1 else "te_passes"
tot = doc = 0
per = collections.Counter(); perdoc = collections.Counter()
mods = {}
for d, dirs, files in os.walk(root):
    dirs[:] = [x for x in dirs if x != "__pycache__"]
    for f in files:
        if not f.endswith(".py"): continue
        p = os.path.join(d, f)
        src = open(p).read()
        n = src.count("\n")
        t = ast.parse(src)
        dl = 0
        items = []
        for node in ast.walk(t):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                b = node.body
                if b and isinstance(b[0], ast.Expr) and isinstance(b[0].value, ast.Constant) and isinstance(b[0].value.value, str):
                    k = b[0].end_lineno - b[0].lineno + 1
                    dl += k
                    items.append((k, getattr(node, "name", "<module>"), b[0].lineno))
        rel = os.path.relpath(p, root)
        folder = rel.split(os.sep)[0] if os.sep in rel else "(top)"
        per[folder] += n; perdoc[folder] += dl
        tot += n; doc += dl
        mods[rel] = (n, dl, items)
print(f"total {tot} doc {doc} {100*doc/tot:.1f}%")
for k in sorted(per): print(f"  {k:10s} {per[k]:6d} doc {perdoc[k]:5d} {100*perdoc[k]/per[k]:.1f}%")
if "-v" in sys.argv:
    for rel,(n,dl,items) in sorted(mods.items(), key=lambda x:-x[1][1]):
        print(f"{rel:40s} {n:5d} {dl:5d}")
if "-d" in sys.argv:
    allit = [(k,rel,name,ln) for rel,(n,dl,items) in mods.items() for (k,name,ln) in items]
    allit.sort(reverse=True)
    for x in allit[:150]: print(x)
