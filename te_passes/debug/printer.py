"""TE-aware FX graph printing: TE op calls, bundles, quantizers and storages as readable fields.

See docs/internals.md#te_passesdebugprinterpy."""

from __future__ import annotations

import builtins
import contextvars
import enum
import functools
import operator
from typing import Any, Iterable, Mapping

import torch
import torch.fx
from torch.utils._dtype_abbrs import dtype_abbrs

from te_passes.ops.constants import hoisted_name
from te_passes.te import graph_model as gmod
from te_passes.te import graph_constants as gconst

INDENT = "    "


# --------------------------------------------------------------------------- values
def format_tensor_type(val: Any) -> str | None:
    """``"bf16[32, 64]"`` for a (fake) tensor ``val`` (symbolic sizes print as their
    expression, e.g. ``"bf16[s0, 64]"``); ``None`` for anything else."""
    if isinstance(val, torch.Tensor):
        shape = ", ".join(str(s) for s in val.shape)
        return f"{dtype_abbrs.get(val.dtype, str(val.dtype))}[{shape}]"
    return None


def node_value(node: torch.fx.Node) -> Any:
    """``node.meta['val']`` (AOT/Inductor graphs) or ``node.meta['example_value']`` (Dynamo
    graphs), or ``None``."""
    val = node.meta.get("val")
    return node.meta.get("example_value") if val is None else val


def node_type(node: torch.fx.Node) -> str | None:
    """The tensor type of the node's value (:func:`node_value`, :func:`format_tensor_type`)."""
    return format_tensor_type(node_value(node))


#: The graph whose nodes are being printed (:func:`format_node` / :func:`node_fields` set it):
#: hoisted constants' names are kept per graph (``runtime.ops.constants.NamedConstants``).
_PRINTING: contextvars.ContextVar[Any] = contextvars.ContextVar("te_passes_printing_graph", default=None)


def _of_node_graph(fn):
    """Run ``fn(node, ...)`` with :data:`_PRINTING` set to ``node``'s owning ``GraphModule``."""
    @functools.wraps(fn)
    def wrapper(node: torch.fx.Node, *args: Any, **kwargs: Any) -> Any:
        token = _PRINTING.set(getattr(node.graph, "owning_module", None))
        try:
            return fn(node, *args, **kwargs)
        finally:
            _PRINTING.reset(token)
    return wrapper


def constant_name(v: Any, owner: torch.fx.GraphModule | None = None) -> str | None:
    """The wrapper-global name of a TE constant that ``hoist_te_constants`` built once
    (``_te_const_<n>``) in post-grad graph ``owner`` (default: the graph being printed), or
    ``None``."""
    return hoisted_name(v, _PRINTING.get() if owner is None else owner)


def format_quantizer(q: Any) -> str:
    """``Float8CurrentScalingQuantizer(rowwise_usage, internal, dtype=DType.kFloat8E4M3,
    amax_epsilon=0.0)``: the quantizer's class and its value fields
    (:func:`te_passes.te.graph_constants.quantizer_fields`); boolean fields that are ``True`` are
    listed by name, ``False`` ones are left out, the others print as ``name=value``."""
    try:
        fields = gconst.quantizer_fields(q)
    except TypeError:
        return repr(q)
    body = ", ".join(k if v is True else f"{k}={format_value(v)}" for k, v in fields.items() if v is not False)
    name = constant_name(q)
    return f"{type(q).__name__}({body})" + (f" as {name}" if name else "")


