"""insert_early_frees: placement, refusals, the free op, Inductor, real TE graphs, and a
property test with a poisoning interpreter."""

from __future__ import annotations

import os

import pytest
import torch
import torch.fx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from te_passes.analyses.liveness import analyze
from te_passes.pipeline.base import PassSkipped, Stage
from te_passes.passes.insert_early_frees import InsertEarlyFrees
from te_passes.pipeline.manager import PassManager
from te_passes.ops import free as free_op
from te_passes.ops.free import free_storage, is_free_node
from te_passes.testing.harness import pass_context

from _qgraphs import F8, QGEMM, QUANTIZE2, real_aot, record_vals

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _runtime():
    """``compat.install()``, as the backend does before any pass runs: it registers the free
    op's Inductor lowering, which the pass requires and never registers itself."""
    from te_passes.compat.install import install

    install()


def _frees(gm):
    """``[(freed node name, name of the node right before the free)]`` in graph order."""
    out = []
    for n in gm.graph.nodes:
        if is_free_node(n):
            prev = n.prev
            while is_free_node(prev):
                prev = prev.prev
            out.append((n.args[0].name, prev.name))
    return out


def _records(res, kind):
    return [r for r in res.records if r.kind == kind]


# --------------------------------------------------------------------------- the free op
def test_free_storage_releases_like_clear_tensor_data():
    t = torch.randn(64, 64)
    view = t[:8]
    storage = t.untyped_storage()
    free_storage(t)
    assert t.numel() == 0 and t.dtype == torch.float32 and t.untyped_storage().nbytes() == 0
    # an alias the graph cannot see keeps its storage (rebinding, not resize_(0))
    assert view.untyped_storage().nbytes() == 64 * 64 * 4 and storage.nbytes() == 64 * 64 * 4
    assert free_storage._schema.is_mutable
    assert torch.Tag.cudagraph_unsafe not in free_storage.tags


def test_free_storage_fake_impl_is_data_free():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        t = torch.empty(4)
        assert free_storage(t) is None
        assert t.shape == (4,)  # fake tensors keep their metadata


# --------------------------------------------------------------------------- placement
def _opaque_graph():
    def f(x, w):
        data, sinv = QUANTIZE2(x)
        t = aten.t.default(data)
        y = QGEMM(data, sinv, w)
        q2 = aten._to_copy.default(x, dtype=F8)       # only ATen uses it
        z = aten._to_copy.default(q2, dtype=torch.float32)
        y2 = QGEMM(aten.t.default(t), sinv, w)        # last use of data, through two views
        r = aten.relu.default(y)
        return (r + y2 + z, sinv)                     # sinv is an output (saved)

    x, w = torch.randn(4, 4), torch.randn(4, 4)
    gm = make_fx(f)(x, w)
    record_vals(gm, x, w)
    return gm, (x, w), f


def test_frees_after_last_use_through_views_policy_opaque():
    gm, args, f = _opaque_graph()
    expect = f(*args)
    res = InsertEarlyFrees().run(gm, pass_context(Stage.POST_GRAD_FWD))
    gm.recompile()
    assert res.modified
    assert _frees(gm) == [("getitem", "qgemm_1")]
    (free,) = _records(res, "free")
    assert free.node == "getitem"
    assert free.data["after"] == "qgemm_1" and free.data["bytes"] == 16 and free.data["source"] == "dtype"
    kept = {r.node: r.data["reason"] for r in _records(res, "kept")}
    # the f32 scale of an unknown quantize op is not recognised as quantized; the ATen-only
    # FP8 cast is left to Inductor's reference counting
    assert set(kept) == {"_to_copy"}
    assert kept["_to_copy"].startswith("only ATen/Inductor kernels use it")
    out = gm(*args)
    assert all(torch.equal(a, b) for a, b in zip(out, expect))


def test_policy_all_also_frees_aten_only_quantized_values():
    gm, args, f = _opaque_graph()
    res = InsertEarlyFrees(policy="all").run(gm, pass_context(Stage.POST_GRAD_FWD))
    gm.recompile()
    assert _frees(gm) == [("_to_copy", "_to_copy_1"), ("getitem", "qgemm_1")]
    assert [r.node for r in _records(res, "free")] == ["getitem", "_to_copy"]
    out = gm(*args)
    assert all(torch.equal(a, b) for a, b in zip(out, f(*args)))


def test_bad_policy_is_rejected():
    with pytest.raises(ValueError, match="policy must be one of"):
        InsertEarlyFrees(policy="sometimes")


