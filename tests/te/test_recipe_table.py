"""The recipe resolution table (te_passes/te/recipe_table.py) against TE 2.20.2's own resolution code.

Everything runs on CPU with real TE installed:

* split accumulators / ``backward_override``: every site in TE's modules that reads
  ``recipe.fp8_gemm_<gemm>`` (found by parsing ``module/{linear,layernorm_linear,layernorm_mlp,
  grouped_linear}.py``) is *executed* — TE's own statements, compiled from its source — with
  the recipe under test, and its result compared with the table;
* quantizer fields: TE's ``RecipeState.create(...).make_quantizers()`` for te.Linear's roles,
  followed (Float8CurrentScaling) by TE's ``Linear._customize_quantizers_float8_current_scaling``,
  compared field by field with the table.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import types
from unittest import mock

import pytest

torch = pytest.importorskip("torch")
te_recipe = pytest.importorskip("transformer_engine.common.recipe")
te = pytest.importorskip("transformer_engine.pytorch")

from transformer_engine.pytorch.module import base as te_base  # noqa: E402
from transformer_engine.pytorch.quantization import QuantizerRole, RecipeState  # noqa: E402

from te_passes.te import recipes  # noqa: E402
from te_passes.te import recipe_table  # noqa: E402
from te_passes.te.graph_constants import quantizer_fields  # noqa: E402

QP = te_recipe.QParams
MM = te_recipe.MMParams
F = te_recipe.Format


def _custom():
    return te_recipe.CustomRecipe(qfactory=lambda role=None: None)


def _cs_nondefault():
    r = te_recipe.Float8CurrentScaling(fp8_format=F.E4M3, use_power_2_scales=True,
                                       fp8_gemm_fprop=MM(use_split_accumulator=True),
                                       fp8_gemm_wgrad=MM(use_split_accumulator=False),
                                       backward_override="high_precision")
    # fp8_quant_* are class attributes of Float8CurrentScaling (not dataclass fields): users set
    # them on the instance.
    r.fp8_quant_fwd_inp = QP(power_2_scale=True, amax_epsilon=1e-3)
    r.fp8_quant_bwd_grad = QP(power_2_scale=False, amax_epsilon=5e-4)
    return r


def _block_nondefault():
    r = te_recipe.Float8BlockScaling(fp8_format=F.HYBRID, w_block_scaling_dim=1, backward_override="dequantized")
    r.fp8_quant_fwd_weight = QP(power_2_scale=False, amax_epsilon=1e-4)
    return r


#: (id, factory): every recipe class at its defaults, plus non-default variants of each knob.
RECIPES = [
    ("DelayedScaling", te_recipe.DelayedScaling),
    ("DelayedScaling-E4M3", lambda: te_recipe.DelayedScaling(fp8_format=F.E4M3, margin=1)),
    ("Float8CurrentScaling", te_recipe.Float8CurrentScaling),
    ("Float8CurrentScaling-nondefault", _cs_nondefault),
    ("MXFP8BlockScaling", te_recipe.MXFP8BlockScaling),
    ("MXFP8BlockScaling-2d-hybrid", lambda: te_recipe.MXFP8BlockScaling(
        enable_2d_quantization=True, fp8_format=F.HYBRID, backward_override="high_precision")),
    ("Float8BlockScaling", te_recipe.Float8BlockScaling),
    ("Float8BlockScaling-nondefault", _block_nondefault),
    ("NVFP4BlockScaling", te_recipe.NVFP4BlockScaling),
    ("NVFP4BlockScaling-nondefault", lambda: te_recipe.NVFP4BlockScaling(
        disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True,
        row_scaled_activation=True, nvfp4_4over6="weights", nvfp4_4over6_e4m3_use_256="weights",
        nvfp4_4over6_err_mode="MSE")),
    ("CustomRecipe", _custom),
]
IDS = [i for i, _ in RECIPES]


# --------------------------------------------------------------------------- TE's split-acc sites
def _module_sources():
    from transformer_engine.pytorch.module import grouped_linear, layernorm_linear, layernorm_mlp, linear

    return {m.__name__.rsplit(".", 1)[1]: m for m in (linear, layernorm_linear, layernorm_mlp, grouped_linear)}


def _parents(tree):
    out = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            out[child] = node
    return out


def _hasattr_gemm(test):
    """``("recipe", "dgrad")`` for ``hasattr(recipe, "fp8_gemm_dgrad")``, else None."""
    if (isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and test.func.id == "hasattr"
            and len(test.args) == 2 and isinstance(test.args[0], ast.Name)
            and isinstance(test.args[1], ast.Constant) and str(test.args[1].value).startswith("fp8_gemm_")):
        return test.args[0].id, str(test.args[1].value).removeprefix("fp8_gemm_")
    return None


def te_split_accumulator_sites():
    """Every ``if hasattr(<recipe>, "fp8_gemm_<gemm>"):`` site in TE's modules, as
    ``(module, function, gemm, target variable, default-assignment stmt, guard block stmt)``."""
    sites = []
    for modname, mod in _module_sources().items():
        tree = ast.parse(inspect.getsource(mod))
        parents = _parents(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.If):
                continue
            hit = _hasattr_gemm(node.test)
            if hit is None:
                continue
            _, gemm = hit
            (assign,) = [s for s in node.body if isinstance(s, ast.Assign)]
            target = assign.targets[0].id
            guard = parents[node]          # ``if fp8:`` / ``if ctx.fp8:`` / ``if self.fp8:``
            assert isinstance(guard, ast.If), f"{modname}: unexpected site shape at line {node.lineno}"
            func = guard
            while not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                func = parents[func]
            defaults = [s for s in ast.walk(func) if isinstance(s, ast.Assign)
                        and isinstance(s.targets[0], ast.Name) and s.targets[0].id == target
                        and isinstance(s.value, ast.Name) and s.value.id.startswith("_2X_ACC_")
                        and s.lineno < guard.lineno]
            assert defaults, f"{modname}.{func.name}: no `{target} = _2X_ACC_*` default before line {node.lineno}"
            sites.append((modname, func.name, gemm, target, defaults[-1], guard))
    return sites


def run_te_site(site, recipe):
    """Execute TE's own statements of one site (default assignment + fp8 guard block) with
    ``recipe`` active; return the value TE resolves (and ``backward_override`` if the block sets it)."""
    _, _, _, target, default, guard = site
    code = compile(ast.Module(body=[default, guard], type_ignores=[]), "<te-site>", "exec")
    ns = {
        "_2X_ACC_FPROP": te_base._2X_ACC_FPROP, "_2X_ACC_DGRAD": te_base._2X_ACC_DGRAD,
        "_2X_ACC_WGRAD": te_base._2X_ACC_WGRAD,
        "FP8GlobalStateManager": types.SimpleNamespace(get_fp8_recipe=lambda: recipe),
        "ctx": types.SimpleNamespace(fp8=True, debug=False, fp8_recipe=recipe),
        "self": types.SimpleNamespace(fp8=True, debug=False),
        "fp8": True, "debug": False,
    }
    exec(code, ns)  # noqa: S102 - TE's own source, compiled from the installed package
    return ns[target], ns.get("backward_override", "<unset>")


SITES = te_split_accumulator_sites()


def test_found_every_te_site():
    """The AST scan finds TE's sites (a scan that found nothing would make the table test vacuous)."""
    found = {(m, g) for m, _, g, *_ in SITES}
    assert {("linear", "fprop"), ("linear", "dgrad"), ("linear", "wgrad"),
            ("layernorm_linear", "fprop"), ("layernorm_linear", "dgrad"), ("layernorm_linear", "wgrad"),
            ("layernorm_mlp", "fprop"), ("layernorm_mlp", "dgrad"), ("layernorm_mlp", "wgrad"),
            ("grouped_linear", "fprop"), ("grouped_linear", "dgrad"), ("grouped_linear", "wgrad")} <= found
    assert len(SITES) >= 15


