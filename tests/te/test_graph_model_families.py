"""TE graph model: any ``register_custom_op`` op family is decoded from its schema (issue 15 part 4).

A synthetic family ``te_passes_test_scaled_add`` is registered through TE's own framework
(``transformer_engine.pytorch.dynamo.custom_op.register_custom_op``, TE 2.20.2) with small
dataclasses and CPU impls; Dynamo / AOT graphs of it are decoded without any code naming it.
"""

# No ``from __future__ import annotations``: TE parses the dataclasses' real annotations.

import dataclasses
import functools
from typing import Optional

import pytest
import torch
import torch.fx

from te_passes.te import graph_model as gmod
from te_passes.te import op_families as opf

te = pytest.importorskip("transformer_engine.pytorch")

FAMILY = "te_passes_test_scaled_add"


@functools.lru_cache(maxsize=None)
def _register():
    """Register the synthetic family once per process; returns TE's ``forward_fn``."""
    from transformer_engine.pytorch.dynamo.custom_op import TensorOrQuantized, register_custom_op
    from transformer_engine.pytorch.dynamo.tensor_spec import TensorSpec

    @dataclasses.dataclass
    class FwdArgs:
        x: torch.Tensor = None
        weight: Optional[torch.Tensor] = None
        other: TensorOrQuantized = None
        alpha: float = 1.0
        tag: str = ""

    @dataclasses.dataclass
    class BwdArgs:
        grad_output: torch.Tensor = None
        saved_weight: Optional[torch.Tensor] = None
        alpha: float = 1.0

        def setup_saved_tensors(self, ctx):
            (self.saved_weight,) = ctx.saved_tensors

    def fwd_impl(a):
        out = a.x * a.weight * a.alpha + (a.other if a.other is not None else 0)
        return out, [a.weight.clone()], {"alpha": a.alpha}  # outputs may not alias inputs

    def fwd_fake(a):
        spec = TensorSpec(shape=tuple(a.x.shape), dtype=a.x.dtype, device=a.x.device)
        wspec = TensorSpec(shape=tuple(a.weight.shape), dtype=a.weight.dtype, device=a.weight.device)
        return spec, [wspec], {"alpha": a.alpha}

    def setup_ctx(bwd, fwd, out, ctx_attrs, saved):
        bwd.alpha = ctx_attrs["alpha"]
        return saved

    def bwd_impl(b):
        return (b.grad_output * b.saved_weight * b.alpha,)

    def bwd_fake(b):
        g = b.grad_output
        return (TensorSpec(shape=tuple(g.shape), dtype=g.dtype, device=g.device),)

    fn = register_custom_op(op_name=FAMILY, input_tensors_for_grad=["x"], fwd_arg_type=FwdArgs,
                            fwd_impl=fwd_impl, setup_context=setup_ctx, bwd_arg_type=BwdArgs,
                            bwd_impl=bwd_impl, bwd_fake_impl=bwd_fake, fwd_fake_impl=fwd_fake)
    assert fn is not None, "TE's register_custom_op refused the synthetic family"
    return fn, FwdArgs


def test_family_is_recognised_from_opdefs():
    _register()
    for suffix, (direction, tier) in opf.FAMILY_SUFFIXES.items():
        fam = opf.te_op_family(FAMILY + suffix)
        assert (fam.name, fam.direction, fam.tier) == (FAMILY, direction, tier)
        assert fam.ops == tuple(FAMILY + s for s in opf.FAMILY_SUFFIXES)
    fam = opf.te_op_family("linear_backward_base")
    assert (fam.name, fam.direction, fam.tier) == ("linear", "backward", "base")
    assert opf.op_family(FAMILY + "_nope") is None


def test_dynamo_graph_of_synthetic_family_is_decoded():
    fn, FwdArgs = _register()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    @torch.compile(backend=backend, fullgraph=True, dynamic=False)
    def f(x, w, o):
        return fn(FwdArgs(x=x, weight=w, other=o, alpha=2.0, tag="t"))

    x = torch.randn(4, 3, requires_grad=True)
    w, o = torch.randn(4, 3), torch.randn(4, 3)
    out = f(x, w, o)
    torch.testing.assert_close(out, x * w * 2.0 + o)
    (gm,) = graphs
    nodes = [n for n in gm.graph.nodes if gmod.is_te_op_node(n)]
    assert [gmod.te_op_name(n) for n in nodes] == [FAMILY]
    call = gmod.decode(nodes[0])
    assert call.op == FAMILY and call.module_kind == FAMILY and not call.is_backward
    assert [s.name for s in call.slots] == ["x", "weight", "other", "other__tensors", "other__meta", "_simple_meta"]
    assert [s.kind for s in call.slots] == [gmod.SlotKind.TENSOR, gmod.SlotKind.TENSOR, gmod.SlotKind.TENSOR,
                                            gmod.SlotKind.TQ_TENSORS, gmod.SlotKind.TQ_META, gmod.SlotKind.CONFIG]
    assert set(call.tensors) == {"x", "weight"} and call.tensors["x"].op == "placeholder"
    assert call.tq_fields["other"].kind == "tensor" and call.tq_fields["other"].tensor.op == "placeholder"
    assert call.config == {"alpha": 2.0, "tag": "t"}
    out.sum().backward()
    torch.testing.assert_close(x.grad, w * 2.0)


