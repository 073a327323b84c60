"""Adversarial fuzz of the readers of a shared dump (issue 23): ``.tegraph`` files
(``te_passes.debug.graph_io.load_graph``), summaries (``te-passes show``: ``main(["show", ...])``),
graph reports (``check_graph_report``) and manifests (``te_passes.cli.dumpdir._check_old_dump``),
mutated from a real dump of ``--example linear-fp8`` (TE quantizers and bundles in its graphs).

Properties, for every mutated file: the reader returns or raises its one documented error
(``GraphFileError``, ``DumpFormatError``, ``CliError``; ``show`` returns an exit status) —
never another exception (a traceback), never a hang (a 5 s ``SIGALRM`` watchdog per example),
never a segfault (it would end the run), and code planted in the file never runs (a marker file
the payloads would create stays absent).

Size: ``HYPOTHESIS_PROFILE=ci`` (default) runs a few dozen examples; ``HYPOTHESIS_PROFILE=long``
runs :data:`LONG_EXAMPLES` in total (figures in docs/testing-real-graphs.md)::

    HYPOTHESIS_PROFILE=long python -m pytest tests/debug/test_dump_fuzz.py -q -s
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
import signal
import sys

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from _cli import dump_example  # noqa: E402

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
EXAMPLES = {"ci": {"bytes": 25, "payload": 25, "summary": 25, "graph_report": 15, "manifest": 15},
            "long": {"bytes": 3000, "payload": 3000, "summary": 2500, "graph_report": 1000,
                     "manifest": 1000}}[PROFILE]
LONG_EXAMPLES = 3000 + 3000 + 2500 + 1000 + 1000
_SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), derandomize=PROFILE == "ci",
                 database=None, phases=[Phase.explicit, Phase.generate],  # no shrinking: the failing file is printed
                 print_blob=True)
COUNTS: dict[str, int] = {k: 0 for k in EXAMPLES}
OUTCOMES: dict[str, int] = {"loaded": 0, "refused": 0}
MARKER = f"/tmp/te_passes_fuzz_PWNED_{os.getpid()}"
WATCHDOG_S = 5


class Hang(Exception):
    pass


@contextlib.contextmanager
def watchdog():
    """Fail the example if it runs longer than :data:`WATCHDOG_S` (a hang, not a timing test)."""
    def fire(*_):
        raise Hang(f"reader still running after {WATCHDOG_S} s")
    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(WATCHDOG_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def real_dump(tmp_path_factory):
    d = dump_example(tmp_path_factory, "linear-fp8", "fuzz")
    import torch  # noqa: F401
    import transformer_engine.pytorch  # noqa: F401
    return d


class _Files(dict):
    """``{path: bytes}`` with a short repr (hypothesis prints fixtures of a failing example)."""

    def __repr__(self) -> str:
        return f"<{len(self)} .tegraph files>"


@pytest.fixture(scope="module")
def tegraphs(real_dump):
    files = sorted(str(p) for p in real_dump.glob("g0/*/input.tegraph"))
    assert files
    return _Files({f: open(f, "rb").read() for f in files})


@pytest.fixture(autouse=True, scope="module")
def _no_marker():
    if os.path.exists(MARKER):
        os.remove(MARKER)
    yield
    assert not os.path.exists(MARKER), "code planted in a fuzzed file ran"


@pytest.fixture(autouse=True, scope="module")
def _report(request):
    def report():
        total = sum(COUNTS.values())
        if total:
            sys.stdout.write(f"\ntest_dump_fuzz ({PROFILE} profile): {total} mutated files ({COUNTS}); .tegraph "
                             f"outcomes {OUTCOMES}; no code ran, no hang over {WATCHDOG_S} s, no traceback\n")
            sys.stdout.flush()
    request.config.add_cleanup(report)
    yield


# --------------------------------------------------------------------------- .tegraph bytes
def _load(path: str) -> None:
    from te_passes.debug.graph_io import GraphFileError, load_graph

    try:
        with watchdog():
            load_graph(path)
        OUTCOMES["loaded"] += 1
    except GraphFileError as e:
        assert str(e) and "\n" not in str(e).strip(), str(e)
        OUTCOMES["refused"] += 1


_CODE = f'__import__("os").system("touch {MARKER}")'


@st.composite
def byte_mutation(draw, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "dup", "opcode"]))
        i = draw(st.integers(0, max(len(b) - 1, 0)))
        if kind == "flip" and b:
            b[i] ^= 1 << draw(st.integers(0, 7))
        elif kind == "insert":
            b[i:i] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del b[i:i + draw(st.integers(1, 64))]
        elif kind == "truncate":
            del b[i:]
        elif kind == "dup":
            j = draw(st.integers(i, min(len(b), i + 256)))
            b[j:j] = b[i:j] * draw(st.integers(1, 50))
        elif kind == "opcode" and b:
            b[i] = draw(st.sampled_from(list(b"()]}acdehjlqrstuR.\x85\x86\x87\x88\x89\x8a\x8b\x8c\x8d\x8e"
                                             b"\x8f\x90\x91\x92\x93\x94\x95")))
    return bytes(b)


@settings(max_examples=EXAMPLES["bytes"], **_SETTINGS)
@given(data=st.data())
def test_mutated_tegraph_bytes(tegraphs, tmp_path_factory, data):
    src = data.draw(st.sampled_from(sorted(tegraphs)))
    mutated = data.draw(byte_mutation(tegraphs[src]))
    p = str(tmp_path_factory.getbasetemp() / "fuzz.tegraph")
    with open(p, "wb") as f:
        f.write(mutated)
    _load(p)
    COUNTS["bytes"] += 1


# --------------------------------------------------------------------------- .tegraph structure
def _evil_values():
    from te_passes.debug.graph_io import SymMeta, TensorMeta, _FnRef, _NodeRef, _OpRef
    import torch

    shared: list = []
    for _ in range(30):
        shared = [shared, shared]
    deep: list = []
    for _ in range(500):
        deep = [deep]
    cyc: list = []
    cyc.append(cyc)
    return [
        _CODE, f"x={_CODE}", "a.b", "", "\x1b]0;t\x07", 10 ** 400, -1, 2 ** 63, float("nan"), None, True,
        shared, deep, cyc, (), {}, {"k": _CODE}, {_CODE: 1},
        _NodeRef("nope"), _NodeRef(_CODE), _FnRef("os", "system"), _FnRef("torch", "os.system"),
        _FnRef("builtins", "eval"), _FnRef("te_passes.debug.graph_io", "load_graph"), _FnRef(_CODE, "x"),
        _OpRef("aten::add", "Tensor"), _OpRef("aten::nope", None), _OpRef(_CODE, None), _OpRef("a::b::c", "x"),
        SymMeta("9**9**9**9", 1), SymMeta(_CODE, 1), SymMeta("s0*" * 2000 + "s0", 1), SymMeta("Eq(s0, 2)", True, "bool"),
        SymMeta("s0", 3, "weird"), SymMeta("(s0//2)", 2),
        TensorMeta((4, -1), (1, 1), torch.float32, "cpu"), TensorMeta((SymMeta("s0", 2),), (1,), torch.float32, "cpu"),
        TensorMeta((2,), (1, 1), torch.float32, "cpu"), TensorMeta((2,), (1,), "float32", "cuda:0"),
        TensorMeta((10 ** 30,), (1,), torch.float32, "meta"), TensorMeta((2,), (1,), torch.float32, "nodev"),
    ]


_PAYLOAD_PATHS = ("name", "op", "target", "args", "kwargs", "meta", "meta.val", "meta.example_value",
                  "meta.stack_trace", "record", "extra_node", "drop_node", "top")


def _mutate_payload(payload, draw):
    evil = _evil_values()
    nodes = payload.get("nodes")
    where = draw(st.sampled_from(_PAYLOAD_PATHS))
    value = draw(st.sampled_from(evil)) if draw(st.booleans()) else draw(
        st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                     lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                     max_leaves=20))
    if not isinstance(nodes, list) or not nodes:
        return
    i = draw(st.integers(0, len(nodes) - 1))
    rec = nodes[i]
    if not isinstance(rec, dict):
        return
    if where in ("name", "op", "target", "args", "kwargs", "meta"):
        rec[where] = value
    elif where.startswith("meta."):
        if isinstance(rec.get("meta"), dict):
            rec["meta"][where[5:]] = value
    elif where == "record":
        nodes[i] = value
    elif where == "extra_node":
        nodes.insert(i, {"name": draw(st.sampled_from(["p", _CODE, "x.y"])),
                         "op": draw(st.sampled_from(["placeholder", "get_attr", "call_function", "call_method",
                                                     "call_module", "output"])),
                         "target": value, "args": (value,) if draw(st.booleans()) else (), "kwargs": {}, "meta": {}})
    elif where == "drop_node":
        del nodes[i]
    else:
        key = draw(st.sampled_from(["format", "nodes", "attrs", "options", "te_state", "example_inputs", "stage",
                                    "symbols", "graph_id"]))
        payload[key] = value


@settings(max_examples=EXAMPLES["payload"], **_SETTINGS)
@given(data=st.data())
def test_mutated_tegraph_structure(tegraphs, tmp_path_factory, data):
    from te_passes.debug.graph_io import _Pickler, load_payload

    src = data.draw(st.sampled_from(sorted(tegraphs)))
    payload = load_payload(src)
    for _ in range(data.draw(st.integers(1, 3))):
        _mutate_payload(payload, data.draw)
    buf = io.BytesIO()
    try:
        _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(payload)
    except (pickle.PicklingError, TypeError, AttributeError, RecursionError, ValueError):
        return  # not representable as a file
    p = str(tmp_path_factory.getbasetemp() / "fuzz_s.tegraph")
    with open(p, "wb") as f:
        f.write(buf.getvalue())
    _load(p)
    COUNTS["payload"] += 1


# --------------------------------------------------------------------------- JSON files
def _json_values():
    deep = "[" * 3000 + "]" * 3000
    return [None, True, 0, -1, 1.5, 10 ** 120, "x", "\x1b[2J\x1b]0;T\x07[red]x[/]", "[/]", [], {}, [1, "a", None],
            {"graph_id": 1}, json.loads("[" * 40 + "]" * 40), deep, "9" * 5000]


@st.composite
def json_mutation(draw, doc):
    """``(text, doc)``: ``doc`` with 1-3 values replaced (or deleted), dumped as text; sometimes
    raw text edits (truncation, a deep array, a huge number) instead."""
    doc = json.loads(json.dumps(doc))
    for _ in range(draw(st.integers(1, 3))):
        paths = []
        stack = [((), doc)]
        while stack and len(paths) < 2000:
            path, v = stack.pop()
            paths.append(path)
            if isinstance(v, dict):
                stack.extend(((*path, k), x) for k, x in v.items())
            elif isinstance(v, list):
                stack.extend(((*path, j), x) for j, x in enumerate(v))
        path = draw(st.sampled_from(paths))
        if not path:
            continue
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        new = draw(st.sampled_from(_json_values()))
        if isinstance(new, str) and new.startswith("[["):
            new = "@@DEEP@@"
        if draw(st.integers(0, 5)) == 0 and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = new
    text = json.dumps(doc).replace('"@@DEEP@@"', "[" * 3000 + "]" * 3000)
    raw = draw(st.integers(0, 6))
    if raw == 0:
        text = text[: draw(st.integers(0, len(text)))]
    elif raw == 1:
        i = draw(st.integers(0, len(text)))
        text = text[:i] + draw(st.sampled_from(["[" * 5000, "9" * 10000, "\x00", "}", '"\\ud800"'])) + text[i:]
    return text


def _show(d) -> int:
    from te_passes.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), watchdog():
        code = main(["show", str(d), "--plain"])
    assert code in (0, 2), (code, err.getvalue()[-2000:])
    assert "Traceback" not in err.getvalue()
    assert "\x1b" not in out.getvalue() and "\x07" not in out.getvalue()
    return code


def _mutated_copy(real_dump, tmp_path_factory, data, name, *rel):
    """``real_dump`` copied once to ``<basetemp>/name``, its JSON file ``rel`` replaced by a
    mutation of the original's document; returns (the copy, the mutated file)."""
    d = tmp_path_factory.getbasetemp() / name
    if not d.exists():
        shutil.copytree(real_dump, d)
    doc = json.loads(real_dump.joinpath(*rel).read_text())
    p = d.joinpath(*rel)
    p.write_text(data.draw(json_mutation(doc)))
    return d, p


