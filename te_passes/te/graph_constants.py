"""TE Python objects as FX graph constants: which kind a constant is and what it holds.

See docs/internals.md#te_passestegraph_constantspy."""

from __future__ import annotations

import enum
import functools
from typing import Any, Iterator

import torch.fx

from te_passes.fx.graph import PLAIN_TYPES, UNKNOWN, get_attr_path


def is_te_object(obj: Any) -> bool:
    """Whether ``obj`` (or the class ``obj``) is defined inside ``transformer_engine``."""
    t = obj if isinstance(obj, type) else type(obj)
    return (getattr(t, "__module__", "") or "").startswith("transformer_engine")


def mro_names(obj: Any) -> set[str]:
    """The class names in the MRO of ``obj`` (or of the class ``obj``)."""
    t = obj if isinstance(obj, type) else type(obj)
    return {k.__name__ for k in getattr(t, "__mro__", ())}


class TEConstKind(str, enum.Enum):
    """Kinds of TE Python objects that appear as constants in FX graphs."""

    BUNDLE = "bundle"        # dynamo.custom_op.OpaqueValueBundle
    QUANTIZER = "quantizer"  # quantized_tensor.Quantizer subclasses (value-opaque constants)
    STORAGE = "storage"      # QuantizedTensorStorage subclasses (classes, in bundles' ``cls``)
    RECIPE = "recipe"        # common.recipe.Recipe subclasses
    ENUM = "enum"            # TE enums (``_TensorOrQuantizedKind``, ``DType``, ...)
    OTHER = "other"


def te_const_kind(obj: Any) -> TEConstKind | None:
    """Classify a graph constant as a TE object kind, or ``None`` if it is not TE's."""
    return _class_kind(obj, True) if isinstance(obj, type) else _class_kind(type(obj), False)


@functools.lru_cache(maxsize=None)
def _class_kind(cls: type, is_class: bool) -> TEConstKind | None:
    """The kind of the class ``cls`` itself (``is_class``) or of its instances: it depends only on these."""
    if not is_te_object(cls):
        return None
    names = mro_names(cls)
    if "OpaqueValueBundle" in names:
        return TEConstKind.BUNDLE
    if "Quantizer" in names:
        return TEConstKind.QUANTIZER
    if "QuantizedTensorStorage" in names:
        return TEConstKind.STORAGE
    if "Recipe" in names:
        return TEConstKind.RECIPE
    if not is_class and issubclass(cls, enum.Enum):
        return TEConstKind.ENUM
    return TEConstKind.OTHER


def is_bundle(obj: Any) -> bool:
    """Whether ``obj`` is TE's ``OpaqueValueBundle``."""
    return te_const_kind(obj) is TEConstKind.BUNDLE


def bundle_dict(obj: Any) -> dict[str, Any]:
    """The ``{name: value}`` mapping inside an ``OpaqueValueBundle`` (a shallow copy).

    Raises:
        TypeError: ``obj`` is not a bundle.
    """
    if not is_bundle(obj):
        raise TypeError(f"not a TE OpaqueValueBundle: {type(obj).__qualname__}")
    return obj.as_dict()


def quantizer_fields(q: Any) -> dict[str, Any]:
    """A quantizer's value fields ``{name: value}``: its ``_value_fields()`` (TE
    ``dynamo/quantizer_opaque.py`` ``register_value_opaque_quantizer``; read by getattr, so
    ``dtype`` stays TE's ``DType``), else the public attributes TE quantizers carry.
    Raises ``TypeError`` for non-quantizers."""
    if te_const_kind(q) is not TEConstKind.QUANTIZER:
        raise TypeError(f"not a TE quantizer: {type(q).__qualname__}")
    value_fields = getattr(q, "_value_fields", None)
    names = (value_fields() if callable(value_fields) else None) or (
        "rowwise_usage", "columnwise_usage", "internal", "optimize_for_gemm", "dtype",
        "with_amax_reduction", "force_pow_2_scales", "amax_epsilon", "block_scaling_dim")
    return {k: getattr(q, k) for k in names if hasattr(q, k)}


def te_reduce(obj: Any) -> tuple[Any, tuple[Any, ...]] | None:
    """A pickle ``__reduce__`` pair ``(rebuild, args)`` that rebuilds a TE graph constant by value."""
    if isinstance(obj, type):  # classes pickle by reference
        return None
    kind = te_const_kind(obj)
    if kind is TEConstKind.BUNDLE:
        return type(obj), (bundle_dict(obj),)
    if kind is TEConstKind.QUANTIZER and callable(getattr(obj, "_value_key", None)) \
            and getattr(obj, "_value_fields", lambda: None)() is not None:
        from transformer_engine.pytorch.dynamo.quantizer_opaque import _rebuild_quantizer

        return _rebuild_quantizer, (type(obj), tuple(obj._value_key()[1]))
    return None


def leaf_values(obj: Any, depth: int = 0) -> Iterator[Any]:
    """Every value inside ``obj`` (args/kwargs), pre-order, recursing into lists/tuples/dicts and
    TE bundles, at most 10 levels deep (an explicit stack: whole-graph scans call it per node)."""
    stack = [(obj, depth)]
    while stack:
        o, d = stack.pop()
        if d > 10:
            continue
        yield o
        if isinstance(o, torch.fx.Node) or isinstance(o, PLAIN_TYPES):
            continue
        if isinstance(o, (list, tuple)):
            stack.extend((v, d + 1) for v in reversed(o))
        elif isinstance(o, dict):
            stack.extend((v, d + 1) for v in reversed(list(o.values())))
        elif te_const_kind(o) is TEConstKind.BUNDLE:
            stack.extend((v, d + 1) for v in reversed(list(bundle_dict(o).values())))


def iter_te_constants(graph: torch.fx.Graph) -> Iterator[tuple[torch.fx.Node, Any, TEConstKind]]:
    """``(node, obj, kind)`` for every TE Python object used as a constant in ``graph``: in node
    args/kwargs (inside containers and bundles, :func:`leaf_values`) and ``get_attr`` values."""
    for node in graph.nodes:
        roots = [node.args, node.kwargs]
        if node.op == "get_attr" and graph.owning_module is not None:
            val = get_attr_path(graph.owning_module, str(node.target))
            if val is not UNKNOWN:
                roots.insert(0, val)
        for root in roots:
            for obj in leaf_values(root):
                kind = te_const_kind(obj)
                if kind is not None:
                    yield node, obj, kind
