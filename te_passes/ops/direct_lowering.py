"""The Inductor lowering of TE's base ops that emits direct calls: the wrapper code
calls a :class:`~te_passes.ops.direct_call.DirectTECall` instead of the dispatcher op.

See docs/internals.md#te_passesopsdirect_loweringpy."""

from __future__ import annotations

import functools
from typing import Any

import torch

from te_passes._logging import get_logger
from te_passes.ops.direct_call import EMITTED_KEY, META_KEY, NAME_PREFIX, DirectTECall
from te_passes.ops.te_base import opdefs, op_family, overload
from te_passes.te.graph_model import TE_OP_NAMESPACE

log = get_logger()


# --------------------------------------------------------------------------- Inductor lowering
#: Attribute marking te_passes' direct-call lowering functions: how a pass tells the lowering in place is ours.
LOWERING_MARK = "_te_passes_direct"


def _stored_names(fn: Any) -> frozenset[str]:
    """Attribute names a function's code refers to (``co_names``, nested code objects included),
    ``frozenset()`` for something without code."""
    code = getattr(getattr(fn, "__wrapped__", fn), "__code__", None)
    names: set[str] = set()
    stack = [code] if code is not None else []
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, type(c)))
    return frozenset(names)


@functools.lru_cache(maxsize=None)
def feature_error() -> str | None:
    """Why this torch's Inductor cannot take the direct-call lowering (``None``: it can); a fact about this
    torch, computed once."""
    reason = None
    try:
        from torch._inductor import graph as G, ir, lowering as L
        from torch._library.utils import get_layout_constraint_tag  # noqa: F401

        for mod, names in ((L, ("make_fallback", "lowerings", "tag_to_layout_constraint")),
                           (ir, ("FallbackKernel",))):
            for n in names:
                if not hasattr(mod, n):
                    raise AttributeError(f"{mod.__name__}.{n}")
        # instance attributes: the names the constructors store (their code objects' co_names),
        # not their source (inspect.getsource would parse all of graph.py / ir.py)
        for cls, attrs in ((G.GraphLowering, ("opaque_value_type_classes", "operations")),
                           (ir.FallbackKernel, ("unflatten_args",))):
            missing = [a for a in attrs if a not in _stored_names(cls.__init__)]
            if missing:
                raise AttributeError(f"{cls.__name__} stores no {', '.join(missing)}")
        if not hasattr(ir.FallbackKernel, "python_kernel_name"):
            raise AttributeError("ir.FallbackKernel.python_kernel_name")
    except Exception as e:  # noqa: BLE001 - any API drift means "not available"
        reason = f"this torch's Inductor lacks what the direct-call lowering needs ({type(e).__name__}: {e})"
    return reason


def base_ops() -> list[torch._ops.OpOverload]:
    """The forward and backward base op of every TE op family (:func:`op_family`) defined now, in
    ``OPDEFS`` order: the ops the direct-call lowering is for (the patch-table row
    ``lowering.direct_call`` of :mod:`te_passes.compat.lowering_rows` registers one per op)."""
    prefix = TE_OP_NAMESPACE + "::"
    out: list[torch._ops.OpOverload] = []
    for qual in [q for q in opdefs() if q.startswith(prefix) and q.endswith("_base")]:
        fam = op_family(overload(qual))
        if fam is None:
            continue
        for base_q in (fam.forward_base, fam.backward_base):
            op = overload(base_q)
            if op not in out:
                out.append(op)
    return out


def is_direct_lowering(fn: Any) -> bool:
    """Whether Inductor lowering ``fn`` is te_passes' direct-call lowering (:func:`make_lowering`)."""
    return bool(getattr(fn, LOWERING_MARK, False))


def lowering_reason(base_op: torch._ops.OpOverload) -> str | None:
    """Why the direct-call lowering of ``base_op`` is not in place (``None``: it is): a pure lookup of
    Inductor's lowering table (``torch._inductor.lowering.lowerings``) and of :func:`feature_error`; a
    pass asks, it never registers."""
    from torch._inductor import lowering as L

    fn = L.lowerings.get(base_op)
    if fn is not None and is_direct_lowering(fn):
        return None
    if fn is not None:
        return f"{base_op} already has an Inductor lowering that is not te_passes'"
    why = feature_error()
    if why is not None:
        return why
    return (f"direct-call lowering not installed: no lowering registered for {base_op} "
            "(te_passes.compat.install.install() registers one for each TE op family defined when it "
            "runs; the backend's import calls it)")