def test_never_frees_inputs_outputs_escapes_or_unextracted_outputs():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    qin = g.placeholder("qin")                  # a quantized graph input
    w = g.placeholder("w")
    cache = g.placeholder("cache")
    tup = g.call_function(QUANTIZE2, (x,))
    data = g.call_function(__import__("operator").getitem, (tup, 0))
    tup2 = g.call_function(QUANTIZE2, (w,))
    sc2 = g.call_function(__import__("operator").getitem, (tup2, 1))   # its data is never extracted
    q2 = g.call_function(aten._to_copy.default, (x,), {"dtype": F8})
    s = g.call_function(aten.set_.source_Tensor, (cache, q2))         # escapes into an input
    sv = g.call_function(aten.detach.default, (data,))
    y = g.call_function(QGEMM, (qin, sc2, w))
    y2 = g.call_function(QGEMM, (q2, g.call_function(aten.ones.default, ([1],)), w))
    g.output((y, y2, sv))                                              # data returned via a view
    gm = torch.fx.GraphModule({}, g)
    args = (torch.randn(4, 4), torch.randn(4, 4).to(F8), torch.randn(4, 4), torch.empty(0, dtype=F8))
    record_vals(gm, *args)
    res = InsertEarlyFrees(policy="all").run(gm, pass_context(Stage.POST_GRAD_FWD))
    assert not res.modified and _frees(gm) == []
    kept = {r.node: r.data["reason"] for r in _records(res, "kept")}
    assert kept["qin"] == "graph input: owned by the caller"
    assert kept[data.name] == "graph output"
    assert kept[f"{tup2.name}[0]"].startswith("no node extracts this output")
    assert kept[q2.name] == f"escapes the graph at {s.name}: set_ into graph input cache"
    assert set(kept) == {"qin", "cache", data.name, f"{tup2.name}[0]", q2.name}


def test_backward_saved_tensors_are_never_freed():
    g = torch.fx.Graph()
    saved = g.placeholder("getitem_2")
    sinv = g.placeholder("detach")
    w = g.placeholder("primals_1")
    tan = g.placeholder("tangents_1")
    y = g.call_function(QGEMM, (saved, sinv, w))
    g.output((g.call_function(aten.add.Tensor, (y, tan)),))
    gm = torch.fx.GraphModule({}, g)
    record_vals(gm, torch.randn(4, 4).to(F8), torch.ones(1), torch.randn(4, 4), torch.randn(4, 4))
    res = InsertEarlyFrees(policy="all").run(gm, pass_context(Stage.POST_GRAD_BWD))
    assert _frees(gm) == []
    (kept,) = _records(res, "kept")
    assert kept.node == "getitem_2" and kept.data["reason"].startswith("saved tensor (backward graph input)")
    assert "retain_graph=True" in kept.data["reason"]


def test_memory_record_and_stages():
    gm, _, _ = _opaque_graph()
    res = InsertEarlyFrees().run(gm, pass_context(Stage.POST_GRAD_FWD))
    (mem,) = _records(res, "memory")
    assert mem.data["peak_before"] == mem.data["peak_before_concrete"]
    assert mem.data["peak_after"] <= mem.data["peak_before"]
    assert mem.data["symbolic"] is False
    assert InsertEarlyFrees.stages == frozenset({Stage.JOINT, Stage.POST_GRAD_FWD, Stage.POST_GRAD_BWD})


def test_skips_when_the_inductor_lowering_is_unavailable(monkeypatch):
    """``compat.install()`` could not register the lowering (torch API drift: the patch-table row
    ``lowering.free_storage`` is refused, naming what is missing): the pass says why."""
    from torch._inductor import lowering as L

    from te_passes.compat import table
    from te_passes.compat.install import install

    table.revert(["lowering.free_storage"])
    try:
        with monkeypatch.context() as m:
            m.delattr(L, "register_lowering")
            install()
        assert "register_lowering" in table.refusal("lowering.free_storage")
        assert free_storage not in L.lowerings
        gm, _, _ = _opaque_graph()
        with pytest.raises(PassSkipped, match=r"not installed: te_passes\.compat\.install\.install\(\) registers it"
                                              r".*Inductor could reuse a freed buffer"):
            InsertEarlyFrees().run(gm, pass_context(Stage.POST_GRAD_FWD))
        rep = PassManager([InsertEarlyFrees()]).run(gm, pass_context(Stage.POST_GRAD_FWD))
        assert rep.runs[0].status == "skipped" and not any(is_free_node(n) for n in gm.graph.nodes)
    finally:
        table.revert(["lowering.free_storage"])
        install()
    assert table.refusal("lowering.free_storage") is None and free_op.lowering_reason() is None


