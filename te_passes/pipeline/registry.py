"""The ordered pass registry: what runs, in which order (``te-passes list`` prints it).

One line per pass, in pipeline order; each names the module and class that implement it (one
file per pass, named for what it does — torch-tensorrt's lowering-pass layout). Within one
stage, passes run in this order.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from te_passes.config import TePassesOptionError
from te_passes.pipeline.base import TEPass

#: (pass name, "module:Class"), in pipeline order.
PASS_REGISTRY: tuple[tuple[str, str], ...] = (
    ("fold_ub_predicates", "te_passes.passes.fold_ub_predicates:FoldUbPredicates"),
    ("fold_recipe_lookups", "te_passes.passes.fold_recipe_lookups:FoldRecipeLookups"),
    ("remove_quantizer_setattrs", "te_passes.passes.remove_quantizer_setattrs:RemoveQuantizerSetattrs"),
    ("hoist_te_constants", "te_passes.passes.hoist_te_constants:HoistTEConstants"),
    # needs the hoisted constants; before the frees / pool check (they treat base ops alike)
    ("call_te_impl_directly", "te_passes.passes.call_te_impl_directly:CallTEImplDirectly"),
    ("insert_early_frees", "te_passes.passes.insert_early_frees:InsertEarlyFrees"),
    ("check_cudagraph_pool", "te_passes.passes.check_cudagraph_pool:CheckCudagraphPool"),
)

#: Deprecated pass names (kept for one release, issue 12): old name -> the passes it became, in
#: order. In ``te_passes.disable`` / ``TE_PASSES_DISABLE`` / ``--disable`` the old name disables
#: all of them, with a ``DeprecationWarning`` (``TePassesOptions.parse(aliases=PASS_ALIASES)``).
PASS_ALIASES: dict[str, tuple[str, ...]] = {
    "hoist_recipe_lookups": ("fold_recipe_lookups", "remove_quantizer_setattrs", "hoist_te_constants"),
}

#: Where a deprecated pass's ``te_passes.pass_config`` parameters went: old name -> {parameter: new pass}.
PASS_CONFIG_ALIASES: dict[str, dict[str, str]] = {
    "hoist_recipe_lookups": {"fp8_state": "fold_recipe_lookups", "hoist_constants": "hoist_te_constants"},
}


def known_pass_names() -> set[str]:
    """Names ``te_passes.disable`` accepts: registered passes and deprecated aliases."""
    return set(pass_names()) | set(PASS_ALIASES)


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
    for ``param`` (``HoistTEConstants(hoist_constants: bool)``: ``"no"`` is refused, not read
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


def _route_deprecated(pass_config: dict) -> tuple[dict[str, dict[str, Any]], dict[tuple[str, str], str]]:
    """``pass_config`` with each deprecated pass's parameters moved to the pass they belong to now
    (:data:`PASS_CONFIG_ALIASES`, a ``DeprecationWarning`` per deprecated name), and for each
    moved ``(pass, parameter)`` the name the user wrote it under (for error messages).

    Raises:
        te_passes.config.TePassesOptionError: a parameter the deprecated pass did not take, or
            one given both under the old and the new pass name.
    """
    import warnings

    routed = {k: dict(v or {}) for k, v in pass_config.items() if k not in PASS_CONFIG_ALIASES}
    written_as: dict[tuple[str, str], str] = {}
    for old, params in PASS_CONFIG_ALIASES.items():
        if old not in pass_config:
            continue
        warnings.warn(f"te_passes.pass_config[{old!r}] is deprecated and will be removed in the next release: "
                      f"{old} was split into {', '.join(PASS_ALIASES[old])}; its parameters go to "
                      + ", ".join(f"{k} -> {v}" for k, v in params.items()), DeprecationWarning, stacklevel=3)
        for k, v in (pass_config[old] or {}).items():
            if k not in params:
                raise TePassesOptionError(f"te_passes.pass_config[{old!r}]: unknown parameter(s) {[k]}; {old} "
                                          f"(deprecated) takes {list(params)}")
            new = params[k]
            if k in routed.setdefault(new, {}):
                raise TePassesOptionError(f"te_passes.pass_config sets {k!r} both under {old!r} (deprecated) and "
                                          f"{new!r}; give it once, under {new!r}")
            routed[new][k] = v
            written_as[(new, k)] = old
    return routed, written_as


def configured_passes(pass_config: dict | None = None) -> list[TEPass]:
    """Every registered pass, constructed with ``pass_config[name]`` keyword arguments.

    Args:
        pass_config: ``{pass name: {parameter: value}}`` (the ``te_passes.pass_config`` option);
            ``None``/empty gives :func:`default_passes`. A deprecated pass name
            (:data:`PASS_CONFIG_ALIASES`) is accepted for one release: its parameters go to the
            passes they belong to now, with a ``DeprecationWarning``.

    Raises:
        te_passes.config.TePassesOptionError: an unknown pass name, a parameter the pass does
            not take (the message lists the ones it does), or a value its constructor rejects.
    """
    if not pass_config:
        return default_passes()
    pass_config, written_as = _route_deprecated(pass_config)
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
            check_parameter_type(cls, written_as.get((name, k), name), k, v)
        try:
            out.append(cls(**kwargs))
        except (TypeError, ValueError) as e:
            where = sorted({written_as.get((name, k), name) for k in kwargs} or {name})
            raise TePassesOptionError(f"te_passes.pass_config[{where[0]!r}]: {e}") from None
    return out
