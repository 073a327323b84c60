"""call_te_impl_directly: TE wrapper ops retargeted to their base ops, marked for a direct call
of TE's impl, and Inductor's generated code calling what the pass says.

* real captured te.Linear graphs (fp8 Float8CurrentScaling and bf16, forward and backward),
  through the same PassManager path the backend uses (``run_pipeline``): exact rewritten nodes;
* refusals: a tensor-subclass ``meta["val"]``, a missing ``meta["val"]``, an OPDEF whose kernel
  is not TE's ``_register_base_op._impl``, constants that were not hoisted;
* Inductor on CPU with a toy op family registered through TE's own ``register_custom_op``
  (tests/_helpers/_toy_te_op.py; TE's real impls need a GPU): the wrapper calls ``_te_direct_N``, the
  results are bit-identical to the dispatcher path, TE's impl runs once per op per step with a
  fresh args object, plain ``backend="inductor"`` is untouched, the FX graph cache round-trips.
"""

from __future__ import annotations

import pickle
import re

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from te_passes.passes.call_te_impl_directly import CallTEImplDirectly
from te_passes.report import clear_compile_reports, compile_reports
from te_passes.ops import direct_call as dc, direct_lowering as dl
from te_passes.ops.te_base import overload

NS = "transformer_engine_compile"


def _run(captured, stage, **opts):
    from te_passes.config import TePassesOptions
    from te_passes.passes.order import configured_passes, pass_names
    from te_passes.compat.install import install
    from te_passes.testing.capture import run_pipeline

    install()  # as the backend does before any pass runs (registers the direct-call lowerings)
    # as the backend builds its manager: options parsed, passes configured from them
    options = TePassesOptions.parse(opts or None, known_passes=set(pass_names()))[0]
    (rep,) = run_pipeline(captured, stages=[stage], options=options,
                          passes=configured_passes(options.pass_config))
    run = next(r for r in rep.runs if r.name == "call_te_impl_directly")
    return rep.gm, run


def _te_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target).startswith(NS)]


# --------------------------------------------------------------------------- real TE graphs
@pytest.mark.parametrize("precision", ["fp8-cs", "bf16"])
@pytest.mark.parametrize("stage,op,impl", [
    ("post_grad_fwd", "linear", "_linear_forward_impl"),
    ("post_grad_bwd", "linear_backward", "_linear_backward_impl"),
])
def test_real_graphs_retargeted_and_marked(te_aot_graphs, precision, stage, op, impl):
    import transformer_engine.pytorch.module.linear as te_linear
    from torch._library.custom_ops import OPDEFS

    a = te_aot_graphs(precision, 2, model="stack")
    before = [n.name for n in _te_nodes(a.forward if stage == "post_grad_fwd" else a.backward)]
    gm, run = _run(a, stage)
    assert run.status == "ok", run
    nodes = _te_nodes(gm)
    assert [n.name for n in nodes] == before and len(nodes) == 2
    base = getattr(getattr(torch.ops, NS), f"{op}_base").default
    init = OPDEFS[f"{NS}::{op}_base"]._init_fn
    closure = dict(zip(init.__code__.co_freevars, (c.cell_contents for c in init.__closure__)))
    for n in nodes:
        assert n.target is base
        call = n.meta[dc.META_KEY]
        assert isinstance(call, dc.DirectTECall) and call.qualname == f"{NS}::{op}_base"
        # exactly the impl / pack_result the op's kernel closes over: TE's own function
        assert call.impl is closure["impl"] and call.pack_result is closure["pack_result"]
        assert (call.impl.__module__, call.impl.__name__) == (te_linear.__name__, impl)
    kinds = [(r.kind, r.node) for r in run.records]
    assert kinds == [k for n in before for k in (("retargeted", n), ("direct_call", n))]
    rec = next(r for r in run.records if r.kind == "retargeted")
    assert rec.data == {"from": f"{NS}::{op}", "to": f"{NS}::{op}_base"}
    d = next(r for r in run.records if r.kind == "direct_call").data
    if op == "linear":
        # LinearFwdArgs slots: weight, weight__tensors, weight__meta, inp, bias, weight_workspace, ...
        assert d["tensor_fields"] == {"weight": 0, "inp": 3, "bias": 4} and d["storage_fields"] == []
    elif precision == "fp8-cs":
        # the saved fp8 input / weight cross as storages: rebuilt from their buffers per call
        assert d["storage_fields"] == ["inputmat", "weight_fp8"]
        assert d["tensor_fields"] == {"grad_output": 0, "saved_weight": 7, "bias": 10}
    else:
        assert d["storage_fields"] == []
        assert d["tensor_fields"] == {"grad_output": 0, "inputmat": 1, "weight_fp8": 4, "saved_weight": 7, "bias": 10}
    gm.graph.lint()


