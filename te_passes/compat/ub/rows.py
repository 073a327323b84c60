"""The patch-table rows of the UB capability (:class:`te_passes.compat.table.Row`), in install order.

``ub.initialize_ub`` / ``ub.destroy_ub`` / ``ub.get_ub_is_fp8`` rebind TE's UB functions in every loaded TE
module that holds them. Not sweeps: a TE module imported later takes the function from ``module/base.py``, which
holds the drop-in by then (and a sweep would scan ``sys.modules`` at every compile). :data:`COMPILER_RESET` is not
in the registry:
:mod:`te_passes.compat.ub.reinit` applies it for the length of a ``with`` block only.
See docs/internals.md#te_passescompatubrowspy."""

from __future__ import annotations

import sys
from typing import Any, Callable

from te_passes.compat.table import Rebind, Refused, Row
from te_passes.compat.ub import guard
from te_passes.te.ub import TE_UB_MODULE
from te_passes.te.version import te_module

TE = "==2.20.*"
TORCH = ">=2.14,<2.16"
#: Marker on te_passes' drop-ins (set on our own functions): the TE function each wraps.
ORIGINAL_ATTR = "__te_passes_original__"


def te_modules() -> list[Any]:
    """Every loaded ``transformer_engine*`` module (``sys.modules``), in import order."""
    return [m for n, m in list(sys.modules.items()) if m is not None and n.startswith("transformer_engine")]


def rebind_everywhere(name: str, build: Callable[[Callable], Callable]) -> list[Rebind]:
    """One :class:`Rebind` per loaded TE module whose ``name`` is TE's ``module/base.py`` function ``name`` (the
    original), to ``build(original)`` (or the drop-in ``base`` already holds).

    Raises:
        Refused: ``"pending: ..."`` while TE's ``module/base.py`` is not imported (:func:`table.install` tries again).
        AttributeError: TE's ``module/base.py`` has no ``name``."""
    base = te_module(TE_UB_MODULE)
    if base is None:
        raise Refused(f"pending: {TE_UB_MODULE} is not imported yet")
    current = getattr(base, name)
    original = getattr(current, ORIGINAL_ATTR, current)
    new = current if current is not original else build(original)
    return [Rebind(m, name, new) for m in te_modules() if getattr(m, name, None) is original]


def _after() -> None:
    guard.recapture()


_COMMON = dict(kind="rebind", te=TE, torch=TORCH, after=_after)

ROWS: tuple[Row, ...] = (
    Row(name="ub.initialize_ub",
        target=f"{TE_UB_MODULE}.initialize_ub (and every TE module that imported it)",
        why="TE gives no signal when its Userbuffers communicators are created; te_passes must bump its UB "
            "generation so compiled graphs specialised on UB state re-check it (compat.ub.graph_guard)",
        drop_when="TE exposes a UB-state change callback or counter (none in TE 2.20 module/base.py)",
        plan=lambda: rebind_everywhere("initialize_ub", guard.state_change_hook), **_COMMON),
    Row(name="ub.destroy_ub",
        target=f"{TE_UB_MODULE}.destroy_ub (and every TE module that imported it)",
        why="as ub.initialize_ub, for TE's destroy_ub (the communicators go away)",
        drop_when="TE exposes a UB-state change callback or counter (none in TE 2.20 module/base.py)",
        plan=lambda: rebind_everywhere("destroy_ub", guard.state_change_hook), **_COMMON),
    Row(name="ub.get_ub_is_fp8",
        target=f"{TE_UB_MODULE}.get_ub_is_fp8 (and linear / layernorm_linear / layernorm_mlp, which import it)",
        why="TE marks get_ub_is_fp8 assume_constant_result without a guard: Dynamo would keep a folded value after "
            "UB is re-initialised; te_passes answers from its UB snapshot, guarded by the UB state token",
        drop_when="TE guards the folded get_ub_is_fp8 value on its UB state (TE module/base.py)",
        plan=lambda: rebind_everywhere("get_ub_is_fp8", guard.guarded_get_ub_is_fp8), **_COMMON),
)


def _skip_compiler_reset() -> None:
    """Stands for ``torch.compiler.reset`` inside :func:`te_passes.compat.ub.reinit.keep_compiled_graphs`: no-op."""
    return None


def _compiler_reset_plan() -> list[Rebind]:
    import torch

    return [Rebind(torch.compiler, "reset", _skip_compiler_reset)]


#: Applied by :mod:`te_passes.compat.ub.reinit` around TE's ``destroy_ub()`` only (``table.install([COMPILER_RESET])``
#: then ``table.revert``): not in :data:`ROWS`, whose rows stay in for the process.
COMPILER_RESET = Row(
    name="ub.compiler_reset",
    target="torch.compiler.reset (inside te_passes.compat.ub.reinit.keep_compiled_graphs only)",
    kind="rebind",
    why="TE's destroy_ub() ends with torch.compiler.reset(), dropping every compiled graph of the process; under "
        "te_inductor the UB guards re-check just the graphs that depend on UB state",
    drop_when="TE's destroy_ub stops calling torch.compiler.reset() (TE 2.20 module/base.py:604)",
    te=TE, torch=TORCH, plan=_compiler_reset_plan)
