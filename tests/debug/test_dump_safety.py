"""Dumps are shared files (issue 23): through the CLI as a user runs it (a subprocess of
``python -m te_passes.cli``), a graph file never runs code, a crafted structure is refused with one
line (never minutes, a segfault or a traceback), writing a dump is one step that keeps the earlier
dump on any failure, nothing is written or deleted through a symbolic link, printed strings are
sanitized, logging prints each line once, and dynamic-shape dumps replay.

The checks under test: ``te_passes.debug.graph_safety`` (names, targets, budgets, size
expressions), ``te_passes.cli.dumpdir`` (staging, journal, commit), ``te_passes.cli._common.clean``,
``te_passes._logging``, ``te_passes._json.read_json_file``.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys

import pytest

from _cli import ROOT, _one_error_line, run_cli, snapshot

PY = sys.executable
#: A generous limit for a subprocess that must be refused quickly (never a timing assertion).
REFUSE_TIMEOUT = 240


# --------------------------------------------------------------------------- fixtures
def _tegraph(d) -> str:
    return str(d / "g0" / "dynamo" / "input.tegraph")


def _payload(path):
    from te_passes.debug.graph_io import load_payload

    return load_payload(path)


def _write_payload(path, payload) -> None:
    import io

    from te_passes.debug.graph_io import _Pickler

    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(payload)
    with open(path, "wb") as f:
        f.write(buf.getvalue())


def _assert_refused(proc, *expect: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    line = _one_error_line(proc)
    assert "Traceback" not in proc.stderr
    assert any(e in line for e in expect), line
    return line


# --------------------------------------------------------------------------- 1. a graph file is data
_INJECT = '__import__("os").system("touch {m}")'


def _inject(kind: str, payload, marker: str) -> None:
    from te_passes.debug.graph_io import _FnRef, _OpRef

    code = _INJECT.format(m=marker)
    nodes = payload["nodes"]
    first = {op: next(i for i, n in enumerate(nodes) if n["op"] == op)
             for op in ("placeholder", "call_function", "output")}
    if kind == "placeholder_target":
        nodes[first["placeholder"]]["target"] = f"x={code}"
    elif kind == "node_name":
        nodes[first["call_function"]]["name"] = f"y=({code})"
    elif kind == "get_attr_target":
        nodes.insert(first["output"], {"name": "c0", "op": "get_attr", "target": f'w"+({code})+"', "args": (),
                                       "kwargs": {}, "meta": {}})
    elif kind == "call_module_target":
        nodes.insert(first["output"], {"name": "m0", "op": "call_module", "target": f'sub"); {code}; ("',
                                       "args": (), "kwargs": {}, "meta": {}})
    elif kind == "call_method_target":
        from te_passes.debug.graph_io import _NodeRef

        nodes.insert(first["output"], {"name": "m1", "op": "call_method", "target": f"sum() or {code} or x.sum",
                                       "args": (_NodeRef(nodes[first['placeholder']]['name']),), "kwargs": {},
                                       "meta": {}})
    elif kind == "kwargs_key":
        nodes[first["call_function"]]["kwargs"] = {f"k={code}, z": 1}
    elif kind == "output_target":
        nodes[first["output"]]["target"] = f"output; {code}"
    elif kind == "function_through_torch_os":
        nodes[first["call_function"]]["target"] = _FnRef("torch", "os.system")
    elif kind == "function_module_text":
        nodes[first["call_function"]]["target"] = _FnRef(f"os;{code}", "system")
    elif kind == "op_namespace":
        nodes[first["call_function"]]["target"] = _OpRef(f"aten::add(); {code}", "default")
    elif kind == "op_overload":
        nodes[first["call_function"]]["target"] = _OpRef("aten::add", f"Tensor; {code}")
    elif kind == "attrs_key":
        payload["attrs"] = {f"a; {code}": 1}
    elif kind == "symbolic_size":
        from te_passes.debug.graph_io import SymMeta, TensorMeta

        _set_size(nodes[first["placeholder"]], code)
    elif kind == "stack_trace":
        nodes[first["call_function"]]["meta"]["stack_trace"] = f'File "x", line 1, in f\n  a\r{code}\n'
    else:  # pragma: no cover
        raise AssertionError(kind)


def _set_size(rec, expr: str) -> None:
    """Make the first size of node record ``rec``'s fake value the symbolic size ``expr``."""
    from te_passes.debug.graph_io import SymMeta, TensorMeta

    key = "val" if isinstance(rec["meta"].get("val"), TensorMeta) else "example_value"
    val = rec["meta"][key]
    rec["meta"][key] = TensorMeta((SymMeta(expr, 4),) + val.shape[1:], val.stride, val.dtype, val.device)


