"""The fp8 recipe resolution table: what each TE recipe class resolves to, per GEMM and tensor role.

Transformer Engine reads its recipe objects at run time in many places; te_passes resolves
every such read once, at compile time, into plain constants (pass ``fold_recipe_lookups``).
This module is the one place that knows how TE resolves a recipe. It mirrors TE 2.20.2:

* **split accumulator per GEMM** — ``transformer_engine/pytorch/module/linear.py``
  (``_linear_forward_impl``: fprop; ``Linear.forward``: dgrad/wgrad into ``LinearFwdArgs``),
  ``layernorm_linear.py``, ``layernorm_mlp.py``, ``grouped_linear.py``: every site reads
  ``recipe.fp8_gemm_<gemm>.use_split_accumulator`` **if the recipe has that attribute**
  (``hasattr``), else falls back to the module defaults ``_2X_ACC_FPROP`` / ``_2X_ACC_DGRAD`` /
  ``_2X_ACC_WGRAD`` of ``transformer_engine/pytorch/module/base.py`` (False / True / True).
  Only ``Float8CurrentScaling`` and ``Float8BlockScaling`` have ``fp8_gemm_*`` fields
  (``transformer_engine/common/recipe/__init__.py``);
* **backward_override** — ``recipe.backward_override`` (``Linear.forward``; ``None`` when fp8 is
  off);
* **quantizer fields** — what ``RecipeState.create(recipe, ...).make_quantizers()``
  (``transformer_engine/pytorch/quantization.py``) sets on the quantizers it builds for a
  module's slots (forward: input / weight / output; backward: grad_output / grad_input), plus
  the Float8CurrentScaling customisation every TE module applies in ``set_meta_tensor``
  (``Linear._customize_quantizers_float8_current_scaling``: input, weight and grad_output get
  ``force_pow_2_scales`` / ``amax_epsilon`` from ``recipe.fp8_quant_{fwd_inp,fwd_weight,bwd_grad}``).

Usage flags (``rowwise_usage``, ``columnwise_usage``, ``internal``, ``optimize_for_gemm``) are
set by the modules per call, not by recipes; they are not in the table. ``CustomRecipe``'s
quantizers come from the user's ``qfactory`` and cannot be resolved statically (its table row
has ``quantizer_class=None``); its GEMMs use the module defaults.

``tests/test_recipes.py`` checks this table against TE's own resolution code, run on CPU.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import sys
from typing import Any, Callable, Mapping

#: The three GEMMs of a TE linear layer.
GEMMS: tuple[str, ...] = ("fprop", "dgrad", "wgrad")

#: Quantizer slots of a TE linear layer: forward (input, weight, output) and backward
#: (grad_output, grad_input), the order of ``RecipeState._FWD/_BWD_DEFAULT_TENSOR_TYPES``.
FWD_ROLES: tuple[str, ...] = ("input", "weight", "output")
BWD_ROLES: tuple[str, ...] = ("grad_output", "grad_input")
ROLES: tuple[str, ...] = FWD_ROLES + BWD_ROLES

#: ``transformer_engine/pytorch/module/base.py`` ``_2X_ACC_FPROP/_DGRAD/_WGRAD`` (TE 2.20.2).
#: :func:`module_default_split_accumulator` reads the live values when TE is importable.
PINNED_MODULE_DEFAULTS: Mapping[str, bool] = {"fprop": False, "dgrad": True, "wgrad": True}

#: TE recipe class names, in ``RecipeState.create`` dispatch order.
RECIPE_CLASSES: tuple[str, ...] = (
    "DelayedScaling", "MXFP8BlockScaling", "Float8CurrentScaling", "Float8BlockScaling",
    "NVFP4BlockScaling", "CustomRecipe",
)

#: Quantizer class ``RecipeState.make_quantizers`` builds per recipe class.
QUANTIZER_CLASS: Mapping[str, str | None] = {
    "DelayedScaling": "Float8Quantizer",
    "MXFP8BlockScaling": "MXFP8Quantizer",
    "Float8CurrentScaling": "Float8CurrentScalingQuantizer",
    "Float8BlockScaling": "Float8BlockQuantizer",
    "NVFP4BlockScaling": "NVFP4Quantizer",
    "CustomRecipe": None,
}

#: Classmethods of ``Recipe`` that only test the recipe's class (pure, foldable).
RECIPE_PREDICATES: frozenset[str] = frozenset({
    "nvfp4", "mxfp8", "delayed", "float8_current_scaling", "float8_per_tensor_scaling",
    "float8_block_scaling", "custom",
})

#: ``FP8GlobalStateManager`` classmethods whose result is fixed for one compiled graph, and
#: the name of the state they read (``transformer_engine/pytorch/quantization.py``).
STATE_LOOKUPS: Mapping[str, str] = {
    "get_fp8_recipe": "recipe",
    "is_fp8_enabled": "fp8_enabled",
    "is_fp8_calibration": "fp8_calibration",
    "with_fp8_parameters": "fp8_parameters",
    "get_fp8_group": "fp8_group",
}

#: Pure module-level TE functions of a recipe (``transformer_engine.pytorch.quantization``),
#: which the pass evaluates at compile time: ``(recipe, *constant args) -> constant``.
PURE_RECIPE_FUNCTIONS: frozenset[str] = frozenset({"get_fp8_te_dtype", "get_fp4_te_dtype", "get_fp8_max"})


class RecipeResolutionError(ValueError):
    """A recipe (or attribute path) that te_passes cannot resolve; the message names it."""


# --------------------------------------------------------------------------- TE objects
def _mro_names(obj: Any) -> set[str]:
    t = obj if isinstance(obj, type) else type(obj)
    return {k.__name__ for k in getattr(t, "__mro__", ())}


def _is_te(obj: Any) -> bool:
    t = obj if isinstance(obj, type) else type(obj)
    return (getattr(t, "__module__", "") or "").startswith("transformer_engine")


def is_recipe(obj: Any) -> bool:
    """Whether ``obj`` is an instance of a TE recipe (``transformer_engine.common.recipe.Recipe``)."""
    return not isinstance(obj, type) and _is_te(obj) and "Recipe" in _mro_names(obj)


def is_recipe_part(obj: Any) -> bool:
    """Whether ``obj`` is a sub-object of a recipe: ``MMParams``, ``QParams`` or ``Format``."""
    return _is_te(obj) and bool(_mro_names(obj) & {"MMParams", "QParams", "Format", "_FormatHelper"})


def is_process_group(obj: Any) -> bool:
    """Whether ``obj`` is a ``torch.distributed`` process group (c10d ``ProcessGroup``)."""
    return "ProcessGroup" in _mro_names(obj) and not isinstance(obj, type)


def recipe_class_name(recipe: Any) -> str:
    """The TE recipe class ``recipe`` dispatches as (``RecipeState.create`` order: a subclass
    of ``Float8CurrentScaling`` resolves as ``"Float8CurrentScaling"``).

    Raises:
        RecipeResolutionError: ``recipe`` is not a TE recipe or not of a known class.
    """
    if not is_recipe(recipe):
        raise RecipeResolutionError(f"not a TE recipe: {type(recipe).__qualname__}")
    names = _mro_names(recipe)
    for cls in RECIPE_CLASSES:
        if cls in names:
            return cls
    raise RecipeResolutionError(f"{type(recipe).__qualname__} is not a TE recipe class te_passes "
                                f"resolves (known: {', '.join(RECIPE_CLASSES)})")


# --------------------------------------------------------------------------- the table
@dataclasses.dataclass(frozen=True)
class Resolved:
    """One resolved value and where TE reads it from (``source``: an attribute path on the
    recipe such as ``"recipe.fp8_gemm_dgrad.use_split_accumulator"``, or a TE module default
    such as ``"module/base.py:_2X_ACC_DGRAD"``)."""

    value: Any
    source: str


@dataclasses.dataclass(frozen=True)
class RecipeResolution:
    """What one recipe object resolves to.

    Fields:
        recipe_class: the TE recipe class (:data:`RECIPE_CLASSES`).
        split_accumulator: ``{gemm: Resolved(bool)}`` for ``fprop``/``dgrad``/``wgrad``.
        backward_override: ``Resolved(None | "high_precision" | "dequantized")``.
        quantizer_class: the TE quantizer class the recipe builds (``None``: CustomRecipe).
        quantizers: ``{role: {field: Resolved}}`` for the roles of :data:`ROLES`: the
            quantizer value fields the recipe sets (``dtype`` as TE's ``DType`` name,
            ``force_pow_2_scales``, ``amax_epsilon``, ``block_scaling_dim``, NVFP4's
            ``with_rht``/``stochastic_rounding``/..., MXFP8's ``with_2d_quantization``).
            Empty for CustomRecipe.
    """

    recipe_class: str
    split_accumulator: Mapping[str, Resolved]
    backward_override: Resolved
    quantizer_class: str | None
    quantizers: Mapping[str, Mapping[str, Resolved]]

    def use_split_accumulator(self, gemm: str) -> bool:
        """The resolved flag of ``gemm`` (``"fprop"``, ``"dgrad"`` or ``"wgrad"``).

        Raises:
            KeyError: unknown GEMM name.
        """
        if gemm not in self.split_accumulator:
            raise KeyError(f"unknown GEMM {gemm!r}; expected one of {GEMMS}")
        return bool(self.split_accumulator[gemm].value)

    def quantizer_values(self, role: str) -> dict[str, Any]:
        """``{field: value}`` the recipe sets on the quantizer of ``role``."""
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
        import torch  # noqa: F401  (TE needs torch imported first)
        from transformer_engine.pytorch.module import base as te_base
    except Exception:  # noqa: BLE001 - TE absent or its core library does not load
        return dict(PINNED_MODULE_DEFAULTS)
    return {"fprop": bool(te_base._2X_ACC_FPROP), "dgrad": bool(te_base._2X_ACC_DGRAD),
            "wgrad": bool(te_base._2X_ACC_WGRAD)}


def _format_name(fmt: Any) -> str:
    return getattr(fmt, "name", str(fmt))


def fp8_dtype_name(recipe: Any, fprop_tensor: bool) -> str:
    """TE ``DType`` member name of the fp8 data of a tensor, as ``get_fp8_te_dtype`` resolves it
    (``quantization.py``): E4M3 for ``Format.E4M3`` and for forward tensors of
    ``Format.HYBRID``, else E5M2."""
    fmt = _format_name(recipe.fp8_format)
    return "kFloat8E4M3" if fmt == "E4M3" or (fmt == "HYBRID" and fprop_tensor) else "kFloat8E5M2"


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
            use_4over6 = False
            scope = recipe.nvfp4_4over6
            if role not in BWD_ROLES:
                use_4over6 = (scope == "all" or (scope == "weights" and role == "weight")
                              or (scope == "activations" and role != "weight"))
            e4m3_max = 448
            if use_4over6:
                s256 = recipe.nvfp4_4over6_e4m3_use_256
                if s256 == "all" or (s256 == "weights" and role == "weight") or (
                        s256 == "activations" and role != "weight"):
                    e4m3_max = 256
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
    """Resolve ``recipe`` as TE 2.20.2 does for a module of ``module_type``.

    Args:
        recipe: a TE recipe instance (any class of :data:`RECIPE_CLASSES` or a subclass).
        module_type: the TE module whose quantizer roles are resolved (``"linear"``,
            ``"grouped_linear"``, ``"layernorm_linear"``, ``"layernorm_mlp"``); only MXFP8's
            2D weight quantization depends on it (``linear`` / ``grouped_linear`` only).

    Returns:
        A :class:`RecipeResolution` (pure data; reading it never touches the recipe again).

    Raises:
        RecipeResolutionError: ``recipe`` is not a TE recipe of a known class.
    """
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
    """A default-constructed TE recipe of class ``cls_name`` (CustomRecipe gets a placeholder
    ``qfactory`` that raises if called).

    Raises:
        RecipeResolutionError: unknown class name. ImportError: TE not installed.
    """
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


# --------------------------------------------------------------------------- lookups
#: Attribute names that may be read off a recipe (or its MMParams/QParams/Format parts) at
#: compile time: dataclass fields of TE 2.20 recipes and their parts. Anything else is not
#: folded (the pass records why).
_PART_FIELDS = frozenset({
    "use_split_accumulator", "power_2_scale", "amax_epsilon", "random_hadamard_transform",
    "stochastic_rounding", "fp4_2d_quantization", "max_fwd", "max_bwd", "value", "name",
})


def recipe_field_names(recipe: Any) -> frozenset[str]:
    """Plain-data attribute names of ``recipe`` that may be read at compile time: its
    dataclass fields plus the QParams class attributes (``fp8_quant_*``, ``fp4_quant_*``)."""
    names = {f.name for f in dataclasses.fields(recipe)} if dataclasses.is_dataclass(recipe) else set()
    names |= {n for n in dir(type(recipe)) if n.startswith(("fp8_quant_", "fp4_quant_", "fp8_gemm_"))}
    names |= {n for n in vars(recipe) if n.startswith(("fp8_quant_", "fp4_quant_", "fp8_gemm_"))}
    names.discard("qfactory")  # a user callable: never a constant
    names.discard("scaling_factor_compute_algo")
    names.discard("amax_compute_algo")
    return frozenset(names)


def read_recipe_attr(obj: Any, name: str) -> Any:
    """Read attribute ``name`` of a recipe or recipe part at compile time.

    Only data fields are read (never user callables such as ``qfactory``); reading a name the
    object lacks raises the ``AttributeError`` TE code would get.

    Raises:
        RecipeResolutionError: ``obj`` is neither a recipe nor a recipe part, or ``name`` is
            not a plain data field of it.
        AttributeError: the object has no such attribute.
    """
    if (is_recipe(obj) or is_recipe_part(obj)) and not hasattr(obj, name):
        raise AttributeError(f"{type(obj).__name__} has no attribute {name!r}")
    if is_recipe(obj):
        if name not in recipe_field_names(obj) and name not in RECIPE_PREDICATES:
            raise RecipeResolutionError(
                f"{type(obj).__name__}.{name} is not a plain data field of the recipe")
    elif is_recipe_part(obj):
        if name not in _PART_FIELDS:
            raise RecipeResolutionError(f"{type(obj).__name__}.{name} is not a recipe data field")
    else:
        raise RecipeResolutionError(f"not a TE recipe or recipe part: {type(obj).__qualname__}")
    return getattr(obj, name)


def call_recipe_function(name: str, args: tuple[Any, ...]) -> Any:
    """Evaluate the pure TE function ``transformer_engine.pytorch.quantization.<name>`` (one
    of :data:`PURE_RECIPE_FUNCTIONS`) on constant ``args``.

    Raises:
        RecipeResolutionError: ``name`` is not a known pure recipe function.
    """
    if name not in PURE_RECIPE_FUNCTIONS:
        raise RecipeResolutionError(f"{name} is not a pure TE recipe function ({sorted(PURE_RECIPE_FUNCTIONS)})")
    from transformer_engine.pytorch import quantization

    return getattr(quantization, name)(*args)


def is_plain_constant(value: Any) -> bool:
    """Whether ``value`` may stand as a literal constant in an FX graph: ``None``, bool, int,
    float, str, ``torch.dtype``, or an ``enum.Enum`` member whose value is plain (TE's ``DType``)."""
    import torch

    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return True
    if isinstance(value, enum.Enum):
        return isinstance(value.value, (bool, int, float, str))
    return False


#: The TE module holding ``FP8GlobalStateManager`` (TE 2.20.2).
FP8_STATE_MODULE = "transformer_engine.pytorch.quantization"


@dataclasses.dataclass(frozen=True)
class Fp8State:
    """The TE autocast state a graph is compiled under (``FP8GlobalStateManager``).

    ``recipe`` is the object ``get_fp8_recipe()`` returns (TE's default recipe when no autocast
    is active; ``None`` when that default cannot be chosen because no GPU is visible: lookups
    of it are then not folded), ``fp8_group`` the amax-reduction process group (``None`` when
    unset). ``recipe_text`` / ``fp8_group_text``: what :meth:`to_json` shows for them when the
    objects are not here (a state read back from a dump by :meth:`from_json`; lookups of the
    recipe are then not folded).
    """

    fp8_enabled: bool = False
    fp8_calibration: bool = False
    fp8_parameters: bool = False
    recipe: Any = None
    fp8_group: Any = None
    recipe_text: str | None = None
    fp8_group_text: str | None = None

    def lookup(self, name: str) -> Any:
        """The value of ``FP8GlobalStateManager.<name>()`` (a key of :data:`STATE_LOOKUPS`).

        Raises:
            KeyError: not a known state lookup.
        """
        return getattr(self, STATE_LOOKUPS[name])

    @classmethod
    def capture(cls) -> "Fp8State":
        """Read TE's live state (``transformer_engine.pytorch.quantization.FP8GlobalStateManager``).

        Raises:
            ImportError: TE is not installed.
        """
        import torch
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager as M

        recipe = M.quantization_state.fp8_recipe
        if recipe is None and not torch.compiler.is_compiling():
            # Outside autocast TE returns its device-dependent default recipe, which queries the
            # GPU; without one the recipe stays unknown (``None``) and lookups of it are not folded.
            # Inside a compilation (a backend such as te_inductor capturing its TE snapshot) TE
            # refuses to build that default (``Recipe.__post_init__``: "Creating Recipe objects
            # inside compiled regions is not supported"): it stays unknown there too.
            try:
                recipe = M.get_fp8_recipe()
            except RuntimeError:
                recipe = None
        return cls(fp8_enabled=bool(M.is_fp8_enabled()), fp8_calibration=bool(M.is_fp8_calibration()),
                   fp8_parameters=bool(M.with_fp8_parameters()), recipe=recipe,
                   fp8_group=M.get_fp8_group())

    @classmethod
    def capture_if_loaded(cls) -> "Fp8State | None":
        """:meth:`capture` when TE's ``transformer_engine.pytorch.quantization`` is already imported
        in this process, else ``None`` (never imports TE: a graph can only hold TE's autocast
        lookups once TE is loaded)."""
        if FP8_STATE_MODULE not in sys.modules:
            return None
        return cls.capture()

    def to_json(self) -> dict[str, Any]:
        """JSON-able form, part of :meth:`te_passes.te.state.TEState.fingerprint`: the flags, the
        recipe's ``repr`` (TE's recipes are dataclasses: their repr is their value) and the
        amax-reduction group's type name (``None`` when unset)."""
        return {"fp8_enabled": self.fp8_enabled, "fp8_calibration": self.fp8_calibration,
                "fp8_parameters": self.fp8_parameters,
                "recipe": self.recipe_text if self.recipe is None else repr(self.recipe),
                "fp8_group": self.fp8_group_text if self.fp8_group is None else type(self.fp8_group).__name__}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Fp8State":
        """The state :meth:`to_json` wrote (same JSON, so the same fingerprint); the recipe and
        group objects are not rebuilt, only their text is kept."""
        return cls(fp8_enabled=bool(data.get("fp8_enabled")), fp8_calibration=bool(data.get("fp8_calibration")),
                   fp8_parameters=bool(data.get("fp8_parameters")), recipe_text=data.get("recipe"),
                   fp8_group_text=data.get("fp8_group"))


def state_lookup_name(target: Any) -> str | None:
    """``"get_fp8_recipe"`` etc. when ``target`` (a ``call_function`` target) is one of TE's
    ``FP8GlobalStateManager`` lookups of :data:`STATE_LOOKUPS`, else ``None``."""
    owner = getattr(target, "__self__", None)
    name = getattr(target, "__name__", None)
    if name not in STATE_LOOKUPS or not isinstance(owner, type):
        return None
    if owner.__name__ != "FP8GlobalStateManager" or not _is_te(owner):
        return None
    return name


def pure_recipe_function_name(target: Any) -> str | None:
    """The name when ``target`` is one of TE's :data:`PURE_RECIPE_FUNCTIONS`, else ``None``."""
    name = getattr(target, "__name__", None)
    mod = getattr(target, "__module__", "") or ""
    if name in PURE_RECIPE_FUNCTIONS and mod.startswith("transformer_engine"):
        return name
    return None


def recipe_predicate(cls: Any) -> Callable[[Any], bool] | None:
    """For ``isinstance(x, cls)`` folding: a predicate when ``cls`` is a TE recipe class."""
    if isinstance(cls, type) and _is_te(cls) and "Recipe" in _mro_names(cls):
        return lambda obj: isinstance(obj, cls)
    return None
