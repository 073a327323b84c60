"""Issue 24: DelayedScaling under te_inductor — the in-graph scale update and its gate.

CPU only, real tensors: the delayed-scaling state is TE's own ``DelayedScalingRecipeState``
(allocated on ``cpu``), registered in TE's global buffers by TE's
``add_fp8_tensors_to_global_buffer``; the step enters and leaves TE's real ``te.autocast``. What
a TE quantize kernel does to the state (write the tensor's amax into row 0 of the history) is
done here by an ATen ``copy_`` (no TE kernel runs on CPU). On CPU tensors the update op runs
TE's unfused Python update (``split_and_copy`` + ``_amax_and_scale_update``); the eager
reference is TE's own ``reduce_and_update_fp8_tensors`` with ``NVTE_UNFUSED_FP8_UPDATE=1``
(TE's switch to that same path). TE's fused CUDA kernel is checked on the GPU only
(tests/gpu/test_delayed_scaling_gpu.py).
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from te_passes.testing.capture import capture_skip_reason

pytestmark = [pytest.mark.skipif(capture_skip_reason() is not None, reason=str(capture_skip_reason())),
              pytest.mark.usefixtures("reset_te_fp8_state")]

RECIPES = [  # (fp8_format, amax_history_len, amax_compute_algo)
    ("HYBRID", 1, "max"), ("HYBRID", 16, "max"), ("E4M3", 16, "most_recent"), ("E4M3", 1, "most_recent"),
]


@pytest.fixture(scope="module")
def te_mods():
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as R
    from transformer_engine.pytorch import quantization as Q

    from te_passes.compat import table
    from te_passes.compat.install import install

    install()
    for name in ("delayed_scaling.reduce_and_update", "delayed_scaling.check_recipe_support"):
        assert table.refusal(name) is None, f"the DelayedScaling row {name} refused to install: {table.refusal(name)}"
    return te, R, Q


@contextlib.contextmanager
def _fp8_supported(Q, monkeypatch):
    """TE's fp8 support flag answers True (no GPU here), as ``testing.fake_gpu`` presets it."""
    monkeypatch.setattr(Q, "_FP8_SUPPORT", (True, ""))
    yield


def _recipe(R, fmt, length, algo):
    return R.DelayedScaling(fp8_format=getattr(R.Format, fmt), amax_history_len=length,
                            amax_compute_algo=algo)


class _State:
    """``n`` modules' forward / backward delayed-scaling state (TE's recipe states, on CPU), in
    TE's global buffers."""

    def __init__(self, Q, recipe, n: int = 2, seed: int = 0) -> None:
        Q.FP8GlobalStateManager.reset()
        gen = torch.Generator().manual_seed(seed)
        self.metas = []
        for _ in range(n):
            meta = {"recipe": recipe, "fp8_group": None}
            for key, mode, num in (("scaling_fwd", "forward", 3), ("scaling_bwd", "backward", 2)):
                st = Q.DelayedScalingRecipeState(recipe, mode=mode, num_quantizers=num, device=torch.device("cpu"))
                st.amax_history.copy_(torch.rand(st.amax_history.shape, generator=gen) * 8)
                st.scale.copy_(torch.rand(st.scale.shape, generator=gen) + 0.5)
                meta[key] = st
            Q.FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(meta)
            self.metas.append(meta)

    def tensors(self):
        return [t for m in self.metas for k in ("scaling_fwd", "scaling_bwd")
                for t in (m[k].scale, m[k].amax_history)]

    def snapshot(self):
        return [t.clone() for t in self.tensors()]


def _amaxes(steps: int, n: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(n, 3, generator=gen) * (4 + 4 * s) for s in range(steps)]


def _make_step(te, recipe, state):
    fwd_rows = [m["scaling_fwd"].amax_history[0] for m in state.metas]

    def step(x, amax):
        with te.autocast(enabled=True, recipe=recipe):
            for i, row in enumerate(fwd_rows):  # what the forward's quantize kernels write
                row.copy_(amax[i])
            y = x * 2
        return y

    return step


