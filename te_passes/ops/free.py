"""The early-free op: ``torch.ops.te_passes.free_storage(t)`` releases ``t``'s memory in a graph.

See docs/internals.md#te_passesopsfreepy."""

from __future__ import annotations

import torch

from te_passes._logging import get_logger
from te_passes.analyses.alias_rules import is_opaque_call
from te_passes.fx.journal import GraphJournal

OP_NAMESPACE = "te_passes"
OP_NAME = "free_storage"
QUALNAME = f"{OP_NAMESPACE}::{OP_NAME}"

_lib = torch.library.Library(OP_NAMESPACE, "FRAGMENT")  # noqa: TOR901 - we define the op below
_lib.define(f"{OP_NAME}(Tensor(a!) t) -> ()")


def _free_storage_impl(t: torch.Tensor) -> None:
    # aten::set_(self) -> self: a fresh empty storage of t's dtype/device; the old storage is
    # released when no other tensor references it. no_grad: the tensor may be a leaf that
    # required grad in a user-level graph.
    with torch.no_grad():
        t.set_()


def _free_storage_fake(t: torch.Tensor) -> None:  # FakeTensor / meta tracing: the op returns nothing
    return None


_lib.impl(OP_NAME, _free_storage_impl, "CompositeExplicitAutograd")
torch.library.register_fake(QUALNAME, _free_storage_fake, lib=_lib)

#: The op overload inserted into graphs.
free_storage: torch._ops.OpOverload = torch.ops.te_passes.free_storage.default


def is_free_node(node: torch.fx.Node) -> bool:
    """Whether FX ``node`` calls :data:`free_storage`."""
    return node.op == "call_function" and node.target is free_storage


#: Attribute marking te_passes' lowering function of :data:`free_storage` (kept by Inductor's
#: ``register_lowering`` wrapper, ``functools.wraps``): how a pass tells the lowering in place is ours.
LOWERING_MARK = "_te_passes_free_lowering"


def make_inductor_lowering():
    """The Inductor lowering function of :data:`free_storage` (not registered: the patch-table row
    ``lowering.free_storage`` of :mod:`te_passes.compat.lowering_rows` registers it). Takes the free's
    argument (an Inductor IR value) and returns ``None``: frees a materialized buffer through Inductor's
    fallback kernel (``torch._inductor.lowering.fallback_handler``) and marks it never reused
    (``V.graph.never_reuse_buffers``); drops the free of a value no kernel materialized.

    Raises:
        ImportError / AttributeError: this torch's Inductor lacks ``fallback_handler``.
    """
    from torch._inductor import lowering as L
    from torch._inductor.virtualized import V

    fallback = L.fallback_handler(free_storage, add_to_fallback_set=False)

    def _lower_free_storage(t):
        if not is_materialized(t):
            # No kernel got this value as a buffer: every reader so far inlined
            # it, or (a layout constraint) copied it. Realizing it here would
            # compute it once more into a buffer made only to be freed.
            _log_dropped_free(t)
            return None
        V.graph.never_reuse_buffers.add(t.get_name())
        return fallback(t)

    setattr(_lower_free_storage, LOWERING_MARK, True)
    return _lower_free_storage


def is_materialized(t) -> bool:
    """Whether Inductor IR value ``t`` (the free's argument at lowering time) already has a buffer: a
    realized ``StorageBox``, possibly seen through views; False for a ``Pointwise``/``Reduction`` that is
    still only a loader (``torch/_inductor/ir.py`` ``StorageBox.realize``, ``IRNode.is_realized_node``)."""
    from torch._inductor import ir

    x = t
    while isinstance(x, ir.TensorBox) or (isinstance(x, ir.BaseView) and not isinstance(x, ir.ReinterpretView)):
        x = x.data
    if isinstance(x, ir.StorageBox):
        return ir.IRNode.is_realized_node(x.data)
    return True


def mark_realize(node: torch.fx.Node, journal: GraphJournal) -> None:
    """Ask Inductor to realize FX ``node``'s value into a buffer right where it is lowered."""
    journal.set_meta(node, "inductor_realize_to_strides", True)


def _log_dropped_free(t) -> None:
    """Log a free the lowering drops: debug level when only Inductor kernels read the value (they inlined
    it), a warning when an opaque op reads it (it got a copy the free cannot reach: the
    ``inductor_realize_to_strides`` mark was lost)."""
    from torch._inductor.virtualized import V

    node = getattr(V.graph, "current_node", None)
    arg = node.args[0] if node is not None and node.args else None
    opaque = sorted(u.name for u in getattr(arg, "users", ()) if u is not node and is_opaque_call(u))
    name = getattr(arg, "name", type(t).__name__)
    if opaque:
        get_logger().warning(
            "free_storage lowering: %s is read by opaque op(s) %s but Inductor never materialized "
            "it (it was not marked inductor_realize_to_strides); they received a copy this free "
            "cannot empty, so no free is emitted", name, ", ".join(opaque))
    else:
        get_logger().debug("free_storage lowering: %s was never materialized (its readers inlined "
                           "it); no buffer to free, none created", name)


def lowering_reason() -> str | None:
    """Why :data:`free_storage`'s Inductor lowering is not in place (``None``: it is): a pure lookup of
    Inductor's lowering table (``torch._inductor.lowering.lowerings``); a pass asks, it never registers."""
    from torch._inductor import lowering as L

    fn = L.lowerings.get(free_storage)
    if fn is not None and getattr(fn, LOWERING_MARK, False):
        return None
    if fn is not None:
        return f"the Inductor lowering of {QUALNAME} is not te_passes' (someone registered another)"
    return (f"the Inductor lowering of {QUALNAME} is not installed: te_passes.compat.install.install() "
            "registers it (the backend's import calls it)")
