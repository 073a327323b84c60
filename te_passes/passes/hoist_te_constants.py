"""Pass ``hoist_te_constants``: TE constants of post-grad graphs are built once, not on every call.

See docs/passes/hoist_te_constants.md and docs/passes/hoist_te_constants.md.."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.fx

from te_passes.analyses.liveness import gc_paused
from te_passes.pipeline.base import PassConfig, PassContext, PassRecord, PassSkipped, Stage, TEPass, TEPassResult
from te_passes.runtime.ops.constants import (can_name, hoisted_name, is_liftable_constant, name_constant, names_in,
                                         rebuild_cached)
from te_passes.te.graph_constants import te_const_kind

#: Prefix of the wrapper-module globals that hold hoisted TE constants.
CONST_ATTR_PREFIX = "_te_const_"


class HoistTEConstants(TEPass):
    """Build value-opaque TE constants (quantizers, ``OpaqueValueBundle`` s) once per compilation
    instead of once per call (docs/passes/hoist_te_constants.md: why and how)."""

    name = "hoist_te_constants"
    stages = frozenset({Stage.POST_GRAD_FWD, Stage.POST_GRAD_BWD})
    description = "build TE constants (quantizers, OpaqueValueBundles) once at compile time, not on every call"

    @dataclasses.dataclass(frozen=True)
    class Config(PassConfig):
        hoist_constants: bool = True

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> TEPassResult:
        """Post-grad stages: build TE constants once (when ``hoist_constants``).

        Raises:
            PassSkipped: ``hoist_constants=False``.
        """
        if not self.cfg.hoist_constants:
            raise PassSkipped("hoist_constants=False: TE constants are left inline")
        # The scans allocate a few objects per constant while the heap holds the whole graph:
        # automatic collections would rescan it again and again (superlinear on 100k nodes).
        with gc_paused():
            records: list[PassRecord] = []
            changed = self._lift_constants(gm, records, ctx)
            return TEPassResult(gm, changed, records)

    def _lift_constants(self, gm: torch.fx.GraphModule, records: list[PassRecord], ctx: PassContext) -> bool:
        graph = gm.graph
        count = hoisted = 0
        log = ctx.journal
        # ``id(constant) -> (constant, compiled expression, globals)`` for this run: a constant
        # used in several slots is rendered once (the constant is held, so its id stays valid).
        rebuilds: dict[int, tuple[Any, Any, dict]] = {}
        # Idempotence: a constant an earlier run already hoisted into this graph keeps its object
        # and name, and new names skip the ones taken.
        taken = names_in(gm)

        def lift(v: Any, user: torch.fx.Node, slot: str) -> Any:
            nonlocal count, hoisted
            if not is_liftable_constant(v):
                return v
            if hoisted_name(v, gm) is not None:
                return v
            why = can_name(v)
            if why is not None:  # runtime.install() has not wrapped this class: a pass patches no class
                records.append(PassRecord("kept_inline", user.name, {"slot": slot, "type": type(v).__name__,
                                                                     "reason": why}))
                return v
            while f"{CONST_ATTR_PREFIX}{count}" in taken:
                count += 1
            # One object per *occurrence*, built exactly as the wrapper would build it on each
            # call: no two slots (or graphs) share an object they did not share before, and the
            # graph's original objects (possibly shared with the Dynamo graph) are not touched.
            fresh = rebuild_cached(v, rebuilds)
            # Unique within this graph, hence within its wrapper module (one module per graph);
            # deterministic, so reports and dumps are reproducible.
            name = f"{CONST_ATTR_PREFIX}{count}"
            name_constant(fresh, name, gm)
            count += 1
            hoisted += 1
            records.append(PassRecord("hoisted_constant", user.name, {
                "name": name, "slot": slot, "const_kind": te_const_kind(fresh).value,
                "type": type(fresh).__name__}))
            return fresh

        for node in list(graph.nodes):
            if node.op not in ("call_function", "output"):
                continue
            new_args = tuple(_lift_top(a, lambda v, j, u=node, i=i: lift(v, u, f"args[{i}]{j}"))
                             for i, a in enumerate(node.args))
            new_kwargs = {k: _lift_top(a, lambda v, j, u=node, k=k: lift(v, u, f"{k}{j}"))
                          for k, a in node.kwargs.items()}
            if not all(map(_same, new_args, node.args)) or not all(
                    _same(new_kwargs[k], node.kwargs[k]) for k in node.kwargs):
                log.set_args(node, new_args, new_kwargs)
        return hoisted > 0


def _same(a: Any, b: Any) -> bool:
    """``a is b``, element-wise for the list/tuple :func:`_lift_top` rebuilds."""
    if isinstance(a, (list, tuple)) and type(a) is type(b):
        return len(a) == len(b) and all(x is y for x, y in zip(a, b))
    return a is b


def _lift_top(a: Any, lift: Callable[[Any, str], Any]) -> Any:
    """Apply ``lift(value, sub-slot)`` to ``a`` and, for list/tuple args (the output node's
    tuple), to their elements; bundles are lifted whole (their quantizers travel inside them)."""
    if isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
        if not any(is_liftable_constant(x) for x in a):
            return a
        return type(a)(lift(x, f"[{j}]") if is_liftable_constant(x) else x for j, x in enumerate(a))
    return lift(a, "") if is_liftable_constant(a) else a

