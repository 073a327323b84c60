"""Shared pytest fixtures.

Real Transformer Engine graphs (no GPU needed), captured once per test session and handed out
as copies (tests may rewrite them): see ``te_passes/testing/capture.py`` and
``docs/testing-real-graphs.md``.

* ``te_dynamo_graph(precision="fp8-cs", layers=1, **kw)`` -> ``CapturedGraph`` (the Dynamo graph
  and its example inputs; ``layers > 1`` is a stack of te.Linear with GELU between);
* ``te_aot_graphs(precision="fp8-cs", layers=1, **kw)`` -> ``CapturedAOT`` (``.joint``,
  ``.forward``, ``.backward`` ATen graphs as Inductor's hooks see them).

Both skip the test when TE cannot be imported or its torch.compile path is off.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch  # noqa: F401  (TE must be imported after torch)

#: Shared test helpers (``from _qgraphs import ...``, ``from _cli import run_cli``): tests/_helpers/
#: on sys.path for every test folder (tests/<folder>/ mirrors te_passes/<folder>/).
HELPERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_helpers")
if HELPERS not in sys.path:
    sys.path.insert(0, HELPERS)


def _te_capture_module():
    from te_passes.testing import capture

    reason = capture.capture_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    return capture


@pytest.fixture(scope="session")
def te_dynamo_graph():
    """Factory: ``te_dynamo_graph(precision, layers, **capture_dynamo_kwargs)`` -> a fresh copy
    of a session-cached ``CapturedGraph``."""
    capture = _te_capture_module()
    return capture.cached_dynamo


@pytest.fixture(scope="session")
def te_aot_graphs():
    """Factory: ``te_aot_graphs(precision, layers, **capture_aot_kwargs)`` -> a fresh copy of a
    session-cached ``CapturedAOT``."""
    capture = _te_capture_module()
    return capture.cached_aot


@pytest.fixture(scope="module")
def fake_tp_group():
    """A tensor-parallel group of size 2 without GPUs: the default ``torch.distributed`` process
    group on the ``fake`` backend (``FakeStore``, rank 0 of 2), for one test module; destroyed
    after it. Skips when a default group already exists in the process."""
    yield from _fake_default_group(2)


@pytest.fixture(scope="module")
def fake_world_of_one():
    """The default process group on torch's ``fake`` backend, rank 0 of 1 (FSDP2 on one rank without a
    GPU), for one test module; destroyed after it. Skips when a default group already exists."""
    yield from _fake_default_group(1)


def _fake_default_group(world_size: int):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture
def reset_te_fp8_state():
    """Leave TE's global fp8 state as a fresh process has it: the delayed-scaling buffers a test
    registers would make later tests' ``te.autocast`` exits run the update."""
    yield
    from transformer_engine.pytorch import quantization as Q

    from te_passes.compat.delayed_scaling import state as delayed_state

    Q.FP8GlobalStateManager.reset()
    delayed_state.TRACE_COUNTS.clear()


#: TE's process-global DelayedScaling buffers (``FP8GlobalState``, TE 2.20.2 quantization.py).
DELAYED_SCALING_BUFFERS = ("global_amax_buffer", "global_amax_history_buffer", "global_scale_buffer")


@pytest.fixture(autouse=True)
def te_delayed_scaling_buffers_left_empty(request):
    """Fail (at teardown) a test that leaves DelayedScaling amax / scale tensors registered in TE's
    global ``FP8GlobalStateManager``, and reset TE's fp8 state so later tests start clean.

    Why: every later ``te.autocast`` exit runs TE's ``reduce_and_update_fp8_tensors`` on them — in
    eager a CUDA kernel (``CUDA driver version is insufficient`` on this machine), under Dynamo two
    more graph inputs (the [history, n] / [n] buffers). Issue 40: one capture through
    ``tests/runtime/test_delayed_linear.py::_capture`` without ``reset_te_fp8_state`` made 13 later
    tests fail in suite order. A test that registers them on purpose requests ``reset_te_fp8_state``
    (torn down before this check: autouse fixtures are set up first). Looks only at a TE already
    imported (``sys.modules``); never imports it."""
    yield
    Q = sys.modules.get("transformer_engine.pytorch.quantization")
    if Q is None:
        return
    qstate = Q.FP8GlobalStateManager.quantization_state
    left = sorted({k for name in DELAYED_SCALING_BUFFERS for k, v in getattr(qstate, name).items() if v})
    if left:
        Q.FP8GlobalStateManager.reset()
        pytest.fail(f"{request.node.nodeid} left DelayedScaling tensors registered in TE's FP8GlobalStateManager "
                    f"(keys {left}): later te.autocast exits would update them; request the reset_te_fp8_state "
                    "fixture (tests/conftest.py)", pytrace=False)


@pytest.fixture(scope="module")
def toy():
    """The toy TE op family of ``_helpers/_toy_te_op.py`` (registered through TE's own
    ``register_custom_op``; TE's real impls need a GPU). Skips without TE."""
    pytest.importorskip("transformer_engine.pytorch")
    import _toy_te_op

    return _toy_te_op


@pytest.fixture(scope="module")
def base_dump(tmp_path_factory):
    """A real dump of ``--example linear-bf16`` (TE graphs captured on fake CUDA tensors), one per
    test module (tests/cli/, tests/debug/); copy it (``dump_copy``) before changing it."""
    from _cli import dump_example

    return dump_example(tmp_path_factory, "linear-bf16")


@pytest.fixture
def dump_copy(base_dump, tmp_path):
    """A copy of ``base_dump`` this test may change."""
    shutil.copytree(base_dump, tmp_path / "D", symlinks=True)
    return tmp_path / "D"