INJECTIONS = ["placeholder_target", "node_name", "get_attr_target", "call_module_target", "call_method_target",
              "kwargs_key", "output_target", "function_through_torch_os", "function_module_text", "op_namespace",
              "op_overload", "attrs_key", "symbolic_size", "stack_trace"]


@pytest.mark.parametrize("kind", INJECTIONS)
def test_injected_code_in_every_node_field_never_runs(kind, dump_copy, tmp_path):
    """Code in a node's name, target (every node kind), keyword, attribute name, size expression
    or stack trace: ``replay`` refuses the file (one line, exit 2) or, for the stack trace, which
    is only ever a comment, loads it with the control characters removed; the code never runs."""
    marker = tmp_path / "PWNED"
    p = _tegraph(dump_copy)
    payload = _payload(p)
    _inject(kind, payload, str(marker))
    _write_payload(p, payload)
    proc = run_cli("replay", p, cwd=str(tmp_path), timeout=REFUSE_TIMEOUT)
    if kind == "stack_trace":
        assert proc.returncode == 0, proc.stderr[-2000:]
    else:
        _assert_refused(proc, "is not an identifier", "is not a dotted identifier", "outside what a te_passes graph",
                        "is not a size expression", "is not an operator", "not registered")
    assert not marker.exists()


def test_load_graph_refuses_injected_targets_in_process(dump_copy, tmp_path):
    """``te_passes.debug.graph_io.load_graph`` (the library entry) refuses as the CLI does."""
    from te_passes.debug.graph_io import GraphFileError, load_graph

    marker = tmp_path / "PWNED"
    p = _tegraph(dump_copy)
    for kind in [k for k in INJECTIONS if k != "stack_trace"]:
        payload = _payload(p)
        _inject(kind, payload, str(marker))
        q = tmp_path / f"{kind}.tegraph"
        _write_payload(q, payload)
        with pytest.raises(GraphFileError):
            load_graph(q)
    assert not marker.exists()


def _splice(payload, data: bytes) -> bytes:
    """The pickle of ``payload`` with the string ``"@@X@@"`` in it replaced by raw opcodes."""
    import io

    from te_passes.debug.graph_io import _Pickler

    buf = io.BytesIO()
    _Pickler(buf, protocol=4).dump(payload)
    raw = buf.getvalue()
    tok = b"\x8c\x05@@X@@"
    assert raw.count(tok) == 1
    return raw.replace(tok, data)


@pytest.mark.parametrize("bomb", ["shared_list_40", "deep_list_200000", "deep_tuple_100000", "self_cycle",
                                  "huge_int", "exponent", "exponent_chain", "deep_size_expr", "memo_index"])
