"""Alias-aware liveness, quantized classification and the memory estimate."""

from __future__ import annotations

import operator

import pytest
import sympy
import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from te_passes.analyses.alias_rules import is_opaque_call
from te_passes.analyses.buffers import BufferOrigin
from te_passes.analyses.liveness import analyze
from te_passes.analyses.memory import estimate, estimate_graph
from te_passes.te.quantized import QUANTIZED_DTYPES, classify_quantized, link_saved_roles

from _qgraphs import F8, QGEMM, QUANTIZE2, real_aot, record_vals  # noqa: F401 - registers tpq ops

aten = torch.ops.aten


def _by_name(lv):
    return {b.name: b for b in lv.buffers}


def _node(gm, name):
    return next(n for n in gm.graph.nodes if n.name == name)


# --------------------------------------------------------------------------- aliasing
def test_views_extend_the_base_lifetime_and_getitem_selects_outputs():
    def f(x, w):
        data, sinv = QUANTIZE2(x)
        t = aten.t.default(data)          # view of data
        u8 = aten.view.dtype(t, torch.uint8)  # view of the view
        y = QGEMM(data, sinv, w)
        z = aten.relu.default(y)
        back = aten.view.dtype(u8, F8)
        y2 = QGEMM(aten.t.default(back), sinv, w)
        return (z + y2,)

    x, w = torch.randn(4, 4), torch.randn(4, 4)
    gm = make_fx(f)(x, w)
    lv = analyze(gm)
    bufs = _by_name(lv)
    data, sinv = bufs["getitem"], bufs["getitem_1"]
    # getitem selects exactly one output of the multi-output op; views alias it
    assert lv.buffers_of(_node(gm, "getitem")) == {data}
    assert lv.buffers_of(_node(gm, "t")) == {data}
    assert lv.buffers_of(_node(gm, "view")) == {data}
    assert lv.buffers_of(_node(gm, "quantize2")) == {data, sinv}
    # data's last use is the second qgemm, reached only through views
    assert lv.last_use[data].name == "qgemm_1"
    assert lv.last_use[sinv].name == "qgemm_1"
    assert lv.owned_buffer(_node(gm, "getitem")) is data
    assert lv.owned_buffer(_node(gm, "t")) is None
    assert data.quantized is not None and data.quantized.source == "dtype"
    assert lv.opaque_uses[data] == [_node(gm, "qgemm"), _node(gm, "qgemm_1")]


def test_list_view_inplace_and_unsafe_view_alias_their_input():
    def f(x):
        a = aten.mul.Tensor(x, 2)
        parts = aten.split.Tensor(a, 2)
        p0 = parts[0]
        b = aten.add_.Tensor(p0, 1)          # in-place on a view of a
        c = aten._unsafe_view.default(aten.clone.default(x), [16])
        d = aten.add.Tensor(c, 1)
        return (b, d)

    gm = make_fx(f)(torch.randn(4, 4))
    lv = analyze(gm)
    bufs = _by_name(lv)
    a = bufs["mul"]
    assert lv.buffers_of(_node(gm, "getitem")) == {a}
    assert lv.buffers_of(_node(gm, "add_")) == {a}
    assert lv.is_output(a)  # b is a view of a and is returned
    clone = bufs["clone"]
    assert lv.buffers_of(_node(gm, "_unsafe_view")) == {clone}
    assert lv.last_use[clone].name == "add"
    assert not lv.is_output(clone)


def test_set_into_input_escapes_and_set_between_internals_extends_lifetime():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    cache = g.placeholder("cache")
    q = g.call_function(aten._to_copy.default, (x,), {"dtype": F8})
    tmp = g.call_function(aten.empty.memory_format, ([16],), {"dtype": F8})
    s1 = g.call_function(aten.set_.source_Tensor, (tmp, q))
    s2 = g.call_function(aten.set_.source_Tensor, (cache, q))
    y = g.call_function(aten.relu.default, (x,))
    g.output((y, tmp))
    gm = torch.fx.GraphModule({}, g)
    lv = analyze(gm)
    qb = lv.owned_buffer(q)
    assert qb is not None and qb.quantized is None  # no metadata: dtype unknown
    assert [(e.node, e.how) for e in lv.escaped(qb)] == [(s2, "set_ into graph input cache")]
    # tmp is returned and holds q's storage: q is live at the end through it
    assert lv.is_output(qb)
    assert lv.live_at_end(qb)
    assert lv.holders[qb] == {lv.owned_buffer(tmp), lv.owned_buffer(cache)}
    assert lv.buffers_of(s1) == {lv.owned_buffer(tmp), qb}


