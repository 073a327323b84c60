"""Patch-table rows on and off in tests (te_passes.compat.table): what the per-module install / uninstall
functions did before the compat fence."""

from __future__ import annotations

from te_passes.compat import table


def rows_of(capability: str):
    """The registry rows of ``capability`` (``"ub"``, ``"autocast"``)."""
    from te_passes.compat.rows import ROWS

    return [r for r in ROWS if r.name.startswith(capability + ".")]


def on(name: str) -> bool:
    """Apply row ``name`` (TE imported first; a kept refusal is reverted so the row is planned again when it is
    not active); returns whether it is active."""
    import transformer_engine.pytorch  # noqa: F401  (the rows need TE's modules)

    if table.refusal(name) is not None:
        table.revert([name])
        table.install([r for r in rows_of(name.split(".", 1)[0]) if r.name == name])
    return table.refusal(name) is None


def off(*names: str) -> None:
    """Undo rows ``names`` (TE's own objects back)."""
    table.revert(list(names))
