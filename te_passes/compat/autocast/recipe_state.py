"""The user's ``te.autocast`` state delivered to TE's impls in compiled code.

See docs/internals.md#te_passescompatautocastrecipe_statepy and docs/design.md "TE global state read at run time"."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch

from te_passes._logging import get_logger
from te_passes.compat import table
from te_passes.fx.graph import op_qualname
from te_passes.te.graph_model import TE_OP_NAMESPACE, UnknownTEOp, decode
from te_passes.ops.te_base import DirectCallUnavailable, resolve_base_impl
from te_passes.compat.te220.runtime_reads import AUTOCAST_FIELDS, FAMILY_IMPLS, runtime_state_refusal

log = get_logger()

#: ``node.meta`` key of the :class:`TracedAutocast` recorded for a TE op node while Dynamo traced it.
META_KEY = "te_passes_autocast"
#: The patch-table row that wraps the fake kernels (:mod:`te_passes.compat.autocast.rows`).
TRACE_HOOKS_ROW = "autocast.trace_hooks"
#: Marker on the fake kernels of TE ops that this module wraps (:func:`te_passes.compat.table.stamp`).
HOOK_ATTR = table.register_stamp("_te_passes_autocast_hook", "a TE op's fake kernel that records the te.autocast "
                                 "state where Dynamo traced the op (compat.autocast.recipe_state)")


class RecipeStateError(RuntimeError):
    """The ``te.autocast`` state TE's impls must see cannot be delivered to a compiled graph
    (unknown where Dynamo traced a TE op, or several states in one graph); the message says which."""


@dataclasses.dataclass(frozen=True, eq=False)
class TracedAutocast:
    """TE's autocast state where Dynamo traced one TE op call."""

    fp8_enabled: bool
    fp8_calibration: bool
    fp8_recipe: Any
    fp8_distributed_group: Any
    source: str = "live"
    guard: str | None = None

    def values(self) -> tuple:
        """The four fields, in :data:`te_passes.compat.te220.runtime_reads.AUTOCAST_FIELDS` order."""
        return tuple(getattr(self, f) for f in AUTOCAST_FIELDS)

    def same(self, other: "TracedAutocast") -> bool:
        return (self.fp8_enabled == other.fp8_enabled and self.fp8_calibration == other.fp8_calibration
                and self.fp8_recipe is other.fp8_recipe and self.fp8_distributed_group is other.fp8_distributed_group)

    def describe(self) -> str:
        """One line: the flags, the recipe's class, the group's type, the source."""
        group = self.fp8_distributed_group
        recipe = self.fp8_recipe
        return (f"fp8_enabled={self.fp8_enabled}, fp8_calibration={self.fp8_calibration}, "
                f"recipe={type(recipe).__name__ if recipe is not None else None}, "
                f"group={type(group).__name__ if group is not None else None} ({self.source})")

    def __repr__(self) -> str:
        return f"TracedAutocast({self.describe()})"


# --------------------------------------------------------------------------- trace time
def _dynamo_tx() -> Any:
    try:
        from torch._dynamo import symbolic_convert
    except ImportError:  # pragma: no cover - torch without Dynamo
        return None
    return getattr(symbolic_convert.tls, "current_tx", None)


class _Unknown(Exception):
    pass


def _python_value(vt: Any) -> Any:
    if vt.is_python_constant():
        return vt.as_python_constant()
    if hasattr(vt, "value"):  # UserDefinedObjectVariable (a recipe), ProcessGroupVariable
        return vt.value
    raise _Unknown(f"a {type(vt).__name__}")


