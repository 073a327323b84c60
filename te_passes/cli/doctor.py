"""``te-passes doctor``: the installed torch / TE and every row of te_passes' patch table (what te_passes
changes in TE and torch), active or refused with the reason, with the versions each row was checked against
and when it can be dropped. docs/cli.md "doctor", docs/design.md "The compat fence"."""

from __future__ import annotations

import argparse
import json

from te_passes.cli._common import EXIT_OK, Out


def _state(active: bool, reason: str | None) -> str:
    if active:
        return "active"
    return "pending" if (reason or "").startswith("pending") else "refused"


def row_dicts(rows: list) -> list[dict]:
    """What each :class:`te_passes.compat.table.Row` declares (name, kind, target, te, torch, why, drop_when)."""
    return [{"name": r.name, "kind": r.kind, "target": r.target, "te": r.te, "torch": r.torch, "why": r.why,
             "drop_when": r.drop_when} for r in rows]


def markdown(data: list[dict]) -> str:
    """The patch table as a Markdown table (docs/design.md "The compat fence" prints it): one line per row."""
    def cell(v: object) -> str:
        return str(v or "-").replace("|", "\\|").replace("\n", " ")
    lines = ["| row | changes | TE | torch | why | drop when |", "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| `{d['name']}` | {d['kind']}: `{cell(d['target'])}` | {cell(d['te'])} | {cell(d['torch'])} | "
              f"{cell(d['why'])} | {cell(d['drop_when'])} |" for d in data]
    return "\n".join(lines)


def cmd_doctor(args: argparse.Namespace, out: Out) -> int:
    """Load the backend (the one install moment), then print the versions and the patch table. Exit 0."""
    import te_passes.backend  # noqa: F401 - installs the patch table, as backend="te_inductor" does
    from te_passes.compat import table
    from te_passes.debug.dump_summary import versions as installed

    status = {s.name: s for s in table.status()}
    data = [{**d, "state": _state(status[d["name"]].active, status[d["name"]].reason),
             "changes": status[d["name"]].changes, "reason": status[d["name"]].reason}
            for d in row_dicts(table.rows())]
    versions = installed()
    if args.json:
        print(json.dumps({"versions": versions, "rows": data}, indent=2))
        return EXIT_OK
    if args.markdown:
        print(markdown(data))
        return EXIT_OK
    out.line(f"te_passes {versions['te_passes']}, torch {versions['torch']}, "
             f"Transformer Engine {versions['transformer_engine'] or 'not importable'}")
    n_active = sum(d["state"] == "active" for d in data)
    out.table(f"patch table: {n_active} of {len(data)} rows active", ["row", "state", "target", "checked (TE; torch)",
                                                                       "why / reason refused"],
              [[d["name"], d["state"], d["target"], f"{d['te'] or '-'}; {d['torch'] or '-'}",
                d["why"] if d["state"] == "active" else d["reason"]] for d in data], limit=None)
    out.line("each row's exit condition: te-passes doctor --json (drop_when), docs/design.md \"The compat fence\"")
    return EXIT_OK