def test_resource_bombs_are_refused_with_one_line(bomb, dump_copy, tmp_path):
    """A 40-level shared list (2**40 paths), a 200,000-deep list, a cycle, a 10,000-digit integer,
    ``9**9**9**9`` as a size, or a memo index of 2**30 (the C unpickler allocates its memo array to
    it: 24 s and gigabytes for a 7 KB file, found by the long fuzz profile): one line, exit 2
    (before: minutes, a segfault, a traceback)."""
    p = _tegraph(dump_copy)
    payload = _payload(p)
    ci = next(i for i, n in enumerate(payload["nodes"]) if n["op"] == "call_function")
    ph = next(i for i, n in enumerate(payload["nodes"]) if n["op"] == "placeholder")
    data = None
    if bomb == "shared_list_40":
        x: list = []
        for _ in range(40):
            x = [x, x]
        payload["nodes"][ci]["args"] = (x,)
    elif bomb == "deep_list_200000":
        payload["nodes"][ci]["args"] = ("@@X@@",)
        data = _splice(payload, b"]" * 200_000 + b"a" * 199_999)
    elif bomb == "deep_tuple_100000":
        payload["nodes"][ci]["args"] = ("@@X@@",)
        data = _splice(payload, b")" + b"\x85" * 100_000)  # EMPTY_TUPLE, then TUPLE1 100,000 times
    elif bomb == "memo_index":
        payload["nodes"][ci]["args"] = ("@@X@@",)
        data = _splice(payload, b"\x8c\x01ar" + (2 ** 30).to_bytes(4, "little"))  # 'a', LONG_BINPUT 2**30
    elif bomb == "self_cycle":
        cyc: list = []
        cyc.append(cyc)
        payload["nodes"][ci]["args"] = (cyc,)
    elif bomb == "huge_int":
        payload["nodes"][ci]["args"] = (10 ** 10_000,)
    else:
        expr = {"exponent": "9**9**9**9", "exponent_chain": "((((9**60)**60)**60)**60)",
                "deep_size_expr": "(" * 150 + "s0" + "+1)" * 150}[bomb]  # 150 nested additions (bare parentheses collapse)
        _set_size(payload["nodes"][ph], expr)
    if data is None:
        _write_payload(p, payload)
    else:
        with open(p, "wb") as f:
            f.write(data)
    proc = run_cli("replay", p, cwd=str(tmp_path), timeout=REFUSE_TIMEOUT)
    _assert_refused(proc, "nested more than", "more than 2000000 items", "contains itself", "digits",
                    "is not a size expression", "memo index")


@pytest.mark.parametrize("cmd", ["show", "replay", "dump"])
def test_deep_and_huge_json_is_one_line(cmd, dump_copy, tmp_path):
    """5,000-deep JSON and a 100,000-digit number in a dump's JSON files: one line, exit 2, in
    ``show``, ``replay`` and ``dump`` (before: RecursionError tracebacks)."""
    deep = "[" * 5000 + "]" * 5000
    if cmd == "show":
        (dump_copy / "report.json").write_text(deep)
        proc = run_cli("show", str(dump_copy), cwd=str(tmp_path), timeout=REFUSE_TIMEOUT)
    elif cmd == "replay":
        (dump_copy / "g0" / "report.json").write_text('{"graph_id": "g0", "stages": [], "x": ' + "9" * 100_000 + "}")
        proc = run_cli("replay", str(dump_copy / "g0"), "--check", cwd=str(tmp_path), timeout=REFUSE_TIMEOUT)
    else:
        (dump_copy / ".te_passes_manifest.json").write_text(deep)
        proc = run_cli("dump", "--example", "linear-bf16", "--out", str(dump_copy), cwd=str(tmp_path))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "RecursionError" not in proc.stderr
    _one_error_line(proc)


# --------------------------------------------------------------------------- 2. writing is one step
def _fsize_limit(nbytes: int):
    def set_limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return set_limit


def _run_cli_limited(*args: str, cwd: str, preexec) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    for k in ("TE_PASSES_DISABLE", "TE_PASSES_DUMP_DIR", "TORCH_TRACE"):
        e.pop(k, None)
    e["PYTHONDONTWRITEBYTECODE"] = "1"
    return subprocess.run([PY, "-m", "te_passes.cli", *args], cwd=cwd, env=e, capture_output=True, text=True,
                          timeout=600, preexec_fn=preexec)


def test_disk_full_fails_the_run_and_keeps_the_earlier_dump(dump_copy, tmp_path):
    """Under a 4 KiB file-size limit (``RLIMIT_FSIZE``: EFBIG, as on a full disk) a dump over an
    earlier one exits 1 naming the write error; the earlier dump is byte for byte unchanged and
    no staging folder is left (before: a truncated dump committed, exit 0)."""
    before = snapshot(dump_copy)
    proc = _run_cli_limited("dump", "--example", "linear-bf16", "--out", str(dump_copy), cwd=str(tmp_path),
                            preexec=_fsize_limit(4096))
    assert proc.returncode == 1, (proc.stdout[-2000:], proc.stderr[-2000:])
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("te-passes: error:")][-1]
    assert "writing the dump failed" in line and ("File too large" in line or "EFBIG" in line or "27" in line), line
    assert f"{dump_copy} is unchanged" in line
    assert snapshot(dump_copy) == before
    assert not [n for n in os.listdir(dump_copy) if n.startswith(".te_passes-")]