def _guard_recipe(tx: Any, source: Any, recipe: Any) -> str | None:
    """Install Dynamo guards on the recipe at ``source``: its identity (``ID_MATCH``) and the
    ``fp8_gemm_fprop.use_split_accumulator`` flag TE's linear impl reads (``EQUALS_MATCH``).
    Returns why not (no source), else ``None``."""
    if source is None:
        return "the recipe has no Dynamo source"
    from torch._dynamo.guards import GuardBuilder, install_guard
    from torch._dynamo.source import AttrSource

    guards = [source.make_guard(GuardBuilder.ID_MATCH)]
    mm = getattr(recipe, "fp8_gemm_fprop", None)
    if mm is not None and isinstance(getattr(mm, "use_split_accumulator", None), bool):
        guards.append(AttrSource(AttrSource(source, "fp8_gemm_fprop"), "use_split_accumulator")
                      .make_guard(GuardBuilder.EQUALS_MATCH))
    install_guard(*guards)
    return None


def traced_autocast(tx: Any) -> TracedAutocast:
    """The autocast state Dynamo's translator ``tx`` is tracing under: for each of
    :data:`AUTOCAST_FIELDS`, the pending store to ``FP8GlobalStateManager.quantization_state``
    (``tx.output.side_effects``) if there is one, else the live value; and guards on the recipe.

    Raises:
        RecipeStateError: a pending value that is not a Python object Dynamo can hand back.
    """
    from torch._dynamo.source import AttrSource
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    qstate = FP8GlobalStateManager.quantization_state
    se = tx.output.side_effects
    var = se.id_to_variable.get(id(qstate))
    values: dict[str, Any] = {}
    traced = False
    recipe_source = None
    for name in AUTOCAST_FIELDS:
        if var is not None and se.has_pending_mutation_of_attr(var, name):
            vt = se.load_attr(var, name)
            try:
                values[name] = _python_value(vt)
            except _Unknown as e:
                raise RecipeStateError(f"te_passes: the te.autocast {name} where Dynamo traced a TE op is {e}, "
                                       "not an object te_passes can set around the compiled call") from None
            traced = True
            if name == "fp8_recipe":
                recipe_source = getattr(vt, "source", None)
        else:
            values[name] = getattr(qstate, name)
            if name == "fp8_recipe" and var is not None and getattr(var, "source", None) is not None:
                recipe_source = AttrSource(var.source, "fp8_recipe")
    guard = None
    # fp8 and calibration off: TE's impls read no recipe (reads_autocast), so none is guarded — te.autocast(
    # enabled=False) without a recipe builds a new default recipe per call (quantization.autocast_enter)
    if values["fp8_recipe"] is not None and (values["fp8_enabled"] or values["fp8_calibration"]):
        try:
            guard = _guard_recipe(tx, recipe_source, values["fp8_recipe"])
        except Exception as e:  # noqa: BLE001 - Dynamo internals: keep the reason, the state is still right
            guard = f"{type(e).__name__}: {e}"
        if guard is not None:
            log.debug("te_passes: recipe identity not guarded: %s", guard)
    return TracedAutocast(bool(values["fp8_enabled"]), bool(values["fp8_calibration"]), values["fp8_recipe"],
                          values["fp8_distributed_group"], source="traced" if traced else "live", guard=guard)


def _tag(qualname: str) -> None:
    tx = _dynamo_tx()
    if tx is None:
        return
    graph = tx.output.current_tracer.graph
    node = next(iter(reversed(graph.nodes)), None)
    if node is None or node.op != "call_function" or op_qualname(node.target) != qualname:
        return  # not the call Dynamo is creating (nested trace): left untagged, graph_autocast says so
    try:
        node.meta[META_KEY] = traced_autocast(tx)
    except RecipeStateError as e:  # kept as the reason; graph_autocast refuses the graph with it
        node.meta[META_KEY] = str(e)
    except Exception as e:  # noqa: BLE001 - Dynamo internals changed: the graph is refused with this reason
        node.meta[META_KEY] = (f"te_passes could not read the te.autocast state from Dynamo's side effects "
                               f"({type(e).__name__}: {e})")


