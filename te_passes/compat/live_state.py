"""Reads of live TE objects at compile time: TE's Userbuffers registry (``module/base.py``), its te.autocast
state (``FP8GlobalStateManager``) and the :class:`~te_passes.te.state.TEState` a compilation is run against.
The data types and what they answer are ``te/`` (pure); taking them from a running TE is here, in the fence.

See docs/internals.md#te_passescompatlive_statepy."""

from __future__ import annotations

import sys
from typing import Any

import torch

from te_passes.te.recipes import FP8_STATE_MODULE, Fp8State
from te_passes.te.state import TEState
from te_passes.te.ub import (METHOD_FIELD, TE_UB_MODULE, UB_PREDICATE_METHODS, UbBufferState, UbConfigError,
                             UbSnapshot, mode_value)
from te_passes.te.version import te_version


def capture_ub() -> UbSnapshot:
    """TE's live UB registry (``module/base.py`` ``_ub_initialized``, ``_ub_with_cublasmp``, one
    :class:`~te_passes.te.ub.UbBufferState` per ``(name, mode)`` key of ``_ub_communicators``, each
    communicator's :data:`~te_passes.te.ub.UB_PREDICATE_METHODS` results); ``source="absent"`` while TE's
    ``module/base.py`` is not imported.

    Raises:
        UbConfigError: a registry key that is not ``(str, UserBufferQuantizationMode)``."""
    base = sys.modules.get(TE_UB_MODULE)
    if base is None:
        return UbSnapshot(source="absent")
    bufs = []
    for key, comm in (getattr(base, "_ub_communicators", None) or {}).items():
        if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str)):
            raise UbConfigError(f"unexpected key {key!r} in {TE_UB_MODULE}._ub_communicators "
                                "(expected (name, UserBufferQuantizationMode))")
        vals: dict[str, Any] = {}
        for m in UB_PREDICATE_METHODS:
            fn = getattr(comm, m, None)
            v = fn() if callable(fn) else None
            field = METHOD_FIELD.get(m, m)
            vals[field] = (int(v) if field == "tp_size" else bool(v)) if v is not None else None
        bufs.append(UbBufferState(key[0], mode_value(key[1]), **vals))
    bufs.sort(key=lambda b: (b.name, b.mode))
    return UbSnapshot(initialized=bool(getattr(base, "_ub_initialized", False)),
                      with_cublasmp=bool(getattr(base, "_ub_with_cublasmp", False)), buffers=tuple(bufs), source="live")


def capture_fp8() -> Fp8State:
    """TE's live ``FP8GlobalStateManager`` state (``ImportError`` without TE). A recipe TE has not built yet
    stays unknown (``None``, not folded) where it cannot be built: inside a compilation (TE's
    ``Recipe.__post_init__`` refuses) or without a GPU (``RuntimeError``)."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as M

    recipe = M.quantization_state.fp8_recipe
    if recipe is None and not torch.compiler.is_compiling():
        try:
            recipe = M.get_fp8_recipe()
        except RuntimeError:
            recipe = None
    return Fp8State(fp8_enabled=bool(M.is_fp8_enabled()), fp8_calibration=bool(M.is_fp8_calibration()),
                    fp8_parameters=bool(M.with_fp8_parameters()), recipe=recipe, fp8_group=M.get_fp8_group())


def capture_te_state(*, ub_snapshot: Any = None, fp8: Fp8State | None = None) -> TEState:
    """The :class:`~te_passes.te.state.TEState` of the live TE process: its version, :func:`capture_ub` (or
    ``ub_snapshot``: a ``UbSnapshot``, dict or JSON path, :meth:`UbSnapshot.load`) and :func:`capture_fp8` while
    TE's quantization module is imported (or ``fp8``). Without TE: ``te_version=None``, no fp8 state.

    Raises:
        UbConfigError / TypeError: ``ub_snapshot`` cannot be read (:meth:`UbSnapshot.load`)."""
    ub = UbSnapshot.load(ub_snapshot) if ub_snapshot is not None else capture_ub()
    if fp8 is None and FP8_STATE_MODULE in sys.modules:
        fp8 = capture_fp8()
    return TEState(te_version=te_version(), ub=ub, fp8=fp8)
