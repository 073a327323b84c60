"""Untouched TE models in one Dynamo graph (issue 21) on CPU with a fake GPU: te_passes' polyfills
of TE's disabled LayerNormLinear / LayerNormMLP / FusedAttention forwards
(te_passes/compat/untouched/polyfills.py), taken only by frames compiled for te_inductor (here: a
recording backend carrying the same mark), never by other backends.

Each test compiles a model exactly as a user writes it (no compile_friendly, no
prepare_te_state) with a backend that runs the graph on fake cuda tensors (TE's fake impls), calls
it three times, and checks: one graph, no graph breaks, every TE GEMM a
``transformer_engine_compile.linear`` node, no recompiles on calls 2-3. Numerics against TE's
kernels need the GPU: tests/gpu/test_untouched_gpu.py.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

te = pytest.importorskip("transformer_engine.pytorch")

from te_passes.compat import gate as frame_gate, table  # noqa: E402
from te_passes.compat.dynamo.hooks import mark_untouched_backend  # noqa: E402
from te_passes.compat.install import install  # noqa: E402
from te_passes.compat.untouched import polyfills as untouched, split as untouched_split  # noqa: E402
from te_passes.compat.untouched.rows import ROWS as UNTOUCHED_ROWS  # noqa: E402
from te_passes.testing.fake_gpu import constructing, fake_gpu, make_recipe, quiet  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def install_polyfills() -> None:
    """``compat.install()`` (the patch table), then every ``untouched.*`` row is active."""
    install()
    off = [s for s in table.status() if s.name in {r.name for r in UNTOUCHED_ROWS} and not s.active]
    assert not off, off


@pytest.fixture(autouse=True)
def _polyfills():
    install_polyfills()
    untouched.clear_island_records()
    yield


def _te_backend(graphs):
    """A backend taking the polyfills (as te_inductor): records each graph, runs it as is."""
    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    return mark_untouched_backend(backend)


def _plain_backend(graphs):
    """Any other backend (what backend='inductor' sees): records, runs."""
    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    return backend


def _run(build, shape, precision="bf16", *, backend=_te_backend, calls=3, autocast="outside", fullgraph=False,
         train_eval=False, options_backend=None):
    """Compile ``step`` over ``build()`` on fake cuda; ``calls`` calls with fresh inputs.

    autocast: "outside" (te.autocast around the compiled call), "inside" (in the compiled
    function, recipe built outside), "inside_new" (recipe built inside the compiled function),
    "none" (no te.autocast at all; bf16 only).
    Returns dict(graphs, breaks, recompiles (reasons), targets (call_function targets of every graph)).
    """
    from torch._dynamo.utils import counters, get_compilation_metrics
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch._dynamo.reset()
    install_polyfills()
    counters.clear()
    fp8 = precision != "bf16"
    graphs: list = []
    be = backend(graphs) if options_backend is None else options_backend
    with quiet(), fake_gpu(precision):
        recipe = make_recipe(precision) if fp8 else None
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode, constructing():
            model = build()

        def step(inp):
            if autocast == "inside":
                with te.autocast(enabled=fp8, recipe=recipe):
                    out = model(inp)
            elif autocast == "inside_new":
                r = type(recipe)() if fp8 else None
                with te.autocast(enabled=fp8, recipe=r):
                    out = model(inp)
            else:
                out = model(inp)
            return out[0] if isinstance(out, tuple) else out

        step.__code__ = step.__code__.replace(co_name=f"untouched_step_{id(build)}_{precision}_{autocast}")
        fn = torch.compile(step, backend=be, fullgraph=fullgraph, dynamic=False)
        seen = {id(m) for m in get_compilation_metrics()}
        outer = (te.autocast(enabled=True, recipe=recipe) if autocast == "outside" and fp8
                 else contextlib.nullcontext())
        for i in range(calls):
            if train_eval and i == calls - 1:
                model.eval()
            with mode, constructing():
                x = torch.randn(*shape, dtype=torch.bfloat16, device="cuda", requires_grad=True)
            with mode, outer:
                fn(x)  # forward only: the autograd engine needs a real CUDA device guard
        reasons = [m.recompile_reason for m in get_compilation_metrics() if id(m) not in seen and m.recompile_reason]
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    return dict(graphs=len(graphs), breaks=dict(counters["graph_break"]), recompiles=reasons, targets=targets,
                model=model)


def _gemms(targets):
    return sum(t.startswith("transformer_engine_compile.linear") for t in targets
               if "backward" not in t)


def _layer(**kw):
    args = dict(hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.bfloat16, device="cuda")
    args.update(kw)
    return te.TransformerLayer(64, 256, 4, **args)


def _one_graph(r, gemms):
    assert r["breaks"] == {}, r["breaks"]
    assert r["graphs"] == 1, (r["graphs"], r["recompiles"])
    assert r["recompiles"] == [], r["recompiles"]
    assert _gemms(r["targets"]) == gemms, [t for t in r["targets"] if "transformer_engine" in t]
    assert not any("te_passes_untouched_island" in t for t in r["targets"])
    assert untouched.island_records() == [], untouched.island_records()


# --------------------------------------------------------------------------- TransformerLayer
@pytest.mark.parametrize("precision", ["bf16", "fp8-cs", "mxfp8"])
def test_transformer_layer_untouched_is_one_graph(precision):
    r = _run(_layer, (16, 2, 64), precision)
    _one_graph(r, 4)  # qkv, proj, fc1, fc2
    assert sum("fused_attn" in t for t in r["targets"]) >= 1, r["targets"]


@pytest.mark.parametrize("kw", [dict(self_attn_mask_type="causal"), dict(num_gqa_groups=2),
                                dict(fuse_qkv_params=True), dict(fuse_qkv_params=True, self_attn_mask_type="causal"),
                                dict(num_gqa_groups=2, self_attn_mask_type="causal")],
                         ids=["causal", "gqa", "fused_qkv", "fused_qkv_causal", "gqa_causal"])
@pytest.mark.parametrize("precision", ["bf16", "fp8-cs"])
def test_transformer_layer_variants(kw, precision):
    r = _run(lambda: _layer(**kw), (16, 2, 64), precision)
    _one_graph(r, 4)


@pytest.mark.parametrize("autocast", ["inside",  # proj prepared in the trace (compat/untouched/forward_state.py)
    pytest.param("inside_new", marks=pytest.mark.xfail(
    strict=True, reason="a recipe built inside the compiled function: Dynamo breaks the graph at TE's pydantic "
                        "dataclass constructor (gb3383), outside te_passes")), "outside"])
def test_te_autocast_placement(autocast):
    r = _run(_layer, (16, 2, 64), "fp8-cs", autocast=autocast)
    _one_graph(r, 4)


def test_te_autocast_inside_does_not_recompile():
    """Was one recompile on step 2 (``proj.fp8 == False``: proj prepared with fp8 off at compile start): issue 38."""
    r = _run(_layer, (16, 2, 64), "fp8-cs", autocast="inside")
    assert r["breaks"] == {} and _gemms(r["targets"]) == 4, r  # one trace
    assert r["recompiles"] == [], r["recompiles"]


def test_bf16_inside_te_autocast():
    r = _run(_layer, (16, 2, 64), "bf16", autocast="inside")
    _one_graph(r, 4)


def test_gqa_split_is_torch_split_under_te_inductor_only():
    """GQA's q/k/v split (TE's SplitAlongDim, rebound by compat/untouched/split.py) is a torch.split with
    contiguous parts in te_inductor frames; any other backend meets TE's autograd.Function and breaks as before."""
    from transformer_engine.pytorch.attention import multi_head_attention as mha

    assert mha.SplitAlongDim is untouched_split.GraphSplitAlongDim
    r = _run(lambda: _layer(num_gqa_groups=2), (16, 2, 64), "bf16", calls=1)
    assert r["breaks"] == {} and r["graphs"] == 1, r
    graphs, err = _fullgraph(lambda: _layer(num_gqa_groups=2), (16, 2, 64), _te_backend)
    assert err is None and len(graphs) == 1, err
    graphs, err = _fullgraph(lambda: _layer(num_gqa_groups=2), (16, 2, 64), _plain_backend)
    assert err is not None and graphs == [], "backend='inductor' must meet TE's islands as without te_passes"