def _other_fs_dir(tmp_path):
    shm = "/dev/shm"
    if not os.path.isdir(shm) or os.stat(shm).st_dev == os.stat(tmp_path).st_dev \
            or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm on another filesystem than the test's tmp_path")
    d = os.path.join(shm, f"te_passes_test_{os.getpid()}_{os.path.basename(tmp_path)}")
    os.makedirs(d)
    return d


@pytest.mark.parametrize("how", ["direct", "symlinked_out"])
def test_out_on_another_filesystem_replaces_the_earlier_dump_whole(how, base_dump, tmp_path):
    """``--out`` on another filesystem than the cwd (``/dev/shm``), given directly or as a
    symlink to it: the second dump replaces the first whole (before: EXDEV after the old dump was
    deleted — both lost)."""
    other = _other_fs_dir(tmp_path)
    try:
        d = os.path.join(other, "D")
        shutil.copytree(base_dump, d)
        out = d
        if how == "symlinked_out":
            os.symlink(d, tmp_path / "link")
            out = str(tmp_path / "link")
        proc = run_cli("dump", "--example", "linear-bf16", "--out", out, cwd=str(tmp_path))
        assert proc.returncode == 0, proc.stderr[-2000:]
        man = json.loads(open(os.path.join(d, ".te_passes_manifest.json")).read())
        assert all(os.path.isfile(os.path.join(d, f)) for f in man["files"])
        assert run_cli("show", out, cwd=str(tmp_path)).returncode == 0
        assert not [n for n in os.listdir(d) if n.startswith(".te_passes-")]
    finally:
        shutil.rmtree(other, ignore_errors=True)


_KILL_AT = r"""
import os, signal, sys
n = int(sys.argv[1])
calls = [0]
real = os.rename
def rename(a, b):
    calls[0] += 1
    if calls[0] > n:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(a, b)
os.rename = rename
from te_passes.cli.dumpdir import staged_out
with staged_out(sys.argv[2]) as stage:
    for root, _dirs, names in os.walk(sys.argv[3]):
        for name in names:
            src = os.path.join(root, name)
            rel = os.path.relpath(src, sys.argv[3])
            if rel.startswith(".te_passes"):
                continue
            dst = os.path.join(stage, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with open(src, "rb") as f, open(dst, "wb") as g:
                g.write(f.read().replace(b"linear", b"LINEAR"))
print("committed", calls[0])
"""


def _kill_offsets() -> list[int]:
    return list(range(0, 400)) if os.environ.get("HYPOTHESIS_PROFILE") == "long" else \
        [0, 15, 31, 32, 33, 47, 64, 10_000]