def test_module_defaults_are_tes():
    assert recipe_table.module_default_split_accumulator() == {
        "fprop": te_base._2X_ACC_FPROP, "dgrad": te_base._2X_ACC_DGRAD, "wgrad": te_base._2X_ACC_WGRAD}
    assert dict(recipes.PINNED_MODULE_DEFAULTS) == recipe_table.module_default_split_accumulator()


@pytest.mark.parametrize("rid,make", RECIPES, ids=IDS)
def test_split_accumulator_matches_every_te_site(rid, make):
    r = make()
    res = recipe_table.resolve_recipe(r)
    for site in SITES:
        te_value, te_bo = run_te_site(site, r)
        gemm = site[2]
        assert res.use_split_accumulator(gemm) is bool(te_value), (rid, site[:4])
        if te_bo != "<unset>":  # Linear.forward's block also resolves backward_override
            assert res.backward_override.value == te_bo, (rid, site[:4])


def test_backward_override_is_resolved_by_some_te_site():
    assert any(run_te_site(s, te_recipe.Float8CurrentScaling())[1] != "<unset>" for s in SITES)


def test_table_rows_at_defaults():
    """Spot values of the documented table (these are what TE's sites resolved above)."""
    t = recipe_table.resolution_table()
    assert set(t) == set(recipes.RECIPE_CLASSES)
    assert {g: t["Float8CurrentScaling"].use_split_accumulator(g) for g in recipes.GEMMS} == \
        {"fprop": False, "dgrad": True, "wgrad": True}
    assert all(t["Float8BlockScaling"].use_split_accumulator(g) for g in recipes.GEMMS)
    for cls in ("DelayedScaling", "MXFP8BlockScaling", "NVFP4BlockScaling", "CustomRecipe"):
        assert t[cls].split_accumulator["fprop"].source == "module/base.py:_2X_ACC_FPROP"
    assert t["Float8CurrentScaling"].split_accumulator["dgrad"].source == "recipe.fp8_gemm_dgrad.use_split_accumulator"
    assert t["CustomRecipe"].quantizer_class is None and t["CustomRecipe"].quantizers == {}
    md = recipe_table.table_markdown()
    assert md.count("\n") == len(recipes.RECIPE_CLASSES) + 1


