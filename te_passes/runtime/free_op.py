"""The early-free op: ``torch.ops.te_passes.free_storage(t)`` releases ``t``'s memory in a graph.

What it does — TE's ``clear_tensor_data`` semantics
---------------------------------------------------
``transformer_engine/pytorch/utils.py`` (TE 2.20.2) ``clear_tensor_data(*tensors)`` frees a
tensor by *rebinding* it to an empty tensor (``t.data = _empty_tensor()``; quantized storages'
``clear()`` rebinds their ``_data`` / ``_transpose`` the same way). The memory goes back to
the caching allocator as soon as no other tensor shares the storage; a tensor object that
another holder references (TE's autograd ``ctx``, a quantized-storage wrapper) is emptied for
that holder too, which is why TE can free tensors that ``del`` cannot.

``free_storage`` does exactly that with the dispatcher's ``aten::set_(Tensor(a!) self)``
("set to an empty tensor"): the tensor object keeps its dtype and device, its storage becomes a
fresh empty one and the old ``StorageImpl`` loses this reference.

Why not ``t.untyped_storage().resize_(0)`` (FSDP2's ``inductor.resize_storage_bytes_``)? It
frees the storage under *every* alias, including aliases the FX graph cannot see: a view kept
by an opaque op, or a ``_scale_inv`` that TE shares between several FP8 tensors (the reason
TE's ``Float8TensorStorage.clear()`` leaves ``_scale_inv`` alone). A later read through such
an alias would read freed memory. Rebinding frees only what nothing else holds, so the
liveness proof over the graph's own references is enough for safety.

Inductor: why the op has a lowering
-----------------------------------
The schema ``free_storage(Tensor(a!) t) -> ()`` marks ``t`` mutated, so Inductor keeps the
call in place (a mutating op is never dead code, and the scheduler orders it after every
earlier reader of ``t``). Inductor's wrapper may also *reuse* a dead buffer's memory for a
later buffer of the same size (``AllocateLine`` -> ``ReuseLine``); reusing a buffer whose
storage we emptied would hand the later kernel an empty storage. The lowering registered by
:func:`register_inductor_lowering` therefore adds the freed buffer to
``V.graph.never_reuse_buffers`` — what Inductor's own ``ResizeStorageBytes`` does
(``torch/_inductor/ir.py``, torch 2.14) — and emits a plain fallback call.

The lowering never *realizes* its argument. An ATen cast lowers to an unrealized
``Pointwise``; a custom op with Inductor's default ``needs_exact_strides`` constraint copies
such an input into a buffer of its own (``ExternKernel.require_strides`` -> ``copy_input``),
so realizing the original at the free computed the value a second time, into a buffer made
only to be freed, while the copy the opaque op kept stayed full (measured: the fused kernel
wrote ``buf0`` for the op and ``buf2`` for the free). Now ``insert_early_frees`` marks the
freed value ``inductor_realize_to_strides`` (:func:`mark_realize`) so it is one buffer from its
definition on, and the lowering emits no call for a value that is still unrealized
(:func:`is_materialized`): no reader received it, nothing holds it.

CUDA graphs (``mode="reduce-overhead"``, cudagraph trees)
---------------------------------------------------------
The op launches no kernel and never synchronises; it only drops a host-side reference. While a
CUDA graph is being captured, a storage allocated during the capture goes back to the graph's
private memory pool when its last reference drops — the same thing that happens to every
Inductor buffer at its ``del`` — and later allocations of the same capture may reuse the
block (replay re-runs kernels in recorded order, so that reuse is valid on every replay).
Replays do not run the op at all (only kernels are replayed). The op is therefore not tagged
``torch.Tag.cudagraph_unsafe``. It must never receive a graph input: cudagraph trees treat
mutated inputs as a reason to skip CUDA graphs, and inputs belong to the caller; the pass
never frees them.
"""

from __future__ import annotations

import threading

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


def _free_storage_fake(t: torch.Tensor) -> None:
    # Data-free: FakeTensor / meta tracing only needs to know the op returns nothing.
    return None


_lib.impl(OP_NAME, _free_storage_impl, "CompositeExplicitAutograd")
torch.library.register_fake(QUALNAME, _free_storage_fake, lib=_lib)

#: The op overload inserted into graphs.
free_storage: torch._ops.OpOverload = torch.ops.te_passes.free_storage.default


def is_free_node(node: torch.fx.Node) -> bool:
    """Whether FX ``node`` calls :data:`free_storage`."""
    return node.op == "call_function" and node.target is free_storage


_lowering_lock = threading.Lock()
_lowering_registered: bool | None = None
_lowering_error: str | None = None