def test_python_level_stores_escape():
    class M(torch.nn.Module):
        pass

    g = torch.fx.Graph()
    x = g.placeholder("x")
    obj = g.placeholder("obj")
    y = g.call_function(torch.relu, (x,))
    g.call_function(setattr, (obj, "cache", y))
    lst = g.placeholder("lst")
    z = g.call_method("mul", (x, 2))
    g.call_method("append", (lst, z))
    g.output(x)
    gm = torch.fx.GraphModule(M(), g)
    lv = analyze(gm, stage="dynamo")
    got = {e.buffer.name: e.how for e in lv.escapes}
    assert got == {"relu": "stored into a Python object by setattr",
                   "mul": "stored into a Python object by .append()"}


def test_unknown_dynamo_calls_are_conservative():
    def mystery(t):
        return t

    g = torch.fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.relu, (x,))
    m = g.call_function(mystery, (a,))
    v = g.call_method("view", (a, -1))
    r = g.call_method("reshape", (a, -1))
    g.output((m, v, r))
    lv = analyze(torch.fx.GraphModule({}, g), stage="dynamo")
    ab = lv.owned_buffer(a)
    assert ab is not None
    assert ab in lv.buffers_of(m)            # may alias: an unknown function
    assert lv.buffers_of(v) == {ab}          # aten.view: a pure view
    assert ab in lv.buffers_of(r) and len(lv.buffers_of(r)) == 2  # reshape: may alias or copy
    assert {n.name for n in lv.unknown_alias_nodes} == {"mystery", "reshape"}
    assert is_opaque_call(m) and not is_opaque_call(v) and not is_opaque_call(a)


def test_analyze_rejects_non_graphs():
    with pytest.raises(TypeError, match="torch.fx.Graph or GraphModule, got int"):
        analyze(3)


# --------------------------------------------------------------------------- memory
def test_memory_estimate_concrete_timeline():
    def f(x):
        a = aten.mul.Tensor(x, 2)        # 64 B (4x4 f32)
        q = aten._to_copy.default(a, dtype=F8)  # 16 B
        b = aten._to_copy.default(q, dtype=torch.float32)  # 64 B
        return (aten.add.Tensor(b, x),)  # 64 B

    gm = make_fx(f)(torch.randn(4, 4))
    est = estimate_graph(gm)
    tl = dict(est.timeline)
    # x (64) held throughout; during each node its inputs and outputs are live
    assert tl["mul"] == 64 + 64
    assert tl["_to_copy"] == 64 + 64 + 16
    assert tl["_to_copy_1"] == 64 + 16 + 64
    assert tl["add"] == 64 + 64 + 64
    assert est.peak == est.peak_concrete == 192
    assert est.input_bytes == 64
    assert est.quantized_bytes_at_peak == 0


def test_memory_estimate_symbolic_then_concrete():
    def f(x):
        q = aten._to_copy.default(x, dtype=F8)
        return (aten._to_copy.default(q, dtype=torch.float32),)

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(8, 4))
    rows, cols = (_node(gm, "x_1").meta["val"].shape[i].node.expr for i in (0, 1))
    est = estimate(analyze(gm), sizes={str(rows): 1000, str(cols): 16})
    assert est.symbolic
    assert est.peak.free_symbols == {rows, cols}
    # x: 4*rows*cols B (f32); q: rows*cols B (fp8); out: 4*rows*cols B. Peak while the second
    # cast runs: x + q + out.
    assert sympy.simplify(est.peak - 9 * rows * cols) == 0
    assert est.peak_concrete == 9 * 1000 * 16
    assert est.symbols == {str(rows): 1000, str(cols): 16}
    # without sizes: the shape environment's hints (the example's 8 x 4)
    assert estimate(analyze(gm)).peak_concrete == 9 * 8 * 4


