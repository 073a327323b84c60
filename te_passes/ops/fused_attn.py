"""TE's fused (cuDNN) attention as a ``register_custom_op`` op family.

See docs/internals.md#te_passesopsfused_attnpy."""

from __future__ import annotations

import threading
from typing import Any, Callable

from te_passes.te import version as te_version_mod
from te_passes.te.fused_attn import make_fakes
from te_passes.te.op_families import TE_OP_NAMESPACE

#: Family name: the four ops live in ``transformer_engine_compile``.
OP_NAME = "fused_attn"
#: ``FusedAttnFwdArgs`` fields that receive gradients, in ``_fused_attn_backward_impl``'s order.
GRAD_FIELDS: tuple[str, ...] = ("q", "k", "v", "attn_bias", "softmax_offset")


class FusedAttentionOpUnavailable(RuntimeError):
    """The fused-attention op is not (and will not be) registered; the message says why."""


_lock = threading.Lock()
_state: dict[str, Any] = {"forward_fn": None, "error": None}


def refused_reason() -> str | None:
    """Why the op cannot be used in this process now (wrong TE version, TE's registration failed), or
    ``None``. Checked on every call, also after registration. Whether a compile uses it is the option
    ``te_passes.fused_attn`` (``TE_PASSES_FUSED_ATTN``), read by its callers (compat/untouched)."""
    v = te_version_mod.te_version()
    if v is None:
        return "Transformer Engine is not installed"
    if not te_version_mod.is_supported(v):  # the TE series the graph model decodes (2.20.x)
        return (f"TE {v}: the fused-attention op wraps TE 2.20.x's FusedAttnFwdArgs / "
                "_fused_attn_forward_impl layout and its fakes mirror TE 2.20's kernels; not registered "
                "for other versions")
    return _state["error"]


def _register() -> Callable[[Any], Any]:
    """Define the ``fused_attn`` family through TE's ``register_custom_op`` (TE's FusedAttn args types and impls,
    our data-free fakes); returns its ``forward_fn``.

    Raises:
        FusedAttentionOpUnavailable: the op is already defined by someone else, TE lacks a piece
            (attention/dot_product_attention/backends.py, pytorch/dynamo), or TE's registration refused it."""
    import torch  # noqa: F401  (TE needs torch first)
    from torch._library.custom_ops import OPDEFS
    from transformer_engine.pytorch import dynamo as te_dynamo
    from transformer_engine.pytorch.attention.dot_product_attention import backends as b

    if f"{TE_OP_NAMESPACE}::{OP_NAME}" in OPDEFS:
        raise FusedAttentionOpUnavailable(f"{TE_OP_NAMESPACE}::{OP_NAME} is already defined by someone else; "
                                          "te_passes does not replace it")
    names = ("FusedAttnFwdArgs", "FusedAttnBwdArgs", "_fused_attn_forward_impl", "_fused_attn_setup_ctx",
             "_fused_attn_backward_impl")
    missing = [n for n in names if not hasattr(b, n)]
    if missing or not hasattr(te_dynamo, "register_custom_op"):
        raise FusedAttentionOpUnavailable(
            f"TE {te_version_mod.te_version()} lacks {missing or ['dynamo.register_custom_op']} "
            "(attention/dot_product_attention/backends.py, pytorch/dynamo)")
    fwd_fake, bwd_fake = make_fakes()
    fn = te_dynamo.register_custom_op(
        op_name=OP_NAME, input_tensors_for_grad=list(GRAD_FIELDS), fwd_arg_type=b.FusedAttnFwdArgs,
        fwd_impl=b._fused_attn_forward_impl, fwd_fake_impl=fwd_fake, setup_context=b._fused_attn_setup_ctx,
        bwd_arg_type=b.FusedAttnBwdArgs, bwd_impl=b._fused_attn_backward_impl, bwd_fake_impl=bwd_fake)
    if fn is None:
        raise FusedAttentionOpUnavailable("TE's register_custom_op refused the fused_attn family (see "
                                          "transformer_engine.pytorch.utils record_compile_disabled)")
    return fn


def install_fused_attention_op(*, import_te: bool = False) -> bool:
    """Register the ``fused_attn`` family once (idempotent, thread-safe; a failure is kept as
    :func:`refused_reason`); returns whether it is registered and usable. A no-op returning ``False`` while TE's
    attention module is not imported (unless ``import_te``) and on another TE version (:func:`refused_reason`).
    Its nodes record their te.autocast state through row ``autocast.trace_hooks`` (a sweep row)."""
    if refused_reason() is not None:
        return False
    if _state["forward_fn"] is not None:  # registered: no lock (Dynamo traces this through the polyfills)
        return True
    if te_version_mod.te_module("transformer_engine.pytorch.attention.dot_product_attention.backends",
                                import_te=import_te) is None:
        return False
    with _lock:
        if _state["forward_fn"] is None and _state["error"] is None:
            try:
                _state["forward_fn"] = _register()
            except FusedAttentionOpUnavailable as e:
                _state["error"] = str(e)
    return _state["forward_fn"] is not None


def fused_attention_op() -> Callable[[Any], Any]:
    """TE's ``forward_fn`` of the ``fused_attn`` family, registering it if needed (imports TE).

    Raises:
        FusedAttentionOpUnavailable: :func:`refused_reason` (TE version, registration).
    """
    install_fused_attention_op(import_te=True)
    reason = refused_reason()
    if reason is None and _state["forward_fn"] is None:
        reason = "TE's attention module could not be imported"
    if reason is not None:
        raise FusedAttentionOpUnavailable(f"TE fused-attention op unavailable: {reason}")
    return _state["forward_fn"]
