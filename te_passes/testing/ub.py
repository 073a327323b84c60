"""Stand-in Userbuffers communicators for tests and offline demos (no GPU, no process group).

See docs/internals.md#te_passestestingubpy."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Mapping

from te_passes.compat import table
from te_passes.compat.ub import guard as guards


@dataclasses.dataclass
class StandInCommunicator:
    """Answers a UB communicator's query methods with fixed values (TE 2.20.2 method names)."""

    fp8_ubuf: bool = False
    cublasmp: bool = False
    atomic_gemm: bool = False
    p2p_overlap: bool = False
    tp_size: int = 2

    def is_fp8_ubuf(self) -> bool:
        return self.fp8_ubuf

    def with_cublasmp(self) -> bool:
        return self.cublasmp

    def is_atomic_gemm(self) -> bool:
        return self.atomic_gemm

    def is_p2p_overlap(self) -> bool:
        return self.p2p_overlap

    def get_tp_size(self) -> int:
        return self.tp_size


#: TE's UB registry (transformer_engine/pytorch/module/base.py module globals).
_REGISTRY = ("_ub_communicators", "_ub_initialized", "_ub_with_cublasmp")


def _set_registry(base: Any, values: tuple[Any, Any, Any]) -> None:
    for attr, v in zip(_REGISTRY, values):
        table.set_state(base, attr, v)
    guards.on_ub_state_changed()


def set_ub_registry(buffers: Mapping[tuple[str, str], StandInCommunicator] | None, *,
                    with_cublasmp: bool = False) -> None:
    """Replace TE's UB registry: ``buffers`` maps ``(name, "none"|"fp8")`` to communicators;
    ``None`` means UB not initialised (as after ``destroy_ub()``). Notifies te_passes (as its
    hooks on ``initialize_ub``/``destroy_ub`` would); does not install the hooks."""
    import torch  # noqa: F401  (TE needs torch first)
    from transformer_engine.pytorch.module import base

    modes = {"none": base.UserBufferQuantizationMode.NONE, "fp8": base.UserBufferQuantizationMode.FP8}
    comms = None if buffers is None else {(n, modes[m]): c for (n, m), c in buffers.items()}
    _set_registry(base, (comms, buffers is not None, buffers is not None and with_cublasmp))


@contextlib.contextmanager
def ub_registry(buffers: Mapping[tuple[str, str], StandInCommunicator] | None, *,
                with_cublasmp: bool = False) -> Iterator[None]:
    """:func:`set_ub_registry` for the duration of the block, then restore TE's previous registry."""
    from transformer_engine.pytorch.module import base

    saved = tuple(getattr(base, a) for a in _REGISTRY)
    set_ub_registry(buffers, with_cublasmp=with_cublasmp)
    try:
        yield
    finally:
        _set_registry(base, saved)