def test_disabled_and_retarget_only(te_aot_graphs):
    a = te_aot_graphs("fp8-cs", 1)
    gm, run = _run(a, "post_grad_fwd", **{"te_passes.disable": ["call_te_impl_directly"]})
    assert run.status == "disabled"
    assert all(n.target is torch.ops.transformer_engine_compile.linear.default for n in _te_nodes(gm))
    gm, run = _run(a, "post_grad_fwd", **{"te_passes.pass_config": {"call_te_impl_directly": {"direct_call": False}}})
    (n,) = _te_nodes(gm)
    assert n.target is torch.ops.transformer_engine_compile.linear_base.default and dc.META_KEY not in n.meta
    assert [(r.kind, r.data.get("reason")) for r in run.records] == [
        ("kept", "direct_call=False (retarget only)"), ("retargeted", None)]


class _Sub(torch.Tensor):
    pass


def test_refuses_subclass_meta_val(te_aot_graphs):
    """A tensor-subclass value in a tensor slot (the wrapper op would flatten a QuantizedTensor)
    keeps the wrapper op and its dispatcher call; the other layer is still rewritten."""
    a = te_aot_graphs("fp8-cs", 2, model="stack")
    first = _te_nodes(a.forward)[0]
    weight = first.args[0]
    weight.meta["val"] = torch.empty(weight.meta["val"].shape).as_subclass(_Sub)
    gm, run = _run(a, "post_grad_fwd")
    n0, n1 = _te_nodes(gm)
    assert n0.target is torch.ops.transformer_engine_compile.linear.default and dc.META_KEY not in n0.meta
    assert n1.target is torch.ops.transformer_engine_compile.linear_base.default and dc.META_KEY in n1.meta
    kept = [r for r in run.records if r.kind == "kept"]
    assert len(kept) == 1 and kept[0].node == n0.name and not kept[0].data["retargeted"]
    assert kept[0].data["reason"] == f"slot weight: {weight.name} is a _Sub (a tensor subclass the wrapper op may flatten)"


def test_refuses_missing_meta_val(te_aot_graphs):
    a = te_aot_graphs("bf16", 1)
    (n,) = _te_nodes(a.forward)
    n.args[3].meta.pop("val")
    gm, run = _run(a, "post_grad_fwd")
    (n,) = _te_nodes(gm)
    assert n.target is torch.ops.transformer_engine_compile.linear.default
    (r,) = run.records
    assert r.kind == "kept" and "has no meta['val']" in r.data["reason"]


def test_refuses_unexpected_opdef_kernel(te_aot_graphs, monkeypatch):
    """The base op's kernel is not TE's ``_register_base_op._impl``: retargeted (the wrapper is
    still a pass-through) but no direct call, with the reason."""
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS[f"{NS}::linear_base"]
    orig = opdef._init_fn

    def other(*flat):
        return orig(*flat)

    monkeypatch.setattr(opdef, "_init_fn", other)
    gm, run = _run(te_aot_graphs("fp8-cs", 1), "post_grad_fwd")
    (n,) = _te_nodes(gm)
    assert n.target is torch.ops.transformer_engine_compile.linear_base.default and dc.META_KEY not in n.meta
    kept = [r for r in run.records if r.kind == "kept"]
    assert len(kept) == 1 and kept[0].data["retargeted"]
    assert "not TE's _register_base_op.<locals>._impl" in kept[0].data["reason"]


