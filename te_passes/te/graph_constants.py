"""TE Python objects as FX graph constants: which kind a constant is and what it holds.

See docs/internals.md#te_passestegraph_constantspy."""

from __future__ import annotations

import enum
from typing import Any, Iterator

import torch.fx


def _type_module(obj: Any) -> str:
    t = obj if isinstance(obj, type) else type(obj)
    return getattr(t, "__module__", "") or ""


def is_te_object(obj: Any) -> bool:
    """Whether ``obj`` (or the class ``obj``) is defined inside ``transformer_engine``."""
    return _type_module(obj).startswith("transformer_engine")


def _mro_names(obj: Any) -> set[str]:
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


#: ``id(class) -> (class, is-a-class flag, kind)``: the kind depends only on the class (and on
#: whether ``obj`` is the class itself), so it is computed once per class; the class is kept
#: to make the id stable. Graph scans call this for every constant (100k-node graphs: ~10^5 calls).
_KIND_CACHE: dict[tuple[int, bool], tuple[type, TEConstKind | None]] = {}


def te_const_kind(obj: Any) -> TEConstKind | None:
    """Classify a graph constant as a TE object kind, or ``None`` if it is not TE's."""
    is_cls = isinstance(obj, type)
    t = obj if is_cls else type(obj)
    hit = _KIND_CACHE.get((id(t), is_cls))
    if hit is not None and hit[0] is t:
        return hit[1]
    kind = _te_const_kind(obj)
    _KIND_CACHE[(id(t), is_cls)] = (t, kind)
    return kind


def _te_const_kind(obj: Any) -> TEConstKind | None:
    if not is_te_object(obj):
        return None
    names = _mro_names(obj)
    if "OpaqueValueBundle" in names:
        return TEConstKind.BUNDLE
    if "Quantizer" in names:
        return TEConstKind.QUANTIZER
    if "QuantizedTensorStorage" in names:
        return TEConstKind.STORAGE
    if "Recipe" in names:
        return TEConstKind.RECIPE
    if isinstance(obj, enum.Enum):
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
    """A quantizer's value fields, as TE's value-opaque ``__fx_repr__`` rebuilds it.

    TE 2.20 quantizers render as ``_rebuild_quantizer(Cls, (('field', value), ...))``; this
    returns that field tuple as a dict, falling back to the public attributes TE quantizers
    carry. Raises ``TypeError`` for non-quantizers.
    """
    if te_const_kind(q) is not TEConstKind.QUANTIZER:
        raise TypeError(f"not a TE quantizer: {type(q).__qualname__}")
    # TE 2.20 value quantizers (dynamo/quantizer_opaque.py register_value_opaque_quantizer):
    # the class's annotated value fields, stored as ``_value_field_names``; read each with
    # getattr so ``dtype`` stays TE's ``DType`` enum (``_value_key`` stores it as an int).
    value_fields = getattr(q, "_value_fields", None)
    names = value_fields() if callable(value_fields) else None
    if names:
        return {k: getattr(q, k) for k in names if hasattr(q, k)}
    out = {}
    for k in ("rowwise_usage", "columnwise_usage", "internal", "optimize_for_gemm", "dtype",
              "with_amax_reduction", "force_pow_2_scales", "amax_epsilon", "block_scaling_dim"):
        if hasattr(q, k):
            v = getattr(q, k)
            out[k] = v
    return out


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


def iter_te_constants(graph: torch.fx.Graph) -> Iterator[tuple[torch.fx.Node, Any, TEConstKind]]:
    """Every TE Python object used as a constant argument anywhere in ``graph``.

    Yields ``(node, obj, kind)`` for objects found in node args/kwargs (recursing into
    lists/tuples/dicts and into bundles' contents) and for ``get_attr`` targets' values.
    """
    def walk(obj: Any, node: torch.fx.Node, depth: int = 0):
        if depth > 8:
            return
        kind = te_const_kind(obj)
        if kind is not None:
            yield node, obj, kind
            if kind is TEConstKind.BUNDLE:
                for v in bundle_dict(obj).values():
                    yield from walk(v, node, depth + 1)
            return
        if isinstance(obj, (list, tuple)):
            for v in obj:
                yield from walk(v, node, depth + 1)
        elif isinstance(obj, dict):
            for v in obj.values():
                yield from walk(v, node, depth + 1)

    owner = graph.owning_module
    for node in graph.nodes:
        if node.op == "get_attr" and owner is not None:
            try:
                val = owner
                for part in str(node.target).split("."):
                    val = getattr(val, part)
            except AttributeError:
                continue
            yield from walk(val, node)
        yield from walk(node.args, node)
        yield from walk(node.kwargs, node)