# --------------------------------------------------------------------------- quantizer fields
@contextlib.contextmanager
def _nvfp4_cpu():
    """NVFP4Quantizer's constructor builds its RHT sign mask / matrix on the current CUDA device;
    on CPU those derived tensors are stubbed (they are not value fields)."""
    from transformer_engine.pytorch.tensor import nvfp4_tensor

    with mock.patch.object(nvfp4_tensor, "get_random_sign_mask_for_rht", return_value=0), \
            mock.patch.object(nvfp4_tensor, "get_rht_matrix", return_value=None), \
            mock.patch("torch.cuda.current_device", return_value=0):
        yield


def te_linear_quantizers(recipe):
    """TE's quantizers for a te.Linear under ``recipe``: ``{role: quantizer}``, built by TE's
    ``RecipeState`` with Linear's roles, then customised by ``Linear.set_meta_tensor``'s
    Float8CurrentScaling hook."""
    out = {}
    with _nvfp4_cpu():
        for mode, roles in (("forward", recipes.FWD_ROLES), ("backward", recipes.BWD_ROLES)):
            qroles = [QuantizerRole(module_type="linear", tensor_type=t) for t in roles]
            state = RecipeState.create(recipe, mode=mode, num_quantizers=len(roles),
                                       device=torch.device("cpu"), roles=qroles)
            qs = state.make_quantizers()
            if recipe.float8_current_scaling():
                key = "scaling_fwd" if mode == "forward" else "scaling_bwd"
                fake_module = types.SimpleNamespace(quantizers={key: qs})
                te.Linear._customize_quantizers_float8_current_scaling(fake_module, mode == "forward", recipe)
            out.update(zip(roles, qs))
    return out


@pytest.mark.parametrize("rid,make", [r for r in RECIPES if r[0] != "CustomRecipe"],
                         ids=[i for i in IDS if i != "CustomRecipe"])
def test_quantizer_fields_match_te_recipe_state(rid, make):
    r = make()
    res = recipe_table.resolve_recipe(r)
    qs = te_linear_quantizers(r)
    for role, q in qs.items():
        assert type(q).__name__ == res.quantizer_class, (rid, role)
        table = res.quantizer_values(role)
        assert table, f"{rid}: no table entry for role {role}"
        te_fields = quantizer_fields(q)
        for field, value in table.items():
            got = te_fields[field]
            got = got.name if field == "dtype" else got
            assert got == value and type(got) is type(value), (rid, role, field, got, value)


def test_nondefault_current_scaling_quirk_is_mirrored():
    """``use_power_2_scales`` reaches only the quantizers the module does not customise
    (output / grad_input); input/weight/grad_output take ``fp8_quant_*.power_2_scale``."""
    r = te_recipe.Float8CurrentScaling(use_power_2_scales=True)
    res = recipe_table.resolve_recipe(r)
    assert res.quantizer_values("output")["force_pow_2_scales"] is True
    assert res.quantizer_values("input")["force_pow_2_scales"] is False  # class-attribute QParams default
    assert quantizer_fields(te_linear_quantizers(r)["input"])["force_pow_2_scales"] is False


