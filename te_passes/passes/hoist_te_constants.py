"""Pass ``hoist_te_constants``: TE constants of post-grad graphs are built once, not on every call.

See docs/passes/hoist_te_constants.md."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.fx

from te_passes.analyses.liveness import gc_paused
from te_passes.fx.graph import same_objects
from te_passes.pipeline.base import PassConfig, PassContext, PassRecord, PassSkipped, Stage, TEPass, TEPassResult
from te_passes.ops.constants import (can_name, hoisted_name, is_liftable_constant, name_constant, names_in,
                                         rebuild_cached)
from te_passes.te.graph_constants import te_const_kind

#: Prefix of the wrapper-module globals that hold hoisted TE constants.
CONST_ATTR_PREFIX = "_te_const_"


class HoistTEConstants(TEPass):
    """Build value-opaque TE constants (quantizers, ``OpaqueValueBundle`` s) once per compilation
    instead of once per call: each becomes a wrapper-module global ``_te_const_<N>``.

    Records: ``"hoisted_constant"`` (``name``, ``slot``, ``const_kind``, ``type``), ``"kept_inline"``
    (``slot``, ``type``, ``reason``). Raises ``PassSkipped``: ``hoist_constants=False``."""

    name = "hoist_te_constants"
    stages = frozenset({Stage.POST_GRAD_FWD, Stage.POST_GRAD_BWD})
    description = "build TE constants (quantizers, OpaqueValueBundles) once at compile time, not on every call"

    @dataclasses.dataclass(frozen=True)
    class Config(PassConfig):
        hoist_constants: bool = True

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> TEPassResult:
        if not self.cfg.hoist_constants:
            raise PassSkipped("hoist_constants=False: TE constants are left inline")
        with gc_paused():
            records: list[PassRecord] = []
            changed = self._lift_constants(gm, records, ctx)
            return TEPassResult(gm, changed, records)

    def _lift_constants(self, gm: torch.fx.GraphModule, records: list[PassRecord], ctx: PassContext) -> bool:
        count = 0
        rebuilds: dict[int, tuple[Any, Any, dict]] = {}  # id(constant) -> (constant, expression, globals)
        taken = names_in(gm)  # names an earlier run gave: kept, new names skip them

        def lift(v: Any, user: torch.fx.Node, slot: str) -> Any:
            nonlocal count
            if hoisted_name(v, gm) is not None:  # _lift_top hands over liftable constants only
                return v
            why = can_name(v)
            if why is not None:
                records.append(PassRecord("kept_inline", user.name, {"slot": slot, "type": type(v).__name__,
                                                                     "reason": why}))
                return v
            while f"{CONST_ATTR_PREFIX}{count}" in taken:
                count += 1
            # one object per occurrence, built as the wrapper builds it per call (no new sharing)
            fresh = rebuild_cached(v, rebuilds)
            name = f"{CONST_ATTR_PREFIX}{count}"
            name_constant(fresh, name, gm)
            count += 1
            records.append(PassRecord("hoisted_constant", user.name, {
                "name": name, "slot": slot, "const_kind": te_const_kind(fresh).value,
                "type": type(fresh).__name__}))
            return fresh

        for node in list(gm.graph.nodes):
            if node.op not in ("call_function", "output"):
                continue
            new_args = tuple(_lift_top(a, lambda v, j, u=node, i=i: lift(v, u, f"args[{i}]{j}"))
                             for i, a in enumerate(node.args))
            new_kwargs = {k: _lift_top(a, lambda v, j, u=node, k=k: lift(v, u, f"{k}{j}"))
                          for k, a in node.kwargs.items()}
            if not same_objects((new_args, *new_kwargs.values()), (node.args, *node.kwargs.values())):
                ctx.journal.set_args(node, new_args, new_kwargs)
        return any(r.kind == "hoisted_constant" for r in records)


def _lift_top(a: Any, lift: Callable[[Any, str], Any]) -> Any:
    """``lift(value, sub-slot)`` on ``a`` or, for a list/tuple, on its elements (bundles lifted whole)."""
    if isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
        if not any(is_liftable_constant(x) for x in a):
            return a
        return type(a)(lift(x, f"[{j}]") if is_liftable_constant(x) else x for j, x in enumerate(a))
    return lift(a, "") if is_liftable_constant(a) else a

