"""Issue 38: an fp8 ``te.autocast`` inside the compiled function recompiled every TE module TE's own forward traces
on step 2 (``proj.fp8 == False``, TE 2.20.2 ``module/base.py`` ``prepare_forward`` reads ``self.fp8`` before
``init_fp8_metadata`` writes it). The patch-table row ``untouched.prepare_forward``
(te_passes/compat/untouched/forward_state.py) runs TE's lazy init with the traced state first. On CPU with a fake
GPU through a backend carrying te_inductor's mark (tests/runtime/test_untouched_recompiles.py ``_run``); the GPU
check: tests/gpu/test_untouched_recompiles_gpu.py.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

te = pytest.importorskip("transformer_engine.pytorch")
# the DelayedScaling cases register state in TE's global buffers: later tests' eager te.autocast exits would
# run TE's update kernel (a CUDA call the fake GPU cannot make)
pytestmark = pytest.mark.usefixtures("reset_te_fp8_state")

from te_passes.compat import table  # noqa: E402
from te_passes.compat.untouched import forward_state  # noqa: E402
from te_passes.compat.untouched.state import PREPARED_KEY  # noqa: E402
from tests.runtime.test_untouched_recompiles import _llama, _no_recompile, _run  # noqa: E402


def _linear():
    return te.Linear(64, 64, params_dtype=torch.bfloat16, device="cuda")


def _inside(model, recipe, x):
    with te.autocast(enabled=True, recipe=recipe):
        return model(x)


def _kept(build, holder):
    def make():
        holder["m"] = build()
        return holder["m"]
    return make


@pytest.mark.parametrize("precision", ["fp8-cs", "fp8-ds"])
@pytest.mark.parametrize("build,shape", [(_linear, (32, 64)), (_llama, (16, 2, 64))], ids=["linear", "llama"])
def test_te_autocast_inside_the_compiled_function_one_graph_no_recompile(build, shape, precision):
    """1 graph, 0 recompiles, 0 breaks over 4 steps (was 2 graphs, 1 recompile: ``.fp8 == False``; with
    DelayedScaling also ``len(...global_amax_buffer) != 0`` until the compile-start registration ran in the
    model's fake mode)."""
    holder = {}
    r = _run(_kept(build, holder), _inside, lambda recipe: contextlib.nullcontext(), precision=precision, shape=shape)
    _no_recompile(r)
    m = holder["m"]
    lin = m if isinstance(m, te.Linear) else m.self_attention.proj
    assert lin.fp8 is True and lin.fp8_initialized is True, (lin.fp8, lin.fp8_initialized)
    assert lin.__dict__[PREPARED_KEY][1] is True, lin.__dict__[PREPARED_KEY]


def test_delayed_scaling_inside_registers_every_module_at_compile_start_in_the_model_s_fake_mode():
    """DelayedScaling, te.autocast inside, nothing prepared: the compile-start callback runs with Dynamo's
    ``_disable_current_modes()`` (the caller's FakeTensorMode popped); ``prepare_delayed_scaling`` makes TE's
    state in the model's fake mode, so TE's global buffers hold each TE module's own state before the first
    trace reads them (was: TE's ``torch.ones(device="cuda")`` raised "Found no NVIDIA driver", the callback
    swallowed it, the trace registered the state itself and guarded on the empty buffer: a step-2 recompile).
    The fp8 state it made is recorded, so proj is not prepared again in the trace (no restart of the analysis)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    holder = {}
    r = _run(_kept(_llama, holder), _inside, lambda recipe: contextlib.nullcontext(), precision="fp8-ds")
    _no_recompile(r)
    # the callback records the fp8 state it made (PREPARED_KEY): TE's traced prepare_forward finds it, no restart
    assert not [x for x in r["restarts"] if x.startswith("te_passes:")], r["restarts"]
    m = holder["m"]
    mods = [x for x in m.modules() if isinstance(getattr(x, "fp8_meta", None), dict) and "scaling_fwd" in x.fp8_meta]
    assert len(mods) == 4, [type(x).__name__ for x in mods]  # layernorm_qkv, proj, layernorm_mlp, core_attention
    histories = [h for hs in FP8GlobalStateManager.quantization_state.global_amax_history_buffer.values() for h in hs]
    mine = [x.fp8_meta[k].amax_history for x in mods for k in ("scaling_fwd", "scaling_bwd") if k in x.fp8_meta]
    assert sorted(map(id, histories)) == sorted(map(id, mine))
    mode = m.self_attention.proj.weight.fake_mode
    assert all(isinstance(h, FakeTensor) and h.fake_mode is mode for h in histories)


def test_a_module_whose_state_the_trace_read_is_prepared_then_traced_anew():
    """MHA sets proj's quantizer roles before proj's forward (the trace reads proj's ``__dict__``): proj is prepared
    with the traced state and the analysis restarted once; a bare te.Linear is prepared without a restart."""
    holder = {}
    r = _run(_kept(_llama, holder), _inside, lambda recipe: contextlib.nullcontext())
    _no_recompile(r)
    ours = [x for x in r["restarts"] if x.startswith("te_passes:")]
    assert len(ours) == 1 and "Linear" in ours[0], r["restarts"]
    proj = holder["m"].self_attention.proj
    assert {k[1] for k in proj.__dict__[forward_state.RESTARTED_KEY]} == {True}

    r = _run(_kept(_linear, holder), _inside, lambda recipe: contextlib.nullcontext(), shape=(32, 64))
    _no_recompile(r)
    assert not [x for x in r["restarts"] if x.startswith("te_passes:")], r["restarts"]
    assert forward_state.RESTARTED_KEY not in holder["m"].__dict__


def test_a_module_run_under_two_states_in_one_frame_restarts_a_bounded_number_of_times():
    """One te.Linear in fp8 and again under te.autocast(enabled=False) in one frame: at most one restart per state
    (no 'Excessive RestartAnalysis'), no break; the second state is left to TE's traced init."""
    def body(model, recipe, x):
        with te.autocast(enabled=True, recipe=recipe):
            h = model(x)
        with te.autocast(enabled=False):
            return model(h)
    holder = {}
    r = _run(_kept(_linear, holder), body, lambda recipe: contextlib.nullcontext(), shape=(32, 64))
    assert r["breaks"] == {} and r["graphs"] <= 2, r
    assert len([x for x in r["restarts"] if x.startswith("te_passes:")]) <= 2, r["restarts"]
    assert len(holder["m"].__dict__.get(forward_state.RESTARTED_KEY, ())) <= 2


def test_the_row_rebinds_prepare_forward_and_eager_calls_run_te_s_function_only():
    """Eagerly (not compiling) the rebound method calls TE's function with the call's arguments and prepares
    nothing (the comptime body is never reached)."""
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    assert table.refusal("untouched.prepare_forward") is None
    assert TransformerEngineBaseModule.__dict__["prepare_forward"] is forward_state.prepare_forward
    te_fn = forward_state.TE_FUNCTION[0]
    assert te_fn.__qualname__ == "TransformerEngineBaseModule.prepare_forward" and te_fn.__module__ == \
        forward_state.TE_BASE_MODULE
    calls = []
    sentinel = object()
    with mock.patch.object(forward_state, "TE_FUNCTION", [lambda *a: calls.append(a) or sentinel]), \
            mock.patch.object(forward_state, "prepare_all", side_effect=AssertionError("prepared eagerly")):
        me, inp = object(), object()
        assert forward_state.prepare_forward(me, inp, 2, True, True) is sentinel
        assert forward_state.prepare_forward(me, inp) is sentinel
    assert calls == [(me, inp, 2, True, True), (me, inp, 1, False, False)]


def test_the_row_is_reverted_and_installed_again():
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    table.revert(["untouched.prepare_forward"])
    try:
        assert TransformerEngineBaseModule.__dict__["prepare_forward"] is forward_state.TE_FUNCTION[0]
    finally:
        from te_passes.compat.install import install

        install()
    assert TransformerEngineBaseModule.__dict__["prepare_forward"] is forward_state.prepare_forward


def test_a_failed_compile_start_preparation_is_logged(monkeypatch, caplog):
    """The compile-start callback never raises, but says why it did not prepare (the session-20 DelayedScaling
    recompile hid behind a silent ``except``)."""
    import logging

    from te_passes.compat.untouched import state

    def boom():
        raise RuntimeError("no frame for you")

    monkeypatch.setattr(state, "_compile_frame", boom)
    logger = logging.getLogger("te_passes")
    monkeypatch.setattr(logger, "propagate", True)
    with caplog.at_level(logging.INFO, logger="te_passes"):
        state.on_compile_start()
    assert any("compile-start preparation of TE modules failed (RuntimeError: no frame for you)" in r.getMessage()
               for r in caplog.records), caplog.records
