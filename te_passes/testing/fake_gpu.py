"""A fake GPU for capturing real Transformer Engine graphs on a CPU-only machine: TE believes a
Hopper / Blackwell device is present (:func:`fake_gpu`), with optional Userbuffers stand-ins.

Mirrors the device queries TE 2.20.2 makes (``transformer_engine/pytorch/quantization.py``
support flags, ``utils._get_device_compute_capability``, ``module/base.py`` UB registry) and
torch 2.14's ``torch.cuda`` device-property calls. See docs/internals.md#te_passestestingcapturepy."""

from __future__ import annotations

import contextlib
import threading
import types
import warnings
from typing import Any, Callable, Iterator
from unittest import mock

import torch

from te_passes.compat.untouched import state as untouched_state
from te_passes.testing.inductor_state import clear_system_info
from te_passes.testing.ub import StandInCommunicator

#: Precisions a capture (and ``te-passes dump --precision``) takes: ``"bf16"`` (no quantization, no
#: ``te.autocast``), ``"fp8-cs"`` (``Float8CurrentScaling()``) and ``"mxfp8"`` (``MXFP8BlockScaling()``).
PRECISIONS: tuple[str, ...] = ("bf16", "fp8-cs", "mxfp8")

#: Device capability each precision is captured under (Hopper for bf16/FP8, Blackwell for MXFP8).
DEVICE_CAPABILITY: dict[str, tuple[int, int]] = {"bf16": (9, 0), "fp8-cs": (9, 0), "mxfp8": (10, 0)}

#: TE's cached support flags (``transformer_engine/pytorch/quantization.py``) -> the function that computes each.
_TE_SUPPORT_FLAGS = {"_FP8_SUPPORT": "_compute_fp8_support", "_MXFP8_SUPPORT": "_compute_mxfp8_support",
                     "_NVFP4_SUPPORT": "_compute_nvfp4_support",
                     "_FP8_BLOCK_SCALING_SUPPORT": "_compute_fp8_block_scaling_support"}

#: ``is_fp8_ubuf()`` of TE 2.20.2's default Userbuffers config in FP8 mode (``initialize_ub(...,
#: quantization_modes=[NONE, FP8])``): the reduce-scatter ``*_fprop`` and bulk ``*_wgrad`` buffers
#: of the ag layers are not FP8; every other buffer is. Names not listed answer ``True``.
DEFAULT_UB_FP8: dict[str, bool] = {
    "qkv_fprop": True, "qkv_dgrad": True, "qkv_wgrad": False,
    "proj_fprop": False, "proj_dgrad": True, "proj_wgrad": True,
    "fc1_fprop": True, "fc1_dgrad": True, "fc1_wgrad": False,
    "fc2_fprop": False, "fc2_dgrad": True, "fc2_wgrad": True,
}

#: Serialises captures (TE's module globals and ``torch.cuda`` are patched while one runs);
#: re-entrant, as the cached captures take it around a capture.
capture_lock = threading.RLock()


class CaptureError(RuntimeError):
    """Capturing failed: TE fell back to eager (graph break, message has TE's reason), a
    precision/model is unknown, or tracing raised (chained)."""


class _FakeUbTable(dict):
    """``base._ub_communicators`` stand-in: every ``(name, mode)`` key resolves to a
    :class:`~te_passes.testing.ub.StandInCommunicator` whose ``is_fp8_ubuf()`` answers
    ``ub_fp8`` (see :func:`~te_passes.testing.dynamo_capture.capture_dynamo`) in FP8 mode."""

    def __init__(self, ub_fp8: Any) -> None:
        super().__init__()
        self.ub_fp8 = ub_fp8

    def __contains__(self, key: object) -> bool:
        return isinstance(key, tuple) and len(key) == 2

    def __missing__(self, key):
        name, mode = key
        fp8 = DEFAULT_UB_FP8.get(name, True) if self.ub_fp8 is None else self.ub_fp8
        if isinstance(fp8, dict):
            fp8 = fp8.get(name, DEFAULT_UB_FP8.get(name, True))
        self[key] = StandInCommunicator(fp8_ubuf=getattr(mode, "name", str(mode)) == "FP8" and bool(fp8))
        return self[key]


def import_te():
    """``transformer_engine.pytorch``, imported (torch first, as TE requires).

    Raises:
        CaptureError: TE does not import (ImportError or TE's own load errors), chained.
    """
    try:
        import transformer_engine  # noqa: F401  (torch is imported above, as TE requires)
        import transformer_engine.pytorch as te
    except Exception as e:  # noqa: BLE001 - ImportError or TE's own load errors
        raise CaptureError(f"transformer_engine is not importable: {type(e).__name__}: {e}") from e
    return te