def test_custom_recipe_quantizers_come_from_qfactory():
    calls = []

    def qfactory(role=None):
        calls.append(role)
        return te.Float8CurrentScalingQuantizer(te.DType.kFloat8E4M3 if hasattr(te, "DType") else 7,
                                                device=torch.device("cpu"))

    r = te_recipe.CustomRecipe(qfactory=qfactory)
    res = recipe_table.resolve_recipe(r)
    assert res.quantizer_class is None and res.quantizers == {}
    assert calls == []  # resolution never calls the user's factory


# --------------------------------------------------------------------------- errors and lookups
def test_bad_input_errors_name_the_problem():
    with pytest.raises(recipes.RecipeResolutionError, match="not a TE recipe: int"):
        recipe_table.resolve_recipe(3)
    with pytest.raises(recipes.RecipeResolutionError, match="unknown TE recipe class 'Foo'"):
        recipe_table.default_recipe("Foo")
    with pytest.raises(KeyError, match="unknown GEMM 'xgrad'"):
        recipe_table.resolve_recipe(te_recipe.Float8CurrentScaling()).use_split_accumulator("xgrad")
    with pytest.raises(recipes.RecipeResolutionError, match="qfactory is not a plain data field"):
        recipes.read_recipe_attr(_custom(), "qfactory")
    with pytest.raises(recipes.RecipeResolutionError, match="not a pure TE recipe function"):
        recipes.call_recipe_function("os.system", ())


def test_read_recipe_attr_and_pure_functions():
    r = te_recipe.Float8CurrentScaling()
    mm = recipes.read_recipe_attr(r, "fp8_gemm_dgrad")
    assert recipes.read_recipe_attr(mm, "use_split_accumulator") is True
    assert recipes.read_recipe_attr(recipes.read_recipe_attr(r, "fp8_quant_fwd_inp"), "amax_epsilon") == 0.0
    assert recipes.read_recipe_attr(r, "float8_current_scaling")() is True
    from transformer_engine.pytorch.quantization import get_fp8_te_dtype

    assert recipes.call_recipe_function("get_fp8_te_dtype", (r, False)) == get_fp8_te_dtype(r, False)
    assert recipes.pure_recipe_function_name(get_fp8_te_dtype) == "get_fp8_te_dtype"


def test_state_lookup_names_and_live_state():
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as M

    assert recipes.state_lookup_name(M.get_fp8_recipe) == "get_fp8_recipe"
    assert recipes.state_lookup_name(M.is_fp8_enabled) == "is_fp8_enabled"
    assert recipes.state_lookup_name(M.reset) is None
    assert recipes.state_lookup_name(len) is None
    from transformer_engine.pytorch import quantization

    from te_passes.compat.api import capture_fp8  # the live read is in the fence; its data type is te/'s

    r = te_recipe.Float8CurrentScaling()
    # No GPU here: preset TE's cached device-support answers (the only CUDA queries autocast makes).
    ok = (True, "")
    with mock.patch.multiple(quantization, _FP8_SUPPORT=ok, _MXFP8_SUPPORT=ok, _NVFP4_SUPPORT=ok,
                             _FP8_BLOCK_SCALING_SUPPORT=ok), te.autocast(enabled=True, recipe=r):
        st = capture_fp8()
    assert st.fp8_enabled is True and st.recipe is r and st.fp8_group is None
    assert capture_fp8().fp8_enabled is False


def test_docs_page_table_is_current():
    """docs/passes/fold_recipe_lookups.md embeds ``table_markdown()`` verbatim."""
    import os
    from pathlib import Path

    if any(k.startswith(("NVTE_BACKWARD_OVERRIDE", "NVTE_FP8_", "NVTE_NVFP4_")) for k in os.environ):
        pytest.skip("NVTE_* recipe environment overrides change the class defaults")
    doc = (Path(__file__).resolve().parents[2] / "docs" / "passes" / "fold_recipe_lookups.md").read_text()
    start = doc.index("<!-- table:")
    body = doc[doc.index("\n", start) + 1: doc.index("<!-- /table -->")].strip()
    assert body == recipe_table.table_markdown()