@pytest.mark.parametrize("sections,squeeze", [((2, 1, 1), ()), (3, ()), ((1, 1), (True,))])  # squeeze: forward only
def test_graph_split_along_dim_matches_te_values_and_gradients(sections, squeeze):
    """CPU tensors: the te_inductor-traced split gives TE's SplitAlongDim forward values and input gradient
    (called with the arguments TE's callers pass: TE's backward returns as many gradients as MHA's 3 inputs)."""
    te_split = untouched_split.TE_SPLIT[0]
    n = 4 if sections == (2, 1, 1) else (6 if sections == 3 else 2)
    x0 = torch.randn(5, 3, n, 8, dtype=torch.float64)

    def step(x):
        return [p * (i + 1) for i, p in enumerate(untouched_split.GraphSplitAlongDim.apply(x, 2, sections, *squeeze))]

    graphs: list = []
    torch._dynamo.reset()
    x = x0.clone().requires_grad_()
    got = torch.compile(step, backend=_te_backend(graphs), fullgraph=True)(x)
    sum(g.sum() for g in got).backward()
    xr = x0.clone().requires_grad_()
    want = [p * (i + 1) for i, p in enumerate(te_split.apply(xr, 2, sections, *squeeze))]
    assert len(graphs) == 1 and len(got) == len(want)
    assert all(torch.equal(a, b) and a.is_contiguous() for a, b in zip(got, want))
    if not squeeze:  # TE's backward returns 3 gradients, too few for 4 inputs: TE never differentiates that call
        sum(g.sum() for g in want).backward()
        assert torch.equal(x.grad, xr.grad)
    assert untouched_split.GraphSplitAlongDim.apply(x0, 2, sections, *squeeze)[0].data_ptr() == x0.data_ptr()  # eager: TE's


