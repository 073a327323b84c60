"""Re-initialising Userbuffers under ``te_inductor`` without TE's process-wide
``torch.compiler.reset()`` (public API; the guards that make it safe are in
:mod:`te_passes.compat.ub.guard`)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from te_passes.compat import table
from te_passes.compat.live_state import capture_ub
from te_passes.compat.ub import guard as guards, rows as ub_rows
from te_passes.te.ub import UbSnapshot


def notify_ub_changed() -> None:
    """Tell te_passes that TE's UB registry changed outside the hooked ``initialize_ub``/``destroy_ub``
    (code that edits ``module/base.py``'s ``_ub_communicators`` / ``_ub_initialized`` by hand)."""
    guards.on_ub_state_changed()


@contextlib.contextmanager
def _no_compiler_reset() -> Iterator[None]:
    """Row :data:`te_passes.compat.ub.rows.COMPILER_RESET` for the block (an enclosing block's stays).

    Raises:
        RuntimeError: the row is refused (its reason): TE's ``destroy_ub`` would reset every compiled graph."""
    name = ub_rows.COMPILER_RESET.name
    if table.refusal(name) is None:
        yield
        return
    table.install([ub_rows.COMPILER_RESET])
    if table.refusal(name) is not None:
        raise RuntimeError(f"te_passes: cannot keep compiled graphs over TE's destroy_ub(): patch {name} is not "
                           f"applied ({table.refusal(name)})")
    try:
        yield
    finally:
        table.revert([name])


def destroy_ub_keep_compiled() -> None:
    """TE's ``destroy_ub()`` without its process-wide ``torch.compiler.reset()`` (``ImportError``: no TE)."""
    from transformer_engine.pytorch.module import base

    table.install(ub_rows.ROWS)  # the ub.* rows (pending until TE's module/base.py is imported)
    with _no_compiler_reset():
        base.destroy_ub()
    guards.on_ub_state_changed()


def reinitialize_ub(*args: Any, **kwargs: Any) -> UbSnapshot:
    """Destroy TE's UB communicators and initialise them again (TE's ``initialize_ub(*args, **kwargs)``),
    keeping compiled graphs; returns the new :class:`UbSnapshot`. Raises what ``initialize_ub`` raises
    (UB is then left destroyed)."""
    from transformer_engine.pytorch.module import base

    destroy_ub_keep_compiled()
    base.initialize_ub(*args, **kwargs)
    guards.on_ub_state_changed()
    return capture_ub()


@contextlib.contextmanager
def keep_compiled_graphs() -> Iterator[None]:
    """Context manager: inside it, TE's ``destroy_ub()`` does not call ``torch.compiler.reset()`` (row
    ``ub.compiler_reset``; ``RuntimeError`` when it is refused, naming why)."""
    table.install(ub_rows.ROWS)
    with _no_compiler_reset():
        try:
            yield
        finally:
            guards.on_ub_state_changed()
