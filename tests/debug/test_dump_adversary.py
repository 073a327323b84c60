"""Crafted dumps the issue-23 suite (tests/debug/test_dump_safety.py) does not cover, run through the
CLI as a user runs it: each case was found by trying a shared dump as an adversary and failed
before its fix (docs/cli.md, "Guarantees")."""

from __future__ import annotations

import json
import operator
import shutil

import pytest

from _cli import run_cli

#: A generous limit for a subprocess that must finish quickly (never a timing assertion).
TIMEOUT = 240


def _add_ub_fold_chain(path: str, kind: str) -> None:
    """Append to the saved Dynamo graph a TE UB query (``is_ub_initialized()``, folded by
    ``fold_ub_predicates``) whose folded value feeds a chain of pure operator nodes that the
    pass's constant propagation would compute: 40 squarings of a 100-digit integer (hours of
    CPU), or a 1 KiB string doubled 40 times (a TiB)."""
    import torch
    import transformer_engine.pytorch.module.base as base

    from te_passes.debug import graph_io

    gm, payload = graph_io.load_graph(path)
    g = gm.graph
    out = next(n for n in g.nodes if n.op == "output")
    with g.inserting_before(out):
        t = g.call_function(operator.not_, (g.call_function(base.is_ub_initialized, ()),))
        if kind == "square":
            x = g.call_function(operator.mul, (t, 10 ** 99))
            for _ in range(40):
                x = g.call_function(operator.mul, (x, x))
        else:
            x = g.call_function(operator.mul, (t, "A" * 1024))
            for _ in range(40):
                x = g.call_function(operator.add, (x, x))
        g.call_function(torch._assert, (x, "kept"))
    info = {k: v for k, v in payload.items()
            if k not in ("format", "torch", "nodes", "attrs", "symbols", "example_inputs_fake")}
    info["example_inputs"] = payload.get("example_inputs_fake")
    graph_io.save_graph(path, gm, **info)


@pytest.mark.parametrize("kind", ["square", "string_doubling"])
def test_ub_constant_folding_of_a_crafted_graph_is_bounded(kind, base_dump, tmp_path):
    """``replay`` of a graph whose folded UB value feeds ``x * x`` forty times: the fold stops at
    values that are not small constants (a ``skipped`` record) and the replay finishes (before:
    it ran for hours, or built a string larger than memory)."""
    d = tmp_path / "D"
    shutil.copytree(base_dump, d, symlinks=True)
    _add_ub_fold_chain(str(d / "g0" / "dynamo" / "input.tegraph"), kind)
    proc = run_cli("replay", str(d / "g0"), "--json", cwd=str(tmp_path), timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    reports = [entry["report"] for entry in json.loads(proc.stdout)]
    recs = [r for rep in reports for st in rep["stages"] for run in st["runs"]
            if run["name"] == "fold_ub_predicates" for r in run["records"]]
    folded = [r for r in recs if r["kind"] == "const_folded"]
    skipped = [r for r in recs if r["kind"] == "skipped" and "not folded" in r.get("reason", "")]
    assert [r["node"] for r in folded] == ["not_"], folded
    assert len(skipped) == 1 and "not a small constant" in skipped[0]["reason"], recs


@pytest.mark.parametrize("name", ["exp[1]", "seed[0-9]"])
def test_replay_of_a_dump_under_a_folder_with_glob_characters(name, base_dump, tmp_path):
    """A dump under ``runs/exp[1]/`` (``[...]`` is ordinary in folder names) replays
    and ``--check`` reproduces it, for the dump and for its graph folder (before: "no saved
    graphs ... in a dump's layout", exit 2: the path was read as a glob pattern)."""
    d = tmp_path / name / "D"
    shutil.copytree(base_dump, d, symlinks=True)
    for target in (str(d), str(d / "g0")):
        proc = run_cli("replay", target, "--check", "--plain", cwd=str(tmp_path), timeout=TIMEOUT)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "reproduces the saved report" in proc.stdout


_FORMATS_TARGET = '''
import torch

def f(x):
    y = x.t().clone(memory_format=torch.contiguous_format)
    z = torch.zeros(y.shape, layout=torch.strided, dtype=y.dtype)
    return (y + z).relu() * 2

def main():
    c = torch.compile(f, backend="te_inductor")
    c(torch.randn(4, 6, requires_grad=True)).sum().backward()
'''

_UNBACKED_TARGET = '''
import torch

torch._dynamo.config.capture_dynamic_output_shape_ops = True

def f(x, w):
    idx = x.nonzero()
    return (x @ w).relu() * 2, idx.float().sum()

def main():
    c = torch.compile(f, backend="te_inductor", dynamic=True)
    for n in (6, 9):
        x = torch.randn(n, 4, requires_grad=True)
        c(x, torch.randn(4, 4, requires_grad=True))[0].sum().backward()
'''


@pytest.mark.parametrize("target", ["formats", "unbacked"])
def test_dumps_of_ordinary_graphs_replay_and_check_reproduces(target, tmp_path):
    """``dump`` then ``replay --check`` of graphs the backend sees every day: ``formats`` holds
    ``memory_format=`` / ``layout=`` arguments (pickled as ``torch._utils`` /
    ``torch.serialization._get_layout``: before, refused as "the file may be crafted"); ``unbacked``
    has an unbacked size (``nonzero``) whose runtime assert ``u0 >= 0`` is a SymBool without a hint
    (before: rebuilt as ``None``, so ``--check`` found other liveness records)."""
    (tmp_path / "t.py").write_text(_FORMATS_TARGET if target == "formats" else _UNBACKED_TARGET)
    proc = run_cli("dump", "t.py:main", "--out", "D", "--plain", cwd=str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = run_cli("replay", "D", "--check", "--plain", cwd=str(tmp_path), timeout=600)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert "reproduces the saved report" in proc.stdout
