"""The wheel ships only the te_passes package (issue 16, item 13): a ``te_passes_dump/`` (``make
demo``) or any other folder of ``.py`` files next to it is not picked up by
``[tool.setuptools.packages.find]``. Checked with setuptools' own finder on the options
pyproject.toml gives, in a copy of the tree that holds a dump. And the torch versions (issue 40):
pyproject.toml's pin, ``te_passes.te.version.SUPPORTED_TORCH``, the set-up's constraints files, its
default and docs/install.md's support matrix name the same ones."""

from __future__ import annotations

import os
import shutil
import tomllib

import pytest

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


# --- torch versions (issue 40): one list, said alike everywhere -------------------------------------

def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _torch_spec():
    from packaging.requirements import Requirement

    reqs = [Requirement(r) for r in _pyproject()["project"]["dependencies"]]
    (torch_req,) = [r for r in reqs if r.name == "torch"]
    return torch_req.specifier


def _constraint_pins() -> dict[str, dict[str, str]]:
    """scripts/constraints/torch-V.txt -> {V: {dist: specifier}}."""
    folder = os.path.join(ROOT, "scripts", "constraints")
    pins = {}
    for name in sorted(os.listdir(folder)):
        lines = [ln.strip() for ln in open(os.path.join(folder, name)) if ln.strip() and not ln.startswith("#")]
        pins[name.removeprefix("torch-").removesuffix(".txt")] = dict(
            (ln.split("=")[0].split("<")[0].split(">")[0], ln) for ln in lines)
    return pins


def test_pyproject_torch_pin_admits_exactly_the_supported_series():
    """``pip install -e .`` keeps a supported torch (2.14.x, 2.15.x) and refuses the others."""
    from te_passes.te.version import SUPPORTED_TORCH

    spec = _torch_spec()
    for major, minor in SUPPORTED_TORCH:
        assert f"{major}.{minor}.0" in spec and f"{major}.{minor}.9" in spec, (spec, major, minor)
    lo, hi = min(SUPPORTED_TORCH), max(SUPPORTED_TORCH)
    assert f"{lo[0]}.{lo[1] - 1}.9" not in spec and f"{hi[0]}.{hi[1] + 1}.0" not in spec, spec


def test_set_up_torch_versions_agree_with_the_pin_the_script_and_the_docs():
    """Each environment scripts/setup_env.sh builds has a constraints file whose torch is supported and
    pinned by pyproject.toml; the script's list, the Makefile's default and docs/install.md's matrix
    name the same versions."""
    from te_passes.te.version import SUPPORTED_TORCH, torch_series

    pins = _constraint_pins()
    assert set(pins) == {"2.15.0", "2.14.1"}, pins
    for v, p in pins.items():
        assert p["torch"] == f"torch=={v}" and v in _torch_spec(), (v, p)
        assert "cuda-toolkit" in p and "triton" in p, p
    assert {torch_series(v) for v in pins} == set(SUPPORTED_TORCH)
    script = open(os.path.join(ROOT, "scripts", "setup_env.sh")).read()
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    install = open(os.path.join(ROOT, "docs", "install.md")).read()
    assert "TORCH_V=${TORCH:-2.15.0}" in script and "\nTORCH ?= 2.15.0\n" in makefile
    for v, p in pins.items():
        toolkit = p["cuda-toolkit"].split("==")[1]
        assert f"  {v}) CUDA_TK={toolkit} ;;" in script, (v, toolkit)
        assert f"| {v} | 2.20.2 |" in install, f"docs/install.md's support matrix has no row for torch {v}"


def test_installed_torch_is_supported():
    from te_passes.te.version import SUPPORTED_TORCH, torch_series

    assert torch_series() in SUPPORTED_TORCH


def test_torch_version_gate_parses_what_torch_reports():
    from te_passes.te.version import torch_at_least, torch_series

    assert torch_series("2.15.0+cu132") == (2, 15) and torch_series("2.16.0a0+git1234") == (2, 16)
    assert torch_at_least(2, 15, "2.15.0+cu132") and not torch_at_least(2, 15, "2.14.1+cu130")
    with pytest.raises(ValueError, match="not of the form major.minor"):
        torch_series("nightly")