def make_lowering(base_op: torch._ops.OpOverload, fallback: Any, constraint: Any) -> Any:
    """The direct-call lowering of TE base op ``base_op`` (not registered: the patch-table row
    ``lowering.direct_call`` registers it): Inductor's ``fallback`` lowering of the op
    (``register_lowering`` of ``fallback_handler``, as ``make_fallback`` builds it) plus, for a node
    the ``call_te_impl_directly`` pass planned (``node.meta[META_KEY]``), the :class:`DirectTECall` named
    as the kernel of the ``FallbackKernel`` it built. ``constraint``: the op's layout constraint
    (``tag_to_layout_constraint`` of its tag) at registration."""
    from torch._inductor.virtualized import V

    def _lower_te_base_op(*args: Any, **kwargs: Any) -> Any:
        graph = V.graph
        first = len(graph.operations)
        out = fallback(*args, **kwargs)
        node = graph.current_node
        call = node.meta.get(META_KEY) if node is not None else None
        if call is not None:
            _emit_direct_call(graph, node, call, base_op, first, constraint)
        return out

    setattr(_lower_te_base_op, LOWERING_MARK, True)
    _lower_te_base_op._is_fallback_handler = True  # type: ignore[attr-defined]  (it is one, plus a rename)
    return _lower_te_base_op


def _emit_direct_call(graph: Any, node: torch.fx.Node, call: Any, base_op: Any, first: int, constraint: Any) -> None:
    """Name ``call`` as the kernel of the ``FallbackKernel`` Inductor just built for ``node``
    (or log why not and leave the dispatcher call)."""
    from torch._inductor import ir
    from torch._library.utils import get_layout_constraint_tag
    from torch._inductor import lowering as L

    def refuse(why: str) -> None:
        log.warning("te_passes: %s keeps its dispatcher call of %s: %s", node.name, base_op, why)
        node.meta[EMITTED_KEY] = None

    if not isinstance(call, DirectTECall):
        return refuse(f"meta[{META_KEY!r}] holds a {type(call).__name__}")
    if getattr(graph, "cpp_wrapper", False) or getattr(graph, "fx_wrapper", False):
        return refuse("the wrapper is not Inductor's Python wrapper (cpp_wrapper / fx_wrapper)")
    if getattr(graph, "parent", None) is not None:
        # a SubgraphLowering keeps its own opaque_value_type_classes, which never become globals
        return refuse("the node is lowered in an Inductor subgraph (its globals do not reach the wrapper module)")
    now = L.tag_to_layout_constraint(get_layout_constraint_tag(base_op, with_default=True))
    if now is not constraint:
        log.warning("te_passes: %s: the custom-op layout constraint changed since the lowering of %s was "
                    "registered (%s, now %s); the registered one was applied", node.name, base_op,
                    getattr(constraint, "__name__", constraint), getattr(now, "__name__", now))
    kernels = [op for op in graph.operations[first:]
               if isinstance(op, ir.FallbackKernel) and op.op_overload is base_op]
    if len(kernels) != 1:
        return refuse(f"expected one FallbackKernel for the node, Inductor built {len(kernels)}")
    kernel = kernels[0]
    args, kwargs = kernel.unflatten_args(kernel.inputs, kernel.constant_args)
    if kwargs or len(args) != call._nargs:
        return refuse(f"the kernel takes {len(args)} args / kwargs {sorted(kwargs)}; the plan has {call._nargs}")
    for i, v in call._consts:
        a = args[i]
        if not (a is v or (v is None and a is None) or (isinstance(v, list) and not v and isinstance(a, (list, tuple))
                                                        and not a)):
            return refuse(f"slot {i} is {type(a).__name__}, the plan holds another object (a later pass "
                          "replaced it?)")
    taken = graph.opaque_value_type_classes
    n = sum(1 for k in taken if k.startswith(NAME_PREFIX))
    while f"{NAME_PREFIX}{n}" in taken:
        n += 1
    name = f"{NAME_PREFIX}{n}"
    taken[name] = call
    kernel.python_kernel_name = name
    node.meta[EMITTED_KEY] = name