def _eager_reference(te, Q, R, cfg, monkeypatch, steps):
    recipe = _recipe(R, *cfg)
    st = _State(Q, recipe)
    step = _make_step(te, recipe, st)
    monkeypatch.setenv("NVTE_UNFUSED_FP8_UPDATE", "1")
    x = torch.ones(4)
    out = []
    for a in _amaxes(steps, len(st.metas)):
        step(x, a)
        out.append(st.snapshot())
    monkeypatch.delenv("NVTE_UNFUSED_FP8_UPDATE")
    return out


def _recording_backend(graphs):
    from te_passes.backend import te_inductor

    def record(graph):  # Inductor hands the post-grad torch.fx.Graph; later passes rewrite it
        graphs.append([(n.op, n.target, n.args) for n in graph.nodes])

    return functools.partial(te_inductor, options={"post_grad_custom_pre_pass": record})


@pytest.mark.parametrize("cfg", RECIPES, ids=["-".join(map(str, c)) for c in RECIPES])
def test_update_in_one_graph_matches_te_eager(te_mods, cfg, monkeypatch):
    """te.autocast(DelayedScaling) inside the compiled function (recipe primed): 1 compile of the
    frame, 0 breaks, 0 recompiles over 5 steps; the update op is in the post-grad graph, its writes functionalized into
    ``copy_`` on the state placeholders; every scale and history equals TE eager's, bit for bit."""
    te, R, Q = te_mods
    from te_passes.compat.untouched.rewrite.te_state import prime_recipe
    from te_passes.testing.compile_watch import CompileWatch, fresh_compile_state

    steps = 5
    with _fp8_supported(Q, monkeypatch):
        ref = _eager_reference(te, Q, R, cfg, monkeypatch, steps)
        recipe = _recipe(R, *cfg)
        st = _State(Q, recipe)
        prime_recipe(recipe)  # TE's autocast registry as after a first step (docs/usage.md)
        graphs = []
        seen = {id(m) for m in torch._dynamo.utils.get_compilation_metrics()}

        def metrics():
            return [m for m in torch._dynamo.utils.get_compilation_metrics() if id(m) not in seen]

        with fresh_compile_state(), CompileWatch() as watch:
            step = torch.compile(_make_step(te, recipe, st), backend=_recording_backend(graphs), fullgraph=True)
            x = torch.ones(4)
            got = []
            for a in _amaxes(steps, len(st.metas)):
                assert torch.equal(step(x, a), x * 2)
                got.append(st.snapshot())
            stats = watch.snapshot()
    # our frame: compiled once, never again; no graph break anywhere (the other compiles are TE's
    # own torch.compile'd helpers of its unfused update, run by the op on CPU tensors)
    frames = [m for m in metrics() if m.co_name == step.__wrapped__.__name__]
    assert len(frames) == 1 and not frames[0].recompile_reason, [m.recompile_reason for m in frames]
    assert stats.graph_breaks == 0, stats
    for s, (r, g) in enumerate(zip(ref, got)):
        for i, (a, b) in enumerate(zip(r, g)):
            assert torch.equal(a, b), (s, i, a, b)
    # the graph: one update op per buffer key of the forward direction, state written back
    (graph,) = graphs
    update_op = torch.ops.te_passes.delayed_scaling_update.default
    updates = [args for op, target, args in graph if target is update_op or (args and args[0] is update_op)]
    assert len(updates) == 1, graph
    copies = [args for op, target, args in graph if target is torch.ops.aten.copy_.default
              and args[0].op == "placeholder"]
    # forward direction: 2 modules x (scale, amax_history) mutated by the op (+ the amax rows the
    # step writes, which alias the histories)
    assert len(copies) >= 4, graph


