"""Pass ``fold_recipe_lookups``: fp8 recipe / autocast lookups become plain constants, resolved once.

See docs/passes/fold_recipe_lookups.md."""

from __future__ import annotations

import builtins
import dataclasses
import functools
import operator
from typing import Any, Callable

import torch
import torch.fx

from te_passes.analyses.liveness import gc_paused
from te_passes.fx.journal import GraphJournal
from te_passes.pipeline.base import PassConfig, PassContext, PassRecord, Stage, TEPass, TEPassResult
from te_passes.te import recipes
from te_passes.te.graph_scan import (LOOKUP_BUILTINS, UNKNOWN, get_attr_path, may_be_te_lookup,  # shared scans
                                     walk_values, find_recipe_and_pg_objects)


def _describe_user(u: torch.fx.Node) -> str:
    tgt = u.target if isinstance(u.target, str) else getattr(u.target, "__qualname__", None) or str(u.target)
    return f"{u.name} ({u.op} {tgt})"


class FoldRecipeLookups(TEPass):
    """Fold fp8 recipe / autocast lookups into plain constants.

    Records: ``"hoisted"`` (``lookup``, ``value``, ``users``), ``"kept"`` (``reason``; ``lookup``,
    ``object`` or ``path`` for objects a consumer takes).

    Raises:
        TypeError: ``fp8_state`` is not an ``Fp8State``.
    """

    name = "fold_recipe_lookups"
    stages = frozenset({Stage.DYNAMO})
    description = "fold fp8 recipe/autocast lookups (FP8GlobalStateManager, recipe attributes) to constants"

    @dataclasses.dataclass(frozen=True)
    class Config(PassConfig):
        fp8_state: recipes.Fp8State | None = None

    def config(self) -> dict[str, Any]:
        return {} if self.cfg.fp8_state is None else {"fp8_state": self.cfg.fp8_state.to_json()}

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> TEPassResult:
        with gc_paused():  # no automatic collections rescanning a large graph's heap
            records: list[PassRecord] = []
            changed = self._fold_lookups(gm, records, ctx.journal, ctx)
            for node_name, path, tname in find_recipe_and_pg_objects(gm):
                records.append(PassRecord("kept", node_name, {
                    "object": tname, "path": path,
                    "reason": "the consumer takes the object itself (not a boolean this pass can resolve)"}))
            return TEPassResult(gm, changed, records)

    def _state(self, ctx: PassContext | None) -> recipes.Fp8State | None:
        """The ``fp8_state`` config, else the compilation's TE snapshot: never TE's live globals."""
        return self.cfg.fp8_state or getattr(getattr(ctx, "te_state", None), "fp8", None)

    def _fold_lookups(self, gm: torch.fx.GraphModule, records: list[PassRecord],
                      log: GraphJournal, ctx: PassContext | None = None) -> bool:
        graph = gm.graph
        get_state = functools.cache(lambda: self._state(ctx))  # captured lazily, once
        # node -> (value, its source expression: "FP8GlobalStateManager.get_fp8_recipe().fp8_gemm_dgrad")
        known: dict[torch.fx.Node, tuple[Any, str]] = {}

        def value_of(a: Any) -> tuple[Any, str] | None:
            if isinstance(a, torch.fx.Node):
                return known.get(a)
            if any(isinstance(x, torch.fx.Node) for _, x in walk_values(a, ())):
                return None
            return a, repr(a) if not recipes.is_recipe(a) else f"<{type(a).__name__} constant>"

        for node in list(graph.nodes):
            try:
                res = self._evaluate(node, value_of, get_state)
            except _NotFoldable as e:
                records.append(PassRecord("kept", node.name, {"reason": str(e)}))
                continue
            if res is not None:
                known[node] = res

        # Fold plain results; drop dead intermediate objects (reverse order: chains die tail-first).
        for node, (value, lookup) in known.items():
            if recipes.is_plain_constant(value) and node.users:
                users = [u.name for u in log.replace_uses(node, value)]
                records.append(PassRecord("hoisted", node.name, {"lookup": lookup, "value": value, "users": users}))
        for node in reversed(list(known)):
            if not node.users and node.op != "placeholder":
                log.erase(node)
        alive = set(graph.nodes)
        for node, (value, lookup) in known.items():
            if node in alive and node.users and not recipes.is_plain_constant(value):
                records.append(PassRecord("kept", node.name, {
                    "lookup": lookup, "object": type(value).__name__,
                    "reason": "the object is observed by " + ", ".join(_describe_user(u) for u in node.users)
                              + "; a consumer that takes the object cannot be given a constant"}))
        return bool(log)

    def _evaluate(self, node: torch.fx.Node, value_of: Callable, get_state: Callable) -> tuple[Any, str] | None:
        """``(value, lookup text)`` of ``node``, ``None`` if it is no recipe lookup. Raises
        :class:`_NotFoldable`: a lookup that cannot be evaluated."""
        if node.op == "get_attr":
            owner = node.graph.owning_module
            val = get_attr_path(owner, str(node.target)) if owner is not None else UNKNOWN
            if val is not UNKNOWN and (recipes.is_recipe(val) or recipes.is_recipe_part(val)
                                        or recipes.recipe_predicate(val) is not None):
                return val, f"self.{node.target}"
            return None
        if node.op == "call_function":
            tgt = node.target
            if tgt not in LOOKUP_BUILTINS and not may_be_te_lookup(tgt):
                return None
            lookup = recipes.state_lookup_name(node.target)
            if lookup is not None:
                if node.args or node.kwargs:
                    raise _NotFoldable(f"FP8GlobalStateManager.{lookup} called with arguments")
                state = get_state()
                if state is None:
                    raise _NotFoldable(f"FP8GlobalStateManager.{lookup}(): the compilation's TE state has no fp8 "
                                       "autocast state (TE not loaded when it was captured) and no fp8_state "
                                       "was given")
                val = state.lookup(lookup)
                if lookup == "get_fp8_recipe" and val is None:
                    raise _NotFoldable("FP8GlobalStateManager.get_fp8_recipe(): no recipe is active and TE's "
                                       "default recipe depends on the GPU; give fp8_state")
                return val, f"FP8GlobalStateManager.{lookup}()"
            if tgt is builtins.getattr and len(node.args) in (2, 3) and isinstance(node.args[1], str):
                src = value_of(node.args[0])
                if src is None or not (recipes.is_recipe(src[0]) or recipes.is_recipe_part(src[0])):
                    return None
                try:
                    val = recipes.read_recipe_attr(src[0], node.args[1])
                except AttributeError:
                    if len(node.args) == 3:
                        d = value_of(node.args[2])
                        if d is None:
                            raise _NotFoldable(f"getattr default of {src[1]}.{node.args[1]} is not constant")
                        return d[0], f"getattr({src[1]}, {node.args[1]!r}, {d[1]})"
                    raise _NotFoldable(f"{src[1]} has no attribute {node.args[1]!r} (TE would raise)")
                except recipes.RecipeResolutionError as e:
                    raise _NotFoldable(str(e)) from None
                return val, f"{src[1]}.{node.args[1]}"
            if tgt is builtins.hasattr and len(node.args) == 2 and isinstance(node.args[1], str):
                src = value_of(node.args[0])
                if src is None or not (recipes.is_recipe(src[0]) or recipes.is_recipe_part(src[0])):
                    return None
                return hasattr(src[0], node.args[1]), f"hasattr({src[1]}, {node.args[1]!r})"
            if tgt is builtins.isinstance and len(node.args) == 2:
                src, cls = value_of(node.args[0]), value_of(node.args[1])
                pred = recipes.recipe_predicate(cls[0]) if cls is not None else None
                if src is None or pred is None or not (recipes.is_recipe(src[0]) or src[0] is None):
                    return None
                return pred(src[0]), f"isinstance({src[1]}, {cls[0].__name__})"
            if tgt in (operator.is_, operator.is_not) and len(node.args) == 2:
                a, b = value_of(node.args[0]), value_of(node.args[1])
                if a is None or b is None:
                    return None
                if not any(recipes.is_recipe(x[0]) or recipes.is_process_group(x[0]) or recipes.is_recipe_part(x[0])
                           for x in (a, b)) or not any(x[0] is None for x in (a, b)):
                    return None
                same = a[0] is b[0]
                op = "is" if tgt is operator.is_ else "is not"
                return (same if tgt is operator.is_ else not same), f"({a[1]} {op} {b[1]})"
            fname = recipes.pure_recipe_function_name(tgt)
            if fname is not None:
                vals = [value_of(a) for a in node.args]
                if node.kwargs or any(v is None for v in vals) or not vals or not recipes.is_recipe(vals[0][0]):
                    raise _NotFoldable(f"{fname}: arguments are not all compile-time constants")
                return (recipes.call_recipe_function(fname, tuple(v[0] for v in vals)),
                        f"{fname}({', '.join(v[1] for v in vals)})")
            return None
        if node.op != "call_method" or node.target not in recipes.RECIPE_PREDICATES:
            return None
        if len(node.args) == 1:
            src = value_of(node.args[0])
            if src is None or not recipes.is_recipe(src[0]):
                return None
            return bool(getattr(src[0], node.target)()), f"{src[1]}.{node.target}()"
        return None


class _NotFoldable(Exception):
    pass
