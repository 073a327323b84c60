"""TE recipe knowledge: the recipe classes and the names TE reads off them, compile-time reads
of recipe objects, and the fp8 autocast state a graph is compiled under (:class:`Fp8State`).

See docs/internals.md#te_passesterecipespy."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, Mapping

import torch

from te_passes.te.graph_constants import is_te_object, mro_names

#: The three GEMMs of a TE linear layer.
GEMMS: tuple[str, ...] = ("fprop", "dgrad", "wgrad")

#: Quantizer slots of a TE linear layer: forward (input, weight, output) and backward
#: (grad_output, grad_input), the order of ``RecipeState._FWD/_BWD_DEFAULT_TENSOR_TYPES``.
FWD_ROLES: tuple[str, ...] = ("input", "weight", "output")
BWD_ROLES: tuple[str, ...] = ("grad_output", "grad_input")
ROLES: tuple[str, ...] = FWD_ROLES + BWD_ROLES

#: ``module/base.py`` ``_2X_ACC_FPROP/_DGRAD/_WGRAD`` (``recipe_table.module_default_split_accumulator``: live values).
PINNED_MODULE_DEFAULTS: Mapping[str, bool] = {"fprop": False, "dgrad": True, "wgrad": True}

#: Quantizer class ``RecipeState.make_quantizers`` builds per recipe class (``RecipeState.create`` order).
QUANTIZER_CLASS: Mapping[str, str | None] = {
    "DelayedScaling": "Float8Quantizer",
    "MXFP8BlockScaling": "MXFP8Quantizer",
    "Float8CurrentScaling": "Float8CurrentScalingQuantizer",
    "Float8BlockScaling": "Float8BlockQuantizer",
    "NVFP4BlockScaling": "NVFP4Quantizer",
    "CustomRecipe": None,
}
#: TE recipe class names, in ``RecipeState.create`` dispatch order.
RECIPE_CLASSES: tuple[str, ...] = tuple(QUANTIZER_CLASS)

#: Classmethods of ``Recipe`` that only test the recipe's class (pure, foldable).
RECIPE_PREDICATES: frozenset[str] = frozenset({
    "nvfp4", "mxfp8", "delayed", "float8_current_scaling", "float8_per_tensor_scaling",
    "float8_block_scaling", "custom",
})

#: ``FP8GlobalStateManager`` classmethods fixed for one compiled graph -> the state they read (``quantization.py``).
STATE_LOOKUPS: Mapping[str, str] = {
    "get_fp8_recipe": "recipe",
    "is_fp8_enabled": "fp8_enabled",
    "is_fp8_calibration": "fp8_calibration",
    "with_fp8_parameters": "fp8_parameters",
    "get_fp8_group": "fp8_group",
}

#: Pure TE functions of a recipe (``pytorch/quantization.py``) the pass evaluates at compile time.
PURE_RECIPE_FUNCTIONS: frozenset[str] = frozenset({"get_fp8_te_dtype", "get_fp4_te_dtype", "get_fp8_max"})


class RecipeResolutionError(ValueError):
    """A recipe (or attribute path) that te_passes cannot resolve; the message names it."""


def is_recipe(obj: Any) -> bool:
    """Whether ``obj`` is an instance of a TE recipe (``transformer_engine.common.recipe.Recipe``)."""
    return not isinstance(obj, type) and is_te_object(obj) and "Recipe" in mro_names(obj)


def is_recipe_part(obj: Any) -> bool:
    """Whether ``obj`` is a sub-object of a recipe: ``MMParams``, ``QParams`` or ``Format``."""
    return is_te_object(obj) and bool(mro_names(obj) & {"MMParams", "QParams", "Format", "_FormatHelper"})


def is_process_group(obj: Any) -> bool:
    """Whether ``obj`` is a ``torch.distributed`` process group (c10d ``ProcessGroup``)."""
    return "ProcessGroup" in mro_names(obj) and not isinstance(obj, type)


def recipe_class_name(recipe: Any) -> str:
    """The TE recipe class ``recipe`` dispatches as (``RecipeState.create`` order: a subclass of
    ``Float8CurrentScaling`` is ``"Float8CurrentScaling"``); :class:`RecipeResolutionError` otherwise."""
    if not is_recipe(recipe):
        raise RecipeResolutionError(f"not a TE recipe: {type(recipe).__qualname__}")
    names = mro_names(recipe)
    for cls in RECIPE_CLASSES:
        if cls in names:
            return cls
    raise RecipeResolutionError(f"{type(recipe).__qualname__} is not a TE recipe class te_passes "
                                f"resolves (known: {', '.join(RECIPE_CLASSES)})")


#: Attribute names that may be read off a recipe's MMParams/QParams/Format parts at compile time.
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
    return frozenset(names - {"qfactory", "scaling_factor_compute_algo", "amax_compute_algo"})  # callables


def read_recipe_attr(obj: Any, name: str) -> Any:
    """Read attribute ``name`` of a recipe or recipe part at compile time. Raises
    :class:`RecipeResolutionError` when ``obj`` is neither or ``name`` is not a plain data field of
    it, ``AttributeError`` when there is no such attribute."""
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
    """Evaluate ``transformer_engine.pytorch.quantization.<name>`` on constant ``args``; raises
    :class:`RecipeResolutionError` unless ``name`` is one of :data:`PURE_RECIPE_FUNCTIONS`."""
    if name not in PURE_RECIPE_FUNCTIONS:
        raise RecipeResolutionError(f"{name} is not a pure TE recipe function ({sorted(PURE_RECIPE_FUNCTIONS)})")
    from transformer_engine.pytorch import quantization

    return getattr(quantization, name)(*args)


def is_plain_constant(value: Any) -> bool:
    """Whether ``value`` may stand as a literal constant in an FX graph: ``None``, bool, int,
    float, str, ``torch.dtype``, or an ``enum.Enum`` member whose value is plain (TE's ``DType``)."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return True
    if isinstance(value, enum.Enum):
        return isinstance(value.value, (bool, int, float, str))
    return False


#: The TE module holding ``FP8GlobalStateManager``.
FP8_STATE_MODULE = "transformer_engine.pytorch.quantization"


@dataclasses.dataclass(frozen=True)
class Fp8State:
    """The TE autocast state a graph is compiled under (``FP8GlobalStateManager``; taken from a running TE by
    :func:`te_passes.compat.live_state.capture_fp8`)."""

    fp8_enabled: bool = False
    fp8_calibration: bool = False
    fp8_parameters: bool = False
    recipe: Any = None
    fp8_group: Any = None
    recipe_text: str | None = None
    fp8_group_text: str | None = None

    def lookup(self, name: str) -> Any:
        """The value of ``FP8GlobalStateManager.<name>()`` (a key of :data:`STATE_LOOKUPS`, else ``KeyError``)."""
        return getattr(self, STATE_LOOKUPS[name])

    def to_json(self) -> dict[str, Any]:
        """JSON-able form (part of ``TEState.fingerprint``): the flags, the recipe's ``repr`` (a
        dataclass: its value) and the amax-reduction group's type name."""
        return {"fp8_enabled": self.fp8_enabled, "fp8_calibration": self.fp8_calibration,
                "fp8_parameters": self.fp8_parameters,
                "recipe": self.recipe_text if self.recipe is None else repr(self.recipe),
                "fp8_group": self.fp8_group_text if self.fp8_group is None else type(self.fp8_group).__name__}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Fp8State":
        """The state :meth:`to_json` wrote (same fingerprint); recipe and group are kept as text only."""
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
    if owner.__name__ != "FP8GlobalStateManager" or not is_te_object(owner):
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
    if isinstance(cls, type) and is_te_object(cls) and "Recipe" in mro_names(cls):
        return lambda obj: isinstance(obj, cls)
    return None
