"""DirectTECall runs TE's impl below ADInplaceOrView (ops/direct_call.py, issue 22).

A toy TE op family (registered through TE's own ``register_custom_op``, as tests/_helpers/_toy_te_op.py)
whose forward impl returns ``out2d.view(...)`` of a GEMM result, as TE's ``_linear_forward_impl``
reshapes its output back to the input's leading dims:

* the direct call's outputs are plain tensors, not views keeping the 2-D GEMM buffer alive
  (under ``_AutoDispatchBelowAutograd`` with AOTAutograd's view replay on they were views);
* inside the impl no view op builds a view-replay record (the host cost: benchmarks/bench_guards_cpu.py
  prints it side by side);
* compiled with te_inductor (direct calls on), in-place mutation of a TE op's output — inside the
  compiled function and by the caller after it — and the gradients through it equal eager's.
"""

# no ``from __future__ import annotations``: TE resolves the args dataclasses' annotations (get_type_hints)

import dataclasses
from typing import Optional

import pytest
import torch
import torch._dynamo

from te_passes.report import clear_compile_reports, compile_reports
from te_passes.ops import direct_call as dc

NS = "transformer_engine_compile"
OP = "tpq_view_toy"
SEEN: dict[str, list] = {"out_is_view": [], "view_replay": []}


@pytest.fixture(scope="module")
def view_op():
    pytest.importorskip("transformer_engine.pytorch")
    from transformer_engine.pytorch.dynamo import custom_op as co
    from transformer_engine.pytorch.dynamo.tensor_spec import TensorSpec

    @dataclasses.dataclass
    class Fwd:
        weight: co.TensorOrQuantized
        inp: torch.Tensor
        scale: float

    @dataclasses.dataclass
    class Bwd:
        grad_output: Optional[torch.Tensor] = None
        saved_inp: Optional[torch.Tensor] = None
        saved_weight: Optional[torch.Tensor] = None
        scale: float = 1.0

        def setup_saved_tensors(self, ctx) -> None:
            from transformer_engine.pytorch.quantized_tensor import restore_from_func_ctx

            self.saved_inp, self.saved_weight = restore_from_func_ctx(ctx)

    def fwd(a):
        x2d = a.inp.reshape(-1, a.inp.shape[-1])  # a view of the input, as TE's impl
        out = (x2d @ a.weight.t()) * a.scale
        y = out.view(*a.inp.shape[:-1], a.weight.shape[0])  # TE returns a view of its 2-D GEMM output
        SEEN["out_is_view"].append(y._is_view())
        SEEN["view_replay"].append(torch._C._is_view_replay_enabled())
        return y, [a.inp.clone(), a.weight.clone()], None

    def fwd_fake(a):
        return (TensorSpec(shape=(*a.inp.shape[:-1], a.weight.shape[0]), dtype=a.inp.dtype, device=a.inp.device),
                [a.inp, a.weight], None)

    def setup_ctx(bwd, f, outputs, ctx_attrs, saved):
        bwd.scale = f.scale
        return saved

    def bwd(a):
        g = a.grad_output.reshape(-1, a.grad_output.shape[-1]) * a.scale
        x2d = a.saved_inp.reshape(-1, a.saved_inp.shape[-1])
        return g.t() @ x2d, (g @ a.saved_weight).view(a.saved_inp.shape)

    def bwd_fake(a):
        return (TensorSpec(shape=tuple(a.saved_weight.shape), dtype=a.grad_output.dtype, device=a.grad_output.device),
                TensorSpec(shape=tuple(a.saved_inp.shape), dtype=a.grad_output.dtype, device=a.grad_output.device))

    op = co.register_custom_op(op_name=OP, input_tensors_for_grad=["weight", "inp"], fwd_arg_type=Fwd,
                               fwd_impl=fwd, fwd_fake_impl=fwd_fake, setup_context=setup_ctx, bwd_arg_type=Bwd,
                               bwd_impl=bwd, bwd_fake_impl=bwd_fake)
    if op is None:
        pytest.skip("TE's register_custom_op refused the op family")
    return op, Fwd, co


def _model(op, Fwd):
    def model(x, w1, w2, mutate_inside: bool, in_place: bool = True):
        h = op(Fwd(weight=w1, inp=x, scale=0.5))
        if mutate_inside:
            if in_place:
                h.mul_(3.0).add_(1.0)  # in-place on a TE op's output inside the compiled graph
            else:
                h = h * 3.0 + 1.0
        h = torch.tanh(h)
        return op(Fwd(weight=w2, inp=h, scale=2.0))
    return model


def _params():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, generator=g, requires_grad=True)
    return x, torch.randn(6, 8, generator=g).requires_grad_(), torch.randn(5, 6, generator=g).requires_grad_()


def test_guard_is_below_ad_inplace_or_view():
    assert dc._below_autograd is torch._C._AutoDispatchBelowADInplaceOrView


def test_direct_call_outputs_are_not_views(view_op):
    op, Fwd, co = view_op
    x, w, _ = _params()
    plan = co._parse_arg_type(Fwd)
    slots = plan.pack(Fwd(weight=w.detach(), inp=x.detach(), scale=0.5))
    flat = [slots[n] for n in plan.slot_names]
    call = dc.DirectTECall(f"{NS}::{OP}_base", len(flat), [(i, v) for i, v in enumerate(flat)
                                                          if not isinstance(v, torch.Tensor)])
    SEEN["out_is_view"].clear()
    prev = torch._C._is_view_replay_enabled()
    torch._C._set_view_replay_enabled(True)  # what AOTAutograd's runtime wrapper does around a compiled forward
    try:
        out = call(*flat)
    finally:
        torch._C._set_view_replay_enabled(prev)
    assert SEEN["out_is_view"] == [False]  # inside TE's impl: no view tracking
    assert not out[0]._is_view() and out[0]._base is None
    want = getattr(getattr(torch.ops, NS), f"{OP}_base").default(*flat)
    assert torch.equal(out[0], want[0])
    # the old guard, for contrast: the same impl's output is a view of the GEMM buffer
    SEEN["out_is_view"].clear()
    with torch._C._AutoDispatchBelowAutograd():
        call._impl_cell.cell_contents(call._build(flat))
    assert SEEN["out_is_view"] == [True]


@pytest.mark.parametrize("mutate_inside", [False, True])
def test_compiled_in_place_mutation_of_te_outputs_matches_eager(view_op, mutate_inside):
    op, Fwd, _ = view_op
    model = _model(op, Fwd)
    torch._dynamo.reset()
    clear_compile_reports()
    compiled = torch.compile(model, backend="te_inductor", options={"fx_graph_cache": False})
    results = []
    # eager reference out of place: through the dispatcher the op's eager output is an autograd view
    # ("output of a function that returns multiple views"), which autograd refuses to mutate in place
    for fn, in_place in ((model, False), (compiled, True)):
        x, w1, w2 = _params()
        y = fn(x, w1, w2, mutate_inside, in_place)
        if in_place:
            y.mul_(2.0)  # the caller mutates the compiled graph's output (a TE op output) in place
        else:
            y = y * 2.0
        (y * y).sum().backward()
        results.append((y.detach(), x.grad, w1.grad, w2.grad))
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (a - b).abs().max()
    recs = [r for rep in compile_reports() for r in rep.records("direct_call")]
    assert {r.data["op"] for r in recs} == {f"{NS}::{OP}_base", f"{NS}::{OP}_backward_base"}, recs
    torch._dynamo.reset()
