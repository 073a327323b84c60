"""``te-passes dump`` / ``replay --out`` never lose a user's files (issue 16, items 1-4).

* ``replay D --out D`` (or ``D/g0 --out D``, ``D --out D/sub``): refused, exit 2, D untouched;
* files a user put into ``g<N>/`` folders of ``--out`` survive later dumps (only the files the
  earlier dump listed in its manifest are removed);
* a dump that fails after the argument checks (no such function, import error, raising target,
  ``sys.exit(3)``, Ctrl-C, compiles nothing) leaves the previous dump exactly as it was and no
  stub; into a new ``--out`` it leaves nothing;
* ``--out`` is locked for the whole run: a second dump into it is refused (exit 2).
"""

from __future__ import annotations

import json
import os

import pytest

from _cli import _one_error_line, run_cli, snapshot


@pytest.mark.parametrize("src, out", [("D", "D"), ("D/g0", "D"), ("D", "D/sub"), ("D/g0/dynamo/input.tegraph", "D"),
                                      ("D", "./D/")])
def test_replay_out_overlapping_the_source_is_refused(dump_copy, tmp_path, src, out):
    before = snapshot(dump_copy)
    proc = run_cli("replay", src, "--out", out, cwd=str(tmp_path))
    assert proc.returncode == 2, proc.stderr
    assert "overlaps the dump being replayed" in _one_error_line(proc)
    assert snapshot(dump_copy) == before


def test_user_files_in_graph_folders_survive_dumps(dump_copy, tmp_path):
    d = dump_copy
    (d / "g0" / "notes.txt").write_text("mine\n")
    (d / "g0" / "dynamo" / "golden.py").write_text("mine too\n")
    (d / "mine").mkdir()
    (d / "mine" / "results.csv").write_text("x\n")
    proc = run_cli("dump", "--example", "linear-bf16", "--out", "D", cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (d / "g0" / "notes.txt").read_text() == "mine\n"
    assert (d / "g0" / "dynamo" / "golden.py").read_text() == "mine too\n"
    assert (d / "mine" / "results.csv").read_text() == "x\n"
    manifest = json.loads((d / ".te_passes_manifest.json").read_text())
    assert "g0/report.json" in manifest["files"] and "g0/notes.txt" not in manifest["files"]
    # replay --out into a folder holding a user's g0/ file: kept too, also on the second run
    (tmp_path / "R" / "g0").mkdir(parents=True)
    (tmp_path / "R" / "g0" / "keep.md").write_text("k")
    for _ in range(2):
        proc = run_cli("replay", "D", "--out", "R", cwd=str(tmp_path))
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert (tmp_path / "R" / "g0" / "keep.md").read_text() == "k"
        assert (tmp_path / "R" / "g0" / "report.json").is_file()


FAILING = {
    "no_function": ("t.py:mian", 2, "has no function 'mian'"),
    "import_error": ("imp.py:main", 1, "raised ModuleNotFoundError while loading"),
    "raises": ("t.py:boom", 1, "raised ValueError: boom"),
    "exit3": ("t.py:leave", 1, "exited with status 3"),
    "ctrl_c": ("t.py:intr", 130, "interrupted"),
    "nothing": ("t.py:main", 1, "compiled nothing"),
}
TARGET = """
import sys
def main():
    return 1
def boom():
    raise ValueError("boom")
def leave():
    sys.exit(3)
def intr():
    raise KeyboardInterrupt
"""


@pytest.mark.parametrize("case", sorted(FAILING))
def test_failing_dump_keeps_the_previous_dump_and_leaves_no_stub(case, dump_copy, tmp_path):
    (tmp_path / "t.py").write_text(TARGET)
    (tmp_path / "imp.py").write_text("import no_such_module_here\ndef main():\n    pass\n")
    target, code, expect = FAILING[case]
    before = snapshot(dump_copy)
    proc = run_cli("dump", target, "--out", "D", cwd=str(tmp_path))
    assert proc.returncode == code, proc.stderr
    assert expect in _one_error_line(proc)
    assert snapshot(dump_copy) == before
    assert not [p for p in os.listdir(tmp_path) if "te_passes-tmp" in p]  # staging folder removed
    # into a new --out: nothing is left behind
    proc = run_cli("dump", target, "--out", "fresh", cwd=str(tmp_path))
    assert proc.returncode == code, proc.stderr
    assert not (tmp_path / "fresh").exists()


def test_out_is_locked_while_a_dump_runs(dump_copy, tmp_path):
    from te_passes.debug.dump_files import dir_lock

    before = snapshot(dump_copy)
    with dir_lock(str(dump_copy), blocking=False):
        proc = run_cli("dump", "--example", "linear-bf16", "--out", "D", cwd=str(tmp_path))
        assert proc.returncode == 2, proc.stderr
        line = _one_error_line(proc)
        assert "is being written by another te_passes process" in line and f"pid {os.getpid()}" in line, line
        proc = run_cli("replay", "D/g0", "--out", "R", cwd=str(tmp_path))  # reading D is fine
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert snapshot(dump_copy) == before


def test_dump_into_a_folder_of_unrelated_files_is_refused(tmp_path):
    """`--out /` (or any folder of your own files without an earlier dump) is refused before
    anything is written; a folder holding only graph folders (g0/ notes) stays allowed (above)."""
    d = tmp_path / "proj"
    d.mkdir()
    (d / "train.py").write_text("x\n")
    (d / "data").mkdir()
    proc = run_cli("dump", "--example", "linear-bf16", "--out", "proj", cwd=str(tmp_path))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "holds 2 entries that are not from a te_passes dump (data, train.py)" in proc.stderr
    assert sorted(p.name for p in d.iterdir()) == ["data", "train.py"]
