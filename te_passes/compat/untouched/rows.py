"""The patch-table rows of the untouched-model polyfills (:class:`te_passes.compat.table.Row`), in install order:
one row per TE function substituted in Dynamo's traces or TE name rebound (docs/untouched.md).

Each plan waits ("pending", retried at the next install) while TE's module is not imported, refuses with the
reason when TE's object is not the one mirrored (another closure layout, TE ships its own compiled op), and
keeps TE's own function for the replacement's fallback (other backends, eager, the named islands). Every
row's ``after`` registers TE's fused-attention op the attention polyfills call (TE's first-forward lazy init at
a compile start, :func:`te_passes.compat.untouched.state.on_compile_start`, is run by te_passes' one Dynamo
start callback, :mod:`te_passes.compat.dynamo.callbacks`)."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any, Callable, Sequence

import torch

from te_passes.compat.table import Change, Rebind, Refused, Row, Substitute
from te_passes.compat.untouched import forward_state, polyfills, rope_norm, split
from te_passes.compat.untouched.state import EAGER_ROW
from te_passes.ops.fused_attn import install_fused_attention_op

TE = "==2.20.*"
TORCH = ">=2.14,<2.16"
_TE_ROOT = "transformer_engine.pytorch"
#: TE's compiled ops (TE#3534 / TE#3472) that make a forward's polyfill unnecessary.
TE_OWN_OPS: dict[str, tuple[str, ...]] = {
    "LayerNormLinear.forward": ("layernorm_linear",), "LayerNormMLP.forward": ("layernorm_mlp",),
    "FusedAttention.forward": ("fused_attention", "dot_product_attention"),
    "DotProductAttention.forward": ("fused_attention", "dot_product_attention"),
}


def _te_module(modname: str) -> Any:
    """TE's module ``modname``, imported once TE's PyTorch package is; raises :class:`Refused` ("pending")
    before that (the row is retried at the next install)."""
    if _TE_ROOT not in sys.modules:
        raise Refused(f"pending: {_TE_ROOT} is not imported yet")
    return importlib.import_module(modname)


def te_ships_op(target: str) -> str | None:
    """Why TE's own compiled op makes the polyfill of ``target`` unnecessary, or ``None``."""
    from torch._library.custom_ops import OPDEFS

    for op in OPDEFS:
        ns, _, name = op.partition("::")
        if ns == "transformer_engine_compile" and name in TE_OWN_OPS[target]:
            return f"TE ships its own op {op}: stepping aside"
    return None


def _forward_plan(target: str) -> Callable[[], Sequence[Change]]:
    def plan() -> Sequence[Change]:
        modname, cls_name, _ = polyfills.TARGETS[target]
        cls = getattr(_te_module(modname), cls_name)
        why = te_ships_op(target)
        layout = polyfills.closure_layout(cls.forward) if why is None else why
        if isinstance(layout, str):
            raise Refused(layout)
        disabled_f, f = layout
        polyfills.keep_te_function(target, disabled_f, f)
        return [Substitute(disabled_f, polyfills.POLYFILLS[target])]
    return plan


def _function_plan(modname: str, name: str) -> Callable[[], Sequence[Change]]:
    def plan() -> Sequence[Change]:
        orig = getattr(_te_module(modname), name, None)
        if not isinstance(orig, types.FunctionType):
            raise Refused(f"{modname} has no {name} function")
        polyfills.keep_te_function(name, orig, orig)
        return [Substitute(orig, polyfills.POLYFILLS[name])]
    return plan


def _rope_plan() -> Sequence[Change]:
    orig = getattr(_te_module(rope_norm.ROPE_MODULE), rope_norm.ROPE_TARGET)
    if not isinstance(orig, types.FunctionType):
        raise Refused(f"{rope_norm.ROPE_MODULE}.{rope_norm.ROPE_TARGET} is {orig!r}, not TE's function")
    rope_norm.keep_rope(orig)
    return [Substitute(orig, rope_norm.rope_polyfill)]


