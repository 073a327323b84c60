"""The TE graph model: the one module that knows what TE ops and constants look like in FX graphs.

See docs/internals.md#te_passestegraph_modelpy."""

from __future__ import annotations

import dataclasses
import enum
import functools
import operator
from typing import Any

import torch
import torch.fx

from te_passes.fx.graph import UNKNOWN, get_attr_path, op_qualname
from te_passes.te.op_families import (  # noqa: F401 - names of the TE op namespace, re-exported
    CONFIG_SLOT, KNOWN_OPS, TE_OP_NAMESPACE, TQ_META_SUFFIX, TQ_TENSORS_SUFFIX, UnknownTEOp, te_op_family)
from te_passes.te.graph_constants import TEConstKind, bundle_dict, is_bundle, te_const_kind
from te_passes.te.version import is_supported, te_version

TQ_KIND_KEY = "__kind__"


class SlotKind(str, enum.Enum):
    """What a schema slot of a TE op carries."""

    TENSOR = "tensor"            # plain Tensor / Tensor? field, or the tensor part of a TQ field
    TQ_TENSORS = "tq_tensors"    # Tensor[]: a quantized storage's buffers
    TQ_META = "tq_meta"          # OpaqueValueBundle: __kind__ (+ storage flatten context)
    CONFIG = "config"            # OpaqueValueBundle: the simple fields (``_simple_meta``)
    TENSOR_LIST = "tensor_list"  # any other Tensor[] slot
    OTHER = "other"


class BufferRole(str, enum.Enum):
    """Role of one buffer of a TE quantized tensor (from its ``_INNER_TENSORS`` attribute name)."""

    ROWWISE_DATA = "rowwise_data"
    COLUMNWISE_DATA = "columnwise_data"          # FP8 ``_transpose``; MXFP8/NVFP4/block ``_columnwise_data``
    SCALE_INV = "scale_inv"                      # FP8 per-tensor ``_scale_inv``
    ROWWISE_SCALE_INV = "rowwise_scale_inv"
    COLUMNWISE_SCALE_INV = "columnwise_scale_inv"
    AMAX_ROWWISE = "amax_rowwise"
    AMAX_COLUMNWISE = "amax_columnwise"
    UNKNOWN = "unknown"


#: ``QuantizedTensorStorage._INNER_TENSORS`` attribute names (``tensor/storage/*_tensor_storage.py``) -> role.
INNER_NAME_ROLES: dict[str, BufferRole] = {
    "_data": BufferRole.ROWWISE_DATA,
    "_transpose": BufferRole.COLUMNWISE_DATA,
    "_scale_inv": BufferRole.SCALE_INV,
    "_rowwise_data": BufferRole.ROWWISE_DATA,
    "_columnwise_data": BufferRole.COLUMNWISE_DATA,
    "_rowwise_scale_inv": BufferRole.ROWWISE_SCALE_INV,
    "_columnwise_scale_inv": BufferRole.COLUMNWISE_SCALE_INV,
    "_amax_rowwise": BufferRole.AMAX_ROWWISE,
    "_amax_columnwise": BufferRole.AMAX_COLUMNWISE,
}

