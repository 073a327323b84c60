"""The ordered pass registry: what runs, in which order (``te-passes list`` prints it).

One line per pass, in pipeline order; each names the module and class that implement it (one
file per pass, named for what it does — torch-tensorrt's lowering-pass layout). Within one
stage, passes run in this order.
"""

from __future__ import annotations

import functools
import importlib

from te_passes.passes.base import TEPass

#: (pass name, "module:Class"), in pipeline order.
PASS_REGISTRY: tuple[tuple[str, str], ...] = (
    ("fold_ub_predicates", "te_passes.passes.fold_ub_predicates:FoldUbPredicates"),
    ("hoist_recipe_lookups", "te_passes.passes.hoist_recipe_lookups:HoistRecipeLookups"),
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
