"""The ordered pass registry: what runs, in which order (``te-passes list`` prints it).

One line per pass, in pipeline order; each names the module and class that implement it (one
file per pass, named for what it does — torch-tensorrt's lowering-pass layout). Within one
stage, passes run in this order.
"""

from __future__ import annotations

import functools
import importlib

from te_passes.config import TePassesOptionError
from te_passes.pipeline.base import TEPass

#: (pass name, "module:Class"), in pipeline order.
PASS_REGISTRY: tuple[tuple[str, str], ...] = (
    ("fold_ub_predicates", "te_passes.passes.fold_ub_predicates:FoldUbPredicates"),
    ("hoist_recipe_lookups", "te_passes.passes.hoist_recipe_lookups:HoistRecipeLookups"),
    # needs the hoisted constants; before the frees / pool check (they treat base ops alike)
    ("call_te_impl_directly", "te_passes.passes.call_te_impl_directly:CallTEImplDirectly"),
    ("insert_early_frees", "te_passes.passes.insert_early_frees:InsertEarlyFrees"),
    ("check_cudagraph_pool", "te_passes.passes.check_cudagraph_pool:CheckCudagraphPool"),
)


@functools.lru_cache(maxsize=None)
def pass_classes() -> tuple[type[TEPass], ...]:
    """Import and return every registered pass class, in order.

    Raises:
        RuntimeError: a registered class's ``name`` differs from its registry entry.
    """
    out = []
    for name, target in PASS_REGISTRY:
        mod_name, cls_name = target.split(":")
        cls = getattr(importlib.import_module(mod_name), cls_name)
        if cls.name != name:
            raise RuntimeError(f"pass registry entry {name!r} points at {target} whose name is {cls.name!r}")
        out.append(cls)
    return tuple(out)


def pass_names() -> list[str]:
    """Registered pass names, in order."""
    return [name for name, _ in PASS_REGISTRY]


def default_passes() -> list[TEPass]:
    """Fresh instances of every registered pass with its default configuration."""
    return [cls() for cls in pass_classes()]


def pass_parameters(cls: type[TEPass]) -> list[str]:
    """The keyword parameters a pass class's constructor names (what ``te_passes.pass_config``
    may set for it)."""
    import inspect

    params = inspect.signature(cls.__init__).parameters.values()
    return [p.name for p in params if p.name != "self" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _parameter_types(cls: type[TEPass]) -> dict[str, Any]:
    """``{parameter: annotation}`` of a pass constructor (``typing.get_type_hints``; ``{}`` when
    the annotations do not resolve)."""
    import typing

    try:
        return typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 - unresolvable annotations: no type check (the constructor still checks)
        return {}


def _accepts(annotation: Any, value: Any) -> bool | None:
    """Whether ``value`` has type ``annotation`` (bool/int/float/str/classes, ``X | None``,
    ``Optional``); ``None`` when the annotation is not one of those (not checked)."""
    import types
    import typing

    if annotation is typing.Any:
        return None
    if annotation is type(None):
        return value is None
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        answers = [_accepts(a, value) for a in typing.get_args(annotation)]
        return True if any(a is True for a in answers) else (None if any(a is None for a in answers) else False)
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return None


def _type_text(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def check_parameter_type(cls: type[TEPass], name: str, param: str, value: Any) -> None:
    """Check a ``te_passes.pass_config`` value against the type the pass constructor declares
    for ``param`` (``HoistRecipeLookups(hoist_constants: bool)``: ``"no"`` is refused, not read
    as true).

    Raises:
        te_passes.config.TePassesOptionError: the value has another type (message names the
            pass, the parameter, the value and the type wanted).
    """
    ann = _parameter_types(cls).get(param)
    if ann is None or _accepts(ann, value) is not False:
        return
    raise TePassesOptionError(f"te_passes.pass_config[{name!r}][{param!r}] must be {_type_text(ann)}, got "
                              f"{value!r} ({type(value).__name__})")


def configured_passes(pass_config: dict | None = None) -> list[TEPass]:
    """Every registered pass, constructed with ``pass_config[name]`` keyword arguments.

    Args:
        pass_config: ``{pass name: {parameter: value}}`` (the ``te_passes.pass_config`` option);
            ``None``/empty gives :func:`default_passes`.

    Raises:
        te_passes.config.TePassesOptionError: an unknown pass name, a parameter the pass does
            not take (the message lists the ones it does), or a value its constructor rejects.
    """
    if not pass_config:
        return default_passes()
    classes = {cls.name: cls for cls in pass_classes()}
    unknown = [n for n in pass_config if n not in classes]
    if unknown:
        raise TePassesOptionError(f"te_passes.pass_config names unknown pass(es) {unknown}; "
                                  f"known passes: {sorted(classes)}")
    out = []
    for name, cls in classes.items():
        kwargs = dict(pass_config.get(name) or {})
        valid = pass_parameters(cls)
        bad = [k for k in kwargs if k not in valid]
        if bad:
            raise TePassesOptionError(f"te_passes.pass_config[{name!r}]: unknown parameter(s) {bad}; "
                                      f"{name} takes {valid or 'no parameters'}")
        for k, v in kwargs.items():
            check_parameter_type(cls, name, k, v)
        try:
            out.append(cls(**kwargs))
        except (TypeError, ValueError) as e:
            raise TePassesOptionError(f"te_passes.pass_config[{name!r}]: {e}") from None
    return out