def _norm_plan(modname: str, cls_name: str) -> Callable[[], Sequence[Change]]:
    def plan() -> Sequence[Change]:
        cls = getattr(_te_module(modname), cls_name)
        from transformer_engine.pytorch.ops.op import BasicOperation

        base = BasicOperation.__dict__.get("forward")
        if not isinstance(base, types.FunctionType) or cls.forward is not base:
            raise Refused(f"{modname}.{cls_name}.forward is not BasicOperation.forward (TE changed it)")
        rope_norm.keep_norm(cls, cls_name, base)
        return [Rebind(cls, "forward", rope_norm.te_ops_norm_forward)]
    return plan


def _split_plan() -> Sequence[Change]:
    mha = sys.modules.get(split.TE_MHA_MODULE)
    if mha is None:
        raise Refused(f"pending: {split.TE_MHA_MODULE} is not imported yet")
    te_split = getattr(mha, "SplitAlongDim", None)
    if not (isinstance(te_split, type) and issubclass(te_split, torch.autograd.Function)):
        raise Refused(f"{split.TE_MHA_MODULE}.SplitAlongDim is {te_split!r}, not TE's autograd.Function")
    split.TE_SPLIT[:] = [te_split]
    return [Rebind(mha, "SplitAlongDim", split.GraphSplitAlongDim)]


def _prepare_forward_plan() -> Sequence[Change]:
    base = _te_module(forward_state.TE_BASE_MODULE)
    cls = getattr(base, "TransformerEngineBaseModule", None)
    orig = cls.__dict__.get("prepare_forward") if isinstance(cls, type) else None
    if not isinstance(orig, types.FunctionType):
        raise Refused(f"{forward_state.TE_BASE_MODULE}.{forward_state.TARGET} is {orig!r}, not TE's function")
    forward_state.keep_te_function(orig)
    return [Rebind(cls, "prepare_forward", forward_state.prepare_forward)]


def _eager_flag_plan() -> Sequence[Change]:
    import torch.compiler as tc

    if not isinstance(getattr(tc, "_is_compiling_flag", None), bool):
        raise Refused("torch.compiler has no _is_compiling_flag: TE's eager-only first-forward code cannot run "
                      "from a compile-start callback or a comptime body")
    return []  # the write is scoped: state.run_eager sets it around TE's eager calls while this row is active


def _after() -> None:
    install_fused_attention_op(import_te=True)  # the attention polyfills' op (refusal: its refused_reason())


def _row(name: str, target: str, kind: str, why: str, drop_when: str, plan: Callable[[], Sequence[Change]],
         te: str = TE, after: Callable[[], None] | None = _after) -> Row:
    return Row(name=name, target=target, kind=kind, why=why, drop_when=drop_when, te=te, torch=TORCH, plan=plan,
               after=after)