def tagging_fake(fn: Callable, qualname: str) -> Callable:
    """The fake kernel for TE op ``qualname`` that row ``autocast.trace_hooks`` puts in place of ``fn`` (the op's
    ``CustomOpDef._abstract_fn``): records the te.autocast state on the node Dynamo is creating
    (``node.meta[META_KEY]``), then returns ``fn(*args, **kwargs)``."""
    def fake(*args, **kwargs):
        _tag(qualname)
        return fn(*args, **kwargs)

    table.stamp(fake, HOOK_ATTR, True)
    fake.__wrapped__ = fn  # type: ignore[attr-defined]
    return fake


def forward_ops() -> list[str]:
    """Qualnames of the forward ops (wrapper and base) of every TE op family defined now."""
    from torch._library.custom_ops import OPDEFS

    out = []
    for q in OPDEFS:
        if not q.startswith(TE_OP_NAMESPACE + "::"):
            continue
        op = q.split("::", 1)[1]
        stem = op.removesuffix("_base")
        if stem.endswith("_backward"):
            continue
        if f"{TE_OP_NAMESPACE}::{stem}_backward" in OPDEFS or op.endswith("_base"):
            out.append(q)
    return sorted(out)


def trace_hook_changes() -> list[table.Rebind]:
    """The plan of row ``autocast.trace_hooks``: for every TE family forward op defined now whose fake kernel
    (``CustomOpDef._abstract_fn``, read by torch at each call) is not wrapped yet, a :class:`table.Rebind` to
    :func:`tagging_fake` (a sweep row: families defined later are wrapped by a later install).

    Raises:
        table.Refused: Dynamo lacks what :func:`traced_autocast` reads, or torch's ``CustomOpDef`` has no
            ``_abstract_fn``."""
    from torch._library.custom_ops import OPDEFS

    try:
        from torch._dynamo import side_effects, symbolic_convert  # noqa: F401
    except ImportError as e:  # pragma: no cover
        raise table.Refused(f"torch._dynamo lacks {e.name}") from None
    if not hasattr(symbolic_convert, "tls") or not hasattr(side_effects.SideEffects, "has_pending_mutation_of_attr"):
        raise table.Refused("torch._dynamo has no tls.current_tx / SideEffects.has_pending_mutation_of_attr")
    changes = []
    for q in forward_ops():
        opdef = OPDEFS[q]
        if not hasattr(opdef, "_abstract_fn"):
            raise table.Refused(f"torch's CustomOpDef of {q} has no _abstract_fn")
        fn = opdef._abstract_fn
        if fn is not None and not getattr(fn, HOOK_ATTR, False):
            changes.append(table.Rebind(opdef, "_abstract_fn", tagging_fake(fn, q)))
    return changes


