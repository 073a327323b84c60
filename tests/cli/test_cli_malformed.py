"""Malformed dumps are one-line errors naming the file and what is wrong, exit 2, no traceback
(issue 16, items 6-7): ``show`` on a report.json with wrong field types or corrupted numbers,
unknown schemas; ``replay --check`` on a truncated or malformed ``g<N>/report.json``; notes when
the saved torch / TE versions differ from the installed ones."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from te_passes.cli import main
from te_passes.debug.dump_files import SCHEMA


@pytest.fixture(scope="module")
def small_dump(tmp_path_factory):
    """A real dump of a small graph through the backend's stage runner (no TE, fast)."""
    from te_passes.debug.offline import run_stages
    from te_passes.passes.order import configured_passes
    from te_passes.pipeline.base import Stage

    d = tmp_path_factory.mktemp("small") / "D"
    gm = torch.fx.symbolic_trace(lambda x: torch.relu(x) + 1)
    run_stages([(Stage.DYNAMO, gm, [torch.ones(4)])], configured_passes(), dump_dir=str(d), graph_id="g0")
    return d


def _run(capsys, *argv):
    code = main(list(argv))
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("te-passes: error: "), err
    assert "Traceback" not in err
    return lines[0]


def _base():
    return json.loads(json.dumps({
        "schema": SCHEMA, "versions": {"te_passes": "0.1.0", "torch": "x", "transformer_engine": "y"},
        "graphs": [{"graph_id": "g0", "mode": "default", "stages": ["g0:dynamo"], "time_ms_passes": 1.0}],
        "passes": [{"graph_id": "g0", "stage": "dynamo", "name": "p", "status": "ok", "changed": False,
                    "time_ms": 0.5, "nodes_before": 3, "nodes_after": 3, "records": 0}],
        "folded": [], "frees": [], "pool_check": [], "skipped": [], "failed": [], "other_records": [],
        "memory": {"stages": [], "peak_before": None, "peak_after": None},
        "graph_breaks": [], "eager_fallbacks": [], "recompiles": [], "uuid": {"g0": {"uuid": "abc"}}}))


def _set(path, value):
    def f(s):
        obj = s
        *head, last = path
        for k in head:
            obj = obj[k]
        obj[last] = value
        return s
    return f


