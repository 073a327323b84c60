"""The fp8 recipe resolution table: what each TE recipe class resolves to, per GEMM and tensor role.

See docs/internals.md#te_passesterecipe_tablepy."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

from te_passes.te.recipes import (BWD_ROLES, FWD_ROLES, GEMMS, PINNED_MODULE_DEFAULTS, QUANTIZER_CLASS, RECIPE_CLASSES,
                                  ROLES, RecipeResolutionError, recipe_class_name)


@dataclasses.dataclass(frozen=True)
class Resolved:
    """One resolved value and where TE reads it from (``source``: an attribute path on the
    recipe such as ``"recipe.fp8_gemm_dgrad.use_split_accumulator"``, or a TE module default
    such as ``"module/base.py:_2X_ACC_DGRAD"``)."""

    value: Any
    source: str


@dataclasses.dataclass(frozen=True)
class RecipeResolution:
    """What one recipe object resolves to: its class (:data:`RECIPE_CLASSES`), ``{gemm:
    Resolved(bool)}`` split-accumulator flags, ``backward_override`` (``None`` /
    ``"high_precision"`` / ``"dequantized"``), the quantizer class it builds (``None``:
    CustomRecipe) and ``{role: {field: Resolved}}`` of the quantizer value fields it sets
    (``dtype`` as TE's ``DType`` name; empty for CustomRecipe)."""

    recipe_class: str
    split_accumulator: Mapping[str, Resolved]
    backward_override: Resolved
    quantizer_class: str | None
    quantizers: Mapping[str, Mapping[str, Resolved]]

    def use_split_accumulator(self, gemm: str) -> bool:
        """The resolved flag of ``gemm`` (``"fprop"``, ``"dgrad"`` or ``"wgrad"``; else ``KeyError``)."""
        if gemm not in self.split_accumulator:
            raise KeyError(f"unknown GEMM {gemm!r}; expected one of {GEMMS}")
        return bool(self.split_accumulator[gemm].value)

    def quantizer_values(self, role: str) -> dict[str, Any]:
        """``{field: value}`` the recipe sets on the quantizer of ``role`` (``KeyError``: unknown role)."""
        if role not in ROLES:
            raise KeyError(f"unknown quantizer role {role!r}; expected one of {ROLES}")
        return {k: r.value for k, r in self.quantizers.get(role, {}).items()}

    def to_json(self) -> dict[str, Any]:
        """JSON-ready form: ``{"recipe_class", "use_split_accumulator": {gemm: bool},
        "backward_override", "quantizer_class", "quantizers": {role: {field: value}}}``."""
        return {
            "recipe_class": self.recipe_class,
            "use_split_accumulator": {g: r.value for g, r in self.split_accumulator.items()},
            "backward_override": self.backward_override.value,
            "quantizer_class": self.quantizer_class,
            "quantizers": {role: self.quantizer_values(role) for role in self.quantizers},
        }


@functools.lru_cache(maxsize=None)
def module_default_split_accumulator() -> dict[str, bool]:
    """``{gemm: bool}`` from TE's ``module/base.py`` ``_2X_ACC_*`` (live when TE imports, else
    :data:`PINNED_MODULE_DEFAULTS`)."""
    try:
        from transformer_engine.pytorch.module import base as te_base
    except Exception:  # noqa: BLE001 - TE absent or its core library does not load
        return dict(PINNED_MODULE_DEFAULTS)
    return {"fprop": bool(te_base._2X_ACC_FPROP), "dgrad": bool(te_base._2X_ACC_DGRAD),
            "wgrad": bool(te_base._2X_ACC_WGRAD)}


def _format_name(fmt: Any) -> str:
    return getattr(fmt, "name", str(fmt))


def fp8_dtype_name(recipe: Any, fprop_tensor: bool) -> str:
    """TE ``DType`` member name of a tensor's fp8 data, as ``quantization.py`` ``get_fp8_te_dtype``
    resolves it (E4M3 for ``Format.E4M3`` and HYBRID's forward tensors, else E5M2)."""
    fmt = _format_name(recipe.fp8_format)
    return "kFloat8E4M3" if fmt == "E4M3" or (fmt == "HYBRID" and fprop_tensor) else "kFloat8E5M2"


def _in_scope(scope: str, role: str) -> bool:
    return scope == "all" or scope == ("weights" if role == "weight" else "activations")


def _quantizers_for(recipe: Any, cls: str, module_type: str) -> dict[str, dict[str, Resolved]]:
    out: dict[str, dict[str, Resolved]] = {}
    if cls == "CustomRecipe":
        return out
    for role in ROLES:
        fwd = role in FWD_ROLES
        f: dict[str, Resolved] = {}
        if cls in ("DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling"):
            f["dtype"] = Resolved(fp8_dtype_name(recipe, fwd), "get_fp8_te_dtype(recipe.fp8_format, fprop)")
        if cls == "Float8CurrentScaling":
            # RecipeState: force_pow_2_scales=recipe.use_power_2_scales, amax_epsilon default 0.0;
            # then the module's set_meta_tensor customisation overrides input/weight/grad_output.
            qp = {"input": "fp8_quant_fwd_inp", "weight": "fp8_quant_fwd_weight",
                  "grad_output": "fp8_quant_bwd_grad"}.get(role)
            if qp is not None:
                params = getattr(recipe, qp)
                f["force_pow_2_scales"] = Resolved(bool(params.power_2_scale), f"recipe.{qp}.power_2_scale")
                f["amax_epsilon"] = Resolved(float(params.amax_epsilon), f"recipe.{qp}.amax_epsilon")
            else:
                f["force_pow_2_scales"] = Resolved(bool(recipe.use_power_2_scales), "recipe.use_power_2_scales")
                f["amax_epsilon"] = Resolved(0.0, "Float8CurrentScalingQuantizer default")
        elif cls == "MXFP8BlockScaling":
            two_d = (fwd and bool(recipe.enable_2d_quantization) and role == "weight"
                     and module_type in ("linear", "grouped_linear"))
            f["with_2d_quantization"] = Resolved(two_d, "recipe.enable_2d_quantization (forward weight)")
        elif cls == "Float8BlockScaling":
            if role == "weight":
                qp, dim, dt = "fp8_quant_fwd_weight", "w_block_scaling_dim", True
            elif role in BWD_ROLES:
                qp, dim, dt = "fp8_quant_bwd_grad", "grad_block_scaling_dim", False
            else:
                qp, dim, dt = "fp8_quant_fwd_inp", "x_block_scaling_dim", True
            params = getattr(recipe, qp)
            f["dtype"] = Resolved(fp8_dtype_name(recipe, dt), "get_fp8_te_dtype(recipe.fp8_format, fprop)")
            f["amax_epsilon"] = Resolved(float(params.amax_epsilon), f"recipe.{qp}.amax_epsilon")
            f["force_pow_2_scales"] = Resolved(bool(params.power_2_scale), f"recipe.{qp}.power_2_scale")
            f["block_scaling_dim"] = Resolved(int(getattr(recipe, dim)), f"recipe.{dim}")
        elif cls == "NVFP4BlockScaling":
            qp = ("fp4_quant_bwd_grad" if role in BWD_ROLES else
                  "fp4_quant_fwd_weight" if role == "weight" else "fp4_quant_fwd_inp")
            params = getattr(recipe, qp)
            use_4over6 = role not in BWD_ROLES and _in_scope(recipe.nvfp4_4over6, role)
            e4m3_max = 256 if use_4over6 and _in_scope(recipe.nvfp4_4over6_e4m3_use_256, role) else 448
            f["dtype"] = Resolved("kFloat4E2M1", "get_fp4_te_dtype(recipe.fp4_format)")
            f["with_rht"] = Resolved(bool(params.random_hadamard_transform), f"recipe.{qp}.random_hadamard_transform")
            f["with_post_rht_amax"] = Resolved(bool(params.random_hadamard_transform),
                                               f"recipe.{qp}.random_hadamard_transform")
            f["with_2d_quantization"] = Resolved(bool(params.fp4_2d_quantization), f"recipe.{qp}.fp4_2d_quantization")
            f["stochastic_rounding"] = Resolved(bool(params.stochastic_rounding), f"recipe.{qp}.stochastic_rounding")
            f["row_scaled_nvfp4"] = Resolved(fwd and role != "weight" and bool(recipe.row_scaled_activation),
                                             "recipe.row_scaled_activation (forward activations)")
            f["nvfp4_use_4over6"] = Resolved(use_4over6, "recipe.nvfp4_4over6")
            f["nvfp4_e4m3_max"] = Resolved(e4m3_max, "recipe.nvfp4_4over6_e4m3_use_256")
            f["nvfp4_4over6_err_mode"] = Resolved(recipe.nvfp4_4over6_err_mode, "recipe.nvfp4_4over6_err_mode")
        out[role] = f
    return out


def resolve_recipe(recipe: Any, *, module_type: str = "linear") -> RecipeResolution:
    """Resolve a TE recipe instance (a class of :data:`RECIPE_CLASSES` or a subclass) as TE does for a
    module of ``module_type`` (``"linear"``, ``"grouped_linear"``, ``"layernorm_linear"``,
    ``"layernorm_mlp"``: only MXFP8's 2D weight quantization depends on it), as pure data.
    Raises :class:`RecipeResolutionError` for anything else."""
    cls = recipe_class_name(recipe)
    defaults = module_default_split_accumulator()
    split: dict[str, Resolved] = {}
    for gemm in GEMMS:
        attr = f"fp8_gemm_{gemm}"
        if hasattr(recipe, attr):
            split[gemm] = Resolved(bool(getattr(recipe, attr).use_split_accumulator),
                                   f"recipe.{attr}.use_split_accumulator")
        else:
            split[gemm] = Resolved(defaults[gemm], f"module/base.py:_2X_ACC_{gemm.upper()}")
    return RecipeResolution(
        recipe_class=cls,
        split_accumulator=split,
        backward_override=Resolved(getattr(recipe, "backward_override", None), "recipe.backward_override"),
        quantizer_class=QUANTIZER_CLASS[cls],
        quantizers=_quantizers_for(recipe, cls, module_type),
    )


def _dummy_qfactory(role: Any = None) -> Any:  # pragma: no cover - never called by resolution
    raise RuntimeError("te_passes' placeholder CustomRecipe qfactory must not be called")


def default_recipe(cls_name: str) -> Any:
    """A default-constructed TE recipe of class ``cls_name`` (CustomRecipe: a placeholder
    ``qfactory`` that raises if called). Raises :class:`RecipeResolutionError` for an unknown class."""
    if cls_name not in RECIPE_CLASSES:
        raise RecipeResolutionError(f"unknown TE recipe class {cls_name!r}; known: {RECIPE_CLASSES}")
    from transformer_engine.common import recipe as te_recipe

    cls = getattr(te_recipe, cls_name)
    return cls(qfactory=_dummy_qfactory) if cls_name == "CustomRecipe" else cls()


def resolution_table(module_type: str = "linear") -> dict[str, RecipeResolution]:
    """``{class name: RecipeResolution}`` of every TE recipe class at its defaults (the
    environment variables TE reads at import, e.g. ``NVTE_BACKWARD_OVERRIDE``, apply)."""
    return {name: resolve_recipe(default_recipe(name), module_type=module_type) for name in RECIPE_CLASSES}


def table_markdown(module_type: str = "linear") -> str:
    """The resolution table at class defaults as Markdown (the docs page embeds it)."""
    table = resolution_table(module_type)
    lines = ["| recipe class | fprop split acc. | dgrad split acc. | wgrad split acc. | backward_override "
             "| quantizer | recipe-set quantizer fields (input / weight / grad_output) |",
             "|---|---|---|---|---|---|---|"]
    for name, res in table.items():
        cells = []
        for g in GEMMS:
            r = res.split_accumulator[g]
            origin = "recipe" if r.source.startswith("recipe.") else "default"
            cells.append(f"{r.value} ({origin})")
        q = "; ".join(f"{role}: " + ", ".join(f"{k}={v!r}" for k, v in res.quantizer_values(role).items())
                      for role in ("input", "weight", "grad_output") if res.quantizer_values(role)) or "from qfactory"
        lines.append(f"| {name} | {' | '.join(cells)} | {res.backward_override.value!r} "
                     f"| {res.quantizer_class or '-'} | {q} |")
    return "\n".join(lines)
