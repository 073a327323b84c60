"""CPU dry run of benchmarks/ub_tp2.py's phase 2 (issue 17) before 2-GPU time is spent.

TE 2.20.2's real ``initialize_ub`` (``module/base.py``) runs with stand-in communicator classes in
place of ``tex.CommOverlap`` / ``tex.CommOverlapP2P`` (they record the buffer dtype and the
communicator kind TE chose, as :class:`te_passes.testing.ub.StandInCommunicator` answers), so TE's
own config rules decide what the phase-2 config changes. Then the script's two te.Linear layers
(column ``qkv``, row ``proj``; fake CUDA tensors, ``fake`` TP group of size 2) are compiled with
``te_inductor`` (passes and guards real; ``compile_fx`` stands in, there is no GPU), UB is
re-initialised through ``te_passes.compat.ub.reinit.reinitialize_ub`` and both functions are called again:
the script's own expectation / judging functions must agree with what happened.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from te_passes.testing.capture import capture_skip_reason

pytestmark = pytest.mark.skipif(capture_skip_reason() is not None, reason=str(capture_skip_reason()))

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
TOKENS, HIDDEN = 64, 64


@pytest.fixture(scope="module")
def ub_tp2():
    spec = importlib.util.spec_from_file_location("ub_tp2_under_test", BENCH / "ub_tp2.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def world(fake_tp_group):
    return fake_tp_group


def _stand_in(p2p: bool):
    from te_passes.testing.ub import StandInCommunicator

    def make(shape, buffer_dtype, helper, tp_size, *args, **kw):
        return StandInCommunicator(fp8_ubuf=buffer_dtype == torch.uint8, p2p_overlap=p2p,
                                   atomic_gemm=bool(kw.get("atomic_gemm")), cublasmp=bool(kw.get("use_cublasmp")),
                                   tp_size=tp_size)
    return make


@contextlib.contextmanager
def te_ub_without_gpus(world):
    """TE's ``initialize_ub`` runs for real; only the pybind communicators, the bootstrap helper
    and the bootstrap process group are stand-ins."""
    import torch.distributed as dist
    import transformer_engine.pytorch.module.base as te_base

    tex = te_base.tex
    with contextlib.ExitStack() as st:
        st.enter_context(mock.patch.object(tex, "device_supports_multicast", lambda: True))
        st.enter_context(mock.patch.object(tex, "ubuf_built_with_mpi", lambda: False))
        st.enter_context(mock.patch.object(tex, "CommOverlapHelper", lambda *a: None))
        st.enter_context(mock.patch.object(tex, "get_stream_priority_range", lambda: (0, -1)))
        st.enter_context(mock.patch.object(tex, "CommOverlap", _stand_in(False)))
        st.enter_context(mock.patch.object(tex, "CommOverlapP2P", _stand_in(True)))
        st.enter_context(mock.patch.object(dist, "new_group", lambda *a, **kw: world))
        st.enter_context(mock.patch.object(dist, "is_backend_available", lambda b: True))
        saved = (te_base._ub_communicators, te_base._ub_initialized, te_base._ub_with_cublasmp)
        te_base._ub_communicators = None
        try:
            yield te_base
        finally:
            te_base._ub_communicators, te_base._ub_initialized, te_base._ub_with_cublasmp = saved
            from te_passes.compat.ub import guard as guards

            guards.on_ub_state_changed()


def _init(te_base, cfgs):
    modes = [te_base.UserBufferQuantizationMode.NONE, te_base.UserBufferQuantizationMode.FP8]
    te_base.initialize_ub(shape=[TOKENS, HIDDEN], tp_size=2, quantization_modes=modes, dtype=torch.bfloat16,
                          ub_cfgs=cfgs, bootstrap_backend="nccl")


def _snapshot():
    from te_passes.compat.api import capture_ub

    return capture_ub().to_json()


def test_te_accepts_the_phase2_config_and_it_changes_only_the_row_layers_reduce_scatter_buffer(ub_tp2, world):
    with te_ub_without_gpus(world) as te_base:
        _init(te_base, None)
        before = _snapshot()
        te_base._ub_communicators = None  # as destroy_ub() leaves it (without its compiler reset)
        _init(te_base, [None, ub_tp2.REINIT_CFGS])
        after = _snapshot()
    assert ub_tp2.changed_buffers(before, after) == ["proj_fprop[fp8]"]
    b, a = (ub_tp2._buffers_by_key(s)["proj_fprop[fp8]"] for s in (before, after))
    assert (b["is_p2p_overlap"], b["is_fp8_ubuf"]) == (False, False)  # TE default: pipeline, bf16 (base.py:357/391)
    assert (a["is_p2p_overlap"], a["is_fp8_ubuf"]) == (True, False)   # ring_exchange -> CommOverlapP2P, still bf16
    assert ub_tp2.unsupported_reinit_reason(after, "proj", "Float8CurrentScaling") is None
    # the column layer's buffers are TE's defaults both times
    for name in ("qkv_fprop[fp8]", "qkv_dgrad[fp8]", "qkv_wgrad[fp8]", "proj_dgrad[fp8]"):
        assert ub_tp2._buffers_by_key(before)[name] == ub_tp2._buffers_by_key(after)[name]


def test_the_fp8_buf_config_of_the_first_run_is_refused_with_the_te_reason(ub_tp2, world):
    """The 2026-11-29 run's config: TE makes proj_fprop an FP8 reduce-scatter buffer (a pipeline
    name with fp8_buf, base.py:564-566), which TE 2.20.2 cannot run with current scaling."""
    with te_ub_without_gpus(world) as te_base:
        _init(te_base, [None, {"proj_fprop": {"fp8_buf": True}}])
        after = _snapshot()
    assert ub_tp2._buffers_by_key(after)["proj_fprop[fp8]"]["is_fp8_ubuf"] is True
    reason = ub_tp2.unsupported_reinit_reason(after, "proj", "Float8CurrentScaling")
    assert reason and "differentiable fp8_output=True" in reason and "Unsupported dtype BFloat16" in reason
    assert ub_tp2.unsupported_reinit_reason(after, "proj", "DelayedScaling") is None


def test_judge_flags_a_config_that_touches_the_column_layer_or_wrong_counts(ub_tp2):
    reads = {"column": {"buffers": ["qkv_fprop[fp8]"], "trace_folds": [], "fx_folds": []},
             "row": {"buffers": ["proj_fprop[fp8]"], "trace_folds": [["get_ub_is_fp8", ["proj_fprop", True], False]],
                     "fx_folds": []}}
    buf = {"with_cublasmp": False, "is_atomic_gemm": False, "tp_size": 2, "is_fp8_ubuf": False}
    before = {"buffers": [{"name": "qkv_fprop", "mode": "fp8", **buf, "is_p2p_overlap": True},
                          {"name": "proj_fprop", "mode": "fp8", **buf, "is_p2p_overlap": False}], "fingerprint": "a"}
    both = {"buffers": [{"name": "qkv_fprop", "mode": "fp8", **buf, "is_p2p_overlap": False},
                        {"name": "proj_fprop", "mode": "fp8", **buf, "is_p2p_overlap": True}], "fingerprint": "b"}
    exp = ub_tp2.phase2_expectations(reads, before, both, cudagraphs=False)
    assert exp["row"]["dynamo_compiles"] == 1 and exp["column"]["dynamo_compiles"] == 0
    assert exp["column"]["te_inductor_compiles"] == 0
    fails = ub_tp2.judge_phase2(exp, {"row": {"dynamo_compiles": 1, "te_inductor_compiles": 1},
                                      "column": {"dynamo_compiles": 0, "te_inductor_compiles": 0}})
    assert fails == ["phase 2: the re-initialisation changes UB state the column graph reads too: ['qkv_fprop[fp8]']"]
    exp_cg = ub_tp2.phase2_expectations(reads, before, both, cudagraphs=True)
    assert exp_cg["column"]["te_inductor_compiles"] == 1 and exp_cg["column"]["why"].startswith("re-recorded")
    fails = ub_tp2.judge_phase2(exp_cg, {"row": {"dynamo_compiles": 0, "te_inductor_compiles": 1},
                                         "column": {"dynamo_compiles": 0, "te_inductor_compiles": 1}})
    assert any("row: dynamo_compiles 0 != expected 1" in f for f in fails), fails


def test_count_calls_sees_only_calls_that_happen(ub_tp2):
    from te_passes.compat.ub.reinit import keep_compiled_graphs

    with ub_tp2.count_calls(torch.compiler, "reset") as calls:
        with keep_compiled_graphs():
            torch.compiler.reset()  # what TE's destroy_ub does: suppressed by te_passes
        assert calls == []
    with mock.patch.object(torch._dynamo, "reset", lambda: None), ub_tp2.count_calls(torch.compiler, "reset") as calls:
        torch.compiler.reset()
    assert len(calls) == 1


# ------------------------------------------------------------------------- phase 2, end to end on CPU
class _Layers:
    def __init__(self, ub_tp2, world):
        import transformer_engine.pytorch as te
        from torch._subclasses.fake_tensor import FakeTensorMode

        from te_passes.testing import fake_gpu as FG

        self.stack = contextlib.ExitStack()
        self.stack.enter_context(FG.quiet())
        self.stack.enter_context(FG.fake_gpu("fp8-cs"))
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        recipe = FG.make_recipe("fp8-cs")
        with self.mode, FG.constructing():
            col = te.Linear(HIDDEN, HIDDEN, bias=False, params_dtype=torch.bfloat16, device="cuda",
                            parallel_mode="column", sequence_parallel=True, tp_group=world, tp_size=2,
                            ub_overlap_ag=True, ub_bulk_dgrad=True, ub_bulk_wgrad=True, ub_name="qkv")
            row = te.Linear(HIDDEN, HIDDEN, bias=False, params_dtype=torch.bfloat16, device="cuda",
                            parallel_mode="row", sequence_parallel=True, tp_group=world, tp_size=2,
                            ub_overlap_rs=True, ub_overlap_ag=True, ub_name="proj")
            self.x_col = torch.randn(TOKENS // 2, HIDDEN, dtype=torch.bfloat16, device="cuda", requires_grad=True)
            self.x_row = torch.randn(TOKENS, HIDDEN // 2, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        self.fns = ub_tp2._layer_fns(te, recipe, world, col, row)

    def call(self, compiled):
        from _fake_inductor import _NeverRun

        for fn, x in zip(compiled, (self.x_col, self.x_row)):
            with self.mode, mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: False):
                try:
                    fn(x)
                except _NeverRun:
                    pass


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_phase2_recompiles_exactly_what_the_script_expects(ub_tp2, world, mode):
    """Real te_passes guards on real TE trace: the row frame (it folded get_ub_is_fp8("proj_fprop",
    True) while traced) is re-traced; the column frame is not; under reduce-overhead the column
    graph is re-recorded by the compiled-graph guard. No torch.compiler.reset()."""
    from _fake_inductor import te_inductor_without_gpu

    from te_passes.report import clear_compile_reports, compile_reports
    from te_passes.compat.ub.reinit import reinitialize_ub

    torch._dynamo.reset()
    clear_compile_reports()
    with te_ub_without_gpus(world) as te_base:
        _init(te_base, None)
        layers = _Layers(ub_tp2, world)
        try:
            kw = {} if mode == "default" else {"mode": mode}
            compiled = [torch.compile(f, backend="te_inductor", **kw) for f in layers.fns]
            with te_inductor_without_gpu():
                m0 = {id(m) for m in torch._dynamo.utils.get_compilation_metrics()}
                layers.call(compiled)
                layers.call(compiled)
                assert ub_tp2.dynamo_compiles_by_function(m0) == {"column": 1, "row": 1}
                reps1 = [r.to_json() for r in compile_reports()]
                reads = ub_tp2.graph_ub_reads(reps1)
                assert reads["row"]["trace_folds"] == [["get_ub_is_fp8", ["proj_fprop", True], False]]
                assert reads["column"]["trace_folds"] == []
                assert reads["row"]["buffers"] == ["proj_dgrad[fp8]", "proj_fprop[fp8]"]
                before = _snapshot()
                n1 = len(compile_reports())
                m1 = {id(m) for m in torch._dynamo.utils.get_compilation_metrics()}
                with ub_tp2.count_calls(torch.compiler, "reset") as cr, ub_tp2.count_calls(torch._dynamo, "reset") as dr:
                    modes = [te_base.UserBufferQuantizationMode.NONE, te_base.UserBufferQuantizationMode.FP8]
                    reinitialize_ub(shape=[TOKENS, HIDDEN], tp_size=2, quantization_modes=modes, dtype=torch.bfloat16,
                                    ub_cfgs=[None, ub_tp2.REINIT_CFGS], bootstrap_backend="nccl")
                    after = _snapshot()
                    layers.call(compiled)
                    layers.call(compiled)
                assert (cr, dr) == ([], [])
                reps2 = [r.to_json() for r in compile_reports()[n1:]]
                te_compiles = dict.fromkeys(ub_tp2.FN_NAMES, 0)
                for fn, r in ub_tp2.graph_ub_reads(reps2).items():
                    te_compiles[fn] = len(r["graphs"])
                observed = {fn: {"dynamo_compiles": n, "te_inductor_compiles": te_compiles[fn]}
                            for fn, n in ub_tp2.dynamo_compiles_by_function(m1).items()}
        finally:
            layers.stack.close()
    expect = ub_tp2.phase2_expectations(reads, before, after, cudagraphs=mode == "reduce-overhead")
    assert expect["row"]["reads_changed"] == ["proj_fprop[fp8]"] and expect["column"]["reads_changed"] == []
    assert observed["row"] == {"dynamo_compiles": 1, "te_inductor_compiles": 1}
    assert observed["column"] == {"dynamo_compiles": 0,
                                  "te_inductor_compiles": 0 if mode == "default" else 1}, observed
    assert ub_tp2.judge_phase2(expect, observed) == []
    # what the dump holds after the re-initialisation: the new snapshot and the row graph's fold
    assert reps2 and all(r["te_state"]["ub"]["fingerprint"] == after["fingerprint"] for r in reps2)
    row_rep = [r for r in reps2 if ub_tp2.graph_ub_reads([r]).get("row")]
    assert ub_tp2.graph_ub_reads(row_rep)["row"]["trace_folds"] == [["get_ub_is_fp8", ["proj_fprop", True], False]]
    new = ub_tp2._buffers_by_key(row_rep[0]["te_state"]["ub"])["proj_fprop[fp8]"]
    assert new["is_p2p_overlap"] is True


def test_script_module_imports_without_te_passes():
    import subprocess

    code = ("import sys; sys.path.insert(0, 'benchmarks'); import ub_tp2; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('te_passes', 'transformer_engine')]; "
            "assert not bad, bad; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=BENCH.parent, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