#: Userbuffers overlap flags of the config bundle per op (``module/linear.py`` ``LinearFwdArgs`` /
#: ``LinearBwdArgs``; the backward's ``ub_overlap_ag`` is the forward's ``ub_overlap_ag_dgrad``).
UB_FLAGS: dict[str, tuple[str, ...]] = {
    "linear": ("ub_overlap_ag_fprop", "ub_overlap_rs_fprop", "ub_overlap_ag_dgrad",
               "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad"),
    "linear_backward": ("ub_overlap_ag", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad"),
}
#: Every config-bundle key of :data:`UB_FLAGS`, forward's first.
UB_CONFIG_KEYS: tuple[str, ...] = tuple(dict.fromkeys(k for flags in UB_FLAGS.values() for k in flags))

#: Config-bundle field groups, in display order (``module/linear.py`` ``LinearFwdArgs`` / ``LinearBwdArgs``).
CONFIG_FIELD_GROUPS: dict[str, tuple[str, ...]] = {
    "quantizers": (),
    "precision": ("activation_dtype", "fp8", "fp8_calibration", "fp8_output", "custom", "debug",
                  "dgrad_use_split_accumulator", "wgrad_use_split_accumulator",
                  "backward_override", "is_weight_param_quantized", "save_original_input",
                  "reduce_and_update_bwd_fp8_tensors"),
    "autograd": ("input_requires_grad", "weight_requires_grad", "bias_requires_grad",
                 "requires_dgrad", "requires_wgrad", "use_bias", "is_grad_enabled", "owns_input",
                 "inp_shape"),
    "weights": ("is_first_microbatch", "cache_weight", "skip_fp8_weight_update",
                "fuse_wgrad_accumulation", "origin_weight_overwrites_main_grad", "cpu_offloading"),
    "parallel": ("parallel_mode", "tp_group", "tp_size", "tensor_parallel", "sequence_parallel",
                 "symmetric_ar_type", "backward_input_needs_gather", "is_fsdp2"),
    "userbuffers": ("ub_name", *UB_CONFIG_KEYS),
}


def config_field_group(field: str) -> str:
    """The :data:`CONFIG_FIELD_GROUPS` group of a config-bundle field (``"other"`` if unknown)."""
    if field.endswith("_quantizer"):
        return "quantizers"
    for group, names in CONFIG_FIELD_GROUPS.items():
        if field in names:
            return group
    return "other"


def te_op_module(op: str) -> str:
    """``"te.Linear"`` for ``"linear"``/``"linear_backward"``/``"linear_base"``; else the op name itself."""
    return "te.Linear" if op.removesuffix("_base").removesuffix("_backward") == "linear" else op


def te_op_name(node: torch.fx.Node) -> str | None:
    """``"linear"`` for a node calling ``torch.ops.transformer_engine_compile.linear[.default]``, else ``None``."""
    ns, _, name = ((op_qualname(node.target) if node.op == "call_function" else None) or "").partition("::")
    return name if ns == TE_OP_NAMESPACE else None


def is_te_op_node(node: torch.fx.Node) -> bool:
    """Whether ``node`` calls any ``transformer_engine_compile`` op."""
    return te_op_name(node) is not None


def _schema_of(target: Any) -> torch._C.FunctionSchema:
    return (target.default if isinstance(target, torch._ops.OpOverloadPacket) else target)._schema


@dataclasses.dataclass
class Slot:
    """One schema argument of a TE op call; ``value`` is the FX argument (Node(s), bundle or constant)."""

    name: str
    kind: SlotKind
    index: int
    value: Any


@dataclasses.dataclass
class QuantizedBuffer:
    """One buffer of a quantized tensor field: its FX ``node``, ``role``, storage attribute and class."""

    node: torch.fx.Node
    role: BufferRole
    inner_name: str
    field: str
    storage_cls: str


@dataclasses.dataclass
class TQField:
    """A decoded tensor-or-quantized field."""

    name: str
    kind: str
    tensor: torch.fx.Node | None = None
    buffers: list[QuantizedBuffer] = dataclasses.field(default_factory=list)
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def storage_cls(self) -> str | None:
        cls = self.meta.get("cls")
        return getattr(cls, "__name__", None) if cls is not None else None

    @property
    def quantizer(self) -> Any:
        return self.meta.get("nontensor_kwargs", {}).get("quantizer")


@dataclasses.dataclass
class TEOpCall:
    """A decoded ``transformer_engine_compile`` op node."""

    node: torch.fx.Node
    op: str
    slots: list[Slot]
    tensors: dict[str, torch.fx.Node | None]
    tq_fields: dict[str, TQField]
    config: dict[str, Any]
    config_slot: Slot | None

    @property
    def is_backward(self) -> bool:
        return "backward" in self.op

    @property
    def module_kind(self) -> str:
        """The TE module the op implements: ``"linear"`` for ``linear``/``linear_backward``."""
        return self.op.removesuffix("_base").removesuffix("_backward")

    def quantized_buffers(self) -> list[QuantizedBuffer]:
        """Every quantized-storage buffer the op takes, in slot order."""
        return [b for f in self.tq_fields.values() for b in f.buffers]

    def quantizers(self) -> dict[str, Any]:
        """Quantizer objects in the config bundle, ``{field: quantizer}`` (``None`` ones omitted)."""
        return {k: v for k, v in self.config.items() if te_const_kind(v) is TEConstKind.QUANTIZER}

    def ub_config(self) -> dict[str, Any]:
        """``ub_name`` and the ``ub_*`` overlap flags from the config bundle (present keys only)."""
        return {k: self.config[k] for k in CONFIG_FIELD_GROUPS["userbuffers"] if k in self.config}

    def uses_ub(self) -> bool:
        """Whether any Userbuffers overlap flag is set."""
        return any(bool(self.config.get(k)) for k in UB_CONFIG_KEYS)


@functools.lru_cache(maxsize=None)
def _schema_slots(schema: torch._C.FunctionSchema) -> tuple[tuple[str, "SlotKind", Any], ...]:
    """``((name, SlotKind, torch._C.Argument), ...)`` of ``schema``, derived once per schema."""
    return tuple((a.name, _slot_kind(a), a) for a in schema.arguments)


def _slot_kind(arg: torch._C.Argument) -> SlotKind:
    name, t = arg.name, str(arg.type)
    if name == CONFIG_SLOT:
        return SlotKind.CONFIG
    if name.endswith(TQ_META_SUFFIX):
        return SlotKind.TQ_META
    if name.endswith(TQ_TENSORS_SUFFIX):
        return SlotKind.TQ_TENSORS
    if t in ("Tensor", "Tensor?", "Optional[Tensor]"):
        return SlotKind.TENSOR
    if t.startswith("Tensor[]") or t == "List[Tensor]":
        return SlotKind.TENSOR_LIST
    return SlotKind.OTHER


def slot_constant(value: Any) -> Any:
    """A slot's constant value: ``value`` itself, or for a ``get_attr`` node (a constant hoisted
    by ``hoist_te_constants``) the attribute it reads; other nodes are returned unchanged."""
    if isinstance(value, torch.fx.Node) and value.op == "get_attr":
        obj = get_attr_path(value.graph.owning_module, str(value.target))
        return value if obj is UNKNOWN else obj
    return value


def decode(node: torch.fx.Node) -> TEOpCall:
    """Decode a ``transformer_engine_compile`` op node into a :class:`TEOpCall`. Raises
    :class:`UnknownTEOp` for a non-TE node, an op in no ``register_custom_op`` family or with a
    schema TE's arg plan does not produce, an unsupported TE version, or mismatching arguments."""
    op = te_op_name(node)
    if op is None:
        raise UnknownTEOp(f"node {node.name} does not call a {TE_OP_NAMESPACE} op (target {node.target})")
    if (v := te_version()) is not None and not is_supported(v):
        raise UnknownTEOp(f"TE {v} is not a version te_passes decodes (supported: 2.20.x)")
    if op not in KNOWN_OPS:
        try:
            te_op_family(op)
        except UnknownTEOp as e:
            raise UnknownTEOp(f"node {node.name}: {e}") from None
    sargs = _schema_slots(_schema_of(node.target))
    if len(node.args) > len(sargs):
        raise UnknownTEOp(f"node {node.name}: {len(node.args)} args for {op} whose schema has {len(sargs)}")
    values = list(node.args) + [node.kwargs.get(name, arg.default_value) for name, _, arg in sargs[len(node.args):]]
    slots = [Slot(name, kind, i, v) for i, ((name, kind, _), v) in enumerate(zip(sargs, values))]
    by_name = {s.name: s for s in slots}

    tensors: dict[str, Any] = {}
    tq: dict[str, TQField] = {}
    config: dict[str, Any] = {}
    config_slot = None
    for s in slots:
        if s.kind is SlotKind.CONFIG:
            cfg = slot_constant(s.value)
            if not is_bundle(cfg):
                raise UnknownTEOp(f"node {node.name}: config slot {s.name} holds {type(cfg).__name__}, not a bundle")
            config, config_slot = bundle_dict(cfg), s
        elif s.kind is SlotKind.TQ_META:
            field = s.name[: -len(TQ_META_SUFFIX)]
            tq[field] = _decode_tq(node, field, by_name, s)
    for s in slots:
        if s.kind is SlotKind.TENSOR and s.name not in tq:
            tensors[s.name] = s.value
    return TEOpCall(node, op, slots, tensors, tq, config, config_slot)


def _decode_tq(node: torch.fx.Node, field: str, by_name: dict[str, Slot], meta_slot: Slot) -> TQField:
    tslot = by_name.get(field)
    bslot = by_name.get(field + TQ_TENSORS_SUFFIX)
    meta_value = slot_constant(meta_slot.value)
    if tslot is None or bslot is None or not is_bundle(meta_value):
        raise UnknownTEOp(f"node {node.name}: tensor-or-quantized field {field!r} lacks its slot triple")
    meta = bundle_dict(meta_value)
    kind_v = meta.get(TQ_KIND_KEY)
    kind = str(getattr(kind_v, "value", kind_v)).lower()
    if kind not in ("none", "tensor", "storage"):
        raise UnknownTEOp(f"node {node.name}: field {field!r} has unknown __kind__ {kind_v!r}")
    out = TQField(field, kind, meta=meta)
    if kind == "tensor":
        out.tensor = tslot.value
    elif kind == "storage":
        names = list(meta.get("_inner_names", []))
        bufs = list(bslot.value or [])
        if len(names) != len(bufs):
            raise UnknownTEOp(f"node {node.name}: field {field!r} has {len(bufs)} buffers for inner names {names}")
        cls_name = out.storage_cls or "?"
        for n, b in zip(names, bufs):
            out.buffers.append(QuantizedBuffer(b, INNER_NAME_ROLES.get(n, BufferRole.UNKNOWN), n, field, cls_name))
    return out


def te_op_calls(graph: torch.fx.Graph, *, unknown: list[str] | None = None) -> list[TEOpCall]:
    """Decode every TE op node of ``graph`` in order; undecodable ones are skipped with their
    :class:`UnknownTEOp` message appended to ``unknown`` when given, else the first one is raised."""
    out = []
    for node in graph.nodes:
        if not is_te_op_node(node):
            continue
        try:
            out.append(decode(node))
        except UnknownTEOp as e:
            if unknown is None:
                raise
            unknown.append(str(e))
    return out


def output_getitems(node: torch.fx.Node) -> dict[int, torch.fx.Node]:
    """``{index: getitem node}`` for a multi-output node (TE ops return ``Tensor[]``)."""
    return {u.args[1]: u for u in node.users
            if u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int)}
