"""Pass ``hoist_recipe_lookups``: fp8 recipe lookups become plain constants, resolved once.

TE's fp8 recipes are Python objects read at run time (``FP8GlobalStateManager.get_fp8_recipe()``,
``recipe.fp8_gemm_dgrad.use_split_accumulator``, ...). In traced graphs they leave three kinds
of residue, each handled here:

1. **Lookups** (``symbolic_trace``'d, hand-built and user graphs; Dynamo inlines them itself):
   ``call_function`` nodes of ``FP8GlobalStateManager.get_fp8_recipe`` / ``is_fp8_enabled`` /
   ``is_fp8_calibration`` / ``with_fp8_parameters`` / ``get_fp8_group``, attribute chains on
   recipe objects (``getattr`` ``call_function`` nodes, recipe ``get_attr`` s, recipe constants),
   ``hasattr`` / ``isinstance`` / recipe predicates (``recipe.float8_current_scaling()``),
   ``is None`` tests and TE's pure recipe functions (``get_fp8_te_dtype``, ...). Each chain is
   evaluated at compile time (values from :mod:`te_passes.te.recipes`) and its plain result
   (bool / int / float / str / None / dtype) replaces the node's uses. Intermediate objects
   (the recipe, ``MMParams``, a process group) are dropped once nothing uses them; where a
   consumer takes the object itself, it is left in place and a ``"kept"`` record names it.
2. **``__setattr__`` residue** (Dynamo graphs of fp8 TE modules): side-effect-only
   ``call_method __setattr__`` nodes whose receiver is a quantizer constant. A group of
   setattrs on one receiver object (identity, ``id``) is removed when it provably has no effect:
   the receiver is not observed by any other node (not in an op bundle, not an output), or
   every write stores the value the constant already holds (a no-op under any execution
   order). Otherwise the nodes stay and a ``"kept"`` record gives the observer and the field
   that would change. The op bundles' quantizers are checked unchanged (identity and value)
   after the rewrite; a change aborts the pass (the manager restores the graph).
3. **Per-call construction of TE constants** (post-grad graphs): Inductor's Python wrapper
   re-evaluates every value-opaque constant's ``__fx_repr__`` (``OpaqueValueBundle({...})``,
   ``_rebuild_quantizer(...)``) inline on every call
   (``torch/_inductor/codegen/wrapper.py`` ``PythonWrapperCodegen.val_to_arg_str``,
   ``ir.OpaqueValueTypeConstant`` for outputs; torch 2.14.1): 52 quantizer rebuilds per
   forward+backward step of a 4-layer fp8 stack. Each such constant (op arguments and graph
   outputs) is replaced by a fresh, equal object built once at compile time from its own
   ``__fx_repr__`` and *named*: while Inductor lowers this graph, its ``__fx_repr__`` answers a
   bare name ``_te_const_<n>`` with ``{name: object}`` as globals (:func:`name_constant`).
   Inductor records those globals in ``GraphLowering.opaque_value_type_classes``, which become
   globals of the wrapper module when it is loaded — also on an FX-graph-cache hit, where they
   come back pickled with the cache entry (``CompiledFxGraphConstants.unwrap``). The call path
   then passes module globals. Anywhere else the object renders as TE's rebuild expression, so
   graphs that meet it later (the forward returns quantizers; Dynamo stores them in the module
   and the next trace bakes them in) keep content-derived, picklable AOTAutograd / FX graph
   cache keys.
   (A ``get_attr`` lift would use Inductor's ``torchbind_constants`` instead, which a cache hit
   does not restore.) One object per *slot*: equal but distinct constants stay distinct objects
   (TE ops update a quantizer's usage flags in place, as TE's eager modules do with their
   persistent quantizers), and the graph's original objects — possibly shared with the Dynamo
   graph — are never touched.

Safety: lookups are folded to the TE autocast state the graph is compiled under
(:class:`te_passes.te.recipes.Fp8State`: the compilation's TE snapshot ``ctx.te_state.fp8``,
captured once per compilation and part of the pipeline uuid, or the pass's ``fp8_state`` config). Graphs from Dynamo are guarded by Dynamo on that state; graphs built
otherwise (``symbolic_trace``) are specialised by this pass and every folded value is recorded.
"""