def test_refuses_constants_not_hoisted(te_aot_graphs):
    """Without hoisted bundles the op path gets freshly built bundles (and quantizers) on every
    call; a direct call holding one object would differ, so the node keeps its op call."""
    gm, run = _run(te_aot_graphs("fp8-cs", 1), "post_grad_fwd",
                   **{"te_passes.disable": ["hoist_te_constants"]})
    (n,) = _te_nodes(gm)
    assert n.target is torch.ops.transformer_engine_compile.linear_base.default and dc.META_KEY not in n.meta
    (kept,) = [r for r in run.records if r.kind == "kept"]
    assert "not a hoisted constant of this graph" in kept.data["reason"]


def test_uuid_covers_runtime_module(monkeypatch):
    import inspect
    import sys

    h0 = CallTEImplDirectly.source_hash()
    real = inspect.getsource

    def fake(obj):
        return real(obj) + ("\n# changed" if obj is sys.modules[dc.__name__] else "")

    monkeypatch.setattr(inspect, "getsource", fake)
    assert CallTEImplDirectly.source_hash() != h0


# --------------------------------------------------------------------------- Inductor on CPU
def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(8, 16), (32, 16), (32,), (32, 32), (32,)]
    return [torch.randn(s, generator=g).requires_grad_() for s in shapes]


def _dispatcher_counts(monkeypatch, toy):
    """Count calls of the toy base ops' dispatcher kernels (the custom op's backend function)."""
    from torch._library.custom_ops import OPDEFS

    calls = {"fwd": 0, "bwd": 0}
    for key, q in (("fwd", f"{NS}::{toy.OP_NAME}_base"), ("bwd", f"{NS}::{toy.OP_NAME}_backward_base")):
        fns = OPDEFS[q]._backend_fns
        orig = fns[None]

        def counted(*a, _o=orig, _k=key, **k):
            calls[_k] += 1
            return _o(*a, **k)

        monkeypatch.setitem(fns, None, counted)
    return calls


def _steps(fn, params, n):
    outs = []
    for _ in range(n):
        for p in params:
            p.grad = None
        out = fn(*params)
        out.sum().backward()
        outs.append((out.detach().clone(), [p.grad.clone() for p in params]))
    return outs


def _compile(toy, backend="te_inductor", **options):
    torch._dynamo.reset()
    return torch.compile(toy.model, backend=backend, options={"fx_graph_cache": False, **options})


def test_inductor_calls_te_impl_directly(toy, monkeypatch):
    from torch._inductor.utils import run_and_get_code

    params = _params()
    ref = _steps(_compile(toy, **{"te_passes.disable": ["call_te_impl_directly"]}), params, 3)

    clear_compile_reports()
    disp = _dispatcher_counts(monkeypatch, toy)
    toy.CALLS["fwd"].clear(), toy.CALLS["bwd"].clear()
    compiled = _compile(toy)
    outs, codes = run_and_get_code(lambda: _steps(compiled, params, 1))
    outs += _steps(compiled, params, 2)
    fwd_code, bwd_code = codes
    # the generated code calls what the pass says: one _te_direct_N per TE op, no dispatcher call
    for code, op in ((fwd_code, toy.OP_NAME), (bwd_code, f"{toy.OP_NAME}_backward")):
        calls = re.findall(r"^\s*buf\d+ = (_te_direct_\d+)\(", code, re.M)
        assert calls == ["_te_direct_0", "_te_direct_1"], code
        assert not re.search(rf"torch\.ops\.{NS}\.{op}(_base)?\.default\(", code)
    recs = [r for rep in compile_reports() for r in rep.records("direct_call")]
    assert len(recs) == 4 and {r.data["op"] for r in recs} == {f"{NS}::{toy.OP_NAME}_base",
                                                              f"{NS}::{toy.OP_NAME}_backward_base"}
    # bit-identical to the dispatcher path, every step
    for (o, g), (ro, rg) in zip(outs, ref):
        assert torch.equal(o, ro) and all(torch.equal(a, b) for a, b in zip(g, rg))
    # TE's impl ran once per op per step, never through the dispatcher; a fresh args object each
    assert len(toy.CALLS["fwd"]) == 2 * 3 and len(toy.CALLS["bwd"]) == 2 * 3
    assert disp == {"fwd": 0, "bwd": 0}
    assert len({id(a) for a in toy.CALLS["fwd"]}) == 6 and all(a.scratch for a in toy.CALLS["fwd"])
    assert all(type(a) is toy.ToyFwdArgs for a in toy.CALLS["fwd"])
    toy.CALLS["fwd"].clear(), toy.CALLS["bwd"].clear()


