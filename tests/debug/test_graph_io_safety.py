"""``.tegraph`` files are loaded with a restricted unpickler (issue 16, item 5) and checked
field by field (items 6, 7): a crafted file never runs code, a malformed one is a one-line
error naming the file and the field, a newer format says so.

The allow-list is checked against the globals real dumps hold (``pickle_globals`` of the
``input.tegraph`` files of every built-in example, captured on fake CUDA tensors)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest

from te_passes.debug import graph_io
from te_passes.debug.graph_io import (FORMAT, GraphFileError, SymMeta, TensorMeta, UnsafeGraphFileError,
                                      _FnRef, _NodeRef, allowed_global, load_graph, load_payload)
from _pickle_scan import pickle_globals

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _evil_file(tmp_path, inner_first: bool = False):
    marker = tmp_path / "PWNED"
    payload = {"format": FORMAT, "nodes": [], "evil": _Evil(str(marker))}
    if inner_first:
        payload = {"evil": _Evil(str(marker)), **payload}
    p = tmp_path / "evil.tegraph"
    p.write_bytes(pickle.dumps(payload))
    return p, marker


def test_crafted_reduce_is_refused_before_it_runs(tmp_path):
    p, marker = _evil_file(tmp_path)
    assert ("posix", "system") in pickle_globals(p.read_bytes())
    with pytest.raises(UnsafeGraphFileError, match=r"refused to load: it references posix\.system"):
        load_payload(p)
    assert not marker.exists()


def test_crafted_file_via_the_cli_is_one_line_exit_2(tmp_path):
    p, marker = _evil_file(tmp_path, inner_first=True)
    e = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "te_passes.cli", "replay", str(p)], cwd=str(tmp_path),
                          env=e, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("te-passes: error: ") and "refused to load" in lines[0], lines
    assert not marker.exists()


@pytest.mark.parametrize("glob", [("builtins", "eval"), ("builtins", "getattr"), ("os", "system"),
                                  ("subprocess", "Popen"), ("torch", "load"), ("torch", "save"),
                                  ("te_passes.cli", "main"), ("importlib", "import_module"),
                                  ("transformer_engine.pytorch", "Linear"), ("torch", "float32.__class__")])
def test_allow_list_refuses(glob):
    assert not allowed_global(*glob)


def test_allow_list_accepts_value_types():
    import torch

    assert allowed_global("torch", "float32") and allowed_global("torch", "bfloat16")
    assert allowed_global("torch", "device") and allowed_global("te_passes.debug.graph_io", "TensorMeta")
    assert torch  # noqa


def test_symbolic_size_text_is_not_evaluated(tmp_path):
    marker = tmp_path / "PWNED2"
    evil = SymMeta(f"__import__('os').system('touch {marker}')", 4)
    p = tmp_path / "sym.tegraph"
    node = {"name": "x", "op": "placeholder", "target": "x", "args": (), "kwargs": {},
            "meta": {"val": TensorMeta((evil,), (1,), __import__("torch").float32, "cpu")}}
    p.write_bytes(pickle.dumps({"format": FORMAT, "nodes": [node]}))
    with pytest.raises(GraphFileError, match="is not a size expression"):
        load_graph(p)
    assert not marker.exists()
    graph_io.check_sym_expr("Max(s0, 2*s1) + 64*s0 // 3", "ok")


def test_function_targets_outside_the_allowed_modules_are_refused(tmp_path):
    for ref in (_FnRef("builtins", "eval"), _FnRef("os", "system"), _FnRef("subprocess", "run")):
        node = {"name": "f", "op": "call_function", "target": ref, "args": (), "kwargs": {}, "meta": {}}
        out = {"name": "output", "op": "output", "target": "output", "args": (None,), "kwargs": {}, "meta": {}}
        p = tmp_path / "fn.tegraph"
        p.write_bytes(pickle.dumps({"format": FORMAT, "nodes": [node, out]}))
        with pytest.raises(UnsafeGraphFileError, match="outside what a te_passes graph may call"):
            load_graph(p)


def test_missing_function_target_is_named():
    """A target in an allowed module that does not exist there is a GraphFileError naming it."""
    with pytest.raises(GraphFileError, match=r"function torch\.no_such_fn does not exist in this process"):
        _FnRef("torch", "no_such_fn").resolve()


def test_newer_format_is_named(tmp_path):
    p = tmp_path / "new.tegraph"
    p.write_bytes(pickle.dumps({"format": "te_passes.tegraph/2", "nodes": []}))
    with pytest.raises(GraphFileError, match=r"unsupported graph file format 2 \(this te_passes reads 1\)"):
        load_payload(p)


@pytest.mark.parametrize("bad, what", [
    ({"nodes": "x"}, "'nodes' is a str, not a list"),
    ({"nodes": [1]}, r"nodes\[0\] is a int"),
    ({"nodes": [{"name": 3, "op": "placeholder", "target": "x", "args": (), "kwargs": {}}]}, r"nodes\[0\]\.name"),
    ({"nodes": [{"name": "x", "op": "weird", "target": "x", "args": (), "kwargs": {}}]}, "unknown op 'weird'"),
    ({"nodes": [{"name": "x", "op": "call_function", "target": "x", "args": (), "kwargs": {}}]},
     "call_function target is str"),
    ({"nodes": [], "te_state": [1]}, "'te_state' is a list"),
    ({"nodes": [{"name": "x", "op": "placeholder", "target": "x", "args": (), "kwargs": {},
                 "meta": {"val": TensorMeta((-1,), (1,), __import__("torch").float32, "cpu")}}]},
     "is not a non-negative int"),
])
def test_malformed_payload_fields_are_named(bad, what, tmp_path):
    p = tmp_path / "bad.tegraph"
    p.write_bytes(pickle.dumps({"format": FORMAT, **bad}))
    with pytest.raises(GraphFileError, match=what) as ei:
        load_graph(p)
    assert str(p) in str(ei.value)


def _built(state):
    """A TensorMeta whose pickled BUILD state is ``state`` (what a byte mutation of a real file's
    state dict gives: the long fuzz profile found it)."""
    obj = object.__new__(TensorMeta)
    obj.__dict__.update(state)
    return obj


@pytest.mark.parametrize("drop, add", [("device", None), (None, "extra"), ("shape", "shap"), (None, (1, 2))])
def test_dataclass_with_missing_or_extra_fields_is_named(drop, add, tmp_path):
    import torch

    state = {"shape": (2,), "stride": (1,), "dtype": torch.float32, "device": "cpu", "requires_grad": False}
    if drop:
        del state[drop]
    if add:
        state[add] = 1
    p = tmp_path / "odd.tegraph"
    p.write_bytes(pickle.dumps({"format": FORMAT, "nodes": [
        {"name": "x", "op": "placeholder", "target": "x", "args": (), "kwargs": {}, "meta": {"val": _built(state)}}]}))
    with pytest.raises(GraphFileError, match="a TensorMeta with fields") as ei:
        load_graph(p)
    assert str(p) in str(ei.value)
    e = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "te_passes.cli", "replay", str(p)], cwd=str(tmp_path),
                          env=e, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "a TensorMeta with fields" in lines[0], proc.stderr


def test_truncated_graph_file(tmp_path):
    p = tmp_path / "t.tegraph"
    p.write_bytes(pickle.dumps({"format": FORMAT, "nodes": []})[:-5])
    with pytest.raises(GraphFileError, match="is not a te_passes graph file"):
        load_payload(p)


# --------------------------------------------------------------------------- real dumps
@pytest.fixture(scope="module")
def real_dump_files(tmp_path_factory):
    pytest.importorskip("transformer_engine")
    from te_passes.examples import EXAMPLES, run_example

    files = []
    for name in EXAMPLES:
        out = tmp_path_factory.mktemp(name)
        run_example(name, dump_dir=str(out), status=lambda m: None)
        files += sorted(out.rglob("*.tegraph"))
    assert files
    return files


def test_real_dumps_hold_only_allowed_globals_and_load(real_dump_files):
    seen = set()
    for f in real_dump_files:
        for mod, name in pickle_globals(f.read_bytes()):
            seen.add((mod, name))
            assert allowed_global(mod, name), (f, mod, name)
        gm, payload = load_graph(f)  # through the restricted unpickler
        assert len(gm.graph.nodes) == len(payload["nodes"])
    # the exact allow-list is not wider than needed: every exact entry used by real dumps is listed
    print(sorted(seen))
