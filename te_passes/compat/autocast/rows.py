"""The patch-table rows of the autocast capability (:class:`te_passes.compat.table.Row`), in install order.

See docs/internals.md#te_passescompatautocastrowspy."""

from __future__ import annotations

from te_passes.compat.autocast import amax_groups, recipe_state, traced_quantizers
from te_passes.compat.table import Row

ROWS: tuple[Row, ...] = (
    Row(name=amax_groups.ROW,
        target=f"{amax_groups.TE_LINEAR_MODULE}._linear_forward_impl / _linear_backward_impl",
        kind="rebind",
        why="an eager sequence-parallel te.Linear call leaves its ProcessGroup on the persistent quantizers "
            "(set_quantizer_amax_reduction_group), which TE rejects in a later trace; the wrappers give back the "
            "group and the usage flags the call found (compat.autocast.amax_groups / quantizer_usage)",
        drop_when="TE sets the amax-reduction group and usage flags per call on a copy, not on the module's "
                  "quantizers (TE 2.20 module/linear.py:448/1142/1150)",
        te="==2.20.*", torch=">=2.14,<2.16",
        plan=amax_groups.linear_impl_changes, after=amax_groups.release_at_install),
    Row(name=traced_quantizers.ROW,
        target=f"{traced_quantizers.TE_LINEAR_MODULE}.{traced_quantizers.TARGET}",
        kind="rebind",
        why="TE's compiled te.Linear path sets the usage flags of the module's value-opaque quantizers by grad mode "
            "at trace time and Dynamo guards on them: every train <-> no_grad switch recompiled (issue 42); in "
            "te_inductor traces the op gets per-call copies (compat.autocast.traced_quantizers)",
        drop_when="TE's compiled te.Linear op works on per-call quantizer copies (TE 2.20 module/linear.py:2559 "
                  "hands _linear_op the module's own objects)",
        te="==2.20.*", torch=">=2.14,<2.16", plan=traced_quantizers.plan),
    Row(name=recipe_state.TRACE_HOOKS_ROW,
        target="CustomOpDef._abstract_fn of every transformer_engine_compile forward op (torch._library.custom_ops)",
        kind="rebind",
        why="TE's impls read the te.autocast state (FP8GlobalStateManager) while they run; the fake kernel records "
            "the state where Dynamo traced each TE op so the compiled graph runs under it",
        drop_when="TE's compile ops take the recipe state as an argument instead of reading FP8GlobalStateManager "
                  "while they run (TE 2.20 module/linear.py), or torch offers a trace-time hook on custom ops",
        te="==2.20.*", torch=">=2.14,<2.16", plan=recipe_state.trace_hook_changes, sweep=True),
)
