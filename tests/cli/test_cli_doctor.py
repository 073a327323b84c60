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


def test_docs_print_the_table_of_the_registry():
    """docs/design.md "The rows" is ``te-passes doctor --markdown`` of the registry, verbatim."""
    import os
    import re

    from te_passes.cli.doctor import markdown, row_dicts

    doc = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "design.md")).read()
    got = re.search(r"<!-- patch-table:begin -->\n(.*?)<!-- patch-table:end -->", doc, re.S)
    assert got, "docs/design.md lost its patch-table markers"
    assert got.group(1).strip() == markdown(row_dicts(list(ROWS))).strip(), \
        "docs/design.md's patch table is stale: paste `te-passes doctor --markdown` between the markers"
