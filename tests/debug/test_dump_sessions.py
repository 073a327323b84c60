"""Backend-only dumps (``te_passes.dump_dir`` / ``TE_PASSES_DUMP_DIR`` without ``te-passes dump``):
one session folder per process under the dump directory, so the summary lists every graph this
process compiled there, in order, and a previous run's graphs are kept (te_passes/debug/dump.py,
docs/cli.md "Dumps without the CLI"). Also: ``mode`` reads ``"default"`` for a compile without a
mode in every report (CompileReport, per-graph report.json, summary, index.md).

Real ``torch.compile(backend="te_inductor")`` on small CPU functions (CPU Inductor).
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch._dynamo

from te_passes.debug import dump, dump_sessions
from te_passes.report import clear_compile_reports, compile_reports

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv("TE_PASSES_DUMP_DIR", raising=False)
    torch._dynamo.reset()
    clear_compile_reports()
    yield
    torch._dynamo.reset()


def _compile_two(d, **kw):
    """Two different graphs (relu*2 of one input, x@y+1 of two) compiled into dump dir ``d``."""
    opts = {"te_passes.dump_dir": str(d)}
    f = torch.compile(lambda x: torch.relu(x) * 2, backend="te_inductor", options=opts, **kw)
    g = torch.compile(lambda x, y: x @ y + 1, backend="te_inductor", options=opts, **kw)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    torch.testing.assert_close(f(x), torch.relu(x) * 2)
    torch.testing.assert_close(g(x, y), x @ y + 1)
    reps = compile_reports()
    assert len(reps) == 2
    return [r.graph_id for r in reps]


def _load(p):
    with open(p) as f:
        return json.load(f)


def test_two_graphs_one_dir_summary_lists_both(tmp_path):
    d = tmp_path / "dumps"
    gids = _compile_two(d)
    sid = dump_sessions.session_id()
    sdir = d / sid
    summary = _load(sdir / "report.json")
    assert [g["graph_id"] for g in summary["graphs"]] == gids  # both, in compile order
    assert summary["owner"] == "backend" and summary["session"] == sid and summary["pid"] == os.getpid()
    # every pass row of both graphs' Dynamo stage is in the summary
    assert {p["graph_id"] for p in summary["passes"] if p["stage"] == "dynamo"} == set(gids)
    for gid in gids:
        g = _load(sdir / gid / "report.json")
        assert g["graph_id"] == gid
        assert (sdir / gid / "dynamo" / "input.tegraph").is_file()
    # nothing of the session is written at the top level of d, except the sessions index
    assert sorted(p.name for p in d.iterdir()) == sorted([sid, "index.md", "sessions.json",
                                                          ".te_passes_sessions.lock"])
    sessions = _load(d / "sessions.json")
    assert sessions["schema"] == dump_sessions.SESSIONS_SCHEMA
    assert [(s["session"], s["graphs"]) for s in sessions["sessions"]] == [(sid, gids)]
    top = (d / "index.md").read_text()
    assert top.startswith(dump_sessions.SESSIONS_INDEX_TITLE + "\n")
    assert f"[{sid}]({sid}/index.md)" in top and ", ".join(gids) in top
    index = (sdir / "index.md").read_text()
    assert all(f"[{gid}]({gid}/report.json)" in index for gid in gids)


def test_mode_is_default_everywhere(tmp_path):
    d = tmp_path / "dumps"
    gids = _compile_two(d)
    sdir = d / dump_sessions.session_id()
    assert [r.mode for r in compile_reports()] == ["default", "default"]
    assert [_load(sdir / gid / "report.json")["mode"] for gid in gids] == ["default", "default"]
    assert [g["mode"] for g in _load(sdir / "report.json")["graphs"]] == ["default", "default"]
    rows = [ln for ln in (sdir / "index.md").read_text().splitlines() if ln.startswith(f"| {gids[0]} |")]
    assert rows and rows[0].split("|")[2].strip() == "default"


def test_explicit_mode_is_reported_as_given(tmp_path, capsys):
    from te_passes.backend import te_inductor

    d = tmp_path / "dumps"
    be = functools.partial(te_inductor, mode="reduce-overhead", options={"te_passes.dump_dir": str(d)})
    f = torch.compile(lambda x: torch.cos(x) - 1, backend=be)
    f(torch.randn(8))
    (rep,) = compile_reports()
    sdir = d / dump_sessions.session_id()
    assert rep.mode == "reduce-overhead"
    assert _load(sdir / rep.graph_id / "report.json")["mode"] == "reduce-overhead"
    assert [g["mode"] for g in _load(sdir / "report.json")["graphs"]] == ["reduce-overhead"]
    from te_passes.cli import main

    assert main(["show", str(sdir), "--plain"]) == 0
    assert "mode:         reduce-overhead" in capsys.readouterr().out.splitlines()


PREVIOUS_RUN = textwrap.dedent("""
    import torch
    f = torch.compile(lambda x: torch.sin(x) + 1, backend="te_inductor", options={"te_passes.dump_dir": %r})
    f(torch.randn(8))
