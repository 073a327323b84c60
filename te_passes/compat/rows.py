"""The ordered registry of the patch table: every row of every capability, in install order.

Order: Dynamo first (its callbacks install nothing of TE), then our ops' lowerings, UB, autocast,
DelayedScaling (its rows need the autocast rows), the untouched-model polyfills last (they use the ops)."""

from __future__ import annotations

from te_passes.compat.autocast.rows import ROWS as AUTOCAST
from te_passes.compat.delayed_scaling.rows import ROWS as DELAYED_SCALING
from te_passes.compat.dynamo.rows import ROWS as DYNAMO
from te_passes.compat.lowering_rows import ROWS as LOWERINGS
from te_passes.compat.table import Row
from te_passes.compat.ub.rows import ROWS as UB
from te_passes.compat.untouched.rows import ROWS as UNTOUCHED

ROWS: tuple[Row, ...] = (*DYNAMO, *LOWERINGS, *UB, *AUTOCAST, *DELAYED_SCALING, *UNTOUCHED)
