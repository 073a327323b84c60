"""Pass ``hoist_te_constants``: TE constants (quantizers, opaque bundles) built once as named module
globals, not per call. Inductor's generated wrapper is produced on CPU for a real fp8 te.Linear
(forward and backward) and checked for per-call constructions; the backend end to end, with an FX
graph cache hit."""

from __future__ import annotations

import re
import types

import pytest

torch = pytest.importorskip("torch")
te_recipe = pytest.importorskip("transformer_engine.common.recipe")
te = pytest.importorskip("transformer_engine.pytorch")

import torch.fx  # noqa: E402
from torch._inductor.virtualized import V  # noqa: E402

from te_passes.pipeline.base import Stage  # noqa: E402
from te_passes.passes.hoist_te_constants import HoistTEConstants  # noqa: E402
from te_passes.ops.constants import hoisted_name  # noqa: E402
from te_passes.pipeline.manager import PassManager  # noqa: E402
from te_passes.te.graph_constants import TEConstKind, te_const_kind  # noqa: E402

from _inductor_cpu import _inductor_codegen_on_cpu  # noqa: E402
from _recipe_passes import (_runtime, ctx, run_pass)  # noqa: E402,F401 (_runtime: autouse fixture)


# --------------------------------------------------------------------------- 3. constants built once
_INLINE = re.compile(r"_rebuild_quantizer\(|OpaqueValueBundle\(")


@pytest.mark.parametrize("graph", ["forward", "backward"])
def test_post_grad_constants_are_named_copies(te_aot_graphs, graph):
    aot = te_aot_graphs("fp8-cs", 1)
    gm = getattr(aot, graph)
    stage = Stage.POST_GRAD_FWD if graph == "forward" else Stage.POST_GRAD_BWD
    originals = [(n.name, i, a) for n in gm.graph.nodes for i, a in enumerate(
        n.args if n.op != "output" else n.args[0]) if te_const_kind(a) in (TEConstKind.BUNDLE, TEConstKind.QUANTIZER)]
    assert _INLINE.search(gm.code)
    res = run_pass(gm, stage=stage)
    hoisted = [r for r in res.records if r.kind == "hoisted_constant"]
    assert len(hoisted) == len(originals) == (3 if graph == "forward" else 4)  # the forward after TE's lazy init
    # The names exist only in the graph's own Inductor lowering (V.graph.module is gm) ...
    with V.set_graph_handler(types.SimpleNamespace(module=gm)):
        lowered = gm.graph.python_code("self")
    assert not _INLINE.search(lowered.src)
    names = re.findall(r"_te_const_\d+", lowered.src)
    assert len(set(names)) == len(originals) and set(names) <= set(lowered.globals)
    # ... everywhere else (this FX code, another graph's lowering) the constants render in full.
    gm.recompile()
    assert not re.search(r"_te_const_\d+", gm.code) and len(_INLINE.findall(gm.code)) >= len(originals)
    with V.set_graph_handler(types.SimpleNamespace(module=torch.fx.GraphModule({}, torch.fx.Graph()))):
        assert not re.search(r"_te_const_\d+", gm.graph.python_code("self").src)
    for (node_name, i, orig) in originals:
        node = next(n for n in gm.graph.nodes if n.name == node_name)
        new = (node.args if node.op != "output" else node.args[0])[i]
        assert new == orig and new is not orig           # equal value, own object per slot
        assert hoisted_name(new, gm) is not None and hoisted_name(orig, gm) is None
    # Equal-valued constants stay distinct objects (TE ops update quantizer usage in place).
    objs = [a for n in gm.graph.nodes for a in (n.args if n.op != "output" else n.args[0])
            if te_const_kind(a) in (TEConstKind.BUNDLE, TEConstKind.QUANTIZER)]
    assert len({id(o) for o in objs}) == len(objs)
    assert te_const_kind(objs[0]) is TEConstKind.BUNDLE


def test_post_grad_hoisting_can_be_switched_off(te_aot_graphs):
    aot = te_aot_graphs("fp8-cs", 1)
    report = PassManager([HoistTEConstants(hoist_constants=False)]).run(aot.forward, ctx(Stage.POST_GRAD_FWD))
    assert report.runs[0].status == "skipped" and _INLINE.search(aot.forward.code)


def _call_body(src):
    return src[src.index("def call("):]