from __future__ import annotations

import builtins
import dataclasses
import operator
from typing import Any, Callable

import torch
import torch.fx

from te_passes.analyses.liveness import gc_paused
from te_passes.fx.graph import PLAIN_TYPES as _PLAIN_TYPES
from te_passes.fx.journal import GraphJournal, replace_uses_with_constant
from te_passes.pipeline.base import PassContext, PassRecord, PassSkipped, Stage, TEPass, TEPassResult
from te_passes.runtime.constants import hoisted_owner, is_liftable_constant, name_constant, names_in, rebuild_cached
from te_passes.te import recipes
from te_passes.te.graph_model import TEConstKind, te_const_kind
from te_passes.te.graph_scan import (_LOOKUP_BUILTINS, _UNKNOWN, _bundle_quantizers, _get_attr, _kind,  # shared scans
                                     _may_be_te_lookup, _users_of_objects, _values, _walk, find_recipe_and_pg_objects)

#: Prefix of the wrapper-module globals that hold hoisted TE constants.
CONST_ATTR_PREFIX = "_te_const_"


# --------------------------------------------------------------------------- lookup evaluation
@dataclasses.dataclass
class _Known:
    value: Any
    lookup: str  # the source expression, e.g. "FP8GlobalStateManager.get_fp8_recipe().fp8_gemm_dgrad"


def _describe_user(u: torch.fx.Node) -> str:
    tgt = u.target if isinstance(u.target, str) else getattr(u.target, "__qualname__", None) or str(u.target)
    return f"{u.name} ({u.op} {tgt})"