@settings(max_examples=EXAMPLES["summary"], **_SETTINGS)
@given(data=st.data())
def test_mutated_summary_in_show(real_dump, tmp_path_factory, data):
    d, _ = _mutated_copy(real_dump, tmp_path_factory, data, "fuzz_show", "report.json")
    _show(d)
    COUNTS["summary"] += 1


@settings(max_examples=EXAMPLES["graph_report"], **_SETTINGS)
@given(data=st.data())
def test_mutated_graph_report(real_dump, tmp_path_factory, data):
    from te_passes.debug.dump_files import DumpFormatError, check_graph_report, read_json
    from te_passes.debug.dump_summary import read_graph_report

    d, p = _mutated_copy(real_dump, tmp_path_factory, data, "fuzz_gr", "g0", "report.json")
    with watchdog():
        read_graph_report(str(d), "g0")
        try:
            check_graph_report(str(p), read_json(str(p)))
        except DumpFormatError as e:
            assert "\n" not in str(e)
    COUNTS["graph_report"] += 1


@settings(max_examples=EXAMPLES["manifest"], **_SETTINGS)
@given(data=st.data())
def test_mutated_manifest(real_dump, tmp_path_factory, data):
    from te_passes.cli._common import CliError
    from te_passes.cli.dumpdir import _check_old_dump

    d, _ = _mutated_copy(real_dump, tmp_path_factory, data, "fuzz_man", ".te_passes_manifest.json")
    with watchdog():
        try:
            files = _check_old_dump(str(d))
        except CliError as e:
            assert "\n" not in str(e)
        else:
            assert files is None or all(not os.path.isabs(f) and not f.startswith("..") for f in files)
    COUNTS["manifest"] += 1
