"""Pass ``fold_recipe_lookups``: TE recipe / autocast-state lookups folded to constants.

Hand-built FX graphs exercise every lookup form (and the forms that must stay), with real TE
recipe objects; graphs are run before and after the pass and must agree (FX codegen). Also the
Dynamo recompiles by recipe identity and value the pass must not add to (TE's own guards)."""

from __future__ import annotations

import operator

import pytest

torch = pytest.importorskip("torch")
te_recipe = pytest.importorskip("transformer_engine.common.recipe")
te = pytest.importorskip("transformer_engine.pytorch")

import torch.fx  # noqa: E402
from transformer_engine.pytorch.quantization import FP8GlobalStateManager as FGSM  # noqa: E402
from transformer_engine.pytorch.quantization import get_fp8_te_dtype  # noqa: E402

from te_passes.passes.fold_recipe_lookups import FoldRecipeLookups  # noqa: E402
from te_passes.te.graph_scan import find_recipe_and_pg_objects  # noqa: E402
from te_passes.te import recipes  # noqa: E402
from te_passes.te import recipe_table  # noqa: E402

from _recipe_passes import (_runtime, X, autocast_cpu, consume, gemm, gm_of, kinds, new_graph, ops,  # noqa: E402,F401 (_runtime: autouse fixture)
                            run_pass, scale_by)


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