def test_aot_backward_of_synthetic_family_is_decoded():
    fn, FwdArgs = _register()
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    seen: dict[str, torch.fx.GraphModule] = {}

    def record(name):
        def comp(gm, inputs):
            seen[name] = gm
            return make_boxed_func(gm.forward)
        return comp

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=record("fw"), bw_compiler=record("bw"))

    @torch.compile(backend=backend, fullgraph=True, dynamic=False)
    def f(x, w):
        return fn(FwdArgs(x=x, weight=w, other=None, alpha=3.0))

    x = torch.randn(2, 5, requires_grad=True)
    w = torch.randn(2, 5)
    f(x, w).sum().backward()
    torch.testing.assert_close(x.grad, w * 3.0)
    calls = {n: gmod.decode(n) for gm in seen.values() for n in gm.graph.nodes if gmod.is_te_op_node(n)}
    ops = sorted(c.op for c in calls.values())
    assert FAMILY in ops and FAMILY + "_backward" in ops, ops
    bwd = next(c for c in calls.values() if c.op == FAMILY + "_backward")
    assert bwd.is_backward and bwd.module_kind == FAMILY
    assert set(bwd.tensors) == {"grad_output", "saved_weight"} and bwd.config == {"alpha": 3.0}
    fwd = next(c for c in calls.values() if c.op == FAMILY)
    assert fwd.tq_fields["other"].kind == "none"


def test_family_member_with_foreign_schema_is_refused():
    """Four ops named like a family but not laid out as TE's arg plan lays them out."""
    lib = torch.library.Library(gmod.TE_OP_NAMESPACE, "FRAGMENT")
    name = "te_passes_test_forged"
    for suffix in opf.FAMILY_SUFFIXES:
        torch.library.custom_op(f"{gmod.TE_OP_NAMESPACE}::{name}{suffix}", lambda x, n: [x.clone()],
                                mutates_args=(), schema="(Tensor x, int n) -> Tensor[]")
    del lib
    with pytest.raises(gmod.UnknownTEOp, match=r"schema is not TE's register_custom_op layout: slot 'n' has "
                                               r"type int"):
        opf.te_op_family(name + "_base")
    g = torch.fx.Graph()
    x = g.placeholder("x")
    n = g.call_function(getattr(torch.ops.transformer_engine_compile, name).default, (x, 3))
    with pytest.raises(gmod.UnknownTEOp, match=r"node .*: TE op .*te_passes_test_forged of family"):
        gmod.decode(n)


def _schema(args: str, ret: str = "Tensor[]"):
    """A stand-in for ``torch._C.FunctionSchema`` (torch's parser rejects ``PyObject``, which is
    how parsed TE schemas print an opaque bundle argument): ``"Tensor a, PyObject b"``."""
    from types import SimpleNamespace as NS

    arg = lambda s: NS(type=s.rsplit(" ", 1)[0], name=s.rsplit(" ", 1)[1])  # noqa: E731
    return NS(arguments=[arg(a.strip()) for a in args.split(",") if a.strip()], returns=[NS(type=ret)])


def test_schema_layout_rules():
    real = torch.ops.transformer_engine_compile.linear.default._schema
    assert opf.schema_layout_problem(real) is None
    ok = _schema("Tensor a, Tensor? b, Tensor? q, Tensor[] q__tensors, PyObject q__meta, PyObject _simple_meta")
    assert opf.schema_layout_problem(ok) is None
    assert "not one Tensor[]" in opf.schema_layout_problem(_schema("Tensor a", ret="Tensor"))
    assert "must be the last argument" in opf.schema_layout_problem(_schema("PyObject _simple_meta, Tensor a"))
    assert "not the triple" in opf.schema_layout_problem(_schema("Tensor? q, Tensor[] q__tensors, Tensor q__meta"))
    assert "outside a tensor-or-quantized triple" in opf.schema_layout_problem(_schema("Tensor[] q__tensors"))
    assert "type float" in opf.schema_layout_problem(_schema("Tensor a, float eps"))