def test_state_changes_every_step(te_mods, monkeypatch):
    """The check above cannot pass with an update that never runs: the histories roll and the
    scales move from step to step (HYBRID, history 16; "most_recent" so that every step's new
    amax sets the scale)."""
    te, R, Q = te_mods
    with _fp8_supported(Q, monkeypatch):
        ref = _eager_reference(te, Q, R, ("HYBRID", 16, "most_recent"), monkeypatch, 3)
    for s in (0, 1):
        assert not torch.equal(ref[s][0], ref[s + 1][0])  # module 0's forward scale
        assert not torch.equal(ref[s][1], ref[s + 1][1])  # module 0's forward history


def test_backward_state_untouched_by_forward_update(te_mods, monkeypatch):
    """The post-forward update writes only the forward state (buffer keys ``forward_*``)."""
    te, R, Q = te_mods
    with _fp8_supported(Q, monkeypatch):
        recipe = _recipe(R, "HYBRID", 16, "max")
        st = _State(Q, recipe)
        before = [(m["scaling_bwd"].scale.clone(), m["scaling_bwd"].amax_history.clone()) for m in st.metas]
        from te_passes.testing.compile_watch import fresh_compile_state

        with fresh_compile_state():
            step = torch.compile(_make_step(te, recipe, st), backend="te_inductor", fullgraph=True)
            step(torch.ones(4), _amaxes(1, len(st.metas))[0])
    for (s, h), m in zip(before, st.metas):
        assert torch.equal(s, m["scaling_bwd"].scale) and torch.equal(h, m["scaling_bwd"].amax_history)


def test_other_backends_unchanged(te_mods, monkeypatch):
    """Under ``backend="eager"`` (any backend but te_inductor) TE's own refusal stands: the
    polyfill runs TE's function, which raises under torch.compile."""
    te, R, Q = te_mods
    with _fp8_supported(Q, monkeypatch):
        recipe = _recipe(R, "HYBRID", 16, "max")
        st = _State(Q, recipe)
        from te_passes.testing.compile_watch import fresh_compile_state

        with fresh_compile_state():
            step = torch.compile(_make_step(te, recipe, st), backend="eager", fullgraph=True)
            with pytest.raises(Exception, match="DelayedScaling is not supported under torch.compile"):
                step(torch.ones(4), _amaxes(1, len(st.metas))[0])


def test_callable_algo_refused_with_reason(te_mods, monkeypatch):
    """A callable ``amax_compute_algo`` is refused under te_inductor, naming it."""
    te, R, Q = te_mods
    with _fp8_supported(Q, monkeypatch):
        recipe = R.DelayedScaling(amax_history_len=4, amax_compute_algo=lambda h: h.max(dim=0).values)
        st = _State(Q, recipe)
        from te_passes.testing.compile_watch import fresh_compile_state

        with fresh_compile_state():
            step = torch.compile(_make_step(te, recipe, st), backend="te_inductor", fullgraph=True)
            with pytest.raises(Exception, match="callable amax_compute_algo"):
                step(torch.ones(4), _amaxes(1, len(st.metas))[0])


def test_update_op_schema_declares_its_writes(te_mods):
    """The op's schema marks the histories and scales written (``Tensor(a!)[]``), nothing else."""
    op = torch.ops.te_passes.delayed_scaling_update.default
    written = [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert written == ["amax_histories", "scales"]
    assert len(op._schema.returns) == 0


def test_update_op_eager_equals_te_unfused(te_mods, monkeypatch):
    """Called directly on CPU tensors the op equals TE's own unfused update of the same key
    (``reduce_and_update_fp8_tensors(forward=False)``, the backward direction)."""
    te, R, Q = te_mods
    recipe = _recipe(R, "E4M3", 16, "max")
    a, b = _State(Q, recipe, seed=3), None
    Q.FP8GlobalStateManager.quantization_state.autocast_arguments[
        Q.FP8GlobalStateManager.get_unique_autocast_key(recipe, None)] = (recipe, None)
    monkeypatch.setenv("NVTE_UNFUSED_FP8_UPDATE", "1")
    Q.FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)
    ref = a.snapshot()
    b = _State(Q, recipe, seed=3)
    hist = [m["scaling_bwd"].amax_history for m in b.metas]
    scales = [m["scaling_bwd"].scale for m in b.metas]
    torch.ops.te_passes.delayed_scaling_update(
        torch.cat([h[0] for h in hist]), hist, scales, "max", int(Q.get_fp8_te_dtype(recipe, False)),
        float(Q.get_fp8_max(recipe, False)), float(recipe.margin))
    for x, y in zip(ref, b.snapshot()):
        assert torch.equal(x, y)


