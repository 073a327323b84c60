"""The one wrapper around a ``te_inductor``-compiled callable: the ``te.autocast`` state TE's impls read
set around the call (``compat.autocast.recipe_state``) and the UB-state guard's generation check
(``compat.ub.graph_guard``). ``Compilation.finish`` builds it once per graph.

See docs/internals.md#te_passescompatcompiled_callpy."""

from __future__ import annotations

from typing import Callable

from te_passes.compat import table
from te_passes.compat.autocast.recipe_state import TracedAutocast
from te_passes.compat.ub.graph_guard import UbGuard, make_guarded
from te_passes.compat.ub.guard import ub_global_state
from te_passes.compat.te220.runtime_reads import AUTOCAST_FIELDS


def wrap_compiled(compiled: Callable, *, guard: UbGuard | None = None,
                  autocast: TracedAutocast | None = None) -> Callable:
    """``compiled`` (Inductor's callable, called ``fn(*args)`` as Dynamo calls a backend's output) in one
    wrapper, or itself when ``guard`` and ``autocast`` are both ``None``.

    The wrapper sets TE's autocast fields (:data:`~te_passes.compat.te220.runtime_reads.AUTOCAST_FIELDS` of
    ``FP8GlobalStateManager.quantization_state``, looked up at each call: TE's ``FP8GlobalStateManager.reset()``
    replaces it) to ``autocast`` and restores them afterwards, also on error; inside that scope, when the UB
    generation moved since ``guard`` was valid, ``guard.revalidate(args)`` (may raise ``UbConfigError`` /
    ``UbStateChanged``, may recompile), then calls ``guard.compiled`` (``compiled`` without a guard). Attributes:
    ``te_ub_guard`` (``guard``, when given), ``te_autocast`` (``autocast``, when given), ``__wrapped__``
    (``compiled``). Mirrors TE's ``quantization.autocast`` enter / exit (``FP8GlobalStateManager.autocast_enter``
    / ``autocast_exit``) for the four fields TE's impls read."""
    if autocast is None:
        return compiled if guard is None else make_guarded(guard)
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    values = autocast.values()  # AUTOCAST_FIELDS order
    mgr, ub = FP8GlobalStateManager, ub_global_state()

    def te_compiled(*args):
        q = mgr.quantization_state
        saved = table.swap_state(q, AUTOCAST_FIELDS, values)
        try:
            if guard is None:
                return compiled(*args)
            if ub.generation != guard.generation:
                guard.revalidate(list(args))
            return guard.compiled(*args)
        finally:
            table.swap_state(q, AUTOCAST_FIELDS, saved)

    te_compiled.te_autocast = autocast  # type: ignore[attr-defined]
    te_compiled.__wrapped__ = compiled  # type: ignore[attr-defined]
    if guard is not None:
        te_compiled.te_ub_guard = guard  # type: ignore[attr-defined]
    return te_compiled