def format_value(v: Any) -> str:
    """One-line text for an FX argument: nodes by name, TE objects by their fields, containers
    recursively, ``torch.dtype`` as ``torch.bfloat16``, enums as ``Type.MEMBER``, classes by
    name, everything else by ``repr``."""
    if isinstance(v, torch.fx.Node):
        return v.name
    kind = gconst.te_const_kind(v)
    if kind is gconst.TEConstKind.QUANTIZER:
        return format_quantizer(v)
    if kind is gconst.TEConstKind.BUNDLE:
        body = ", ".join(f"{k}={format_value(x)}" for k, x in gconst.bundle_dict(v).items())
        name = constant_name(v)
        return f"Bundle({body})" + (f" as {name}" if name else "")
    if isinstance(v, type):
        return v.__name__
    if isinstance(v, enum.Enum):
        return f"{type(v).__name__}.{v.name}"
    if isinstance(v, torch.dtype):
        return str(v)
    if isinstance(v, (torch.device, torch.Size)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(format_value(x) for x in v) + "]"
    if isinstance(v, tuple):
        inner = ", ".join(format_value(x) for x in v)
        return f"({inner},)" if len(v) == 1 else f"({inner})"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k!r}: {format_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, slice):
        return f"{format_value(v.start) if v.start is not None else ''}:" \
               f"{format_value(v.stop) if v.stop is not None else ''}" + \
               (f":{format_value(v.step)}" if v.step is not None else "")
    return repr(v)


def format_target(node: torch.fx.Node) -> str:
    """The callable a node calls, as source text: ``torch.ops.aten.detach.default``,
    ``operator.add``, a method name for ``call_method``, ``self.<path>`` for modules/attrs."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        ns, name = t._schema.name.split("::")
        return f"torch.ops.{ns}.{name}.{t._overloadname}"
    if isinstance(t, torch._ops.OpOverloadPacket):
        return "torch.ops." + t._qualified_op_name.replace("::", ".")
    if isinstance(t, str):
        return t if node.op == "call_method" else f"self.{t}"
    if getattr(builtins, getattr(t, "__name__", ""), None) is t:
        return t.__name__
    mod = getattr(t, "__module__", None) or ""
    name = getattr(t, "__qualname__", None) or getattr(t, "__name__", None) or repr(t)
    if mod in ("_operator", "operator"):
        mod = "operator"
    return f"{mod}.{name}" if mod else name


# --------------------------------------------------------------------------- TE op fields
def _storage_lines(field: gmod.TQField) -> list[tuple[str, str, str | None]]:
    """``(sub-field, value text, comment)`` rows of a quantized-storage field."""
    rows: list[tuple[str, str, str | None]] = []
    for b in field.buffers:
        t = node_type(b.node) if isinstance(b.node, torch.fx.Node) else None
        comment = b.role.value + (f" {t}" if t else "")
        rows.append((b.inner_name, format_value(b.node), comment))
    rows += [(k, format_value(v), None) for k, v in (field.meta.get("nontensor_kwargs") or {}).items()]
    rows += [(k, format_value(v), None) for k, v in field.meta.items()
             if k not in ("cls", "_inner_names", "nontensor_kwargs", gmod.TQ_KIND_KEY)]
    return rows


def _te_op_fields(call: gmod.TEOpCall) -> list[tuple[str, Any]]:
    """Logical fields of a decoded op call, in schema order:
    ``(name, ("tensor", value) | ("tq", TQField) | ("config", dict) | ("slot", value))``."""
    out: list[tuple[str, Any]] = []
    tq_slot_names = {f + suf for f in call.tq_fields for suf in (gmod.TQ_TENSORS_SUFFIX, gmod.TQ_META_SUFFIX)}
    for s in call.slots:
        if s.name in tq_slot_names:
            continue
        if s.name in call.tq_fields:
            out.append((s.name, ("tq", call.tq_fields[s.name])))
        elif s.kind is gmod.SlotKind.CONFIG:
            out.append(("config", ("config", call.config)))
        else:
            out.append((s.name, ("slot", s.value)))
    return out


def _grouped_config(config: Mapping[str, Any]) -> list[tuple[str, list[tuple[str, Any]]]]:
    groups: dict[str, list[tuple[str, Any]]] = {}
    order = [*gmod.CONFIG_FIELD_GROUPS, "other"]
    for k, v in config.items():
        groups.setdefault(gmod.config_field_group(k), []).append((k, v))
    return [(g, groups[g]) for g in order if g in groups]


@_of_node_graph
def node_fields(node: torch.fx.Node) -> dict[str, str]:
    """A node's printed fields as a flat ``{path: text}`` map (the unit of structured diffs)."""
    out: dict[str, str] = {"op": node.op, "target": format_target(node) if node.op != "output" else "output"}
    if node.op == "get_attr":
        out["value"] = format_value(_attr_value(node))
    if node.op == "output" and isinstance(node.args[0], (tuple, list)):
        for i, v in enumerate(node.args[0]):
            out[f"return[{i}]"] = format_value(v)
        return out
    call = _try_decode(node)
    if call is None:
        out["args"] = format_value(tuple(node.args))
        out["kwargs"] = format_value(dict(node.kwargs))
        return out
    for s in call.slots:
        if s.kind in (gmod.SlotKind.CONFIG, gmod.SlotKind.TQ_META):
            cname = constant_name(s.value) if not isinstance(s.value, torch.fx.Node) else s.value.name
            out[f"{s.name}.<constant>"] = cname or "inline"
    for name, (what, val) in _te_op_fields(call):
        if what == "config":
            for k, v in val.items():
                _put_field(out, f"config.{k}", v)
        elif what == "tq":
            if val.kind == "storage":
                out[name] = val.storage_cls or "storage"
                for sub, text, _ in _storage_lines(val):
                    out[f"{name}.{sub}"] = text
                if val.quantizer is not None:
                    _put_field(out, f"{name}.quantizer", val.quantizer)
            elif val.kind == "tensor":
                out[name] = format_value(val.tensor)
            else:
                out[name] = "None"
        else:
            out[name] = format_value(val)
    return out


