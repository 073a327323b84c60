"""The patch-table rows of this capability (:class:`te_passes.compat.table.Row`), in install order."""

from __future__ import annotations

from te_passes.compat.table import Row

ROWS: tuple[Row, ...] = ()