MALFORMED = {
    "graphs_str": (_set(["graphs"], "g0"), "report.json: graphs is a str, expected a list"),
    "graph_entry_str": (_set(["graphs", 0], "g0"), "graphs[0] is a str, expected an object"),
    "passes_entry_str": (_set(["passes", 0], "x"), "passes[0] is a str, expected an object"),
    "time_none": (_set(["passes", 0, "time_ms"], None), "passes[0].time_ms is null, expected a number"),
    "nodes_str": (_set(["passes", 0, "nodes_before"], "3"), "passes[0].nodes_before is a str, expected an integer"),
    "changed_str": (_set(["passes", 0, "changed"], "no"), "passes[0].changed is a str, expected true/false"),
    "uuid_list": (_set(["uuid"], []), "uuid is a list, expected an object"),
    "memory_stages": (_set(["memory", "stages"], [1]), "memory.stages[0] is a int, expected an object"),
    "breaks": (_set(["graph_breaks"], [{"reason": 3}]), "graph_breaks[0].reason is a int, expected a string"),
    "versions": (_set(["versions"], "2.0"), "versions is a str, expected an object"),
    "stage_names": (_set(["graphs", 0, "stages"], [1]), "graphs[0].stages[0] is a int, expected a string"),
    "schema_99": (_set(["schema"], "te_passes.dump/99"),
                  "schema te_passes.dump/99 is not supported (this te_passes reads te_passes.dump/1)"),
    "schema_other": (_set(["schema"], "other_tool/7"), "is not a te_passes dump summary (schema 'other_tool/7')"),
    "schema_missing": (lambda s: {k: v for k, v in s.items() if k != "schema"},
                       "is not a te_passes dump summary (no schema)"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_show_malformed_summary_is_one_line(case, tmp_path, capsys):
    mutate, expect = MALFORMED[case]
    (tmp_path / "report.json").write_text(json.dumps(mutate(_base())))
    code, out, err = _run(capsys, "show", str(tmp_path))
    assert code == 2, (code, err)
    line = _one_line(err)
    assert expect in line and str(tmp_path / "report.json") in line, line


def test_show_well_formed_summary_prints(tmp_path, capsys):
    (tmp_path / "report.json").write_text(json.dumps(_base()))
    code, out, err = _run(capsys, "show", str(tmp_path), "--plain")
    assert code == 0, err
    assert "Passes" in out


def test_show_truncated_summary(tmp_path, capsys):
    (tmp_path / "report.json").write_text(json.dumps(_base())[:-7])
    code, out, err = _run(capsys, "show", str(tmp_path))
    assert code == 2
    assert "not valid JSON" in _one_line(err)


@pytest.mark.parametrize("content, expect", [
    ('{"graph_id": "g0", "stages": [', "not valid JSON"),
    ('{"graph_id": "g0", "stages": "x"}', "stages is a str, expected a list"),
    ('{"graph_id": "g0", "stages": [{"graph_id": "g0", "stage": "dynamo", "runs": [1]}]}',
     "stages[0].runs[0] is a int, expected an object"),
    ('[1]', "is a list, expected an object"),
])
def test_replay_check_with_a_malformed_graph_report(small_dump, tmp_path, capsys, content, expect):
    import shutil

    d = tmp_path / "D"
    shutil.copytree(small_dump, d)
    (d / "g0" / "report.json").write_text(content)
    code, out, err = _run(capsys, "replay", str(d), "--check")
    assert code == 2, (code, err)
    line = _one_line(err)
    assert expect in line and str(d / "g0" / "report.json") in line, line


def test_replay_notes_version_differences(small_dump, tmp_path, capsys):
    import shutil

    d = tmp_path / "D"
    shutil.copytree(small_dump, d)
    code, out, err = _run(capsys, "replay", str(d), "--check")
    assert code == 0 and "warning" not in err, err
    f = d / "g0" / "dynamo" / "input.tegraph"
    payload = pickle.loads(f.read_bytes())
    payload["torch"] = "2.0.0"
    payload["te_state"] = {**(payload.get("te_state") or {}), "te_version": "1.9.0"}
    f.write_bytes(pickle.dumps(payload))
    code, out, err = _run(capsys, "replay", str(d), "--check")
    assert code == 0, err
    from te_passes.te.version import te_version

    assert (f"te-passes: warning: g0 was saved under torch 2.0.0, Transformer Engine 1.9.0; installed here: "
            f"torch {torch.__version__}, Transformer Engine {te_version()}") in err, err
    code, out, err = _run(capsys, "replay", str(d), "--check", "--json")
    (res,) = json.loads(out)
    assert res["versions"] == {"saved": {"torch": "2.0.0", "transformer_engine": "1.9.0"},
                               "installed": {"torch": str(torch.__version__), "transformer_engine": te_version()}}


def test_replay_missing_graph_file(small_dump, tmp_path, capsys):
    import shutil

    d = tmp_path / "D"
    shutil.copytree(small_dump, d)
    (d / "g0" / "dynamo" / "input.tegraph").unlink()
    code, out, err = _run(capsys, "replay", str(d), "--check")
    assert code == 2
    assert "no saved graphs (*.tegraph)" in _one_line(err)


def test_replay_check_without_a_saved_report_is_an_error(small_dump, tmp_path, capsys):
    """--check that cannot compare does not pass silently."""
    import shutil

    d = tmp_path / "D"
    shutil.copytree(small_dump, d)
    (d / "g0" / "report.json").unlink()
    code, out, err = _run(capsys, "replay", str(d))
    assert code == 0 and "nothing to compare with" in out
    code, out, err = _run(capsys, "replay", str(d), "--check")
    assert code == 2
    assert "--check: no saved report.json to compare with for g0" in _one_line(err)


def test_replay_of_a_directory_looks_only_where_dumps_put_graphs(small_dump, tmp_path, capsys):
    """`te-passes replay DIR` reads the dump layouts only (debug.offline.DUMP_LAYOUTS), never a
    search of the whole tree (`replay /usr` used to walk every folder); a stray graph file deeper
    down is not picked up."""
    import shutil

    deep = tmp_path / "a" / "b" / "c" / "d"
    deep.mkdir(parents=True)
    shutil.copy(small_dump / "g0" / "dynamo" / "input.tegraph", deep / "input.tegraph")
    code, out, err = _run(capsys, "replay", str(tmp_path / "a"))
    assert code == 2 and "in a dump's layout" in _one_line(err)
    shutil.copytree(small_dump, tmp_path / "sessions" / "s1")  # a backend dump dir of sessions
    code, out, err = _run(capsys, "replay", str(tmp_path / "sessions"), "--check")
    assert code == 0, err


def test_show_of_a_graph_folder_points_at_the_dump_above_it(small_dump, capsys):
    code, out, err = _run(capsys, "show", str(small_dump / "g0"))
    assert code == 2 and "is one graph's report (a graph folder)" in _one_line(err)
    assert str(small_dump) in _one_line(err)