def _attr_value(node: torch.fx.Node) -> Any:
    """The value a ``get_attr`` node reads, or ``None`` when the module lacks it."""
    value = gmod.slot_constant(node)
    return None if value is node else value


def _put_field(out: dict[str, str], path: str, v: Any) -> None:
    """``out[path]`` = the value's text; a quantizer is split into ``path`` (its class, and
    ``as <name>`` when hoisted) and one ``path.<value field>`` per field, so a diff names the
    flipped flag."""
    if gconst.te_const_kind(v) is gconst.TEConstKind.QUANTIZER:
        try:
            fields = gconst.quantizer_fields(v)
        except TypeError:
            fields = None
        if fields:
            name = constant_name(v)
            out[path] = type(v).__name__ + (f" as {name}" if name else "")
            for f, fv in fields.items():
                out[f"{path}.{f}"] = format_value(fv)
            return
    out[path] = format_value(v)


def _try_decode(node: torch.fx.Node) -> gmod.TEOpCall | None:
    if not gmod.is_te_op_node(node):
        return None
    try:
        return gmod.decode(node)
    except gmod.UnknownTEOp:
        return None


# --------------------------------------------------------------------------- graph
def _lhs(node: torch.fx.Node) -> str:
    t = node_type(node)
    return f'{node.name}: "{t}"' if t else node.name


def _with_comment(line: str, comment: str | None, width: int = 60) -> str:
    if not comment:
        return line
    return f"{line.ljust(width)}  # {comment}"


@_of_node_graph
def format_node(node: torch.fx.Node, notes: Iterable[str] = ()) -> list[str]:
    """Source lines (unindented) for one non-placeholder node; see docs/internals.md."""
    lines = [f"# <- {n}" for n in notes]
    if node.op == "output":
        ret = node.args[0]
        text = f"return {format_value(ret)}"
        if len(text) > 120 and isinstance(ret, (tuple, list)):  # one returned value per line
            lines.append("return (")
            lines.extend(f"{INDENT}{format_value(v)}," for v in ret)
            lines.append(")")
        else:
            lines.append(text)
        return lines
    if node.op == "get_attr":
        value = _attr_value(node)
        comment = format_value(value) if gconst.te_const_kind(value) is not None else None
        lines.append(_with_comment(f"{_lhs(node)} = self.{node.target}", comment, 0))
        return lines
    if gmod.is_te_op_node(node):
        try:
            return lines + _format_te_call(node, gmod.decode(node))
        except gmod.UnknownTEOp as e:
            lines.append(f"# te_passes: not decoded ({e})")
    args = [format_value(a) for a in node.args]
    args += [f"{k}={format_value(v)}" for k, v in node.kwargs.items()]
    if node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2 \
            and not node.kwargs:
        rhs = f"{args[0]}[{args[1]}]"
    elif node.op == "call_method":
        rhs = f"{args[0]}.{node.target}({', '.join(args[1:])})"
    else:
        rhs = f"{format_target(node)}({', '.join(args)})"
    lines.append(f"{_lhs(node)} = {rhs}")
    return lines


