"""The wheel ships only the te_passes package (issue 16, item 13): a ``te_passes_dump/`` (``make
demo``) or any other folder of ``.py`` files next to it is not picked up by
``[tool.setuptools.packages.find]``. Checked with setuptools' own finder on the options
pyproject.toml gives, in a copy of the tree that holds a dump."""

from __future__ import annotations

import os
import shutil
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _found(root: str) -> list[str]:
    from setuptools.discovery import FlatLayoutPackageFinder, PEP420PackageFinder, PackageFinder  # noqa: F401

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        find = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]
    finder = PEP420PackageFinder if find.get("namespaces", True) else PackageFinder  # setuptools' default: True
    return sorted(finder.find(where=os.path.join(root, *find.get("where", ["."])[:1]),
                              include=find.get("include", ("*",)), exclude=find.get("exclude", ())))


def test_only_te_passes_packages_are_found(tmp_path):
    shutil.copytree(os.path.join(ROOT, "te_passes"), tmp_path / "te_passes",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp_path)
    for d in ("te_passes_dump/g0/dynamo/01_hoist_recipe_lookups", "te_passes_dump/g0/post_grad_fwd",
              "te_passes_extra", "tests"):
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
        (tmp_path / d / "after.py").write_text("# not python\n")
    (tmp_path / "te_passes_extra" / "__init__.py").write_text("")
    found = _found(str(tmp_path))
    assert "te_passes" in found and "te_passes.debug" in found and "te_passes.passes" in found
    assert all(p == "te_passes" or p.startswith("te_passes.") for p in found), found
    expected = sorted(os.path.relpath(dp, tmp_path).replace(os.sep, ".") for dp, _, names in
                      os.walk(tmp_path / "te_passes") if "__init__.py" in names)
    assert found == expected