# --------------------------------------------------------------------------- real TE graphs
@pytest.mark.te
@pytest.mark.parametrize("precision,roles", [
    ("fp8-cs", {"getitem_2": ("columnwise_data", "inputmat", "_transpose"),
                "getitem_3": ("scale_inv", "inputmat", "_scale_inv"),
                "getitem_4": ("rowwise_data", "weight_fp8", "_data"),
                "getitem_5": ("columnwise_data", "weight_fp8", "_transpose"),
                "getitem_6": ("scale_inv", "weight_fp8", "_scale_inv")}),
    ("mxfp8", {"getitem_2": ("columnwise_data", "inputmat", "_columnwise_data"),
               "getitem_3": ("columnwise_scale_inv", "inputmat", "_columnwise_scale_inv"),
               "getitem_4": ("rowwise_data", "weight_fp8", "_rowwise_data"),
               "getitem_5": ("rowwise_scale_inv", "weight_fp8", "_rowwise_scale_inv"),
               "getitem_6": ("columnwise_data", "weight_fp8", "_columnwise_data"),
               "getitem_7": ("columnwise_scale_inv", "weight_fp8", "_columnwise_scale_inv")}),
])
def test_real_linear_saved_quantized_buffers_roles(precision, roles):
    c = real_aot(precision, 1)
    linked = link_saved_roles(c.forward.graph, c.backward.graph)
    assert {k: (v.role, v.field, v.inner_name) for k, v in linked.items()} == roles
    # backward: the saved buffers are placeholders with their slot roles
    lv_bw = analyze(c.backward, stage="post_grad_bwd")
    q_bw = {b.name: (b.quantized.role, b.origin) for b in lv_bw.quantized_buffers()}
    assert q_bw == {k: (v[0], BufferOrigin.INPUT) for k, v in roles.items()}
    assert {n.name for n in lv_bw.saved_inputs} >= set(roles)
    # forward: the same buffers are allocated by linear and returned (saved for backward)
    lv_fw = analyze(c.forward, stage="post_grad_fwd", saved_roles=linked)
    q_fw = {b.name: b for b in lv_fw.quantized_buffers()}
    assert set(q_fw) == set(roles)
    for name, b in q_fw.items():
        assert b.origin is BufferOrigin.ALLOCATED and b.node.name == "linear"
        assert b.quantized.role == roles[name][0]
        assert lv_fw.is_output(b)
    # without the backward, the forward still knows they are quantized (role unknown)
    plain = {b.name: b.quantized.source for b in analyze(c.forward, stage="post_grad_fwd").quantized_buffers()}
    assert plain == {k: "te_forward_output" for k in roles}


@pytest.mark.te
def test_real_bf16_graphs_have_no_quantized_buffers():
    c = real_aot("bf16", 1)
    assert analyze(c.forward).quantized_buffers() == []
    assert analyze(c.backward, stage="post_grad_bwd").quantized_buffers() == []
    assert classify_quantized(c.forward.graph) == {}


M, K, N = 32, 64, 128  # tokens, hidden, out_features of the captured te.Linear
BF16, U8, F32 = 2, 1, 4
#: Saved quantized buffers per precision, in bytes, from TE 2.20.2's storage layouts:
#: FP8-CS: input transpose u8[K, M], f32[1] scale_inv; weight data u8[N, K], transpose u8[K, N],
#: f32[1] scale_inv. MXFP8: input columnwise data u8[M, K] + E8M0 scales u8[M/32 -> pad 4,
#: K -> pad 128]; weight rowwise data u8[N, K] + scales u8[N, K/32 -> pad 4], columnwise data
#: u8[N, K] + scales u8[N/32 -> pad 4, K -> pad 128].
SAVED = {
    "bf16": 0,
    "fp8-cs": K * M * U8 + F32 + N * K * U8 + K * N * U8 + F32,
    "mxfp8": M * K * U8 + 4 * 128 + N * K * U8 + N * 4 + N * K * U8 + 4 * 128,
}


