"""``te-passes doctor``: versions and every patch-table row, in a fresh process (the CLI loads the backend:
the one install moment)."""

from __future__ import annotations

import json

from _cli import run_cli

from te_passes.compat.rows import ROWS


def test_doctor_json_lists_every_row_active_on_this_torch_and_te(tmp_path):
    proc = run_cli("doctor", "--json", cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    import torch

    assert out["versions"]["torch"] == torch.__version__ and out["versions"]["transformer_engine"]
    assert [r["name"] for r in out["rows"]] == [r.name for r in ROWS]
    refused = {r["name"]: r["reason"] for r in out["rows"] if r["state"] != "active"}
    assert refused == {}, refused
    for r in out["rows"]:
        assert r["why"] and r["drop_when"] and r["torch"] and r["changes"] >= 0, r


def test_doctor_table_names_each_row_and_the_count(tmp_path):
    proc = run_cli("doctor", "--plain", cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"patch table: {len(ROWS)} of {len(ROWS)} rows active" in proc.stdout
    for row in ROWS:
        assert row.name in proc.stdout