# --------------------------------------------------------------------------- Inductor
def test_inductor_keeps_the_free_and_never_reuses_the_freed_buffer():
    """Without the lowering, Inductor's wrapper reuses a dead buffer of the same size
    (``buf4 = buf0; del buf0  # reuse``) — after a free that buffer has no storage. With it,
    the free stays in place and the buffer is never reused; results equal eager."""
    from torch._inductor.custom_graph_pass import CustomGraphPass
    from torch._inductor.utils import run_and_get_code

    assert free_op.lowering_reason() is None  # compat.install() registered it (the autouse fixture)

    class InsertFree(CustomGraphPass):
        def __call__(self, graph):
            mms = [n for n in graph.nodes if n.target is aten.mm.default]
            with graph.inserting_after(mms[1]):
                graph.call_function(free_storage, (mms[0],))

        def uuid(self):
            return None

    def f(x):
        return x @ x @ x @ x

    x = torch.randn(8, 8)
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="inductor", options={"post_grad_custom_pre_pass": InsertFree(),
                                                             "fx_graph_cache": False})
    out, (code,) = run_and_get_code(compiled, x)
    torch._dynamo.reset()
    assert torch.allclose(out, f(x), rtol=1e-4, atol=1e-4)
    free_lines = [ln.strip() for ln in code.splitlines() if "te_passes.free_storage" in ln]
    assert len(free_lines) == 1
    freed = free_lines[0].split("(")[1].rstrip(")")
    assert f"= {freed}; del {freed}  # reuse" not in code
    assert "# reuse" not in code.split(free_lines[0])[1]


# --------------------------------------------------------------------------- real TE graphs
_ROLES = {"fp8-cs": 5, "mxfp8": 6, "bf16": 0}


@pytest.mark.te
@pytest.mark.parametrize("layers", [1, 4])
@pytest.mark.parametrize("precision", ["bf16", "fp8-cs", "mxfp8"])
def test_real_te_linear_graphs_free_nothing_and_say_why(precision, layers):
    c = real_aot(precision, layers)
    fw_before = str(c.forward.graph)
    rep_fw = PassManager([InsertEarlyFrees()]).run(c.forward, pass_context(Stage.POST_GRAD_FWD))
    rep_bw = PassManager([InsertEarlyFrees()]).run(c.backward, pass_context(Stage.POST_GRAD_BWD))
    (run_fw,), (run_bw,) = rep_fw.runs, rep_bw.runs
    assert run_fw.status == run_bw.status == "ok" and not run_fw.changed and not run_bw.changed
    assert str(c.forward.graph) == fw_before
    n_q = _ROLES[precision] * layers
    # forward: every quantized buffer is saved for backward (a graph output)
    kept_fw = [r for r in run_fw.records if r.kind == "kept"]
    assert [r.kind for r in run_fw.records if r.kind == "free"] == []
    assert len(kept_fw) == n_q
    assert {r.data["reason"] for r in kept_fw} <= {"graph output (saved for backward)"}
    # backward: the saved buffers are inputs the caller (AOTAutograd) owns
    kept_bw = [r for r in run_bw.records if r.kind == "kept"]
    assert len(kept_bw) == n_q
    assert all(r.data["reason"].startswith("saved tensor (backward graph input)") for r in kept_bw)
    assert {r.node for r in kept_bw} == {r.node for r in kept_fw}
    for run in (run_fw, run_bw):
        (mem,) = [r for r in run.records if r.kind == "memory"]
        assert mem.data["peak_before"] == mem.data["peak_after"] > 0


