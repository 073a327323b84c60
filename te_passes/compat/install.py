"""The one entry that installs te_passes' process-level integration: our fused-attention op family, then
the patch table (:data:`te_passes.compat.rows.ROWS`). Called once when the backend loads
(:func:`te_passes.compat.dynamo.hooks.register`); tests and tools that run the passes without the backend
call it too.

See docs/internals.md#te_passescompatinstallpy."""

from __future__ import annotations

from te_passes.ops import fused_attn as fused_attn_op
from te_passes.compat import table
from te_passes.compat.rows import ROWS


def install() -> bool:
    """Register our fused-attention op family (TE's ``register_custom_op``; before the rows, so the
    direct-call lowering and the trace hooks cover it) and apply every row of the patch table (idempotent;
    ``table.status()`` says what is active or why not). Returns ``False`` while a row waits ("pending": TE
    not imported yet, or called inside a trace), ``True`` once every row is active or refused."""
    fused_attn_op.install_fused_attention_op()
    statuses = table.install(ROWS)
    return not any(not s.active and (s.reason or "").startswith("pending") for s in statuses)
