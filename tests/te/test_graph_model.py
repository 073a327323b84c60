"""TE graph model: what it refuses to decode (real-graph decoding is asserted in test_capture.py)."""

from __future__ import annotations

import pytest
import torch
import torch.fx

from te_passes.te import graph_model as gmod
from te_passes.te import graph_constants as gconst
from te_passes.te import version as vmod

te = pytest.importorskip("transformer_engine.pytorch")

_lib = torch.library.Library(gmod.TE_OP_NAMESPACE, "FRAGMENT")
_lib.define("te_passes_test_mystery(Tensor x) -> Tensor")
_lib.impl("te_passes_test_mystery", lambda x: x.clone(), "CompositeExplicitAutograd")


def _graph_with(target, *args):
    g = torch.fx.Graph()
    x = g.placeholder("x")
    n = g.call_function(target, (x, *args))
    g.output(n)
    return g, n


def test_unknown_te_op_is_reported_not_decoded():
    g, n = _graph_with(torch.ops.transformer_engine_compile.te_passes_test_mystery.default)
    assert gmod.is_te_op_node(n) and gmod.te_op_name(n) == "te_passes_test_mystery"
    with pytest.raises(gmod.UnknownTEOp, match=r"node te_passes_test_mystery_default: unknown TE op "
                       r"transformer_engine_compile::te_passes_test_mystery \(TE 2\.20\.2\)"):
        gmod.decode(n)
    unknown: list[str] = []
    assert gmod.te_op_calls(g, unknown=unknown) == [] and len(unknown) == 1


def test_unsupported_te_version_is_reported(monkeypatch):
    monkeypatch.setattr(gmod, "te_version", lambda: "2.21.0")
    monkeypatch.setattr(gmod, "is_supported", lambda v: vmod.parse_version(v) in vmod.SUPPORTED_TE)
    g, n = _graph_with(torch.ops.transformer_engine_compile.linear.default)
    with pytest.raises(gmod.UnknownTEOp, match=r"TE 2\.21\.0 is not a version te_passes decodes"):
        gmod.decode(n)


def test_non_te_nodes_and_objects():
    g, n = _graph_with(torch.ops.aten.relu.default)
    assert not gmod.is_te_op_node(n)
    with pytest.raises(gmod.UnknownTEOp, match="does not call a transformer_engine_compile op"):
        gmod.decode(n)
    assert gconst.te_const_kind(3) is None and gconst.te_const_kind(torch.float32) is None
    with pytest.raises(TypeError, match="not a TE OpaqueValueBundle: dict"):
        gconst.bundle_dict({"a": 1})


def test_te_objects_are_classified():
    from transformer_engine.common import recipe
    from transformer_engine.pytorch.dynamo.custom_op import OpaqueValueBundle
    from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import Float8TensorStorage

    b = OpaqueValueBundle({"fp8": True, "ub_name": "qkv"})
    assert gconst.te_const_kind(b) is gconst.TEConstKind.BUNDLE
    assert gconst.bundle_dict(b) == {"fp8": True, "ub_name": "qkv"}
    assert gconst.te_const_kind(recipe.Float8CurrentScaling()) is gconst.TEConstKind.RECIPE
    assert gconst.te_const_kind(Float8TensorStorage) is gconst.TEConstKind.STORAGE


def test_version_parsing():
    assert vmod.parse_version("2.20.2") == (2, 20)
    assert vmod.is_supported("2.20.0") and not vmod.is_supported("2.19.1") and not vmod.is_supported("junk")
    assert vmod.te_version() == "2.20.2"