def test_plain_inductor_untouched(toy, monkeypatch):
    from torch._inductor.utils import run_and_get_code

    _compile(toy)(*_params())  # the direct-call lowering is registered now
    disp = _dispatcher_counts(monkeypatch, toy)
    compiled = _compile(toy, backend="inductor")
    _, codes = run_and_get_code(lambda: _steps(compiled, _params(), 1))
    assert "_te_direct_" not in "".join(codes)
    assert len(re.findall(rf"torch\.ops\.{NS}\.{toy.OP_NAME}\.default\(", codes[0])) == 2
    assert disp == {"fwd": 2, "bwd": 2}


def test_fx_graph_cache_round_trip(toy, monkeypatch):
    """A cache hit loads the pickled DirectTECall objects: same results, still no dispatcher."""
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import fresh_cache

    params = _params(1)
    counters.clear()
    with fresh_cache(), inductor_config.patch(fx_graph_cache=True, fx_graph_remote_cache=False):
        torch._dynamo.reset()
        first = _steps(torch.compile(toy.model, backend="te_inductor"), params, 2)
        misses = counters["inductor"]["fxgraph_cache_miss"]
        disp = _dispatcher_counts(monkeypatch, toy)
        torch._dynamo.reset()
        second = _steps(torch.compile(toy.model, backend="te_inductor"), params, 2)
        hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
    torch._dynamo.reset()
    assert misses == 2 and hits >= 1, dict(counters["inductor"])
    assert disp == {"fwd": 0, "bwd": 0}
    for (o, g), (ro, rg) in zip(second, first):
        assert torch.equal(o, ro) and all(torch.equal(a, b) for a, b in zip(g, rg))


def test_direct_call_pickles_and_matches_dispatcher(toy, monkeypatch):
    """DirectTECall against the op's dispatcher call on the same flat arguments, and its pickle
    round trip (what the FX graph cache does); an OPDEF that changed unpickles to the op call."""
    from transformer_engine.pytorch.dynamo import custom_op as co

    x, w, b = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6)
    args = toy.ToyFwdArgs(weight=w, inp=x, bias=b, extra=None, scale=0.25, mode="gelu", out_dtype=torch.float32)
    plan = co._parse_arg_type(toy.ToyFwdArgs)
    slots = plan.pack(args)
    flat = [slots[n] for n in plan.slot_names]
    consts = [(i, v) for i, v in enumerate(flat) if not isinstance(v, torch.Tensor)]
    q = f"{NS}::{toy.OP_NAME}_base"
    call = dc.DirectTECall(q, len(flat), consts)
    op = getattr(getattr(torch.ops, NS), f"{toy.OP_NAME}_base").default
    want = op(*flat)
    got = call(*flat)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    again = pickle.loads(pickle.dumps(call))
    assert isinstance(again, dc.DirectTECall)
    assert all(torch.equal(a, b) for a, b in zip(again(*flat), want))
    from torch._library.custom_ops import OPDEFS

    monkeypatch.setattr(OPDEFS[q], "_init_fn", lambda *f: None)
    stale = pickle.loads(pickle.dumps(call))
    assert isinstance(stale, dc.OpCall) and "not TE's" in stale.reason


