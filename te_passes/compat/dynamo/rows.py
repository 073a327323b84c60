"""The patch-table rows of Dynamo (:class:`te_passes.compat.table.Row`), in install order.

``dynamo.keep_callbacks`` keeps te_passes' start / end callbacks registered over ``torch._dynamo.reset()``.
The toggles are Dynamo config values set only while a te_inductor frame is wrapped and traced (each is read
then: ``CheckpointHigherOrderVariable.__init__`` in torch/_dynamo/variables/higher_order_ops.py,
``variables/builder.py``), by :func:`te_passes.compat.dynamo.callbacks.on_compile_start`; the user's values
are back after every compile, other backends never see them. Why skipping the replay of TE's forward side
effects under activation checkpointing is safe: docs/usage.md "Training loop".
"""

from __future__ import annotations

from typing import Any

import torch

from te_passes.compat.dynamo.callbacks import clear_then_register, register_on
from te_passes.compat.table import Change, Rebind, Refused, Row, Toggle

#: The Dynamo config flag te_inductor's compiles run with for activation checkpointing.
CHECKPOINT_FLAG = "skip_fwd_side_effects_in_bwd_under_checkpoint"
_TORCH = ">=2.14,<2.16"


def _plan_keep_callbacks() -> list[Change]:
    handler = torch._dynamo.callback_handler
    clear = type(handler).__dict__.get("clear")
    if clear is None or not hasattr(handler, "start_callbacks") or not hasattr(handler, "end_callbacks"):
        raise Refused(f"{type(handler).__qualname__} has no clear() / start_callbacks / end_callbacks")
    return [Rebind(type(handler), "clear", clear_then_register(clear))]


def _register_callbacks() -> None:
    register_on(torch._dynamo.callback_handler)


def _toggle(short: str, name: str, value: Any, why: str, drop_when: str, scope: str = "te_inductor") -> Row:
    def plan() -> list[Change]:
        if not hasattr(torch._dynamo.config, name):
            raise Refused(f"torch._dynamo.config has no {name}")
        return [Toggle(torch._dynamo.config, name, value, scope)]
    where = "te_inductor compiles" if scope == "te_inductor" else "compiles inside a compile_step step"
    return Row(name=f"dynamo.{short}", target=f"torch._dynamo.config.{name} = {value!r} ({where})",
               kind="toggle", why=why, drop_when=drop_when, te="", torch=_TORCH, plan=plan)


ROWS: tuple[Row, ...] = (
    Row(name="dynamo.keep_callbacks", target="torch._dynamo.callback.CallbackHandler.clear", kind="rebind",
        why="torch._dynamo.reset() clears every start / end callback; te_passes' callback does TE's lazy init, "
            "the Dynamo config scope and the capture-state warning before a frame is traced",
        drop_when="torch keeps backend callbacks over reset() (or forwards backend_ctx_ctor from "
                  "torch.compile's wrapper)",
        te="", torch=_TORCH, plan=_plan_keep_callbacks, after=_register_callbacks),
    _toggle("checkpoint_side_effects", CHECKPOINT_FLAG, True,
            "torch.utils.checkpoint(te_module, ..., use_reentrant=False) otherwise stops Dynamo's checkpoint op at "
            "TE's first-forward fast_setattr (module/base.py prepare_forward: 'HOP: Unsafe side effect') and the "
            "region runs eagerly",
            "TE's prepare_forward sets no module attribute inside a checkpointed forward"),
    _toggle("specialize_float", "specialize_float", True,
            "dynamic=True makes the floats Dynamo reads symbolic (a quantizer's amax_epsilon, softmax_scale), which "
            "TE's custom ops must hold as constants in their OpaqueValueBundle",
            "TE's custom ops take symbolic floats"),
    _toggle("allow_ignore_mark_dynamic", "allow_ignore_mark_dynamic", True,
            "TE's fused-attention op holds max_seqlen as a constant: a sequence length the user marked dynamic is "
            "specialised under a guard (one graph per length) instead of ConstraintViolationError",
            "TE's FusedAttnFwdArgs takes a symbolic max_seqlen"),
    _toggle("trace_autograd_ops", "trace_autograd_ops", True,
            "te_passes.compile_step traces the whole training step: loss.backward() / torch.autograd.grad inside "
            "the compiled function (torch/_dynamo/variables/tensor.py method_backward)",
            "torch traces autograd ops by default", scope="step"),
)
