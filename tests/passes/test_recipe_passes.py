"""Passes ``fold_recipe_lookups`` (lookups folded), ``remove_quantizer_setattrs`` (``__setattr__``
residue removed) and ``hoist_te_constants`` (TE constants built once).

Hand-built FX graphs exercise every lookup form (and the forms that must stay), with real TE
recipe and quantizer objects; graphs are run before and after the pass and must agree (FX
codegen for lookups, ``torch.fx.Interpreter`` — in-memory objects — for ``__setattr__``).
Real graphs come from ``te_passes.testing.capture`` (Float8CurrentScaling and MXFP8 te.Linear,
1 and 4 layers). Inductor's generated wrapper is produced on CPU for a real fp8 te.Linear
(forward and backward) and checked for per-call constructions.
"""

from __future__ import annotations

import collections
import contextlib
import operator
import re
import types

import pytest

torch = pytest.importorskip("torch")
te_recipe = pytest.importorskip("transformer_engine.common.recipe")
te = pytest.importorskip("transformer_engine.pytorch")

import torch.fx  # noqa: E402
from torch._inductor.virtualized import V  # noqa: E402
from transformer_engine.pytorch.quantization import FP8GlobalStateManager as FGSM  # noqa: E402
from transformer_engine.pytorch.quantization import get_fp8_te_dtype  # noqa: E402

from te_passes.pipeline.base import Stage  # noqa: E402
from te_passes.passes.fold_recipe_lookups import FoldRecipeLookups  # noqa: E402
from te_passes.passes.hoist_te_constants import HoistTEConstants  # noqa: E402
from te_passes.passes.remove_quantizer_setattrs import RemoveQuantizerSetattrs  # noqa: E402
from te_passes.pipeline.base import TEPassResult  # noqa: E402
from te_passes.te.graph_scan import find_recipe_and_pg_objects, object_occurrences  # noqa: E402
from te_passes.runtime.ops.constants import hoisted_name  # noqa: E402
from te_passes.runtime.install import install  # noqa: E402
from te_passes.pipeline.manager import PassManager  # noqa: E402
from te_passes.te import recipes  # noqa: E402
from te_passes.te import recipe_table  # noqa: E402
from te_passes.te.graph_constants import TEConstKind, bundle_dict, te_const_kind  # noqa: E402
from te_passes.te.state import TEState  # noqa: E402
from te_passes.testing.harness import pass_context  # noqa: E402

from _inductor_cpu import _inductor_codegen_on_cpu  # noqa: E402


# --------------------------------------------------------------------------- helpers
def gemm(x, split):
    """Stand-in GEMM whose result shows which flag it got."""
    return x * (2.0 if split is True else 3.0 if split is False else 5.0)


def consume(x, obj):
    """A consumer that takes an object itself (must never be given a folded constant)."""
    return x + (1.0 if obj is not None else 0.0)


def scale_by(x, value):
    return x * float(value if not isinstance(value, str) else len(value))


def use_quantizer(x, q):
    """Reads quantizer fields in-memory (an op observing its quantizer)."""
    return x * (2.0 if q.columnwise_usage else 3.0) + (1.0 if q.internal else 0.0)


def ctx(stage=Stage.DYNAMO):
    """The pass reads TE's autocast state from the compilation's TE snapshot, taken here (as
    ``te_inductor`` takes it when a compilation begins)."""
    return pass_context(stage, te_state=TEState.capture(), strict=True)


@pytest.fixture(autouse=True)
def _runtime():
    """``runtime.install()``, as the backend does before any pass runs (it wraps TE's constant
    classes' ``__fx_repr__``, which ``hoist_te_constants`` needs and never patches itself)."""
    install()