@pytest.mark.te
@pytest.mark.parametrize("precision", ["fp8-cs", "mxfp8"])
def test_real_joint_graph_plan_frees_saved_buffers_after_linear_backward(precision):
    """The joint graph (forward + backward in one graph, before partitioning) is where saved
    quantized buffers are allocated *and* consumed: the plan frees each right after the
    ``linear_backward`` that last reads it, with the role from TE's storage slot."""
    c = real_aot(precision, 1)
    lv = analyze(c.joint, stage="joint")
    plan, records = InsertEarlyFrees().plan(lv, Stage.JOINT)
    got = {r.node: (r.data["role"], r.data["after"], r.data["field"]) for r in records if r.kind == "free"}
    if precision == "fp8-cs":
        assert got == {"getitem_2": ("columnwise_data", "linear_backward", "inputmat"),
                       "getitem_3": ("scale_inv", "linear_backward", "inputmat"),
                       "getitem_4": ("rowwise_data", "linear_backward", "weight_fp8"),
                       "getitem_5": ("columnwise_data", "linear_backward", "weight_fp8"),
                       "getitem_6": ("scale_inv", "linear_backward", "weight_fp8")}
    else:
        assert {k: v[0] for k, v in got.items()} == {
            "getitem_2": "columnwise_data", "getitem_3": "columnwise_scale_inv", "getitem_4": "rowwise_data",
            "getitem_5": "rowwise_scale_inv", "getitem_6": "columnwise_data", "getitem_7": "columnwise_scale_inv"}
    assert [b.name for b, _ in plan] == sorted(got)


# --------------------------------------------------------------------------- property test
class UseAfterFree(AssertionError):
    pass


class PoisonInterpreter(torch.fx.Interpreter):
    """Runs a graph; a ``free_storage`` node fills the storage with 0xFF bytes (NaN for
    floats) instead of releasing it and remembers it; any later node reading a tensor on a
    poisoned storage raises :class:`UseAfterFree`. Values are never garbage-collected, so a
    poisoned storage's address cannot be reused by a new allocation."""

    def __init__(self, gm):
        super().__init__(gm, garbage_collect_values=False)
        self.poisoned: dict[int, str] = {}
        self.frees = 0

    def _check(self, node, args, kwargs):
        def visit(a):
            if isinstance(a, torch.Tensor):
                p = a.untyped_storage().data_ptr()
                if p and p in self.poisoned:
                    raise UseAfterFree(f"{node.name} reads storage freed by {self.poisoned[p]}")
            return a

        torch.fx.node.map_aggregate((args, kwargs), visit)

    def run_node(self, n):
        if n.op in ("call_function", "call_method", "call_module", "output"):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            self._check(n, args, kwargs)
            if is_free_node(n):
                t = args[0]
                st_ = t.untyped_storage()
                if st_.nbytes():
                    st_.fill_(0xFF)
                    self.poisoned[st_.data_ptr()] = n.name
                self.frees += 1
                return None
        return super().run_node(n)


OPS = ("quantize_cast", "quantize_multi", "view_t", "view_detach", "view_u8", "split", "set_internal",
       "inplace_copy", "consume_opaque", "consume_aten", "save", "multi_all")


def build_random_graph(program):
    """Build an ATen-level graph from ``program`` (``[(op, a, b, flag)]``): quantize (casts,
    a multi-output op with some outputs unextracted), views (t, detach, dtype views, split),
    a ``set_`` into an internal tensor, in-place ``copy_`` between quantized values, opaque
    (``tpq::qgemm``) and ATen consumers, and saved-for-backward values (graph outputs).
    Returns ``(gm, args)``."""
    import operator

    g = torch.fx.Graph()
    x = g.placeholder("x")
    w = g.placeholder("w")
    floats = [x]
    quants = []       # (node, rows): fp8 tensors with 4 columns
    scales = []
    saved = []
    for op, a, b, flag in program:
        f = floats[a % len(floats)]
        if op == "quantize_cast":
            quants.append((g.call_function(aten._to_copy.default, (f,), {"dtype": F8}), 4))
        elif op in ("quantize_multi", "multi_all"):
            tup = g.call_function(QUANTIZE2, (f,))
            if flag or op == "multi_all":
                quants.append((g.call_function(operator.getitem, (tup, 0)), 4))
            if not flag or op == "multi_all":
                scales.append(g.call_function(operator.getitem, (tup, 1)))
        elif not quants:
            continue
        elif op == "view_t":
            q, r = quants[a % len(quants)]
            if r == 4:
                quants.append((g.call_function(aten.t.default, (q,)), 4))
        elif op == "view_detach":
            q, r = quants[a % len(quants)]
            quants.append((g.call_function(aten.detach.default, (q,)), r))
        elif op == "view_u8":
            q, r = quants[a % len(quants)]
            u8 = g.call_function(aten.view.dtype, (q, torch.uint8))
            quants.append((g.call_function(aten.view.dtype, (u8, F8)), r))
        elif op == "split":
            q, r = quants[a % len(quants)]
            if r == 4:
                parts = g.call_function(aten.split.Tensor, (q, 2))
                quants.append((g.call_function(operator.getitem, (parts, b % 2)), 2))
        elif op == "set_internal":
            q, r = quants[a % len(quants)]
            tmp = g.call_function(aten.empty.memory_format, ([0],), {"dtype": F8})
            g.call_function(aten.set_.source_Tensor, (tmp, q))
            quants.append((tmp, r))
        elif op == "inplace_copy":
            # dst.copy_(src): an in-place write whose result aliases dst
            # (src: a fresh cast, so it never overlaps dst)
            dst, r = quants[a % len(quants)]
            if r == 4:
                src = g.call_function(aten._to_copy.default, (floats[b % len(floats)],), {"dtype": F8})
                quants.append((g.call_function(aten.copy_.default, (dst, src)), r))
        elif op == "consume_opaque":
            q, r = quants[a % len(quants)]
            s = scales[b % len(scales)] if scales else g.call_function(aten.ones.default, ([1],))
            y = g.call_function(QGEMM, (q, s, w))
            floats.append(y if r == 4 else g.call_function(aten.add.Tensor, (x, g.call_function(aten.mean.default, (y,)))))
        elif op == "consume_aten":
            q, _ = quants[a % len(quants)]
            d = g.call_function(aten._to_copy.default, (q,), {"dtype": torch.float32})
            floats.append(g.call_function(aten.add.Tensor, (x, g.call_function(aten.mean.default, (d,)))))
        elif op == "save":
            pool = [n for n, _ in quants] + scales
            saved.append(pool[b % len(pool)])
    total = floats[-1]
    for f in floats[1:-1]:
        total = g.call_function(aten.add.Tensor, (total, f))
    g.output((total, *saved))
    gm = torch.fx.GraphModule({}, g)
    args = (torch.randn(4, 4), torch.randn(4, 4))
    record_vals(gm, *args)
    return gm, args