def test_sigkill_at_every_point_of_the_commit_leaves_one_whole_dump(base_dump, tmp_path):
    """The commit (``te_passes.cli.dumpdir._commit``, the code ``dump`` and ``replay --out`` run)
    is killed with SIGKILL after its N-th rename, for N over the whole commit: afterwards
    ``te-passes show`` (which undoes an interrupted commit) sees the earlier dump byte for byte
    or the new one whole, never a mix (before: a partly deleted old dump reported whole)."""
    script = tmp_path / "kill_at.py"
    script.write_text(_KILL_AT)
    e = dict(os.environ, PYTHONPATH=ROOT)
    old = snapshot(base_dump)
    new_files = None
    seen = set()
    for n in _kill_offsets():
        d = tmp_path / f"D{n}"
        shutil.copytree(base_dump, d)
        proc = subprocess.run([PY, str(script), str(n), str(d), str(base_dump)], env=e, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode in (0, -signal.SIGKILL), proc.stderr[-2000:]
        show = run_cli("show", str(d), "--json", cwd=str(tmp_path))
        assert show.returncode == 0, show.stderr[-2000:]
        now = snapshot(d)
        if now == old:
            seen.add("old")
        else:
            man = json.loads((d / ".te_passes_manifest.json").read_text())
            files = sorted(man["files"])
            new_files = new_files or files
            assert files == new_files
            for f in files:
                assert b"LINEAR" in (d / f).read_bytes() or b"linear" not in (d / f).read_bytes(), f
            seen.add("new")
        assert not [x for x in os.listdir(d) if x.startswith(".te_passes-") or x == ".te_passes_commit.json"]
        shutil.rmtree(d)
        if proc.returncode == 0:
            break
    assert seen == {"old", "new"}


def test_ctrl_c_during_the_commit_waits_for_it(base_dump, tmp_path):
    """SIGINT during the commit is held until the commit is done: the new dump is whole."""
    script = tmp_path / "int_at.py"
    script.write_text(_KILL_AT.replace("signal.SIGKILL", "signal.SIGINT").replace("calls[0] > n", "calls[0] == n"))
    d = tmp_path / "D"
    shutil.copytree(base_dump, d)
    proc = subprocess.run([PY, str(script), "20", str(d), str(base_dump)], env=dict(os.environ, PYTHONPATH=ROOT),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0  # the interrupt arrives after the commit
    man = json.loads((d / ".te_passes_manifest.json").read_text())
    assert all(b"linear" not in (d / f).read_bytes() or b"LINEAR" in (d / f).read_bytes() for f in man["files"])
    assert not (d / ".te_passes_commit.json").exists()


@pytest.mark.parametrize("where", ["graph_folder", "stage_folder", "manifest_entry", "lock_file", "new_file",
                                   "journal"])
def test_nothing_is_written_or_deleted_through_a_symlink(where, dump_copy, tmp_path):
    """A symlinked ``g0/`` (or ``g0/dynamo/``, or a listed file, the lock, the commit journal)
    pointing outside ``--out``: the dump is refused (one line) and the link's target is
    untouched (before: its files deleted or truncated)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    d = dump_copy
    if where in ("graph_folder", "stage_folder"):
        sub = d / "g0" if where == "graph_folder" else d / "g0" / "dynamo"
        shutil.copytree(sub, outside / "victim")
        shutil.rmtree(sub)
        os.symlink(outside / "victim", sub)
    elif where == "manifest_entry":
        (outside / "victim").mkdir()
        (outside / "victim" / "report.json").write_text("precious")
        os.symlink(outside / "victim", d / "g7")
        man = json.loads((d / ".te_passes_manifest.json").read_text())
        man["files"].append("g7/report.json")
        (d / ".te_passes_manifest.json").write_text(json.dumps(man))
    elif where == "lock_file":
        (outside / "victim").write_text("precious")
        os.remove(d / ".te_passes_sessions.lock") if (d / ".te_passes_sessions.lock").exists() else None
        os.symlink(outside / "victim", d / ".te_passes_sessions.lock")
    elif where == "new_file":
        (outside / "victim").write_text("precious")
        os.remove(d / "g0" / "te_state.json")
        os.symlink(outside / "victim", d / "g0" / "te_state.json")
    else:
        (outside / "victim").write_text("precious")
        os.symlink(outside / "victim", d / ".te_passes_commit.json")
    before = snapshot(outside)
    proc = run_cli("dump", "--example", "linear-bf16", "--out", str(d), cwd=str(tmp_path))
    _assert_refused(proc, "symbolic link", "not a regular file", "never writes through a link")
    assert snapshot(outside) == before


def test_a_target_that_changes_directory_dumps_where_asked(tmp_path):
    """``--out D`` is resolved before the target runs: a target that ``chdir``\\ s into another
    folder holding a dump ``D`` leaves that one alone (before: committed over it)."""
    (tmp_path / "elsewhere" / "D").mkdir(parents=True)
    (tmp_path / "elsewhere" / "D" / "mine.txt").write_text("keep")
    (tmp_path / "t.py").write_text(
        "import os, torch\n\ndef main():\n"
        f"    os.chdir({str(tmp_path / 'elsewhere')!r})\n"
        "    f = torch.compile(lambda x: torch.relu(x) * 2, backend='te_inductor')\n"
        "    f(torch.randn(4, 4))\n")
    proc = run_cli("dump", "t.py:main", "--out", "D", cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "D" / "report.json").is_file()
    assert sorted(os.listdir(tmp_path / "elsewhere" / "D")) == ["mine.txt"]


def test_stale_staging_folders_are_removed_by_the_next_run(dump_copy, tmp_path):
    """Staging / trash folders a killed run left inside ``--out`` are removed by the next dump,
    which says so on stderr."""
    (dump_copy / ".te_passes-stage-abc123").mkdir()
    (dump_copy / ".te_passes-stage-abc123" / "x").write_text("half")
    (dump_copy / ".te_passes-old-zz").mkdir()
    proc = run_cli("dump", "--example", "linear-bf16", "--out", str(dump_copy), cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "removed 2 staging folder(s) left by killed runs" in proc.stderr
    assert not [n for n in os.listdir(dump_copy) if n.startswith(".te_passes-")]


# --------------------------------------------------------------------------- 3. printed strings
ESC = "\x1b]0;PWNED\x07\x1b[2J\x1b]8;;http://evil.example\x1b\\link\x1b]8;;\x1b\\\x9b31m[red]x[/]\u202e[/bold]"


def _poison(v):
    if isinstance(v, str):
        return v + ESC
    if isinstance(v, list):
        return [_poison(x) for x in v]
    if isinstance(v, dict):
        return {k: (v[k] if k == "schema" else _poison(x)) for k, x in v.items()}
    return v


def _pty_run(args, cwd):
    """Run the CLI on a pseudo-terminal (rich output) and return (rc, output)."""
    import pty
    import select

    e = dict(os.environ, PYTHONPATH=ROOT, COLUMNS="200", TERM="xterm")
    master, slave = pty.openpty()
    p = subprocess.Popen([PY, "-m", "te_passes.cli", *args], cwd=cwd, env=e, stdin=slave, stdout=slave,
                         stderr=slave, close_fds=True)
    os.close(slave)
    out = b""
    while True:
        r, _, _ = select.select([master], [], [], 240)
        if not r:
            p.kill()
            break
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    return p.wait(timeout=60), out.decode("utf-8", "replace")


@pytest.mark.parametrize("terminal", ["plain", "rich"])
def test_escape_sequences_and_markup_in_every_field_are_not_printed(terminal, dump_copy, tmp_path):
    """Every string of a shared ``report.json`` gets OSC (title, hyperlink), CSI (clear screen),
    C1 and bidi characters and rich markup appended: ``show`` prints none of the control
    characters, the markup literally, and no traceback, in plain and rich output."""
    rp = dump_copy / "report.json"
    rp.write_text(json.dumps(_poison(json.loads(rp.read_text()))))
    if terminal == "plain":
        proc = run_cli("show", str(dump_copy), cwd=str(tmp_path))
        rc, text = proc.returncode, proc.stdout + proc.stderr
    else:
        rc, text = _pty_run(["show", str(dump_copy)], str(tmp_path))
    assert rc == 0, text[-3000:]
    assert "Traceback" not in text and "MarkupError" not in text
    assert "PWNED" in text  # the text is shown ...
    assert "\x07" not in text and "\x9b" not in text and "\u202e" not in text  # ... its controls are not
    if terminal == "plain":
        assert "\x1b" not in text
        assert "[red]x[/]" in text
    else:  # rich's own styling uses CSI sequences; none of ours may get through
        assert "\x1b]" not in text and "\x1b[2J" not in text
        assert "[red]x[/]" in text


def test_error_lines_are_sanitized(tmp_path):
    """A file name with an escape sequence in an error line prints without the ESC character."""
    bad = tmp_path / "x\x1b]0;PWNED\x07.tegraph"
    bad.write_bytes(b"junk")
    proc = run_cli("replay", str(bad), cwd=str(tmp_path))
    assert proc.returncode == 2
    assert "\x1b" not in proc.stderr and "\x07" not in proc.stderr


# --------------------------------------------------------------------------- 4. logging
_LOG_TARGET = """
import logging, torch
from te_passes._logging import get_logger

def main():
    get_logger().info("te-passes-marker")
    logging.getLogger("torch._dynamo").info("dynamo-marker")
    f = torch.compile(lambda x: torch.relu(x) * 2, backend="{backend}")
    f(torch.randn(4, 4))
    f(torch.randn(5, 4))
    get_logger().info("te-passes-marker-2")

if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize("backend", ["te_inductor", "inductor"])
def test_torch_logs_lines_are_printed_once(backend, tmp_path):
    """``TORCH_LOGS=+te_passes,recompiles``: every log line of te_passes and torch appears once
    (before: twice, ``backend="inductor"`` included, as te_passes re-ran torch's ``_init_logs``)."""
    (tmp_path / "t.py").write_text(_LOG_TARGET.replace("{backend}", backend))
    e = dict(os.environ, PYTHONPATH=ROOT, TORCH_LOGS="+te_passes,recompiles,+dynamo")
    proc = subprocess.run([PY, "t.py"], cwd=str(tmp_path), env=e, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln[:1] in "VIWE" and "] " in ln]
    for marker in ("te-passes-marker", "te-passes-marker-2", "dynamo-marker"):
        assert sum(ln.endswith("] " + marker) for ln in lines) == 1, marker
    recompiles = [ln for ln in lines if "Recompiling function" in ln]
    assert len(recompiles) == 1, recompiles
    # multi-line records repeat their prefix on every line; a duplicated handler repeats whole
    # records, so the records' first lines are compared
    firsts = [ln for ln in lines if "TorchDynamo attempted to trace" in ln or "Step 1: torchdynamo start" in ln]
    assert len(firsts) == len(set(firsts)), firsts


# --------------------------------------------------------------------------- 5. dynamic shapes
_DYN_TARGET = """
import torch

def f(x, w):
    n = x.shape[0]
    y = (x @ w).relu()
    z = y.reshape(n // 2, -1)  # floor division of a symbol
    return z * (n % 3 + 1), y[: n - 1]

def main():
    c = torch.compile(f, backend="te_inductor", dynamic=True)
    w = torch.randn(8, 7)
    for n in (6, 10):
        x = torch.randn(n, 8)
        got, want = c(x, w), f(x, w)
        torch.testing.assert_close(got, want)
"""


def test_dynamic_shape_dump_replays_and_check_reproduces(tmp_path):
    """A ``dynamic=True`` compile (symbolic sizes, ``//`` and ``%`` of a symbol in the graph):
    ``replay --check`` rebuilds the symbols with their hints and ranges and reproduces the
    saved report (before: records differed, floor division did not rebuild)."""
    (tmp_path / "dyn.py").write_text(_DYN_TARGET)
    proc = run_cli("dump", "dyn.py:main", "--out", "D", cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    from te_passes.debug.graph_io import load_payload

    payload = load_payload(tmp_path / "D" / "g0" / "dynamo" / "input.tegraph")
    assert payload["symbols"], payload.get("symbols")
    assert all(s["hint"] is not None for s in payload["symbols"].values())
    proc = run_cli("replay", "D", "--check", cwd=str(tmp_path))
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "reproduces the saved report" in proc.stdout


@pytest.mark.parametrize("expr, hint", [("Eq(s0, 4)", True), ("PythonMod(s0, 3)", 1), ("(s0//2)", 2),
                                        ("Max(1, s0) + ModularIndexing(s0, 1, 2)", 4), ("s0**2", 16),
                                        ("IntTrueDiv(s0, 2)", 2.0), ("Ne(s0, 1) & (s1 > 3)", True),
                                        ("CeilDiv(s0, 3)", 2)])
def test_size_expressions_torch_prints_parse(expr, hint):
    """Every size function ``str(SymInt.node.expr)`` prints parses back to the same text."""
    from te_passes.debug.sym_expr import parse_sym_expr

    e = parse_sym_expr(expr, "test")
    import sympy

    s0, s1 = sympy.Symbol("s0", integer=True, positive=True), sympy.Symbol("s1", integer=True, positive=True)
    v = e.subs({s0: 4, s1: 5})
    assert (bool(v) if isinstance(hint, bool) else float(v)) == hint, (expr, v)