def run_pass(gm, fp8_state=None, stage=Stage.DYNAMO, **kw):
    """The passes of ``stage`` in pipeline order (Dynamo: fold_recipe_lookups, then
    remove_quantizer_setattrs; post-grad: hoist_te_constants), their records concatenated."""
    if stage is Stage.DYNAMO:
        passes = [FoldRecipeLookups(fp8_state=fp8_state, **kw), RemoveQuantizerSetattrs()]
    else:
        passes = [HoistTEConstants(**kw)]
    results = [p.run(gm, ctx(stage)) for p in passes]
    gm.graph.lint()
    gm.recompile()
    return TEPassResult(gm, any(r.modified for r in results), [x for r in results for x in r.records])


def kinds(res):
    return collections.Counter(r.kind for r in res.records)


@contextlib.contextmanager
def autocast_cpu(recipe):
    """``te.autocast`` on this GPU-less machine (TE's device-support answers preset)."""
    from te_passes.testing.fake_gpu import fake_gpu

    with fake_gpu("fp8-cs"), te.autocast(enabled=True, recipe=recipe):
        yield


def new_graph():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    return g, x


def gm_of(g, root=None):
    return torch.fx.GraphModule(root if root is not None else torch.nn.Module(), g)


def ops(gm):
    return [(n.op, getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes]


X = torch.arange(4.0)


# --------------------------------------------------------------------------- 1. lookups
@pytest.mark.parametrize("cls", ["Float8CurrentScaling", "Float8BlockScaling"])
@pytest.mark.parametrize("gemm_name", ["fprop", "dgrad", "wgrad"])
def test_state_lookup_attribute_chain_folds_to_the_tables_bool(cls, gemm_name):
    g, x = new_graph()
    r = g.call_function(FGSM.get_fp8_recipe)
    mm = g.call_function(getattr, (r, f"fp8_gemm_{gemm_name}"))
    flag = g.call_function(getattr, (mm, "use_split_accumulator"))
    g.output(g.call_function(gemm, (x,), {"split": flag}))
    gm = gm_of(g)
    recipe = recipe_table.default_recipe(cls)
    with autocast_cpu(recipe):
        expected = gm(X)
        res = run_pass(gm)  # folds against the TE snapshot taken inside the autocast
    want = recipe_table.resolve_recipe(recipe).use_split_accumulator(gemm_name)
    assert ops(gm) == [("placeholder", "x"), ("call_function", "gemm"), ("output", "output")]
    (call,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert call.kwargs == {"split": want} and call.kwargs["split"] is want
    assert torch.equal(gm(X), expected)
    (rec,) = [r for r in res.records if r.kind == "hoisted"]
    assert rec.data == {"lookup": f"FP8GlobalStateManager.get_fp8_recipe().fp8_gemm_{gemm_name}"
                                  ".use_split_accumulator", "value": want, "users": ["gemm"]}
    assert kinds(res) == {"hoisted": 1}


@pytest.mark.parametrize("cls", recipes.RECIPE_CLASSES)
def test_hasattr_lookup_folds_for_every_recipe_class(cls):
    """``hasattr(recipe, "fp8_gemm_fprop")`` is how TE picks recipe vs module default."""
    g, x = new_graph()
    r = g.call_function(FGSM.get_fp8_recipe)
    has = g.call_function(hasattr, (r, "fp8_gemm_fprop"))
    g.output(g.call_function(gemm, (x, has)))
    gm = gm_of(g)
    recipe = recipe_table.default_recipe(cls)
    res = run_pass(gm, recipes.Fp8State(fp8_enabled=True, recipe=recipe))
    (call,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert call.args[1] is hasattr(recipe, "fp8_gemm_fprop")
    assert call.args[1] is (recipe_table.resolve_recipe(recipe).split_accumulator["fprop"].source != "module/base.py:_2X_ACC_FPROP")
    assert kinds(res) == {"hoisted": 1}


@pytest.mark.parametrize("enabled", [True, False])
def test_is_fp8_enabled_and_calibration_fold(enabled):
    g, x = new_graph()
    en = g.call_function(FGSM.is_fp8_enabled)
    cal = g.call_function(FGSM.is_fp8_calibration)
    y = g.call_function(gemm, (x, en))
    g.output(g.call_function(gemm, (y, cal)))
    gm = gm_of(g)
    r = te_recipe.Float8CurrentScaling()
    if enabled:
        with autocast_cpu(r):
            expected = gm(X)
            res = run_pass(gm)
    else:
        expected = gm(X)
        res = run_pass(gm, recipes.Fp8State(fp8_enabled=False))
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [c.args[1] for c in calls] == [enabled, False]
    assert torch.equal(gm(X), expected)
    assert {r.data["lookup"] for r in res.records} == {"FP8GlobalStateManager.is_fp8_enabled()",
                                                       "FP8GlobalStateManager.is_fp8_calibration()"}


def test_predicates_isinstance_backward_override_and_pure_functions():
    recipe = te_recipe.Float8CurrentScaling(backward_override="high_precision")
    root = torch.nn.Module()
    root.MXFP8BlockScaling = te_recipe.MXFP8BlockScaling  # FX cannot print a class literal
    g, x = new_graph()
    r = g.call_function(FGSM.get_fp8_recipe)
    is_cs = g.call_method("float8_current_scaling", (r,))
    is_mx = g.call_function(isinstance, (r, g.get_attr("MXFP8BlockScaling")))
    bo = g.call_function(getattr, (r, "backward_override"))
    dt = g.call_function(get_fp8_te_dtype, (r, False))
    eps = g.call_function(getattr, (g.call_function(getattr, (r, "fp8_quant_bwd_grad")), "amax_epsilon"))
    y = g.call_function(gemm, (x, is_cs))
    y = g.call_function(gemm, (y, is_mx))
    y = g.call_function(scale_by, (y, bo))
    y = g.call_function(scale_by, (y, dt))
    g.output(g.call_function(operator.add, (y, eps)))
    gm = gm_of(g, root)
    with autocast_cpu(recipe):
        expected = gm(X)
        res = run_pass(gm)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [c.target for c in calls] == [gemm, gemm, scale_by, scale_by, operator.add]
    assert calls[0].args[1] is True and calls[1].args[1] is False
    assert calls[2].args[1] == "high_precision"
    assert calls[3].args[1] is get_fp8_te_dtype(recipe, False)
    assert calls[4].args[1] == 0.0
    assert torch.equal(gm(X), expected)  # FX codegen renders the folded enum/str/float constants
    assert kinds(res) == {"hoisted": 5}
    assert "get_fp8_te_dtype(FP8GlobalStateManager.get_fp8_recipe(), False)" in {
        r.data["lookup"] for r in res.records}


def test_get_attr_recipe_and_recipe_constant_args_fold():
    recipe = te_recipe.Float8BlockScaling()
    root = torch.nn.Module()
    root.my_recipe = recipe
    g, x = new_graph()
    r = g.get_attr("my_recipe")
    f = g.call_function(getattr, (g.call_function(getattr, (r, "fp8_gemm_fprop")), "use_split_accumulator"))
    d = g.call_function(getattr, (None, "backward_override"))
    y = g.call_function(gemm, (x, f))
    g.output(g.call_function(consume, (y, d)))
    gm = gm_of(g, root)
    # A recipe object embedded as a constant argument (hand-built / user graphs; FX cannot even
    # print such a graph as Python, so it is run with the Interpreter).
    d.args = (te_recipe.MXFP8BlockScaling(), "backward_override")
    expected = torch.fx.Interpreter(gm).run(X)
    assert [o[2] for o in find_recipe_and_pg_objects(gm)] == ["Float8BlockScaling", "MXFP8BlockScaling"]
    res = run_pass(gm, recipes.Fp8State())
    assert ops(gm) == [("placeholder", "x"), ("call_function", "gemm"), ("call_function", "consume"),
                       ("output", "output")]
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert calls[0].args[1] is True and calls[1].args[1] is None
    assert torch.equal(gm(X), expected)
    assert find_recipe_and_pg_objects(gm) == []
    assert {r.data["lookup"] for r in res.records} == {
        "self.my_recipe.fp8_gemm_fprop.use_split_accumulator", "<MXFP8BlockScaling constant>.backward_override"}


class ProcessGroup:  # stands in for torch.distributed's c10d ProcessGroup (matched by class name)
    pass


def test_process_group_is_none_checks_fold_but_the_group_is_kept_for_its_consumer():
    pg = ProcessGroup()
    g, x = new_graph()
    grp = g.call_function(FGSM.get_fp8_group)
    has_group = g.call_function(operator.is_not, (grp, None))
    y = g.call_function(gemm, (x, has_group))
    g.output(g.call_function(consume, (y, grp)))
    gm = gm_of(g)
    res = run_pass(gm, recipes.Fp8State(fp8_enabled=True, recipe=te_recipe.Float8CurrentScaling(), fp8_group=pg))
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [c.target for c in calls] == [FGSM.get_fp8_group, gemm, consume]
    assert calls[1].args[1] is True            # the boolean consumer got the resolved bool
    assert calls[2].args[1] is calls[0]        # the consumer of the object still gets the object
    (kept,) = [r for r in res.records if r.kind == "kept"]
    assert kept.node == "get_fp8_group" and "consume" in kept.data["reason"] and kept.data["object"] == "ProcessGroup"
    assert [r.data["lookup"] for r in res.records if r.kind == "hoisted"] == [
        "(FP8GlobalStateManager.get_fp8_group() is not None)"]


def test_no_process_group_folds_to_none():
    g, x = new_graph()
    grp = g.call_function(FGSM.get_fp8_group)
    g.output(g.call_function(consume, (x, grp)))
    gm = gm_of(g)
    expected = gm(X)
    res = run_pass(gm, recipes.Fp8State(fp8_enabled=True, recipe=te_recipe.Float8CurrentScaling()))
    assert ops(gm) == [("placeholder", "x"), ("call_function", "consume"), ("output", "output")]
    assert torch.equal(gm(X), expected) and kinds(res) == {"hoisted": 1}


# ---- lookups that must NOT be folded: the graph stays exactly as it was
def test_recipe_object_observed_by_a_consumer_is_left_alone():
    g, x = new_graph()
    r = g.call_function(FGSM.get_fp8_recipe)
    g.output(g.call_function(consume, (x, r)))
    gm = gm_of(g)
    before = gm.code
    res = run_pass(gm, recipes.Fp8State(fp8_enabled=True, recipe=te_recipe.Float8CurrentScaling()))
    assert gm.code == before and res.modified is False
    (kept,) = res.records
    assert kept.kind == "kept" and kept.node == "get_fp8_recipe"
    assert "consume (call_function consume)" in kept.data["reason"]


def test_chain_folds_but_recipe_stays_for_its_other_consumer():
    g, x = new_graph()
    r = g.call_function(FGSM.get_fp8_recipe)
    f = g.call_function(getattr, (g.call_function(getattr, (r, "fp8_gemm_wgrad")), "use_split_accumulator"))
    y = g.call_function(gemm, (x, f))
    g.output(g.call_function(consume, (y, r)))
    gm = gm_of(g)
    res = run_pass(gm, recipes.Fp8State(fp8_enabled=True, recipe=te_recipe.Float8CurrentScaling()))
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [FGSM.get_fp8_recipe, gemm, consume]
    assert kinds(res) == {"hoisted": 1, "kept": 1}


def test_non_data_attribute_and_missing_attribute_are_not_folded():
    g, x = new_graph()
    r = g.call_function(FGSM.get_fp8_recipe)
    qf = g.call_function(getattr, (r, "qfactory"))          # a user callable: never a constant
    missing = g.call_function(getattr, (r, "fp8_gemm_fprop"))  # CustomRecipe has none: TE would raise
    y = g.call_function(consume, (x, qf))
    g.output(g.call_function(consume, (y, missing)))
    gm = gm_of(g)
    before = gm.code
    res = run_pass(gm, recipes.Fp8State(fp8_enabled=True, recipe=te_recipe.CustomRecipe(qfactory=lambda role=None: None)))
    assert gm.code == before and res.modified is False
    reasons = {r.node: r.data["reason"] for r in res.records}
    assert "qfactory is not a plain data field" in reasons["getattr_1"]
    assert "has no attribute 'fp8_gemm_fprop'" in reasons["getattr_2"]


def test_unknown_recipe_state_is_not_folded():
    g, x = new_graph()
    r = g.call_function(FGSM.get_fp8_recipe)
    f = g.call_function(getattr, (r, "backward_override"))
    g.output(g.call_function(consume, (x, f)))
    gm = gm_of(g)
    before = gm.code
    res = run_pass(gm, recipes.Fp8State(fp8_enabled=False, recipe=None))
    assert gm.code == before and res.modified is False
    assert "no recipe is active" in res.records[0].data["reason"]


def test_bad_config_is_rejected():
    with pytest.raises(TypeError, match=r"fp8_state must be Fp8State \| None, got .* \(dict\)"):
        FoldRecipeLookups(fp8_state={"recipe": None})


# --------------------------------------------------------------------------- 2. __setattr__ residue
def _cs_quantizer(**fields):
    q = te.Float8CurrentScalingQuantizer(te.DType.kFloat8E4M3 if hasattr(te, "DType") else 7, device=torch.device("cpu"))
    for k, v in fields.items():
        setattr(q, k, v)
    return q


def _setattr_graph(recv, field, value, observer=None):
    g, x = new_graph()
    g.call_method("__setattr__", (recv, field, value))
    y = g.call_function(use_quantizer, (x, observer)) if observer is not None else x
    g.output(y)
    return gm_of(g)


def _interp(gm):
    return torch.fx.Interpreter(gm).run(X)


def test_setattr_on_unobserved_receiver_is_removed_even_if_it_changes_a_field():
    q = _cs_quantizer(columnwise_usage=True)
    gm = _setattr_graph(q, "columnwise_usage", False)
    res = run_pass(gm, recipes.Fp8State())
    assert ops(gm) == [("placeholder", "x"), ("output", "output")]
    (rec,) = res.records
    assert rec.kind == "folded_setattr" and rec.data["reason"] == "receiver is not observed by any other node"
    assert q.columnwise_usage is True  # the constant object itself is not mutated


def test_noop_setattr_on_observed_receiver_is_removed():
    q = _cs_quantizer(columnwise_usage=False, internal=True)
    gm = _setattr_graph(q, "columnwise_usage", False, observer=q)
    expected = _interp(gm)
    res = run_pass(gm, recipes.Fp8State())
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "call_function", "output"]
    assert torch.equal(_interp(gm), expected)
    assert res.records[0].data["reason"].startswith("no-op: writes the value the constant already holds")


def test_changing_setattr_on_observed_receiver_is_kept():
    q = _cs_quantizer(columnwise_usage=True)
    gm = _setattr_graph(q, "columnwise_usage", False, observer=q)
    before = gm.code
    res = run_pass(gm, recipes.Fp8State())
    assert gm.code == before and res.modified is False
    (rec,) = res.records
    assert rec.kind == "kept" and "also used by use_quantizer" in rec.data["reason"]
    assert "changes columnwise_usage from True to False" in rec.data["reason"]
    # In-memory semantics are what they were: the observer sees the written value.
    assert torch.equal(_interp(gm), X * 3.0)


def test_equal_but_distinct_observer_does_not_block_removal_and_is_untouched():
    q_recv = _cs_quantizer(columnwise_usage=True)
    q_obs = _cs_quantizer(columnwise_usage=True)
    assert q_recv == q_obs and q_recv is not q_obs  # value-equal, distinct objects
    gm = _setattr_graph(q_recv, "columnwise_usage", False, observer=q_obs)
    expected = _interp(gm)  # mutates q_recv only
    key_before = q_obs._value_key()
    res = run_pass(gm, recipes.Fp8State())
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "call_function", "output"]
    assert res.records[0].data["reason"] == "receiver is not observed by any other node"
    assert q_obs._value_key() == key_before and torch.equal(_interp(gm), expected)


def test_used_setattr_result_is_kept():
    q = _cs_quantizer()
    g, x = new_graph()
    s = g.call_method("__setattr__", (q, "internal", True))
    g.output(g.call_function(consume, (x, s)))
    gm = gm_of(g)
    before = gm.code
    res = run_pass(gm, recipes.Fp8State())
    assert gm.code == before and res.records[0].kind == "kept"
    assert "not side-effect-only" in res.records[0].data["reason"]


# --------------------------------------------------------------------------- real Dynamo graphs
def _bundle_quantizer_snapshot(gm):
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and "transformer_engine_compile" in str(n.target):
            for i, a in enumerate(n.args):
                if te_const_kind(a) is TEConstKind.BUNDLE:
                    for k, v in bundle_dict(a).items():
                        if te_const_kind(v) is TEConstKind.QUANTIZER:
                            out.append((n.name, i, k, id(v), v._value_key()))
    return out


@pytest.mark.parametrize("precision,layers,n_setattr,n_noop", [
    ("fp8-cs", 1, 23, 16), ("mxfp8", 1, 17, 10), ("fp8-cs", 4, None, None), ("mxfp8", 4, None, None)])
def test_real_dynamo_graph_setattr_chains_gone_bundles_unchanged(te_dynamo_graph, precision, layers, n_setattr, n_noop):
    cap = te_dynamo_graph(precision, layers)
    gm = cap.gm
    setattrs = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "__setattr__"]
    if n_setattr is not None:  # the reference graph (shared/reference/.../linear_fp8_cs_dynamo.txt): 23
        assert len(setattrs) == n_setattr
    assert setattrs and all(te_const_kind(n.args[0]) is TEConstKind.QUANTIZER for n in setattrs)
    # The receivers: some are the very objects in the op bundles / outputs (identity), others
    # only equal to them. Both occur in real graphs.
    occ = object_occurrences(gm.graph)
    shared = [n for n in setattrs if any(u.op != "call_method" for u, _ in occ[id(n.args[0])])]
    assert 0 < len(shared) < len(setattrs)
    rest = [(n.op, str(n.target), n.name) for n in gm.graph.nodes if n not in setattrs]
    bundles = _bundle_quantizer_snapshot(gm)
    assert bundles
    res = run_pass(gm)
    assert [(n.op, str(n.target), n.name) for n in gm.graph.nodes] == rest
    assert _bundle_quantizer_snapshot(gm) == bundles  # same objects, same values
    folded = [r for r in res.records if r.kind == "folded_setattr"]
    assert len(folded) == len(setattrs) and kinds(res) == {"folded_setattr": len(setattrs)}
    noop = [r for r in folded if r.data["reason"].startswith("no-op")]
    assert len(noop) == len(shared)
    if n_noop is not None:
        assert len(noop) == n_noop
    assert find_recipe_and_pg_objects(gm) == []
    assert "__setattr__" not in gm.code