def _same(a, b):
    if isinstance(a, torch.Tensor):
        if a.dtype in (F8,):
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        return a.shape == b.shape and torch.equal(a, b)
    return a == b


_EXAMPLES = int(os.environ.get("TE_PASSES_PROPERTY_EXAMPLES", "2000"))

program_st = st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 63), st.integers(0, 63), st.booleans()),
                      min_size=1, max_size=14)


@settings(max_examples=_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(program=program_st, policy=st.sampled_from(["all", "opaque"]))
def test_property_frees_never_change_results(program, policy):
    gm, args = build_random_graph(program)
    expect = torch.fx.Interpreter(gm).run(*args)
    res = InsertEarlyFrees(policy=policy).run(gm, pass_context(Stage.POST_GRAD_FWD))
    gm.graph.lint()
    gm.recompile()
    poison = PoisonInterpreter(gm)
    got = poison.run(*args)                       # raises UseAfterFree on any read of freed storage
    assert poison.frees == len(_records(res, "free"))
    assert len(got) == len(expect) and all(_same(a, b) for a, b in zip(got, expect))
    # the real op too (rebinding), with FX's own last-use GC
    again = gm(*args)
    assert all(_same(a, b) for a, b in zip(again, expect))
    (mem,) = _records(res, "memory")
    assert mem.data["peak_after"] <= mem.data["peak_before"]


def test_property_generator_exercises_frees():
    """The random programs do produce frees (so the property test is not vacuous)."""
    prog = [("quantize_multi", 0, 0, True), ("consume_opaque", 0, 0, False), ("view_t", 0, 0, False),
            ("consume_opaque", 1, 0, False), ("quantize_cast", 0, 0, False), ("consume_aten", 2, 0, False),
            ("quantize_cast", 1, 0, False), ("save", 0, 3, False), ("quantize_cast", 0, 0, False),
            ("set_internal", 4, 0, False)]
    gm, args = build_random_graph(prog)
    res = InsertEarlyFrees(policy="all").run(gm, pass_context(Stage.POST_GRAD_FWD))
    # the multi-output op's data: freed after the second qgemm, which reads it through t();
    # the cast: after its dequantizing copy; the saved cast is an output; the set_ pair shares
    # a storage and is left alone
    assert _frees(gm) == [("getitem", "qgemm_default_1"), ("_to_copy_default", "_to_copy_default_1")]
    kept = {r.node: r.data["reason"] for r in _records(res, "kept")}
    assert kept["_to_copy_default_2"] == "graph output"
    assert kept["empty_memory_format"] == ("its storage is shared with _to_copy_default_3 (set_); "
                                           "left to reference counting")
    assert kept["_to_copy_default_3"].startswith("its storage is shared with empty_memory_format")
    poison = PoisonInterpreter(gm)
    poison.run(*args)
    assert poison.frees == 2


def test_poison_interpreter_catches_a_misplaced_free():
    """The oracle works: a free moved before the last use is caught."""
    gm, args, _ = _opaque_graph()
    data = next(n for n in gm.graph.nodes if n.name == "getitem")
    first_use = next(n for n in gm.graph.nodes if n.name == "qgemm")
    with gm.graph.inserting_after(first_use):
        gm.graph.call_function(free_storage, (data,))
    gm.recompile()
    with pytest.raises(UseAfterFree, match="reads storage freed by free_storage"):
        PoisonInterpreter(gm).run(*args)


def test_te_inductor_end_to_end_frees_after_the_opaque_consumer():
    """``backend="te_inductor"`` on CPU: the pass runs at post-grad, the free of the FP8
    temporary that the opaque op reads lands right after that op in Inductor's output code,
    its buffer is never reused, results equal eager, and the report has the records."""
    from torch._inductor.utils import run_and_get_code

    from te_passes.report import clear_compile_reports, compile_reports

    def f(x, w):
        data, sinv = QUANTIZE2(x)
        y = QGEMM(data, sinv, w)
        return torch.relu(y) * 2

    x, w = torch.randn(8, 8), torch.randn(8, 8)
    torch._dynamo.reset()
    clear_compile_reports()
    compiled = torch.compile(f, backend="te_inductor", options={"fx_graph_cache": False})
    out, (code,) = run_and_get_code(compiled, x, w)
    torch._dynamo.reset()
    assert torch.equal(out, f(x, w))
    lines = [ln.strip() for ln in code.splitlines()]
    (i_free,) = [i for i, ln in enumerate(lines) if "te_passes.free_storage.default(" in ln]
    i_gemm = max(i for i, ln in enumerate(lines) if "tpq.qgemm.default(" in ln)
    assert i_gemm < i_free
    freed = lines[i_free].split("free_storage.default(")[1].split(")")[0]
    assert f"= {freed}; del {freed}  # reuse" not in code
    (rep,) = compile_reports()
    frees = rep.records("free")
    assert [(r.data["role"], r.data["source"]) for r in frees] == [("unknown", "dtype")]
    assert frees[0].data["after"].startswith("qgemm")
    assert [r.data["findings"] for r in rep.records("pool_check")] == [0]


@pytest.mark.te
@pytest.mark.parametrize("precision,roles", [
    ("fp8-cs", ["columnwise_data", "scale_inv", "rowwise_data", "columnwise_data", "scale_inv"]),
    ("mxfp8", ["columnwise_data", "columnwise_scale_inv", "rowwise_data", "rowwise_scale_inv",
               "columnwise_data", "columnwise_scale_inv"]),
])
def test_pipeline_joint_stage_names_the_forward_saved_buffers(precision, roles):
    """Through the pipeline (joint -> post-grad fwd -> post-grad bwd, as the backend runs it):
    the joint stage records the exact role of each saved buffer under its forward node name;
    the forward's own records (stage-local, replayable) name the same nodes."""
    from te_passes.testing.capture import run_pipeline

    c = real_aot(precision, 1)
    joint, fwd, bwd = run_pipeline(c, stages=[Stage.JOINT, Stage.POST_GRAD_FWD, Stage.POST_GRAD_BWD],
                                   passes=[InsertEarlyFrees()])
    (rec,) = joint.runs[0].records
    assert rec.kind == "saved_roles" and not joint.runs[0].changed
    names = [f"getitem_{i}" for i in range(2, 2 + len(roles))]
    assert [rec.data["roles"][n]["role"] for n in names] == roles
    assert {rec.data["roles"][n]["field"] for n in names} == {"inputmat", "weight_fp8"}
    kept_fw = [r for r in fwd.runs[0].records if r.kind == "kept"]
    assert [r.node for r in kept_fw] == names
    assert {(r.data["role"], r.data["source"]) for r in kept_fw} == {("unknown", "te_forward_output")}
    assert {r.data["reason"] for r in kept_fw} == {"graph output (saved for backward)"}
    kept_bw = [r for r in bwd.runs[0].records if r.kind == "kept"]
    assert [r.node for r in kept_bw] == names and [r.data["role"] for r in kept_bw] == roles