def test_bf16_without_te_autocast():
    r = _run(_layer, (16, 2, 64), "bf16", autocast="none")
    _one_graph(r, 4)


def test_train_eval_switch_recompiles_once_without_breaks():
    r = _run(_layer, (16, 2, 64), "bf16", calls=4, train_eval=True)
    assert r["breaks"] == {} and r["graphs"] == 2, r
    assert len(r["recompiles"]) == 1 and "training" in r["recompiles"][0], r["recompiles"]


def test_four_layer_stack_is_one_graph():
    r = _run(lambda: torch.nn.Sequential(*[_layer(layer_number=i + 1) for i in range(4)]), (16, 2, 64), "fp8-cs")
    _one_graph(r, 16)


# --------------------------------------------------------------------------- single modules
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_layernorm_linear(normalization, zero_centered_gamma, monkeypatch):
    """TE_PASSES_UNTOUCHED_NORM=torch: the norm in torch ops (Inductor fuses it)."""
    monkeypatch.setenv(untouched.NORM_ENV, "torch")
    r = _run(lambda: te.LayerNormLinear(64, 128, normalization=normalization, zero_centered_gamma=zero_centered_gamma,
                                        params_dtype=torch.bfloat16, device="cuda"), (32, 64), "fp8-cs")
    _one_graph(r, 1)
    norm = "rms_norm" if normalization == "RMSNorm" else "layer_norm"
    assert any(norm in t for t in r["targets"]), r["targets"]


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_te_norm_kernel_switch(normalization, monkeypatch):
    """The default (TE_PASSES_UNTOUCHED_NORM unset, or te): the norm is TE's kernel as the
    te_passes::te_norm_fwd op."""
    monkeypatch.delenv(untouched.NORM_ENV, raising=False)
    r = _run(lambda: te.LayerNormLinear(64, 128, normalization=normalization, params_dtype=torch.bfloat16,
                                        device="cuda"), (32, 64), "bf16")
    _one_graph(r, 1)
    assert any("te_norm_fwd" in t for t in r["targets"]) and not any("layer_norm" in t or "rms_norm" in t
                                                                      for t in r["targets"]), r["targets"]