def test_pass_runs_in_the_pipeline_on_real_graphs(te_dynamo_graph):
    from te_passes.testing.capture import run_pipeline

    cap = te_dynamo_graph("fp8-cs", 1)
    reports = run_pipeline(cap, [Stage.DYNAMO])
    runs = {r.name: r for rep in reports for r in rep.runs}
    fold, setattrs = runs["fold_recipe_lookups"], runs["remove_quantizer_setattrs"]
    assert fold.status == "ok" and not fold.changed and fold.records == []  # Dynamo inlined the lookups
    assert setattrs.status == "ok" and setattrs.changed
    assert len(setattrs.records) == 23
    assert "hoist_te_constants" not in runs  # post-grad only


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
    assert len(hoisted) == len(originals) == (8 if graph == "forward" else 4)
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
        assert counts == [(8, 3), (5, 4)]
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


# --------------------------------------------------------------------------- 4. recipe identity
def _recompile_counts(second, *, warm_repr=False, first_steps=3, second_steps=3):
    """Frame compiles of a fresh compiled fp8 te.Linear: ``(warm-up with recipe r1 over
    first_steps calls, further calls with r1, calls with ``second``)``."""
    from torch._dynamo.utils import counters
    from torch._subclasses.fake_tensor import FakeTensorMode

    from te_passes.testing import dynamo_capture as DC
    from te_passes.testing import fake_gpu as FG

    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward  # TE's fake impls under the fake mode: nothing runs on a device

    torch._dynamo.reset()
    with FG.fake_gpu("fp8-cs"):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode, FG.constructing():
            lin = te.Linear(64, 64, params_dtype=torch.bfloat16, device="cuda")
            x = torch.randn(32, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        state = {"recipe": te_recipe.Float8CurrentScaling()}

        def f(inp):
            with te.autocast(enabled=True, recipe=state["recipe"]):
                return lin(inp)

        cf = torch.compile(DC.fresh_function(f), backend=backend, fullgraph=True)

        def steps(n):
            before, graphs_before = len(compiles), counters["stats"]["unique_graphs"]
            with mode:
                for _ in range(n):
                    cf(x)
            new = len(compiles) - before
            # Dynamo's own count agrees with the backend invocations.
            assert counters["stats"]["unique_graphs"] - graphs_before == new
            return new

        warm = steps(first_steps)
        same = steps(10)
        if second is None:
            return warm, same, None
        state["recipe"] = second
        if warm_repr:
            repr(second)
        return warm, same, steps(second_steps)


def test_same_recipe_object_never_recompiles_after_warm_up():
    """Measured: 2 frame compiles on the first calls (TE caches ``_is_fsdp2`` on the module and
    the recipe's lazily computed ``_cached_repr`` during the first call, both guarded), then 0."""
    assert _recompile_counts(None) == (2, 0, None)


@pytest.mark.parametrize("second,warm_repr,expected", [
    (lambda: te_recipe.Float8CurrentScaling(), False, 2),
    (lambda: te_recipe.Float8CurrentScaling(), True, 1),
    (lambda: te_recipe.Float8CurrentScaling(fp8_format=te_recipe.Format.E4M3), False, 2),
    (lambda: te_recipe.Float8CurrentScaling(fp8_gemm_fprop=te_recipe.MMParams(use_split_accumulator=True)), False, 2),
], ids=["equal-new-object", "equal-new-object-repr-warmed", "different-format", "different-fprop-split"])
def test_recompiles_by_recipe_identity_and_value(second, warm_repr, expected):
    """Measured Dynamo recompiles when the recipe object changes (TE 2.20.2, torch 2.14.1).

    * a new object with equal values: 2 — TE's ``init_fp8_metadata`` guards on identity
      (``recipe is module.fp8_meta["recipe"]``, ``module/base.py``) and the new object's
      ``_cached_repr`` is filled during its first call (``Recipe.__repr__``,
      ``common/recipe/__init__.py``); 1 when ``repr(recipe)`` was taken before the call;
    * different values: 2 (value guards, then ``_cached_repr``).
    These guards are TE's: the pass runs after Dynamo and adds none. Documented in
    docs/passes/fold_recipe_lookups.md.
    """
    assert _recompile_counts(second(), warm_repr=warm_repr) == (2, 0, expected)