# --------------------------------------------------------------------------- compile time
def te_op_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Every node (also in subgraph modules) calling a TE family forward op (wrapper or base)."""
    fwd = set(forward_ops())
    return [n for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes
            if n.op == "call_function" and op_qualname(n.target) in fwd]


def reads_autocast(node: torch.fx.Node) -> bool:
    """Whether the TE op ``node`` calls an impl that uses an autocast-delivered read (``delivery == "autocast"``
    in :data:`te_passes.compat.te220.runtime_reads.READS`): every one of them is used only when the op runs quantized
    (linear.py:414/568/611 and backends.py:1606 sit under ``fp8`` or need a quantizer), so ``config["fp8"]`` (the
    args bundle, :func:`te_passes.te.graph_model.decode`) decides; a node that cannot be decoded counts as reading
    it. A family with no inventory (:data:`~te_passes.compat.te220.runtime_reads.FAMILY_IMPLS`) reads none:
    :func:`autocast_for_graph` refuses it first when its impls read any TE state (bytecode scan)."""
    if family_of(op_qualname(node.target) or "") not in FAMILY_IMPLS:
        return False
    try:
        call = decode(node)
    except UnknownTEOp:
        return True
    return bool(call.config.get("fp8", True))


def graph_autocast(gm: torch.fx.GraphModule, nodes: Sequence[torch.fx.Node] | None = None) -> TracedAutocast | None:
    """The autocast state to run ``gm``'s TE ops under: the :class:`TracedAutocast` its TE op nodes recorded
    while Dynamo traced them, when they all agree; otherwise the one state of the nodes that use it
    (:func:`reads_autocast`; the others get a state they do not read).

    Raises:
        RecipeStateError: a node that uses the state has none recorded (the trace hook was not
            in effect: ``table.refusal("autocast.trace_hooks")``), or such nodes were traced under different
            states (both named): te_inductor cannot give two TE ops of one graph different states.
    """
    nodes = te_op_nodes(gm) if nodes is None else list(nodes)
    if not nodes:
        return None
    states = [n.meta.get(META_KEY) for n in nodes]
    if all(isinstance(s, TracedAutocast) for s in states) and all(s.same(states[0]) for s in states):
        return states[0]
    nodes = [n for n in nodes if reads_autocast(n)]
    if not nodes:
        return None
    missing = [n.name for n in nodes if not isinstance(n.meta.get(META_KEY), TracedAutocast)]
    if missing:
        reasons = {n.meta[META_KEY] for n in nodes if isinstance(n.meta.get(META_KEY), str)}
        why = ("; ".join(sorted(reasons)) or table.refusal(TRACE_HOOKS_ROW)
               or "the trace hook was not installed when Dynamo traced it")
        raise RecipeStateError(f"te_passes: TE op node(s) {', '.join(missing)}: the te.autocast state where "
                               f"Dynamo traced them is unknown ({why}); TE's impls read the recipe while they run "
                               "(docs/design.md 'TE global state read at run time'), so this graph is refused")
    first = nodes[0].meta[META_KEY]
    for n in nodes[1:]:
        s = n.meta[META_KEY]
        if not s.same(first):
            raise RecipeStateError(
                f"te_passes: TE op nodes {nodes[0].name} and {n.name} of one graph were traced under different "
                f"te.autocast states ({first.describe()} vs {s.describe()}); te_inductor sets one state around a "
                "compiled graph, so it refuses this graph rather than run an op under the wrong recipe. Split the "
                "autocast regions into separate compiled functions (or put a graph break between them)")
    return first


def _family_impls(family: str) -> list[Any]:
    """The ``impl`` functions the family's base ops run now (:func:`resolve_base_impl`); an op
    whose kernel is not TE's ``_impl`` is left out (its reads cannot be scanned: refused)."""
    out = []
    for op in (f"{family}_base", f"{family}_backward_base"):
        try:
            out.append(resolve_base_impl(f"{TE_OP_NAMESPACE}::{op}").impl)
        except DirectCallUnavailable as e:
            out.append(_Unscannable(str(e)))
    return out


class _Unscannable:
    """Stands for an impl whose code cannot be read; scanning it raises TypeError with the reason."""

    def __init__(self, why: str) -> None:
        self.why = why

    def __repr__(self) -> str:
        return self.why


def family_of(qualname: str) -> str:
    """``"transformer_engine_compile::linear_base"`` -> ``"linear"``."""
    return qualname.split("::", 1)[1].removesuffix("_base")


def autocast_for_graph(gm: torch.fx.GraphModule) -> TracedAutocast | None:
    """:func:`graph_autocast` of ``gm`` after checking that the installed TE's impls read only inventoried
    state (:func:`te_passes.compat.te220.runtime_reads.runtime_state_refusal`); ``None`` when the graph calls no TE op.

    Raises:
        RecipeStateError: the refusal's reason, or :func:`graph_autocast`'s.
    """
    nodes = te_op_nodes(gm)
    if not nodes:
        return None
    families = {family_of(op_qualname(n.target) or "") for n in nodes}
    reason = runtime_state_refusal(families, impls={f: _family_impls(f) for f in families
                                                    if f not in FAMILY_IMPLS})
    if reason is not None:
        raise RecipeStateError(f"te_passes: {reason}; te_inductor cannot give TE's impls the user's te.autocast "
                               "state and refuses to compile TE ops rather than run them on guesses")
    return graph_autocast(gm, nodes)