@contextlib.contextmanager
def fake_gpu(precision: str = "fp8-cs", *, fake_ub: bool = False, ub_fp8: Any = None) -> Iterator[None]:
    """Make TE believe a GPU of ``DEVICE_CAPABILITY[precision]`` is present (no CUDA calls)."""
    if precision not in DEVICE_CAPABILITY:
        raise CaptureError(f"unknown precision {precision!r}; expected one of {PRECISIONS}")
    import_te()
    import transformer_engine.pytorch.module.base as te_base
    import transformer_engine.pytorch.quantization as te_quant
    import transformer_engine.pytorch.utils as te_utils

    cap = DEVICE_CAPABILITY[precision]
    # stands in for torch.cuda.get_device_properties (_CudaDeviceProperties)
    props = types.SimpleNamespace(major=cap[0], minor=cap[1], name=f"te_passes fake sm_{cap[0]}{cap[1]}",
                                  total_memory=141 * 2**30, multi_processor_count=132, gcnArchName="",
                                  L2_cache_size=50 * 2**20, warp_size=32)
    with contextlib.ExitStack() as stack:
        stack.callback(clear_system_info)  # runs last: after the patches are undone
        stack.enter_context(mock.patch.object(te_utils, "_get_device_compute_capability",
                                              lambda device=None: cap))
        stack.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: 0))
        stack.enter_context(mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: cap))
        stack.enter_context(mock.patch.object(torch.cuda, "get_device_properties", lambda device=None: props))
        for flag, compute in _TE_SUPPORT_FLAGS.items():
            if hasattr(te_quant, flag):  # TE's own answer for the faked capability (Hopper: no MXFP8 / NVFP4)
                stack.enter_context(mock.patch.object(te_quant, flag, _support(getattr(te_quant, compute, None))))
        if fake_ub:
            stack.enter_context(mock.patch.object(te_base, "_ub_communicators", _FakeUbTable(ub_fp8)))
            stack.enter_context(mock.patch.object(te_base, "_ub_initialized", True))
        # TE's attention backend selection asks cuDNN (the driver): the fake GPU's cuDNN takes every
        # configuration with its F16_arbitrary_seqlen sub-backend (TE's choice for bf16 on sm80+)
        import transformer_engine.pytorch.attention.dot_product_attention.utils as dpa_utils

        if hasattr(dpa_utils, "_get_fused_attn_backend"):
            stack.enter_context(mock.patch.object(dpa_utils, "_get_fused_attn_backend", _fake_fused_attn_backend))
        # the untouched-model polyfills build hidden te.Linear modules during the first trace
        stack.enter_context(mock.patch.object(untouched_state, "BUILD_CONTEXTS",
                                              [*untouched_state.BUILD_CONTEXTS, constructing]))
        clear_system_info()
        yield


def _support(compute: Callable[[], tuple[bool, str]] | None) -> tuple[bool, str]:
    """TE's ``compute()`` (a ``_compute_*_support`` of :data:`_TE_SUPPORT_FLAGS`) under the faked capability: so
    the fake Hopper picks TE's default recipe as a real one does (``get_default_fp8_recipe``: DelayedScaling, not
    MXFP8) and refuses MXFP8 / NVFP4 with TE's message. ``(True, "")`` when TE has no such function or it needs a
    GPU for its answer (the CUDA / cuBLASLt version checks below sm_89)."""
    try:
        return compute() if compute is not None else (True, "")
    except Exception:  # noqa: BLE001 - a check that asks the driver
        return True, ""


def _fake_fused_attn_backend(**_kwargs: Any) -> tuple[int, str]:
    """``dpa_utils._get_fused_attn_backend`` on the fake GPU: ``F16_arbitrary_seqlen``, no rejection."""
    from transformer_engine.pytorch.cpp_extensions.fused_attn import FusedAttnBackend

    return int(FusedAttnBackend["F16_arbitrary_seqlen"]), ""


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence the warnings every TE trace emits on torch 2.14 (Dynamo tracing through TE's
    ``functools.lru_cache``-wrapped ``_nvtx_enabled``; TE's ComplexHalf ``None`` sentinel)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Dynamo detected a call to a `functools.lru_cache`")
        warnings.filterwarnings("ignore", message=r"ComplexHalf support is experimental")
        yield


@contextlib.contextmanager
def constructing() -> Iterator[None]:
    """``torch.cuda.is_available()`` answers ``True`` inside (TE's modules check it when built on ``cuda``)."""
    with mock.patch.object(torch.cuda, "is_available", lambda: True):
        yield


def make_recipe(precision: str):
    """The TE recipe of a precision: ``None`` (bf16), ``Float8CurrentScaling()`` (fp8-cs) or
    ``MXFP8BlockScaling()`` (mxfp8), from ``transformer_engine.common.recipe`` (TE 2.20.2).

    Raises:
        CaptureError: unknown precision.
    """
    if precision == "bf16":
        return None
    from transformer_engine.common import recipe as te_recipe

    if precision == "fp8-cs":
        return te_recipe.Float8CurrentScaling()
    if precision == "mxfp8":
        return te_recipe.MXFP8BlockScaling()
    raise CaptureError(f"unknown precision {precision!r}; expected one of {PRECISIONS}")
