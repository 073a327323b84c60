"""Package size: lines per top folder and the docstring fraction (ast: docstring lines / all lines), and
issue 39's growth table (lines per folder at a base commit and now, the change split by issue).

Usage: python scripts/measure_size.py [te_passes] [-v per module] [-d longest docstrings]
                                      [--since REV: the per-folder growth table since REV, by issue]
"""

import ast
import collections
import os
import re
import subprocess
import sys

#: first-parent commits since ca97f7e (the issue-39 baseline) that belong to other issues (merges of a
#: feature branch count as one commit: their diff against the first parent); any other commit counts for 39.
ISSUE_OF = {"23f5d47": "40", "7a3f810": "38", "5b63e7d": "42", "a3dbe53": "42", "51eb9e0": "38", "b3f91d0": "38",
            "a1095f0": "38", "c32da8f": "43", "fd6d207": "38", "8bd5d0a": "38", "c091222": "38", "996e2fe": "38",
            "b1a927f": "38", "b8589aa": "38", "b99d1b6": "38"}
#: the commit that moved runtime/ and rewrite/ into compat/, ops/ and cudagraphs/ (old paths count in the new folder)
MOVE = "9eeb7c5"
ISSUES = ("38", "42", "40", "43", "39")


def folder_sizes(root: str) -> None:
    """Print total lines and docstring lines per top folder of ``root`` (``-v``: per module, ``-d``: the
    longest docstrings)."""
    tot = doc = 0
    per, perdoc, mods = collections.Counter(), collections.Counter(), {}
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        for f in (f for f in files if f.endswith(".py")):
            p = os.path.join(d, f)
            src = open(p).read()
            n, dl, items = src.count("\n"), 0, []
            for node in ast.walk(ast.parse(src)):
                if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    b = node.body
                    if b and isinstance(b[0], ast.Expr) and isinstance(b[0].value, ast.Constant) \
                            and isinstance(b[0].value.value, str):
                        k = b[0].end_lineno - b[0].lineno + 1
                        dl += k
                        items.append((k, getattr(node, "name", "<module>"), b[0].lineno))
            rel = os.path.relpath(p, root)
            top = rel.split(os.sep)[0] if os.sep in rel else "(top)"
            per[top] += n
            perdoc[top] += dl
            tot += n
            doc += dl
            mods[rel] = (n, dl, items)
    print(f"total {tot} doc {doc} {100 * doc / tot:.1f}%")
    for k in sorted(per):
        print(f"  {k:10s} {per[k]:6d} doc {perdoc[k]:5d} {100 * perdoc[k] / per[k]:.1f}%")
    if "-v" in sys.argv:
        for rel, (n, dl, _items) in sorted(mods.items(), key=lambda x: -x[1][1]):
            print(f"{rel:40s} {n:5d} {dl:5d}")
    if "-d" in sys.argv:
        allit = sorted(((k, rel, name, ln) for rel, (_n, _dl, items) in mods.items() for (k, name, ln) in items),
                       reverse=True)
        for x in allit[:150]:
            print(x)


def _git(*args: str) -> str:
    return subprocess.run(("git",) + args, capture_output=True, text=True, check=True).stdout


def growth(since: str, root: str = "te_passes") -> None:
    """Print a markdown table: lines per top folder at ``since`` and at HEAD, and the net change of each
    first-parent commit in between, summed per issue (``ISSUE_OF``; default 39). Paths moved by ``MOVE``
    count in their new folder at ``since`` too, so the move itself nets to its edits."""
    moved = dict(s.split("\t")[1:] for s in _git("diff", "-M", "--name-status", MOVE + "^", MOVE, "--", root)
                 .splitlines() if s.startswith("R"))

    def top(path: str) -> str:
        path = moved.get(path, path)
        path = re.sub(rf"^{root}/runtime/(ops|cudagraphs)/", rf"{root}/\1/", path)
        path = re.sub(rf"^{root}/(runtime|rewrite)/", f"{root}/compat/", path)
        parts = path.split("/")
        return parts[1] if len(parts) > 2 else "(top)"

    def sizes(rev: str) -> collections.Counter:
        out = collections.Counter()
        for f in _git("ls-tree", "-r", "--name-only", rev, root).split():
            if f.endswith(".py"):
                out[top(f)] += _git("show", f"{rev}:{f}").count("\n")
        return out

    change = collections.defaultdict(collections.Counter)
    for c in _git("log", "--first-parent", "--format=%h", f"{since}..HEAD", "--", root).split():
        renames = "-M" if c == MOVE else "--no-renames"
        for line in _git("diff", renames, "--numstat", c + "^", c, "--", root).splitlines():
            added, deleted, path = line.split("\t")
            path = re.sub(r"\{[^}]* => ([^}]*)\}", r"\1", path).replace("//", "/").split(" => ")[-1]
            if path.endswith(".py"):
                change[top(path)][ISSUE_OF.get(c, "39")] += int(added) - int(deleted)
    before, now = sizes(since), sizes("HEAD")
    print(f"| folder | {since} | now | " + " | ".join(ISSUES) + " |\n|---" + "|---:" * (2 + len(ISSUES)) + "|")
    total = [0] * (2 + len(ISSUES))
    for f in sorted(set(before) | set(now)):
        row = [before[f], now[f]] + [change[f][i] for i in ISSUES]
        total = [t + v for t, v in zip(total, row)]
        print(f"| {f} | " + " | ".join(map(str, row)) + " |")
    print("| total | " + " | ".join(map(str, total)) + " |")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("-")]
    if "--since" in sys.argv:
        since = sys.argv[sys.argv.index("--since") + 1]
        growth(since, next((a for a in args if a != since), "te_passes"))
    else:
        folder_sizes(args[0] if args else "te_passes")
