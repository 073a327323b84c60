"""The one entry that installs te_passes' process-level integration (called by the backend).

See docs/internals.md#te_passescompatinstallpy."""

from __future__ import annotations

import torch

from te_passes.ops import fused_attn as fused_attn_op
from te_passes.compat.untouched import polyfills as untouched, split as untouched_split
from te_passes.compat import table
from te_passes.compat.rows import ROWS


def install() -> bool:
    """Install every runtime hook (idempotent; ``te_inductor`` calls it on every compile, so classes and
    ops TE registers later are picked up). Returns whether TE's hooks are in place (``False`` while
    Transformer Engine is not imported yet; the backend's Dynamo start callback retries until then)."""
    fused_attn_op.install_fused_attention_op()  # our op family (TE's register_custom_op), before the lowering rows
    table.install(ROWS)  # the patch table (te_passes.compat.rows); the calls below are not rows yet
    untouched.install_untouched_polyfills()  # refusals kept per target: polyfill_status()
    settled = True
    # These rebind TE names (te.autocast's check, Linear's _linear_op, a recipe-state method) that a
    # trace may have read and guarded on: never while Dynamo compiles a frame (a backend call), only
    # at a compile's start or outside torch.compile; until then the start callback stays.
    if torch._guards.TracingContext.try_get() is None:
        untouched_split.install_split_polyfill()  # refusal kept: untouched_split.refused_reason()
    rows = {r.name for r in ROWS}  # a row waiting ("pending": TE not imported yet, or inside a trace) is retried
    settled = settled and not any(s.name in rows and not s.active and s.reason.startswith("pending")
                                  for s in table.status())
    return settled and all(m.installed() or m.refused_reason() is not None for m in (untouched_split,))