def _format_te_call(node: torch.fx.Node, call: gmod.TEOpCall) -> list[str]:
    direction = "backward" if call.is_backward else "forward"
    lines = [f"# {gmod.te_op_module(call.op)} {direction} ({gmod.TE_OP_NAMESPACE}::{call.op})",
             f"{_lhs(node)} = {format_target(node)}("]
    ind = INDENT
    for name, (what, val) in _te_op_fields(call):
        if what == "config":
            src = call.config_slot.value if call.config_slot is not None else None
            hoisted = f"  # {src.name} (hoisted constant)" if isinstance(src, torch.fx.Node) else ""
            if not hoisted and constant_name(src):
                hoisted = f"  # bundle hoisted as {constant_name(src)}"
            lines.append(f"{ind}config={{{hoisted}")
            for group, items in _grouped_config(val):
                lines.append(f"{ind}{INDENT}# {group}")
                for k, v in items:
                    lines.append(f"{ind}{INDENT}{k}={format_value(v)},")
            lines.append(f"{ind}}},")
        elif what == "tq":
            if val.kind == "storage":
                meta_slot = next((sl for sl in call.slots if sl.name == name + gmod.TQ_META_SUFFIX), None)
                cname = constant_name(meta_slot.value) if meta_slot is not None else None
                lines.append(f"{ind}{name}={val.storage_cls or 'QuantizedStorage'}(" +
                             (f"  # meta bundle hoisted as {cname}" if cname else ""))
                for sub, text, comment in _storage_lines(val):
                    lines.append(_with_comment(f"{ind}{INDENT}{sub}={text},", comment))
                lines.append(f"{ind}),")
            elif val.kind == "tensor":
                t = node_type(val.tensor) if isinstance(val.tensor, torch.fx.Node) else None
                lines.append(_with_comment(f"{ind}{name}={format_value(val.tensor)},",
                                           f"tensor {t}" if t else "tensor"))
            else:
                lines.append(f"{ind}{name}=None,")
        else:
            t = node_type(val) if isinstance(val, torch.fx.Node) else None
            lines.append(_with_comment(f"{ind}{name}={format_value(val)},", t))
    lines.append(")")
    return lines


def format_graph(gm: torch.fx.GraphModule | torch.fx.Graph, *, name: str = "GraphModule",
                 notes: Mapping[str, Iterable[str]] | None = None) -> str:
    """The whole graph as TE-aware Python-like source (see docs/internals.md).

    Args:
        gm: a ``GraphModule`` or a bare ``Graph``.
        name: the class name printed in the header.
        notes: ``{node name: [note, ...]}`` printed as ``# <- note`` above the node.

    Returns:
        The text, ending with a newline. Never raises for undecodable TE ops: they are printed
        generically with a ``# te_passes: not decoded (...)`` comment.
    """
    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    notes = notes or {}
    params = [_lhs(node) for node in graph.find_nodes(op="placeholder")]
    out = [f"# te_passes TE-aware printout: quantizers list their True flags by name (flags not listed are "
           f"False)", f"class {name}(torch.nn.Module):", f"{INDENT}def forward(self, {', '.join(params)}):"]
    for node in graph.nodes:
        if node.op == "placeholder":
            for n in notes.get(node.name, ()):
                out.append(f"{INDENT * 2}# <- {node.name}: {n}")
            continue
        for line in format_node(node, notes.get(node.name, ())):
            out.append(INDENT * 2 + line)
    return "\n".join(out) + "\n"