def register_inductor_lowering() -> bool:
    """Register :data:`free_storage`'s Inductor lowering (idempotent); True when registered.

    For an argument that already has a buffer (:func:`is_materialized`) the lowering emits
    Inductor's generic fallback call for the op (``torch._inductor.lowering.fallback_handler``)
    and adds the buffer to ``V.graph.never_reuse_buffers`` so Inductor's wrapper never reuses
    the freed memory for a later buffer. For an argument still unrealized (fused into its
    readers, or copied by them) it emits nothing and creates no buffer. Uses ``torch._inductor.lowering.register_lowering`` (torch 2.14); when that
    internal API is unavailable it returns False and :func:`lowering_error` says why — the
    ``insert_early_frees`` pass then refuses to insert frees into graphs Inductor will compile.
    Called by ``te_passes.runtime.install.install()`` only; passes read :func:`lowering_reason`.
    """
    global _lowering_registered, _lowering_error
    with _lowering_lock:
        if _lowering_registered is not None:
            return _lowering_registered
        try:
            from torch._inductor import lowering as L
            from torch._inductor.virtualized import V

            if free_storage not in L.lowerings:
                fallback = L.fallback_handler(free_storage, add_to_fallback_set=False)

                @L.register_lowering(free_storage, type_promotion_kind=None)
                def _lower_free_storage(t):
                    if not is_materialized(t):
                        # No kernel got this value as a buffer: every reader so far inlined
                        # it, or (a layout constraint) copied it. Realizing it here would
                        # compute it once more into a buffer made only to be freed.
                        _log_dropped_free(t)
                        return None
                    V.graph.never_reuse_buffers.add(t.get_name())
                    return fallback(t)

            _lowering_registered = True
        except Exception as e:  # noqa: BLE001 - report any API drift as "not registered"
            _lowering_registered = False
            _lowering_error = f"{type(e).__name__}: {e}"
        return _lowering_registered


def is_materialized(t) -> bool:
    """Whether Inductor IR value ``t`` (the free's argument at lowering time) already has a
    buffer: a realized ``StorageBox`` (``ComputedBuffer``, an extern kernel's output, an input),
    possibly seen through views. False for a ``Pointwise``/``Reduction`` that is still only a
    loader (``torch/_inductor/ir.py`` ``StorageBox.realize``, ``IRNode.is_realized_node``,
    torch 2.14).

    Why it matters: a free must release the buffer the graph's readers received. An unrealized
    value at the free means no reader received a buffer of it — Inductor kernels inlined its
    loader, and an extern kernel with a stride constraint (a custom op's default
    ``needs_exact_strides``: ``ExternKernel.require_strides`` -> ``copy_input``) got a *copy*.
    ``insert_early_frees`` marks the freed value ``inductor_realize_to_strides`` so that an
    opaque reader receives the realized buffer itself (see :func:`mark_realize`).
    """
    from torch._inductor import ir

    x = t
    while True:
        if isinstance(x, ir.TensorBox) or (isinstance(x, ir.BaseView) and not isinstance(x, ir.ReinterpretView)):
            x = x.data
            continue
        break
    if isinstance(x, ir.StorageBox):
        return ir.IRNode.is_realized_node(x.data)
    return True


def mark_realize(node: torch.fx.Node, journal: GraphJournal) -> None:
    """Ask Inductor to realize FX ``node``'s value into a buffer right where it is lowered.

    Sets ``node.meta["inductor_realize_to_strides"] = True`` through the pass's ``journal``, the flag Inductor's own post-grad
    passes set for the same purpose (``torch/_inductor/fx_passes/decompose_mem_bound_mm.py``
    ``realize_inputs``; read in ``GraphLowering.run_node``, torch 2.14): the value becomes a
    ``ComputedBuffer`` with ``meta['val']``'s stride order before any user is lowered. A later
    custom op with ``needs_exact_strides`` then freezes that buffer's layout instead of
    copying an unrealized ``Pointwise`` into a buffer of its own, so the op and the free
    receive the same buffer. Costs nothing when an extern kernel reads the value anyway (it
    would be materialized once either way; here it is the same single kernel and buffer).
    """
    journal.set_meta(node, "inductor_realize_to_strides", True)


def _log_dropped_free(t) -> None:
    """Log a free the lowering drops. Debug level when only Inductor kernels read the value
    (they inlined it: nothing to free); a warning when an opaque op reads it — then that op got a
    copy the free cannot reach (the ``inductor_realize_to_strides`` mark was lost, e.g. a later
    post-grad pass replaced the node)."""
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


def lowering_error() -> str | None:
    """Why :func:`register_inductor_lowering` failed (``None`` if it did not fail)."""
    return _lowering_error


def lowering_reason() -> str | None:
    """Why :data:`free_storage`'s Inductor lowering is not in place (``None``: it is). A pure
    lookup of what :func:`register_inductor_lowering` (run by
    ``te_passes.runtime.install.install()``) did: a pass asks, it never registers (issue 12)."""
    if _lowering_registered:
        return None
    if _lowering_registered is False:
        return f"cannot register the Inductor lowering of {QUALNAME} ({_lowering_error})"
    return (f"the Inductor lowering of {QUALNAME} is not installed: te_passes.runtime.install.install() "
            "registers it (the backend calls it on every te_inductor call)")
