"""The one entry that installs te_passes' process-level integration (called by the backend).

:func:`install` puts in place, idempotently and process-wide:

* :func:`te_passes.runtime.ub_guard.install_te_ub_hooks` — guarded ``get_ub_is_fp8``,
  generation bump on ``initialize_ub`` / ``destroy_ub``;
* :func:`te_passes.runtime.amax_groups.install_amax_group_hooks` — TE Linear's per-call amax
  reduction groups released after each eager call, and a one-time sweep of live modules (issue 8);
* :func:`te_passes.runtime.free_op.register_inductor_lowering` — the Inductor lowering of our
  ``te_passes::free_storage`` op (``insert_early_frees`` only checks that it is there);
* :func:`te_passes.runtime.direct_lowering.install_lowerings` — the direct-call lowering of the base
  ops of every TE op family in ``torch._library.custom_ops.OPDEFS`` now (``call_te_impl_directly``
  only looks it up; families defined later are registered by the next call);
* :func:`te_passes.runtime.constants.wrap_te_constant_classes` — the ``__fx_repr__`` of TE's
  value-opaque constant classes answers a wrapper-global name inside its own graph's Inductor
  lowering (``hoist_te_constants``' named constants);
* :func:`te_passes.runtime.fused_attn_op.install_fused_attention_op` — TE's fused attention as the
  ``transformer_engine_compile::fused_attn`` family (TE 2.20.x only, ``TE_PASSES_FUSED_ATTN=0``
  switches it off; once TE's attention module is imported; refusals: ``refused_reason()``);
* :func:`te_passes.runtime.delayed_scaling.install_delayed_scaling` — DelayedScaling's scale update
  as the ``te_passes::delayed_scaling_update`` op and the te_inductor-gated replacements of TE's
  ``check_recipe_support`` / ``reduce_and_update_fp8_tensors`` (checked TE layout only; refusals:
  ``delayed_scaling.refused_reason()``); :func:`te_passes.runtime.delayed_linear.install_delayed_linear`
  — te.Linear's delayed-scaling calls as the ``te_passes::delayed_linear_fwd/bwd`` op pair.
* :func:`te_passes.runtime.recipe_state.install_trace_hooks` — TE op nodes record the
  ``te.autocast`` state where Dynamo traced them (the backend sets it around the compiled call).
* :func:`te_passes.runtime.untouched.install_untouched_polyfills` — polyfills of TE's disabled
  ``LayerNormLinear`` / ``LayerNormMLP`` / ``FusedAttention`` forwards, taken only by frames
  compiled for ``te_inductor`` (``te_passes.untouched``; per target: ``polyfill_status()``).

So no pass changes process-global state while it runs (tests/test_pass_purity.py). The TE parts
need TE imported; until then they are no-ops and :func:`install` returns ``False``.
"""

from __future__ import annotations

import torch

from te_passes.runtime import (constants, delayed_linear, delayed_scaling, direct_lowering, free_op, fused_attn_op,
                               recipe_state, untouched)
from te_passes.runtime.amax_groups import install_amax_group_hooks
from te_passes.runtime.ub_guard import install_te_ub_hooks


def install() -> bool:
    """Install every runtime hook (idempotent). Returns whether TE's hooks are in place (``False``
    while Transformer Engine is not imported yet; the backend's Dynamo start callback retries
    until then). The constant classes are wrapped on every call: TE registers a quantizer class
    when its module is imported, possibly after the hooks went in (``te_inductor`` calls this on
    every compile)."""
    free_op.register_inductor_lowering()  # failure is kept: lowering_error(); the pass then skips
    fused_attn_op.install_fused_attention_op()  # first, so the lowerings below cover its family; refusal kept
    direct_lowering.install_lowerings()  # refusals are kept: lowering_reason(); the pass then only retargets
    constants.wrap_te_constant_classes()
    recipe_state.install_trace_hooks()  # refusal kept: trace_hook_refusal(), graphs then refused
    untouched.install_untouched_polyfills()  # refusals kept per target: polyfill_status()
    settled = install_te_ub_hooks() & install_amax_group_hooks()
    # These rebind TE names (te.autocast's check, Linear's _linear_op, a recipe-state method) that a
    # trace may have read and guarded on: never while Dynamo compiles a frame (a backend call), only
    # at a compile's start or outside torch.compile; until then the start callback stays.
    if torch._guards.TracingContext.try_get() is None:
        delayed_scaling.install_delayed_scaling()  # refusal kept: delayed_scaling.refused_reason()
        delayed_linear.install_delayed_linear()  # refusal kept: delayed_linear.refused_reason()
    return settled and all(m.installed() or m.refused_reason() is not None for m in (delayed_scaling, delayed_linear))
