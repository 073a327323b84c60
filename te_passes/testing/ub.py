"""Stand-in Userbuffers communicators for tests and offline demos (no GPU, no process group).

See docs/internals.md#te_passestestingubpy."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Mapping

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


def set_ub_registry(buffers: Mapping[tuple[str, str], StandInCommunicator] | None, *,
                    with_cublasmp: bool = False) -> None:
    """Replace TE's UB registry: ``buffers`` maps ``(name, "none"|"fp8")`` to communicators;
    ``None`` means UB not initialised (as after ``destroy_ub()``). Notifies te_passes (as its
    hooks on ``initialize_ub``/``destroy_ub`` would); does not install the hooks."""
    import torch  # noqa: F401  (TE needs torch first)
    from transformer_engine.pytorch.module import base

    modes = {"none": base.UserBufferQuantizationMode.NONE, "fp8": base.UserBufferQuantizationMode.FP8}
    if buffers is None:
        base._ub_communicators, base._ub_initialized, base._ub_with_cublasmp = None, False, False
    else:
        base._ub_communicators = {(n, modes[m]): c for (n, m), c in buffers.items()}
        base._ub_initialized = True
        base._ub_with_cublasmp = with_cublasmp
    guards.on_ub_state_changed()


@contextlib.contextmanager
def ub_registry(buffers: Mapping[tuple[str, str], StandInCommunicator] | None, *,
                with_cublasmp: bool = False) -> Iterator[None]:
    """:func:`set_ub_registry` for the duration of the block, then restore TE's previous registry."""
    from transformer_engine.pytorch.module import base

    saved = (base._ub_communicators, base._ub_initialized, base._ub_with_cublasmp)
    set_ub_registry(buffers, with_cublasmp=with_cublasmp)
    try:
        yield
    finally:
        base._ub_communicators, base._ub_initialized, base._ub_with_cublasmp = saved
        guards.on_ub_state_changed()