def test_gate():
    """The gate the polyfills use (compat/gate.py) recognises te_inductor through Dynamo's wrappers and
    nothing else."""
    from te_passes.backend import te_inductor, te_inductor_backend
    from te_passes.compat.delayed_scaling.scaling import te_inductor_tracing
    from te_passes.compat.gate import options_for

    assert options_for(te_inductor) is not None
    assert options_for(te_inductor_backend()) is not None
    assert options_for(functools.partial(te_inductor, options={})) is not None
    assert options_for(torch._dynamo.lookup_backend("inductor")) is None
    assert options_for(None) is None
    assert not te_inductor_tracing()  # eager


def test_reduce_overhead_compiles_delayed_graphs_without_cudagraphs_only_on_cpu_values():
    """A delayed-scaling op returning a CPU tensor made Inductor cut the graph and cudagraph trees
    fail on the op's list output (H200 2026-12-02): such a graph is compiled with triton.cudagraphs
    off, with a warning naming the op; the same op with values on the GPU, and other graphs, keep it."""
    import warnings

    from te_passes.compat.delayed_scaling import linear as delayed_linear
    from te_passes.passes.check_cudagraph_hazard import CheckCudagraphHazard
    from te_passes.pipeline.compilation import Compilation, CompileSettings
    from te_passes.pipeline.facts import CudagraphHazard
    from te_passes.pipeline.manager import PassManager
    from te_passes.report import CompileReport
    from te_passes.te.state import TEState

    op = torch.ops.te_passes.delayed_scaling_update.default  # our op: defined when te_passes.backend loads

    def graph(device):
        g = torch.fx.Graph()
        x = g.placeholder("x")
        n = g.call_function(op, (x,))
        with torch._subclasses.FakeTensorMode():
            n.meta["example_value"] = [torch.empty(0, dtype=torch.complex32, device=device)]
        g.output(n)
        return torch.fx.GraphModule(torch.nn.Module(), g)

    on_cpu, on_gpu = graph("cpu"), graph("meta")
    plain = torch.fx.symbolic_trace(lambda t: t + 1)
    settings = CompileSettings.parse("reduce-overhead", None, set())
    assert settings.config_patches["triton.cudagraphs"] is True
    assert "te_passes::delayed_scaling_update returns a CPU tensor" in delayed_linear.cudagraph_hazard(on_cpu)
    assert delayed_linear.cudagraph_hazard(on_gpu) is None and delayed_linear.cudagraph_hazard(plain) is None

    def begin(gm):  # the Dynamo stage with the hazard analysis, as te_inductor's Compilation runs it
        comp = Compilation(PassManager([CheckCudagraphHazard()]), settings, TEState(), CompileReport("g_hz"),
                           live=False)
        comp.begin(gm)
        return comp

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = begin(on_cpu)
        same = [begin(g) for g in (on_gpu, plain)]
    assert out.settings.config_patches["triton.cudagraphs"] is False and all(c.settings is settings for c in same)
    assert [type(f) for f in out.facts()] == [CudagraphHazard] and [c.facts() for c in same] == [[], []]
    assert [str(x.message) for x in w if "delayed_scaling_update" in str(x.message)]
