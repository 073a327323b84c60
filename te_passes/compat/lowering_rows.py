"""The patch-table rows for te_passes' own ops (:mod:`te_passes.ops`): Inductor lowerings and the named-constant
``__fx_repr__`` of TE's classes."""

from __future__ import annotations

from te_passes.compat.table import Row

ROWS: tuple[Row, ...] = ()