@pytest.mark.parametrize("hoist", [True, False])
def test_inductor_wrapper_builds_no_te_constant_per_call(te_aot_graphs, hoist):
    """Forward and backward wrappers Inductor generates for a real fp8 te.Linear: with the pass,
    the call path constructs no quantizer and no bundle; without it, every constant is rebuilt
    inline (8 per forward, 5 per backward here)."""
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx_inner

    aot = te_aot_graphs("fp8-cs", 1)
    with _inductor_codegen_on_cpu() as loaded:
        for gm, inputs, stage in ((aot.forward, aot.forward_inputs, Stage.POST_GRAD_FWD),
                                  (aot.backward, aot.backward_inputs, Stage.POST_GRAD_BWD)):
            if hoist:  # what the backend's post_grad_custom_pre_pass hook does
                PassManager([HoistTEConstants()]).run(gm, ctx(stage))
            mode = inputs[0].fake_mode
            with tracing(TracingContext(mode)), mode:
                compile_fx_inner(gm, inputs, is_backward=stage is Stage.POST_GRAD_BWD)
    assert len(loaded) == 2
    counts = [(_call_body(src).count("_rebuild_quantizer("), _call_body(src).count("OpaqueValueBundle("))
              for src, _ in loaded]
    if not hoist:
        assert counts == [(3, 3), (5, 4)]  # after TE's lazy init at compile start (was 8 quantizers without it)
        return
    assert counts == [(0, 0), (0, 0)]
    for src, attrs in loaded:
        assert not _INLINE.search(src)  # not at module level either
        used = set(re.findall(r"_te_const_\d+", _call_body(src)))
        assert used and used <= set(attrs)  # every name is a module global, built at load time
        assert all(te_const_kind(attrs[n]) in (TEConstKind.BUNDLE, TEConstKind.QUANTIZER) for n in used)
    fwd_src = loaded[0][0]
    assert re.search(r"transformer_engine_compile\.linear\.default\(primals_1, \[\], _te_const_\d+,", fwd_src)


def test_te_inductor_backend_end_to_end_and_fx_graph_cache_hit(tmp_path, monkeypatch):
    """``torch.compile(backend=te_inductor)`` on a real fp8 te.Linear (inference, built on fake
    CUDA tensors; the compiled wrapper is generated and loaded, never run). A second compile of
    the same graph hits Inductor's FX graph cache and the loaded wrapper still gets every named
    constant (they travel in the cache entry)."""
    from torch._dynamo.utils import counters
    from torch._subclasses.fake_tensor import FakeTensorMode

    from te_passes.backend import te_inductor
    from te_passes.testing import fake_gpu as FG

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    recipe = te_recipe.Float8CurrentScaling()

    def compile_once():
        torch._dynamo.reset()

        def backend(gm, example_inputs):
            te_inductor(gm, example_inputs)
            return lambda *a: (_ for _ in ()).throw(RuntimeError("never run"))

        with _inductor_codegen_on_cpu() as loaded:
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            with mode, FG.constructing():
                lin = te.Linear(64, 64, params_dtype=torch.bfloat16, device="cuda")
                x = torch.randn(32, 64, dtype=torch.bfloat16, device="cuda")

            def f(inp):
                with te.autocast(enabled=True, recipe=recipe):
                    return lin(inp)

            with mode, torch.no_grad(), pytest.raises(RuntimeError, match="never run"):
                torch.compile(f, backend=backend, fullgraph=True)(x)
        return loaded

    counters.clear()
    with torch._inductor.config.patch(fx_graph_cache=True):  # never monkeypatch Inductor's config module
        first = compile_once()
        assert counters["inductor"]["fxgraph_cache_miss"] == 1
        second = compile_once()  # fresh Dynamo state, same graph: served from the FX graph cache
        assert counters["inductor"]["fxgraph_cache_hit"] == 1
    for loaded in (first, second):
        (src, attrs), = loaded
        body = _call_body(src)
        assert body.count("_rebuild_quantizer(") == 0 and body.count("OpaqueValueBundle(") == 0
        used = set(re.findall(r"_te_const_\d+", body))
        assert len(used) == 8 and used <= set(attrs)
        assert sorted(type(attrs[n]).__name__ for n in used) == ["Float8CurrentScalingQuantizer"] * 5 + [
            "OpaqueValueBundle"] * 3