def test_rollback_restores_targets_and_meta(te_aot_graphs, monkeypatch):
    """A failure after the rewrite (a later pass of the stage) restores every target and drops
    the plans through the manager's undo of the pass's edit journal."""
    from te_passes.passes import Stage, TEPass
    from te_passes.passes.hoist_te_constants import HoistTEConstants
    from te_passes.compat.api import capture_te_state
    from te_passes.testing.harness import run_passes

    rewritten = []

    class FailAfter(TEPass):
        name, stages, description = "fail_after", frozenset({Stage.POST_GRAD_FWD}), "test"

        def run(self, gm, ctx):
            assert CallTEImplDirectly().run(gm, ctx).modified
            rewritten.append([(n.name, n.target, sorted(n.meta)) for n in gm.graph.nodes])
            raise RuntimeError("boom after rewriting")

    gm = te_aot_graphs("fp8-cs", 2, model="stack").forward
    hoist = run_passes(gm, HoistTEConstants(), Stage.POST_GRAD_FWD, te_state=capture_te_state())
    assert hoist.report.runs[0].changed  # the direct call needs the hoisted constants
    before = [(n.name, n.target, sorted(n.meta)) for n in gm.graph.nodes]
    with pytest.warns(RuntimeWarning, match="boom after rewriting"):
        run = run_passes(gm, FailAfter(), Stage.POST_GRAD_FWD, te_state=capture_te_state())
    assert run.report.runs[0].status == "failed"
    (after_rewrite,) = rewritten
    assert sum(t is not u for (_, t, _), (_, u, _) in zip(before, after_rewrite)) == 2  # two ops retargeted
    assert [(n.name, n.target, sorted(n.meta)) for n in gm.graph.nodes] == before
    assert run.before_ops == run.after_ops and not any(dc.META_KEY in n.meta for n in gm.graph.nodes)


@pytest.mark.parametrize("precision", ["fp8-cs", "bf16"])
def test_args_object_equals_te_unpack(te_aot_graphs, precision):
    """On the real LinearFwdArgs / LinearBwdArgs plans: the args object a DirectTECall hands TE's
    impl has, field for field, the objects the base op's own ``_impl`` (``plan.unpack``) passes —
    the same objects for constants and tensors, an equal storage rebuilt from the same buffers
    (fp8 backward). TE's impl is swapped for a recording stub in the closure cell both read."""
    import dataclasses

    from te_passes.testing.capture import run_pipeline
    from torch._library.custom_ops import OPDEFS

    a = te_aot_graphs(precision, 1)
    for rep in run_pipeline(a, stages=["post_grad_fwd", "post_grad_bwd"]):
        (node,) = [n for n in rep.gm.graph.nodes if n.op == "call_function" and dc.META_KEY in n.meta]
        call = node.meta[dc.META_KEY]

        def real(v):
            if isinstance(v, torch.fx.Node):
                val = v.meta["val"]
                return torch.zeros(val.shape, dtype=val.dtype)
            return [real(x) for x in v] if isinstance(v, (list, tuple)) else v

        flat = [real(v) for v in node.args]
        seen = []
        outs = (torch.zeros(1), torch.zeros(1), torch.zeros(1))
        is_bwd = "backward" in call.qualname

        def stub(args):
            seen.append(args)
            return (outs[0], outs[1], None) if is_bwd else (outs[0], None, [outs[1], outs[2]], None)

        init = OPDEFS[call.qualname]._init_fn
        cell = dict(zip(init.__code__.co_freevars, init.__closure__))["impl"]
        orig, cell.cell_contents = cell.cell_contents, stub
        try:
            got = call(*flat)
            want = overload(call.qualname)(*flat)
        finally:
            cell.cell_contents = orig
        # same tensors; a ``None`` output is TE's fresh 0-element complex32 sentinel on both paths
        assert len(got) == len(want) and all(
            t is u or (t.numel() == u.numel() == 0 and t.dtype == u.dtype == torch.complex32)
            for t, u in zip(got, want))
        mine, te = seen
        assert type(mine) is type(te) and mine is not te
        storages = set(call.describe()["storage_fields"])
        assert storages == ({"inputmat", "weight_fp8"} if is_bwd and precision == "fp8-cs" else set())
        for f in dataclasses.fields(te):
            x, y = getattr(mine, f.name), getattr(te, f.name)
            if f.name in storages:
                assert type(x) is type(y) and x is not y
                names, _ = y.__tensor_flatten__()
                assert all(getattr(x, n) is getattr(y, n) for n in names), f.name
                # the storage constructor TE's unflatten calls builds its own quantizer copy on both paths
                assert type(x._quantizer) is type(y._quantizer) and x._quantizer == y._quantizer
                assert x._fp8_dtype == y._fp8_dtype
            else:
                assert x is y, f"{call.qualname} field {f.name}: {x!r} is not {y!r}"