""")


def test_previous_process_dump_is_kept(tmp_path):
    """A dump another process wrote into the same directory keeps its graphs, byte for byte;
    both sessions are listed; this process's summary holds only its own graphs."""
    d = tmp_path / "dumps"
    e = dict(os.environ, PYTHONPATH=ROOT)
    e.pop("TE_PASSES_DUMP_DIR", None)
    proc = subprocess.run([sys.executable, "-c", PREVIOUS_RUN % str(d)], cwd=str(tmp_path), env=e,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (old,) = [p for p in d.iterdir() if p.is_dir()]
    assert re.fullmatch(r"\d{8}T\d{6}Z-.+-p\d+", old.name) and old.name != dump_sessions.session_id()
    assert old.name.endswith(f"-p{_load(old / 'session.json')['pid']}")
    old_g0 = (old / "g0" / "report.json").read_bytes()
    old_summary = _load(old / "report.json")
    assert [g["graph_id"] for g in old_summary["graphs"]] == ["g0"]

    gids = _compile_two(d)  # in this process, graph ids may well be g0, g1 again
    assert (old / "g0" / "report.json").read_bytes() == old_g0
    assert _load(old / "report.json")["graphs"] == old_summary["graphs"]
    mine = _load(d / dump_sessions.session_id() / "report.json")
    assert [g["graph_id"] for g in mine["graphs"]] == gids
    sessions = _load(d / "sessions.json")["sessions"]
    # oldest session start first (this process's session may have started before the subprocess,
    # in an earlier test)
    want = sorted([(old_summary["started"], old.name, ["g0"]),
                   (dump_sessions._STATE.session["started"], dump_sessions.session_id(), gids)])
    assert [(s["started"], s["session"], s["graphs"]) for s in sessions] == want
    top = (d / "index.md").read_text()
    assert top.index(want[1][1]) < top.index(want[0][1])  # newest first

    # te-passes show on the directory shows the newest session and says so
    proc_out = subprocess.run([sys.executable, "-m", "te_passes.cli", "show", str(d), "--plain"],
                              env=e, capture_output=True, text=True, timeout=300)
    assert proc_out.returncode == 0, proc_out.stderr
    first = proc_out.stdout.splitlines()[0]
    assert first == (f"{d} holds 2 backend dump sessions; showing the newest, {d / want[1][1]} "
                     f"(others: see {d / 'index.md'})")


def test_foreign_top_level_index_is_left_alone(tmp_path, caplog):
    """A directory holding a te-passes dump (report.json) or an index.md of its own: the session
    folder is written, the top-level index.md is not touched, and a warning names the folder."""
    d = tmp_path / "dumps"
    d.mkdir()
    (d / "index.md").write_text("# my notes\n")
    dump_sessions._STATE.warned_foreign_index.discard(str(d))
    with caplog.at_level("WARNING", logger="te_passes"):
        gids = _compile_two(d)
    assert (d / "index.md").read_text() == "# my notes\n"
    assert [s["graphs"] for s in _load(d / "sessions.json")["sessions"]] == [gids]
    msgs = [r.getMessage() for r in caplog.records if "left alone" in r.getMessage()]
    assert msgs == [f"te_passes dump: {d} already holds a te-passes dump or an index.md of its own; this process's "
                    f"dump is in {d / dump_sessions.session_id()} (the top-level index.md is left alone)"]


def test_cli_claimed_dir_is_written_directly(tmp_path):
    """Under ``te-passes dump`` (claim_dir) the backend writes straight into the directory, as before."""
    d = tmp_path / "out"
    d.mkdir()
    dump_sessions.claim_dir(d)
    try:
        w = dump.DumpWriter.for_backend(str(d))
        assert w.root == str(d) and w.sessions_dir is None
    finally:
        dump_sessions.unclaim_dir(d)
    w = dump.DumpWriter.for_backend(str(d))
    assert w.root == os.path.join(str(d), dump_sessions.session_id()) and w.sessions_dir == str(d)


def test_cli_refuses_to_dump_into_a_sessions_dir(tmp_path):
    from te_passes.cli import CliError
    from _cli import clear_old_dump

    d = tmp_path / "dumps"
    _compile_two(d)
    with pytest.raises(CliError, match="holds te_passes backend dump sessions .*choose another --out"):
        clear_old_dump(str(d))
    assert (d / dump_sessions.session_id() / "report.json").is_file()


RANK = textwrap.dedent("""
    import sys, torch
    opts = {"te_passes.dump_dir": sys.argv[1]}
    f = torch.compile(lambda x: torch.relu(x) * 2, backend="te_inductor", options=opts)
    g = torch.compile(lambda x, y: x @ y + 1, backend="te_inductor", options=opts)
    f(torch.randn(4, 4)); g(torch.randn(4, 4), torch.randn(4, 4))
""")


def test_two_ranks_at_once_each_keep_their_graphs(tmp_path):
    """Two processes (ranks of one job) writing into one dump directory at the same time: each
    has its own session with both its graphs; the sessions index lists both, complete."""
    d = tmp_path / "dumps"
    e = dict(os.environ, PYTHONPATH=ROOT)
    e.pop("TE_PASSES_DUMP_DIR", None)
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(d)], cwd=str(tmp_path), env=e,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
    pids = sorted(p.pid for p in procs)
    sessions = _load(d / "sessions.json")["sessions"]
    assert sorted(s["pid"] for s in sessions) == pids
    assert [s["graphs"] for s in sessions] == [["g0", "g1"], ["g0", "g1"]]
    for s in sessions:
        summary = _load(d / s["dir"] / "report.json")
        assert summary["pid"] == s["pid"] and [g["graph_id"] for g in summary["graphs"]] == ["g0", "g1"]
        assert _load(d / s["dir"] / "g1" / "report.json")["graph_id"] == "g1"
    top = (d / "index.md").read_text()
    assert all(f"[{s['session']}]({s['dir']}/index.md)" in top for s in sessions)


def test_replay_of_a_sessions_dir_replays_the_newest_session(tmp_path, capsys):
    from te_passes.cli import main

    d = tmp_path / "dumps"
    gids = _compile_two(d)
    assert main(["replay", str(d), "--check", "--plain"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{d} holds 1 backend dump session; replaying the newest, {d / dump_sessions.session_id()}"
    assert [ln for ln in out if ln.startswith("reproduces the saved report")] and \
        len([ln for ln in out if ln.startswith("== replay of ")]) == len(gids)