_DISABLED = "TE's forward is torch.compiler.disable'd (a graph break per call)"
ROWS: tuple[Row, ...] = (
    _row("untouched.layernorm_linear_forward", f"{_TE_ROOT}.module.layernorm_linear.LayerNormLinear.forward",
         "substitute", f"{_DISABLED}: in te_inductor frames norm + a hidden te.Linear",
         "TE#3534 (LayerNormLinear compile support) lands", _forward_plan("LayerNormLinear.forward")),
    _row("untouched.layernorm_mlp_forward", f"{_TE_ROOT}.module.layernorm_mlp.LayerNormMLP.forward",
         "substitute", f"{_DISABLED}: in te_inductor frames norm + hidden fc1 / fc2 te.Linears",
         "TE#3534 (LayerNormMLP compile support) lands", _forward_plan("LayerNormMLP.forward")),
    _row("untouched.fused_attention_forward",
         f"{_TE_ROOT}.attention.dot_product_attention.backends.FusedAttention.forward", "substitute",
         f"{_DISABLED}: in te_inductor frames TE's fused_attn op",
         "TE#3472 (fused attention compile support) lands", _forward_plan("FusedAttention.forward")),
    _row("untouched.dot_product_attention_forward",
         f"{_TE_ROOT}.attention.dot_product_attention.dot_product_attention.DotProductAttention.forward",
         "substitute", "TE's backend selection and lazy state recompile: in te_inductor frames the fused_attn op "
         "for the calls it expresses", "TE#3472 (fused attention compile support) lands",
         _forward_plan("DotProductAttention.forward")),
    _row("untouched.get_default_fp8_recipe", f"{_TE_ROOT}.quantization.get_default_fp8_recipe", "substitute",
         "TE asserts it is not called while compiling (te.autocast without recipe=): built once eagerly",
         "TE builds the default recipe without the is_compiling assertion",
         _function_plan(f"{_TE_ROOT}.quantization", "get_default_fp8_recipe")),
    _row("untouched.noop_cat", f"{_TE_ROOT}.module._common.noop_cat", "substitute",
         "_NoopCatFunc compares storages / data_ptrs (a graph break): torch.cat in te_inductor frames",
         "TE's noop_cat is traceable", _function_plan(f"{_TE_ROOT}.module._common", "noop_cat")),
    _row("untouched.apply_rotary_pos_emb", f"{rope_norm.ROPE_MODULE}.{rope_norm.ROPE_TARGET}", "substitute",
         "FusedRoPEFunc's pybind kernels break the graph: te_passes::te_rope_fwd in te_inductor frames",
         "TE registers its fused RoPE as a custom op", _rope_plan),
    *(_row(f"untouched.{cls_name.lower()}_forward", f"{modname}.{cls_name}.forward", "rebind",
           f"{te_name} inherits BasicOperation.forward (OperationFuser + pybind kernels; Dynamo inlines a "
           "module's forward, substitute_in_graph is never consulted): te_passes::te_ops_norm_fwd in te_inductor "
           "frames", "TE's te.ops norms compile (custom ops)", _norm_plan(modname, cls_name))
      for modname, cls_name, te_name in rope_norm.NORM_CLASSES),
    _row("untouched.split_along_dim", f"{split.TE_MHA_MODULE}.SplitAlongDim", "rebind",
         "an autograd.Function whose backward compares data_ptrs (a graph break) and whose strided outputs send "
         "DotProductAttention to its eager island: torch.split in te_inductor frames",
         "TE's SplitAlongDim is traceable", _split_plan),
    _row("untouched.prepare_forward", f"{forward_state.TE_BASE_MODULE}.{forward_state.TARGET}", "rebind",
         "TE reads self.fp8 / fp8_initialized / fp8_meta['recipe'] / activation_dtype before prepare_forward writes "
         "the te.autocast state of the call: Dynamo guards on the values of the state before the frame (prepared "
         "at compile start with the te.autocast active then), a recompile on step 2 when the frame runs the module "
         "under another state (te.autocast inside the compiled function, a nested enabled=False LM head): in "
         "te_inductor frames TE's lazy init runs eagerly with the traced state first (issue 38), the call's fp8 flag "
         "is written before TE reads the previous call's, and a call without fp8 keeps fp8_initialized (fp8 and "
         "bf16 calls alternating recompiled every call); a rebind: Dynamo inlines a method found on the class, "
         "substitute_in_graph is never consulted",
         "TE's prepare_forward writes the te.autocast state before reading it (or Dynamo stops guarding on values "
         "the frame overwrites)", _prepare_forward_plan, after=None),
    _row(EAGER_ROW, "torch.compiler._is_compiling_flag (scoped: state.run_eager)", "toggle",
         "TE's first-forward lazy init (and get_default_fp8_recipe) asserts not is_compiling(); run from a "
         "compile-start callback / comptime body inside Dynamo's compile session, it needs False for the block",
         "torch exposes a way to run eager code inside a compile session (or TE's init stops asserting)",
         _eager_flag_plan, te="", after=None),
)