def test_lowering_unavailable_only_retargets(te_aot_graphs, monkeypatch):
    """Without the Inductor lowering (torch API drift: ``feature_error`` names what is missing, the
    patch-table row ``lowering.direct_call`` is refused with it) the pass only retargets, and the
    reason is recorded."""
    from te_passes.compat import table
    from te_passes.compat.install import install

    install()
    assert dl.feature_error() is None  # torch 2.14.1 / 2.15 have everything the lowering needs
    table.revert(["lowering.direct_call"])
    try:
        with monkeypatch.context() as m:
            m.setattr(dl, "feature_error", lambda: "this torch's Inductor lacks X")
            install()
            assert table.refusal("lowering.direct_call") == "this torch's Inductor lacks X"
            gm, run = _run(te_aot_graphs("fp8-cs", 1), "post_grad_bwd")
    finally:
        table.revert(["lowering.direct_call"])
        install()
    (n,) = _te_nodes(gm)
    assert n.target is torch.ops.transformer_engine_compile.linear_backward_base.default
    assert dc.META_KEY not in n.meta
    assert [(r.kind, r.data.get("reason")) for r in run.records] == [
        ("kept", "this torch's Inductor lacks X"), ("retargeted", None)]
    assert table.refusal("lowering.direct_call") is None and dl.lowering_reason(n.target) is None


def test_base_op_without_plan_lowers_as_a_fallback(toy, monkeypatch):
    """Retargeted but refused (constants not hoisted): Inductor emits the base op's dispatcher
    call through the direct-call lowering's plain fallback; results equal the wrapper path."""
    from torch._inductor.utils import run_and_get_code

    params = _params(2)
    ref = _steps(_compile(toy, **{"te_passes.disable": ["call_te_impl_directly"]}), params, 2)
    compiled = _compile(toy, **{"te_passes.disable": ["hoist_te_constants"]})
    disp = _dispatcher_counts(monkeypatch, toy)
    outs, codes = run_and_get_code(lambda: _steps(compiled, params, 2))
    assert "_te_direct_" not in "".join(codes)
    assert len(re.findall(rf"torch\.ops\.{NS}\.{toy.OP_NAME}_base\.default\(", codes[0])) == 2
    assert disp == {"fwd": 4, "bwd": 4}
    for (o, g), (ro, rg) in zip(outs, ref):
        assert torch.equal(o, ro) and all(torch.equal(a, b) for a, b in zip(g, rg))


