"""The one entry that installs te_passes' process-level integration (called by the backend).

See docs/internals.md#te_passescompatinstallpy."""

from __future__ import annotations

import torch

from te_passes.ops import constants, direct_lowering, free as free_op, fused_attn as fused_attn_op
from te_passes.compat.delayed_scaling import linear as delayed_linear, scaling as delayed_scaling
from te_passes.compat.autocast import recipe_state
from te_passes.compat.autocast.amax_groups import install_amax_group_hooks
from te_passes.compat.ub.guard import install_te_ub_hooks
from te_passes.compat import table
from te_passes.compat.rows import ROWS


def install() -> bool:
    """Install every runtime hook (idempotent; ``te_inductor`` calls it on every compile, so classes and
    ops TE registers later are picked up). Returns whether TE's hooks are in place (``False`` while
    Transformer Engine is not imported yet; the backend's Dynamo start callback retries until then)."""
    table.install(ROWS)  # the patch table (te_passes.compat.rows); the calls below are not rows yet
    free_op.register_inductor_lowering()  # failure is kept: lowering_error(); the pass then skips
    fused_attn_op.install_fused_attention_op()  # first, so the lowerings below cover its family; refusal kept
    direct_lowering.install_lowerings()  # refusals are kept: lowering_reason(); the pass then only retargets
    constants.wrap_te_constant_classes()
    recipe_state.install_trace_hooks()  # refusal kept: trace_hook_refusal(), graphs then refused
    settled = install_te_ub_hooks() & install_amax_group_hooks()
    # These rebind TE names (te.autocast's check, Linear's _linear_op, a recipe-state method) that a
    # trace may have read and guarded on: never while Dynamo compiles a frame (a backend call), only
    # at a compile's start or outside torch.compile; until then the start callback stays.
    if torch._guards.TracingContext.try_get() is None:
        delayed_scaling.install_delayed_scaling()  # refusal kept: delayed_scaling.refused_reason()
        delayed_linear.install_delayed_linear()  # refusal kept: delayed_linear.refused_reason()
    return settled and all(m.installed() or m.refused_reason() is not None
                           for m in (delayed_scaling, delayed_linear)) \
        and not any((s.reason or "").startswith("pending") for s in table.status())  # rows waiting for TE
