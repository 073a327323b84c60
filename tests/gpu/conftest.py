"""GPU suite set-up: skip cleanly without a GPU / TE compile path, fresh compile state per test.

Every test under ``tests/gpu/`` must carry ``@pytest.mark.gpu`` (checked at collection) and is
skipped, not failed, when :func:`te_passes.testing.gpu.gpu_skip_reason` gives a reason (no CUDA
device, TE does not import, or TE's torch.compile custom-op path is off). On a CPU machine the
check stops at ``torch.cuda.is_available()`` and never imports TE, so collection stays fast.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from te_passes.testing import gpu as gpu_harness

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    unmarked = [it.nodeid for it in items
                if _HERE in Path(str(it.path)).resolve().parents and it.get_closest_marker("gpu") is None]
    if unmarked:
        raise pytest.UsageError(f"tests under tests/gpu/ must be marked @pytest.mark.gpu: {unmarked}")
    # The end-to-end suite (issue 7) runs first, so a device call cut short by its time limit
    # still has its results; the order within each group is unchanged (stable sort).
    first = _HERE / "test_te_inductor_gpu.py"
    items.sort(key=lambda it: 0 if Path(str(it.path)).resolve() == first else 1)


@functools.lru_cache(maxsize=None)
def _skip_reason() -> str | None:
    return gpu_harness.gpu_skip_reason()


@pytest.fixture(autouse=True)
def _require_te_on_gpu():
    """Skip when TE cannot be compiled on a GPU here; otherwise give each test a fresh Dynamo /
    cudagraph-tree state and an empty te_passes compile-report list, and leave TE's global fp8 state
    as a fresh process has it."""
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    from te_passes.report import clear_compile_reports

    gpu_harness.ensure_te_inductor_backend()
    clear_compile_reports()
    with gpu_harness.fresh_compile_state():
        yield
    # GPU tests run DelayedScaling for real and leave its amax / scale buffers in TE's global
    # FP8GlobalStateManager, which tests/conftest.py's te_delayed_scaling_buffers_left_empty (torn down after
    # this fixture) would report: reset them here, as the reset_te_fp8_state fixture does
    from transformer_engine.pytorch import quantization as Q

    from te_passes.compat.delayed_scaling import state as delayed_state

    Q.FP8GlobalStateManager.reset()
    delayed_state.TRACE_COUNTS.clear()