class HoistRecipeLookups(TEPass):
    """Fold fp8 recipe lookups and recipe ``__setattr__`` residue into constants; build TE
    constants once per compilation instead of once per call (module docstring: why and how).

    Before / after (Dynamo graph of a Float8CurrentScaling ``te.Linear``; ``Q(...)`` stands for
    ``_rebuild_quantizer(Float8CurrentScalingQuantizer, (...))``)::

        # before
        setattr_1 = Q(<input q>).__setattr__('force_pow_2_scales', False)     # 23 such nodes
        ...
        linear = torch.ops.transformer_engine_compile.linear(w, [], B0, x, b, None, [], B1,
                     OpaqueValueBundle({'input_quantizer': Q(<input q>), ...}))
        # after
        linear = torch.ops.transformer_engine_compile.linear(w, [], B0, x, b, None, [], B1,
                     OpaqueValueBundle({'input_quantizer': Q(<input q>), ...}))   # same objects

    Lookups (a graph computing ``gemm(x, split=FP8GlobalStateManager.get_fp8_recipe()
    .fp8_gemm_fprop.use_split_accumulator)`` with the lookup as ``call_function`` nodes, e.g. a
    tracer that leaves ``FP8GlobalStateManager`` calls as leaves; Float8CurrentScaling active)::

        # before
        get_fp8_recipe = transformer_engine...FP8GlobalStateManager.get_fp8_recipe()
        getattr_1 = getattr(get_fp8_recipe, 'fp8_gemm_fprop')
        getattr_2 = getattr(getattr_1, 'use_split_accumulator')
        gemm = gemm(x, split = getattr_2)
        # after
        gemm = gemm(x, split = False)

    Post-grad graph, as Inductor's wrapper calls it::

        # before: rebuilt on every call
        buf0 = torch.ops.transformer_engine_compile.linear.default(primals_1, [],
            OpaqueValueBundle({'__kind__': ...}), ..., OpaqueValueBundle({... Q(...) ...}))
        return (buf1, Q(...), Q(...), ...)
        # after: wrapper-module globals, built once when the module is loaded
        buf0 = torch.ops.transformer_engine_compile.linear.default(primals_1, [], _te_const_0, ...,
            _te_const_2)
        return (buf1, _te_const_3, _te_const_4, ...)

    Configuration (keyword args):

    * ``fp8_state`` — a :class:`te_passes.te.recipes.Fp8State` to fold lookups against (default:
      the compilation's TE snapshot, ``ctx.te_state.fp8``: TE's autocast state when the
      compilation began, :meth:`te_passes.te.state.TEState.capture`);
    * ``hoist_constants`` — build value-opaque TE constants once (named wrapper globals) at the
      post-grad stages (default ``True``).

    Records (``PassRecord.kind``): ``"hoisted"`` (a lookup folded: ``lookup``, ``value``,
    ``users``), ``"folded_setattr"`` (a removed ``__setattr__``: ``receiver``, ``field``,
    ``value``, ``reason``), ``"kept"`` (a lookup / setattr / object left in place, with
    ``reason``), ``"hoisted_constant"`` (a constant built once: ``name``, ``slot``,
    ``const_kind``, ``type``; ``node`` is the op or output using it).
    """

    name = "hoist_recipe_lookups"
    stages = frozenset({Stage.DYNAMO, Stage.POST_GRAD_FWD, Stage.POST_GRAD_BWD})
    description = ("fold fp8 recipe/autocast lookups and quantizer __setattr__ residue to constants; "
                   "build TE constants once at compile time")
    checkpoints_itself = True

    def __init__(self, *, fp8_state: recipes.Fp8State | None = None, hoist_constants: bool = True) -> None:
        if fp8_state is not None and not isinstance(fp8_state, recipes.Fp8State):
            raise TypeError(f"fp8_state must be a te_passes.te.recipes.Fp8State, got {type(fp8_state).__name__}")
        super().__init__(hoist_constants=bool(hoist_constants),
                         **({"fp8_state": fp8_state} if fp8_state is not None else {}))
        self._fp8_state = fp8_state
        self._hoist_constants = bool(hoist_constants)

    def config(self) -> dict[str, Any]:
        cfg = {"hoist_constants": self._hoist_constants}
        if self._fp8_state is not None:
            s = self._fp8_state
            cfg["fp8_state"] = {"fp8_enabled": s.fp8_enabled, "fp8_calibration": s.fp8_calibration,
                                "fp8_parameters": s.fp8_parameters, "recipe": repr(s.recipe),
                                "fp8_group": None if s.fp8_group is None else type(s.fp8_group).__name__}
        return cfg

    # ------------------------------------------------------------------ entry
    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> TEPassResult:
        """Stage ``dynamo``: fold lookups and setattr residue; post-grad stages: build TE
        constants once (when ``hoist_constants``). See the class docstring."""
        # The scans allocate a few objects per constant while the heap holds the whole graph:
        # automatic collections would rescan it again and again (superlinear on 100k nodes).
        with gc_paused():
            return self._run(gm, ctx)

    def _run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> TEPassResult:
        if ctx.stage is Stage.DYNAMO:
            records: list[PassRecord] = []
            log = GraphJournal(gm.graph, ctx)  # both rewrites share one undo log
            changed = self._fold_lookups(gm, records, log, ctx)
            changed |= self._fold_setattrs(gm, records, log)
            for node_name, path, tname in find_recipe_and_pg_objects(gm):
                records.append(PassRecord("kept", node_name, {
                    "object": tname, "path": path,
                    "reason": "the consumer takes the object itself (not a boolean this pass can resolve)"}))
            return TEPassResult(gm, changed, records)
        if ctx.stage in (Stage.POST_GRAD_FWD, Stage.POST_GRAD_BWD):
            if not self._hoist_constants:
                raise PassSkipped("hoist_constants=False: TE constants are left inline")
            records = []
            changed = self._lift_constants(gm, records, ctx)
            return TEPassResult(gm, changed, records)
        raise PassSkipped(f"nothing to do at stage {ctx.stage.value}")

    # ------------------------------------------------------------------ 1. lookups
    def _state(self, ctx: PassContext | None) -> recipes.Fp8State | None:
        """The fp8 state lookups fold to: the ``fp8_state`` config, else the compilation's TE
        snapshot (``ctx.te_state.fp8``, part of the pipeline uuid) — never TE's live globals."""
        if self._fp8_state is not None:
            return self._fp8_state
        return getattr(getattr(ctx, "te_state", None), "fp8", None)

    def _fold_lookups(self, gm: torch.fx.GraphModule, records: list[PassRecord],
                      log: GraphJournal | None = None, ctx: PassContext | None = None) -> bool:
        graph = gm.graph
        state: recipes.Fp8State | None | object = _UNKNOWN  # captured lazily, once
        known: dict[torch.fx.Node, _Known] = {}

        def value_of(a: Any) -> tuple[Any, str] | None:
            if isinstance(a, torch.fx.Node):
                k = known.get(a)
                return None if k is None else (k.value, k.lookup)
            if any(isinstance(x, torch.fx.Node) for _, x in _walk(a, ())):
                return None
            return a, repr(a) if not recipes.is_recipe(a) else f"<{type(a).__name__} constant>"

        for node in list(graph.nodes):
            try:
                res = self._evaluate(node, value_of, lambda: state)
            except _NeedState:
                if state is _UNKNOWN:
                    state = self._state(ctx)
                try:
                    res = self._evaluate(node, value_of, lambda: state)
                except _NotFoldable as e:
                    records.append(PassRecord("kept", node.name, {"reason": str(e)}))
                    continue
            except _NotFoldable as e:
                records.append(PassRecord("kept", node.name, {"reason": str(e)}))
                continue
            if res is not None:
                known[node] = _Known(*res)

        changed = False
        log = log or GraphJournal(graph, None)
        # Fold plain results; drop dead intermediate objects (reverse order: chains die tail-first).
        for node, k in known.items():
            if recipes.is_plain_constant(k.value) and node.users:
                users = replace_uses_with_constant(node, k.value, log)
                records.append(PassRecord("hoisted", node.name, {"lookup": k.lookup, "value": k.value,
                                                                 "users": users}))
                changed = True
        for node in reversed(list(known)):
            if not node.users and node.op != "placeholder":
                log.erase(node)
                changed = True
        alive = set(graph.nodes)
        for node, k in known.items():
            if node in alive and node.users and not recipes.is_plain_constant(k.value):
                if True:
                    records.append(PassRecord("kept", node.name, {
                        "lookup": k.lookup, "object": type(k.value).__name__,
                        "reason": "the object is observed by " + ", ".join(_describe_user(u) for u in node.users)
                                  + "; a consumer that takes the object cannot be given a constant"}))
        return changed

    def _evaluate(self, node: torch.fx.Node, value_of: Callable, get_state: Callable) -> tuple[Any, str] | None:
        """Compile-time value of ``node`` as ``(value, lookup text)``, ``None`` if ``node`` is not a
        recipe lookup. Raises :class:`_NotFoldable` for a lookup that cannot be evaluated and
        :class:`_NeedState` when TE's autocast state is needed but not yet captured."""
        if node.op == "get_attr":
            owner = node.graph.owning_module
            val = _get_attr(owner, str(node.target)) if owner is not None else _UNKNOWN
            if val is not _UNKNOWN and (recipes.is_recipe(val) or recipes.is_recipe_part(val)
                                        or recipes.recipe_predicate(val) is not None):
                return val, f"self.{node.target}"
            return None
        if node.op == "call_function":
            tgt = node.target
            if tgt not in _LOOKUP_BUILTINS and not _may_be_te_lookup(tgt):
                return None
            lookup = recipes.state_lookup_name(node.target)
            if lookup is not None:
                if node.args or node.kwargs:
                    raise _NotFoldable(f"FP8GlobalStateManager.{lookup} called with arguments")
                state = get_state()
                if state is _UNKNOWN:
                    raise _NeedState()
                if state is None:
                    raise _NotFoldable(f"FP8GlobalStateManager.{lookup}(): the compilation's TE state has no fp8 "
                                       "autocast state (TE not loaded when it was captured) and no fp8_state "
                                       "was given")
                val = state.lookup(lookup)
                if lookup == "get_fp8_recipe" and val is None:
                    raise _NotFoldable("FP8GlobalStateManager.get_fp8_recipe(): no recipe is active and TE's "
                                       "default recipe depends on the GPU; give fp8_state")
                return val, f"FP8GlobalStateManager.{lookup}()"
            tgt = node.target
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

    # ------------------------------------------------------------------ 2. setattr residue
    def _fold_setattrs(self, gm: torch.fx.GraphModule, records: list[PassRecord],
                       log: GraphJournal | None = None) -> bool:
        graph = gm.graph
        groups: dict[int, list[torch.fx.Node]] = {}
        for node in graph.nodes:
            if (node.op == "call_method" and node.target == "__setattr__" and len(node.args) == 3
                    and _kind(node.args[0]) is TEConstKind.QUANTIZER):
                groups.setdefault(id(node.args[0]), []).append(node)
        if not groups:
            return False
        before = _bundle_quantizers(graph)
        users = _users_of_objects(graph, set(groups))
        to_erase: list[torch.fx.Node] = []
        for rid, nodes in groups.items():
            recv = nodes[0].args[0]
            cls = type(recv).__name__
            own = set(nodes)
            observers = sorted({n.name for n in users.get(rid, ()) if n not in own})
            bad = [n for n in nodes if n.users or n.kwargs or not isinstance(n.args[1], str)
                   or (not isinstance(n.args[2], _PLAIN_TYPES)  # a plain value holds no node
                       and any(isinstance(x, torch.fx.Node) for x in _values(n.args[2])))]
            if bad:
                for n in nodes:
                    records.append(PassRecord("kept", n.name, {
                        "receiver": cls, "reason": f"{bad[0].name} is used, takes kwargs or writes a "
                                                   "non-constant value: not side-effect-only"}))
                continue
            noop = all(hasattr(recv, n.args[1]) and type(getattr(recv, n.args[1])) is type(n.args[2])
                       and getattr(recv, n.args[1]) == n.args[2] for n in nodes)
            if observers and not noop:
                changing = next(n for n in nodes if not (hasattr(recv, n.args[1])
                                                         and getattr(recv, n.args[1]) == n.args[2]))
                for n in nodes:
                    records.append(PassRecord("kept", n.name, {
                        "receiver": cls, "field": n.args[1], "value": n.args[2],
                        "reason": f"receiver is also used by {', '.join(observers)} and {changing.name} changes "
                                  f"{changing.args[1]} from {getattr(recv, changing.args[1], '<unset>')!r} to "
                                  f"{changing.args[2]!r}"}))
                continue
            reason = ("no-op: writes the value the constant already holds (receiver also used by "
                      + ", ".join(observers) + ")") if observers else "receiver is not observed by any other node"
            for n in nodes:
                records.append(PassRecord("folded_setattr", n.name, {
                    "receiver": cls, "field": n.args[1], "value": n.args[2], "reason": reason}))
                to_erase.append(n)
        log = log or GraphJournal(graph, None)
        for n in to_erase:
            log.erase(n)
        after = _bundle_quantizers(graph)
        if [(a[0], a[1], id(a[2]), a[3]) for a in before] != [(a[0], a[1], id(a[2]), a[3]) for a in after]:
            raise RuntimeError("hoist_recipe_lookups: op bundle quantizers changed while folding __setattr__ "
                               "residue (identity or value); refusing the rewrite")
        return bool(to_erase)

    # ------------------------------------------------------------------ 3. build constants once
    def _lift_constants(self, gm: torch.fx.GraphModule, records: list[PassRecord],
                        ctx: PassContext | None = None) -> bool:
        graph = gm.graph
        count = hoisted = 0
        # The rewrite only replaces nodes' args/kwargs: the undo log restores them (the manager
        # then needs no copy of the graph).
        log = GraphJournal(graph, ctx)
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
            if hoisted_owner(v) is gm:
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
            if any(x is not y for x, y in zip(new_args, node.args)) or any(
                    new_kwargs[k] is not node.kwargs[k] for k in node.kwargs):
                log.set_args(node, new_args, new_kwargs)
        return hoisted > 0


def _lift_top(a: Any, lift: Callable[[Any, str], Any]) -> Any:
    """Apply ``lift(value, sub-slot)`` to ``a`` and, for list/tuple args (the output node's
    tuple), to their elements; bundles are lifted whole (their quantizers travel inside them)."""
    if isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
        if not any(is_liftable_constant(x) for x in a):
            return a
        return type(a)(lift(x, f"[{j}]") if is_liftable_constant(x) else x for j, x in enumerate(a))
    return lift(a, "") if is_liftable_constant(a) else a


class _NotFoldable(Exception):
    pass


class _NeedState(Exception):
    pass