def test_feature_error_reads_no_source(toy, monkeypatch):
    """``feature_error`` checks torch's Inductor API from attributes and code objects: it never
    parses torch's source (``inspect.getsource`` of ``graph.py`` / ``ir.py`` cost the first
    compile of a process hundreds of ms, issue 13), and still names each missing piece."""
    import inspect

    from torch._inductor import graph as G, ir

    monkeypatch.setattr(inspect, "getsource", lambda *a, **k: pytest.fail("feature_error read source"))
    monkeypatch.setattr(dl, "feature_error", dl.feature_error.__wrapped__)  # uncached for this test
    assert dl.feature_error() is None

    def no_stores(self, *a, **k):
        self.x = 1

    for cls, attr in ((G.GraphLowering, "opaque_value_type_classes"), (ir.FallbackKernel, "unflatten_args")):
        with monkeypatch.context() as m:
            m.setattr(cls, "__init__", no_stores)
            why = dl.feature_error()
            assert why is not None and cls.__name__ in why and attr in why, why
    with monkeypatch.context() as m:
        m.delattr(ir.ExternKernel, "python_kernel_name")
        why = dl.feature_error()
        assert why is not None and "python_kernel_name" in why, why
    with monkeypatch.context() as m:
        from torch._inductor import lowering as L

        m.delattr(L, "tag_to_layout_constraint")
        why = dl.feature_error()
        assert why is not None and "tag_to_layout_constraint" in why, why
    # a refusal is the row's (lowering.direct_call) and what the pass reads for an op without the lowering
    from te_passes.compat import table
    from te_passes.compat.install import install

    table.revert(["lowering.direct_call"])
    try:
        with monkeypatch.context() as m:
            m.setattr(dl, "feature_error", lambda: "this torch's Inductor lacks what the direct-call lowering needs (X)")
            install()
            assert "lacks" in table.refusal("lowering.direct_call")
            assert "lacks" in dl.lowering_reason(overload(f"{NS}::{toy.OP_NAME}_base"))
    finally:
        table.revert(["lowering.direct_call"])
        install()
    assert dl.lowering_reason(overload(f"{NS}::{toy.OP_NAME}_base")) is None


def test_lowering_not_installed_only_retargets(te_aot_graphs, monkeypatch):
    """The pass only looks the lowering up (it registers nothing): a base op whose lowering
    ``compat.install()`` did not register is retargeted, kept, and the record says why."""
    from torch._inductor import lowering as L

    from te_passes.compat.install import install
    from te_passes.testing.capture import run_pipeline

    base = torch.ops.transformer_engine_compile.linear_base.default
    a = te_aot_graphs("fp8-cs", 1)
    install()
    monkeypatch.delitem(L.lowerings, base)  # as if install() had not registered it (monkeypatch puts it back)
    n_lowerings = len(L.lowerings)
    (rep,) = run_pipeline(a, stages=["post_grad_fwd"])
    run = next(r for r in rep.runs if r.name == "call_te_impl_directly")
    (n,) = _te_nodes(rep.gm)
    assert n.target is base and dc.META_KEY not in n.meta
    (kept,) = [r for r in run.records if r.kind == "kept"]
    assert kept.data["reason"].startswith("direct-call lowering not installed: ") and str(base) in kept.data["reason"]
    assert base not in L.lowerings and len(L.lowerings) == n_lowerings


def test_install_registers_lowerings_of_families_defined_later(toy):
    """``compat.install()`` registers the direct-call lowering of every TE op family in OPDEFS
    when it runs, the toy family (defined after te_passes was imported) included; idempotent."""
    from torch._inductor import lowering as L

    from te_passes.compat.install import install

    install()
    ops = [overload(f"{NS}::{toy.OP_NAME}{s}") for s in ("_base", "_backward_base")]
    real = [torch.ops.transformer_engine_compile.linear_base.default,
            torch.ops.transformer_engine_compile.linear_backward_base.default]
    for op in ops + real:
        assert dl.lowering_reason(op) is None and L.lowerings[op]._te_passes_direct
    before = dict(L.lowerings)
    install()
    assert dict(L.lowerings) == before