@pytest.mark.te
@pytest.mark.parametrize("precision", ["bf16", "fp8-cs", "mxfp8"])
def test_real_linear_memory_estimate(precision):
    c = real_aot(precision, 1)
    params = N * K * BF16 + N * BF16
    inputs_fw = params + M * K * BF16
    est = estimate_graph(c.forward, stage="post_grad_fwd")
    assert est.input_bytes == inputs_fw
    # the op allocates its output and every saved quantized buffer at once
    assert est.peak == inputs_fw + M * N * BF16 + SAVED[precision]
    assert est.peak_node == "linear"
    assert est.quantized_bytes_at_peak == SAVED[precision]
    # backward: params + saved buffers (bf16 saves the input itself) + tangent, plus the three
    # grads linear_backward makes
    saved_bw = SAVED[precision] if precision != "bf16" else M * K * BF16
    inputs_bw = params + saved_bw + M * N * BF16
    grads = N * K * BF16 + N * BF16 + M * K * BF16
    est_bw = estimate_graph(c.backward, stage="post_grad_bwd")
    assert est_bw.input_bytes == inputs_bw
    assert est_bw.peak == inputs_bw + grads
    assert est_bw.quantized_bytes_at_peak == SAVED[precision]


def test_quantized_dtypes_cover_float8_families():
    assert torch.float8_e4m3fn in QUANTIZED_DTYPES and torch.float8_e5m2 in QUANTIZED_DTYPES
    assert torch.uint8 not in QUANTIZED_DTYPES and torch.bfloat16 not in QUANTIZED_DTYPES


def test_higher_order_op_outputs_may_alias_their_inputs():
    """auto_functionalized's "new" tensors become in-place mutations of its inputs once
    Inductor decomposes it: freeing the input at its last *direct* use would be a
    use-after-free through the HOP output."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized

    @torch.library.custom_op("tpq::scale_", mutates_args=("q",))
    def scale_(q: torch.Tensor) -> None:
        q.mul_(1)

    g = torch.fx.Graph()
    x = g.placeholder("x")
    q = g.call_function(aten._to_copy.default, (x,), {"dtype": torch.float32})
    af = g.call_function(auto_functionalized, (torch.ops.tpq.scale_.default,), {"q": q})
    new_q = g.call_function(operator.getitem, (af, 1))
    y = g.call_function(aten.relu.default, (new_q,))
    g.output((y,))
    gm = torch.fx.GraphModule({}, g)
    lv = analyze(gm)
    qb = lv.owned_buffer(q)
    assert qb in lv.buffers_of(new_q)
    assert lv.last_use[qb] is y
    assert af in lv.unknown_alias_nodes


@pytest.mark.te
def test_real_dynamo_graph_fp8_stack():
    """The Dynamo-stage graph of a 2-layer FP8 stack: TE ops (OpOverloadPackets) allocate fresh
    outputs, the layer-1 output flows through GELU into layer 2, the quantizer ``__setattr__``
    residue stores no tensor anywhere, and nothing escapes."""
    from te_passes.testing.capture import capture_dynamo

    c = capture_dynamo("stack", "fp8-cs", layers=2)
    lv = analyze(c.gm, stage="dynamo")
    te_nodes = c.te_nodes()
    assert len(te_nodes) == 2
    outs = [lv.buffers_of(n) for n in te_nodes]
    assert all(outs) and not (outs[0] & outs[1])
    assert all(b.origin is BufferOrigin.ALLOCATED for s in outs for b in s)
    # layer 1's output (getitem 0) is last used by layer 2's op (through the GELU)
    first_out = next(g for g in te_nodes[0].users if g.args[1] == 0)
    (b0,) = lv.buffers_of(first_out)
    assert lv.last_use[b0].name != "output" and lv.order[lv.last_use[b0]] < lv.order[te_nodes[1]]
    assert lv.escapes == []
    assert lv.quantized_buffers() == []  # Dynamo graphs carry no quantized tensors between TE ops


def test_wait_tensor_returns_its_argument():
    """``_c10d_functional.wait_tensor`` has no alias annotation but returns the tensor it was
    given: a free of the collective's output after the wait would hit the waited tensor."""
    import torch.distributed._functional_collectives  # noqa: F401 - registers the ops

    g = torch.fx.Graph()
    x = g.placeholder("x")
    q = g.call_function(aten._to_copy.default, (x,), {"dtype": F8})
    ar = g.call_function(torch.ops._c10d_functional.all_reduce.default, (q, "sum", "0"))
    w = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (ar,))
    y = g.call_function(aten._to_copy.default, (w,), {"dtype": torch.float32})
    g.output((y,))
    lv = analyze(torch.fx.GraphModule({}, g))
    arb = lv.owned_buffer(ar)
    assert lv.buffers_of(w) == {arb}
    assert lv.last_use[arb] is y