ACTIVATIONS = ["gelu", "geglu", "qgelu", "qgeglu", "relu", "reglu", "srelu", "sreglu", "silu", "swiglu",
               "clamped_swiglu", "glu"]


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_layernorm_mlp_every_activation(act):
    from transformer_engine.pytorch.module.layernorm_mlp import _get_act_func_supported_list

    if act not in _get_act_func_supported_list(None):
        pytest.skip(f"TE has no activation {act!r}")
    r = _run(lambda: te.LayerNormMLP(64, 256, activation=act, params_dtype=torch.bfloat16, device="cuda"),
             (32, 64), "bf16")
    _one_graph(r, 2)


def test_every_te_activation_is_tested():
    from transformer_engine.pytorch.module.layernorm_mlp import _get_act_func_supported_list

    assert set(_get_act_func_supported_list(None)) <= set(ACTIVATIONS)


@pytest.mark.parametrize("kw", [{}, dict(num_gqa_groups=2), dict(num_gqa_groups=1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("precision", ["bf16", "fp8-cs"])
def test_multihead_attention(precision, kw):
    r = _run(lambda: te.MultiheadAttention(64, 4, attention_dropout=0.0, params_dtype=torch.bfloat16, device="cuda",
                                           **kw), (16, 2, 64), precision)
    _one_graph(r, 2)


class _CrossAttention(torch.nn.Module):
    """te.MultiheadAttention(attention_type="cross") attending from ``x`` to ``2 * x``."""

    def __init__(self, **kw):
        super().__init__()
        self.mha = te.MultiheadAttention(64, 4, attention_dropout=0.0, params_dtype=torch.bfloat16, device="cuda",
                                         attention_type="cross", **kw)

    def forward(self, x):
        return self.mha(x, encoder_output=x * 2)


@pytest.mark.parametrize("kw", [{}, dict(num_gqa_groups=2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("precision", ["bf16", "fp8-cs"])
def test_cross_attention(precision, kw):
    _one_graph(_run(lambda: _CrossAttention(**kw), (16, 2, 64), precision), 3)  # query, key_value, proj


# --------------------------------------------------------------------------- the gate
@contextlib.contextmanager
def _fake_cuda_model(build, shape, precision):
    """Dynamo reset (polyfills re-installed), then inside quiet() + fake_gpu(precision): ``build()``
    and a bf16 input of ``shape`` made on fake cuda; yields ``(mode, model, x)``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch._dynamo.reset()
    install_polyfills()
    with quiet(), fake_gpu(precision):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode, constructing():
            model = build()
            x = torch.randn(*shape, dtype=torch.bfloat16, device="cuda")
        yield mode, model, x


def _fullgraph(build, shape, backend, precision="bf16"):
    """Compile ``build()`` with ``fullgraph=True`` on fake cuda; returns (graphs, error text or None).
    TE's eager forwards cannot run on fake tensors, so an island shows as fullgraph's error."""
    graphs: list = []
    with _fake_cuda_model(build, shape, precision) as (mode, model, x):
        fn = torch.compile(model, backend=backend(graphs), fullgraph=True, dynamic=False)
        try:
            with mode:
                fn(x)
        except Exception as e:  # noqa: BLE001 - the text is the result
            return graphs, str(e)
    return graphs, None


def _lnl():
    return te.LayerNormLinear(64, 64, params_dtype=torch.bfloat16, device="cuda")


def test_other_backends_see_te_as_without_te_passes():
    """Same process, same module: a plain backend (what backend='inductor' gets) stops at TE's
    disabled LayerNormLinear.forward exactly as without te_passes; the te backend traces one graph;
    the plain backend again stops (per-backend cache entries, the gate folded per trace)."""
    graphs, err = _fullgraph(_lnl, (32, 64), _plain_backend)
    assert graphs == [] and err is not None and "torch.compiler.disable" in err and "LayerNormLinear.forward" in err
    assert "te_passes_untouched_island" not in err
    graphs, err = _fullgraph(_lnl, (32, 64), _te_backend)
    assert err is None and len(graphs) == 1
    graphs, err2 = _fullgraph(_lnl, (32, 64), _plain_backend)
    assert graphs == [] and err2 is not None and "LayerNormLinear.forward" in err2


def test_cache_entries_are_per_backend():
    """One code object, no reset between: the te backend's cache entry (polyfills folded in) is
    never reused for the plain backend, and the plain backend's failure does not evict it."""
    te_graphs: list = []
    plain_graphs: list = []
    with _fake_cuda_model(_lnl, (32, 64), "bf16") as (mode, m, x):
        def step(t):
            return m(t) * 2

        ours = _te_backend(te_graphs)
        with mode:
            torch.compile(step, backend=ours, fullgraph=True)(x)
            with pytest.raises(Exception, match=r"torch.compiler.disable"):
                torch.compile(step, backend=_plain_backend(plain_graphs), fullgraph=True)(x)
            torch.compile(step, backend=ours, fullgraph=True)(x)  # its cache entry: no new trace
    assert len(te_graphs) == 1 and plain_graphs == []


def test_other_backends_transformer_layer_fails_where_te_fails():
    """bf16 TransformerLayer without te.autocast under a plain backend: TE's own assertion in
    get_default_fp8_recipe (as without te_passes); under the te backend: one graph."""
    graphs, err = _fullgraph(_layer, (16, 2, 64), _plain_backend)
    assert err is not None and "Creating Recipe objects inside compiled regions" in err
    graphs, err = _fullgraph(_layer, (16, 2, 64), _te_backend)
    assert err is None and len(graphs) == 1


def test_backend_recognition():
    import functools

    import te_passes.backend as backend

    def takes(fn):  # what the polyfills ask the frame gate (compat/gate.py)
        opts = frame_gate.options_for(fn)
        return opts is not None and opts.untouched

    wrapper = torch._TorchCompileWrapper("te_inductor", None, None, None)
    assert takes(wrapper)
    off = torch._TorchCompileWrapper("te_inductor", None, {"te_passes.untouched": False}, None)
    assert not takes(off)
    assert takes(functools.partial(backend.te_inductor, mode=None, options=None))
    assert not takes(torch._TorchCompileWrapper("eager", None, None, None))
    from torch._dynamo.backends.registry import lookup_backend

    assert not takes(lookup_backend("inductor"))


def test_option_and_env_switch_off(monkeypatch):
    from te_passes.config import TePassesOptionError

    from te_passes.config import TePassesOptions

    def enabled(options=None):
        return TePassesOptions.parse(options)[0].untouched

    monkeypatch.setenv(untouched.ENV, "0")
    assert not enabled()
    assert enabled({"te_passes.untouched": True})  # the option wins
    monkeypatch.setenv(untouched.ENV, "maybe")
    with pytest.raises(TePassesOptionError, match="TE_PASSES_UNTOUCHED"):
        enabled()
    monkeypatch.delenv(untouched.ENV)
    with pytest.raises(TePassesOptionError, match="must be a bool"):
        enabled({"te_passes.untouched": "no"})


def test_switched_off_compile_behaves_as_before(monkeypatch):
    monkeypatch.setenv(untouched.ENV, "0")
    graphs, err = _fullgraph(_lnl, (32, 64), _te_backend)
    assert err is not None and "torch.compiler.disable" in err and "LayerNormLinear.forward" in err


def test_polyfills_installed_for_the_te_targets():
    for row in ("untouched.layernorm_linear_forward", "untouched.layernorm_mlp_forward",
                "untouched.fused_attention_forward", "untouched.get_default_fp8_recipe"):
        assert table.refusal(row) is None
    assert isinstance(untouched.closure_layout(te.LayerNormLinear.forward), tuple)
    assert "not a closure" in untouched.closure_layout(lambda: 0) or "closes over" in untouched.closure_layout(lambda: 0)


# --------------------------------------------------------------------------- islands
def test_delayed_scaling_is_a_named_island_with_a_warning():
    """A DelayedScaling module the compile-start callback does not reach (held in a list: it scans the frame's
    locals, closure cells and module globals for modules) has no registered state: a named island with the fix.
    (A module it reaches is registered, in the model's fake mode here: tests/runtime/test_prepare_forward_state.py.)"""
    from transformer_engine.common import recipe as te_recipe

    def step_model():
        return te.LayerNormLinear(64, 64, params_dtype=torch.bfloat16, device="cuda")

    graphs: list = []
    with _fake_cuda_model(step_model, (8, 64), "fp8-cs") as (mode, m, x):
        recipe = te_recipe.DelayedScaling()
        box = [m]
        fn = torch.compile(lambda t: box[0](t) * 2, backend=_te_backend(graphs), fullgraph=True)
        with warnings.catch_warnings(record=True) as w, mode:
            warnings.simplefilter("always")
            with pytest.raises(Exception, match=r"te_passes_untouched_island\[LayerNormLinear.forward\]"):
                with te.autocast(enabled=True, recipe=recipe):
                    fn(x)
    isl = untouched.island_records()
    assert isl and isl[0].te_module == "te.LayerNormLinear" and "DelayedScaling" in isl[0].reason, isl
    # one frame gate: a backend registered there takes the DelayedScaling ops too, so the island names the
    # missing registration of the module's state (was: "the backend does not take te_passes' ops")
    assert "prepare_delayed_scaling" in isl[0].fix, isl[0]
    assert sum("DelayedScaling" in str(x.message) and "te_passes" in str(x.message) for x in w) == 1


def test_unexpressed_configuration_is_a_named_island():
    graphs, err = _fullgraph(lambda: te.LayerNormMLP(64, 256, return_layernorm_output=True,
                                                     params_dtype=torch.bfloat16, device="cuda"), (32, 64), _te_backend)
    assert err is not None and "te_passes_untouched_island[LayerNormMLP.forward]" in err, err
    isl = untouched.island_records()
    assert len(isl) == 1 and isl[0].te_module == "te.LayerNormMLP" and "return_layernorm_output" in isl[0].reason, isl
    assert "runs eagerly" in str(isl[0])


# --------------------------------------------------------------------------- capture
@pytest.mark.parametrize("model", ["layernorm_linear", "layernorm_mlp", "multihead_attention", "transformer_layer"])
def test_capture_learns_untouched_models(model):
    from te_passes.testing.capture import capture_dynamo

    cg = capture_dynamo(model, "fp8-cs")
    targets = [str(n.target) for n in cg.gm.graph.nodes if n.op == "call_function"]
    assert _gemms(targets) == {"layernorm_linear": 1, "layernorm_mlp": 2, "multihead_attention": 2,
                               "transformer_layer": 4}[model]


# --------------------------------------------------------------------------- te-passes dump --example
@pytest.mark.parametrize("name", ["transformer-layer-bf16", "transformer-layer-fp8"])
def test_dump_example_untouched_transformer_layer(name, tmp_path):
    """The built-in untouched te.TransformerLayer examples: one graph, no breaks, no TE islands."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("TE_PASSES_DISABLE", "TE_PASSES_DUMP_DIR", "TORCH_TRACE", untouched.ENV):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-m", "te_passes.cli", "dump", "--example", name, "--out", "d", "--plain"],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "TE eager islands: none" in out and "graph breaks: none recorded" in out, out
    assert "recompiles: none recorded" in out, out
    import re

    graphs = [ln for ln in out.splitlines() if re.match(r"g\d+\s+default\s", ln)]
    assert len(graphs) == 1, out  # the Graphs table: one compiled graph
