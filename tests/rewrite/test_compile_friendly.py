"""compile_friendly (issue 15 part 1) on CPU: one Dynamo graph for a rewritten te.TransformerLayer,
refusals, state-dict identity, the SDPA path's numerics against a reference attention.

TE modules are built on this CPU-only machine under ``fake_gpu`` (TE 2.20.2 checks for CUDA
at construction): on ``cpu`` for state-dict / SDPA numerics tests, on fake ``cuda`` tensors
for the Dynamo captures. Numerics of the rewritten modules against TE's kernels need the GPU:
tests/gpu/test_compile_friendly_gpu.py.
"""

from __future__ import annotations

import contextlib
import io
import math

import pytest
import torch

from te_passes.compat.untouched.rewrite import compile_friendly as cf
from te_passes.compat.untouched.rewrite import module_state, rewriters
from te_passes.te import norm_act

te = pytest.importorskip("transformer_engine.pytorch")

from te_passes.testing.fake_gpu import constructing, fake_gpu, quiet  # noqa: E402


@pytest.fixture(autouse=True)
def _torch_ops_norm(monkeypatch):
    """These tests check the rewrite's torch-ops norm (its graph nodes, and its numerics against TE's
    formula on CPU tensors, where TE's norm kernel cannot run); the default, TE's norm kernel, is
    tests/runtime/test_untouched.py::test_te_norm_kernel_switch."""
    monkeypatch.setenv("TE_PASSES_UNTOUCHED_NORM", "torch")


@contextlib.contextmanager
def _cpu_te(precision="bf16"):
    """Build TE modules on ``cpu`` (TE's CUDA check patched)."""
    with quiet(), fake_gpu(precision), constructing():
        yield


def _layer(device="cpu", **kw):
    args = dict(hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.bfloat16, device=device)
    args.update(kw)
    return te.TransformerLayer(64, 256, 4, **args)


def _capture(precision: str, build, x_shape, *, rewrite=True, autocast=True, **cf_kwargs):
    """Compile ``build()(x)`` under fake cuda with ``fullgraph=True`` and a recording backend;
    returns (graphs, records, graph-break counter, recompiles)."""
    from torch._dynamo.utils import counters
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformer_engine.common import recipe as te_recipe

    counters.clear()
    recipe = te_recipe.Float8CurrentScaling()
    enabled = precision == "fp8-cs"
    with quiet(), fake_gpu(precision):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode, constructing():
            model = build()
            x = torch.randn(*x_shape, dtype=torch.bfloat16, device="cuda", requires_grad=True)
            if rewrite:
                cf.compile_friendly(model, **cf_kwargs)
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)

            def never_run(*a, **k):
                raise _NeverRun()
            return never_run

        def step(inp):
            # TE's MultiheadAttention reads FP8GlobalStateManager.get_fp8_recipe() even in bf16: an
            # explicit recipe keeps TE from building a default one inside the compiled region.
            if not autocast:
                return model(inp)
            with te.autocast(enabled=enabled, recipe=recipe):
                return model(inp)

        fn = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)
        with mode, contextlib.suppress(_NeverRun):
            fn(x)
    return graphs, cf.rewrite_records(model), dict(counters["graph_break"]), counters["stats"]["unique_graphs"]


class _NeverRun(Exception):
    pass


def _targets(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("precision", ["bf16", "fp8-cs"])
def test_transformer_layer_is_one_graph(precision):
    graphs, records, breaks, _ = _capture(precision, lambda: _layer("cuda"), (16, 2, 64))
    assert [r.action for r in records] == ["rewritten"] * 4, records
    assert [r.module for r in records] == ["self_attention", "self_attention.layernorm_qkv",
                                           "self_attention.core_attention", "layernorm_mlp"]
    assert len(graphs) == 1 and breaks == {}
    t = _targets(graphs[0])
    # qkv, proj, fc1, fc2 through TE's compiled op; both norms and the attention in torch ops
    assert t.count("transformer_engine_compile.linear") == 4
    assert sum("layer_norm" in s for s in t) == 2
    assert sum("scaled_dot_product_attention" in s for s in t) == 1
    assert sum(s.endswith("gelu>") for s in t) == 1


def test_bf16_without_te_autocast_is_one_graph():
    """TE's MultiheadAttention would build its default recipe inside the compiled region."""
    graphs, records, breaks, _ = _capture("bf16", lambda: _layer("cuda"), (16, 2, 64), autocast=False)
    assert len(graphs) == 1 and breaks == {}
    assert "default recipe" in records[0].detail and records[0].module == "self_attention"
    with pytest.raises(Exception, match="Creating Recipe objects inside compiled regions"):
        _capture("bf16", lambda: _layer("cuda"), (16, 2, 64), autocast=False, attention="keep",
                 rewrite=False)


def test_without_rewrite_fullgraph_fails_at_te_disabled_forward():
    """The control: the same capture of the untouched layer cannot be one graph."""
    with pytest.raises(Exception, match=r"(?i)skip|disable|graph break"):
        _capture("bf16", lambda: _layer("cuda"), (16, 2, 64), rewrite=False)


def test_gqa_layer_names_te_split_along_dim_break():
    """GQA: TE's MultiheadAttention (not rewritten) splits q/k/v with SplitAlongDim."""
    with pytest.raises(Exception, match="data_ptr"):
        _capture("bf16", lambda: _layer("cuda", num_gqa_groups=2), (16, 2, 64))
    with _cpu_te():
        layer = cf.compile_friendly(_layer(num_gqa_groups=2))
    recs = {r.module: r for r in cf.rewrite_records(layer)}
    assert recs["self_attention"].action == "rewritten" and "SplitAlongDim" in recs["self_attention"].detail
    assert recs["self_attention.core_attention"].action == "rewritten"


@pytest.mark.parametrize("kw", [dict(normalization="RMSNorm", zero_centered_gamma=True, activation="swiglu",
                                     bias=False),
                                dict(attn_input_format="bshd", activation="clamped_swiglu",
                                     fuse_qkv_params=True)])
def test_variants_are_one_graph(kw):
    shape = (2, 16, 64) if kw.get("attn_input_format") == "bshd" else (16, 2, 64)
    graphs, records, breaks, _ = _capture("bf16", lambda: _layer("cuda", **kw), shape)
    assert [r.action for r in records] == ["rewritten"] * 4, records
    assert len(graphs) == 1 and breaks == {}
    t = _targets(graphs[0])
    assert sum("rms_norm" in s for s in t) == (2 if kw.get("normalization") == "RMSNorm" else 0)
    assert sum("scaled_dot_product_attention" in s for s in t) == 1


def test_state_dict_identity_and_reload():
    with _cpu_te():
        layer = _layer()
        sd0 = layer.state_dict()
        params0 = {n: p for n, p in layer.named_parameters()}
        ptrs0 = {k: v.data_ptr() for k, v in sd0.items() if v.numel()}
        buf = io.BytesIO()
        torch.save(sd0, buf)
        cf.compile_friendly(layer)
    sd1 = layer.state_dict()
    assert list(sd1) == list(sd0)
    assert {k: v.data_ptr() for k, v in sd1.items() if v.numel()} == ptrs0
    assert all(p is params0[n] for n, p in layer.named_parameters()) and len(list(layer.parameters())) == len(params0)
    # the hidden te.Linear modules run on the very same Parameter objects, read from the owner
    # at each call (they hold none of their own)
    mlp = layer.layernorm_mlp
    fc1, fc2 = module_state.state_of(mlp).linears
    assert fc1._get_weight_tensors()[0] is mlp.fc1_weight and fc2._get_weight_and_bias_tensors()[1] is mlp.fc2_bias
    assert fc1.weight_names == ["fc1_weight"] and not list(fc1.parameters()) and not list(fc2.parameters())
    qkv_lin = module_state.state_of(layer.self_attention.layernorm_qkv).linears[0]
    assert qkv_lin._get_weight_tensors()[0] is layer.self_attention.layernorm_qkv.query_weight
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(1.0)
    buf.seek(0)
    res = layer.load_state_dict(torch.load(buf, weights_only=False))
    assert not res.missing_keys and not res.unexpected_keys
    assert all(torch.equal(v, sd0[k]) for k, v in layer.state_dict().items())
    assert fc1._get_weight_tensors()[0] is mlp.fc1_weight  # loading copies into the shared objects
    # restore() swaps the TE classes back
    assert sorted(cf.restore(layer)) == ["layernorm_mlp", "self_attention", "self_attention.core_attention",
                                         "self_attention.layernorm_qkv"]
    assert type(layer.layernorm_mlp) is te.LayerNormMLP and not cf.is_rewritten(layer.layernorm_mlp)


def test_train_eval_reach_hidden_linears():
    with _cpu_te():
        layer = cf.compile_friendly(_layer())
    fc1, fc2 = module_state.state_of(layer.layernorm_mlp).linears
    layer.eval()
    assert not fc1.training and not fc2.training
    layer.train()
    assert fc1.training and fc2.training


def _with(mod, **attrs):
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod


@pytest.mark.parametrize("build, expect", [
    (lambda: te.LayerNormLinear(64, 64, return_layernorm_output=True, device="cpu"), "return_layernorm_output"),
    (lambda: te.LayerNormLinear(64, 64, fuse_wgrad_accumulation=True, device="cpu"), "fuse_wgrad_accumulation"),
    (lambda: te.LayerNormLinear(64, 64, delay_wgrad_compute=True, device="cpu"), "delay_wgrad_compute"),
    (lambda: te.LayerNormLinear(64, 64, tp_size=2, parallel_mode="column", device="cpu"), "tensor parallel"),
    (lambda: te.LayerNormMLP(64, 128, checkpoint=True, device="cpu"), "checkpoint=True"),
    (lambda: te.LayerNormMLP(64, 128, return_layernorm_output=True, device="cpu"), "return_layernorm_output"),
    (lambda: te.DotProductAttention(4, 16, attention_dropout=0.1), "attention_dropout=0.1"),
    (lambda: te.DotProductAttention(4, 16, qkv_format="thd", attn_mask_type="padding"), "qkv_format='thd'"),
    (lambda: te.DotProductAttention(4, 16, attn_mask_type="padding_causal"), "attn_mask_type='padding_causal'"),
    (lambda: te.DotProductAttention(4, 16, window_size=(8, 0)), "sliding window"),
    # softmax_type != vanilla allocates its offset on cuda at construction: set after building
    (lambda: _with(te.DotProductAttention(4, 16), softmax_type="off-by-one"), "softmax_type='off-by-one'"),
    (lambda: te.DotProductAttention(4, (16, 8)), "different K and V head dims"),
])
def test_refusals_leave_the_module_as_it_was(build, expect):
    with _cpu_te():
        mod = build()
        cls = type(mod)
        holder = torch.nn.Sequential(mod)
        cf.compile_friendly(holder)
        (rec,) = cf.rewrite_records(holder)
        assert rec.action == "refused" and expect in rec.reason, rec
        assert type(mod) is cls and not cf.is_rewritten(mod)
        with pytest.raises(cf.CompileFriendlyError, match=expect.replace("(", r"\(").replace("[", r"\[")):
            cf.compile_friendly(holder, strict=True)


def test_strict_changes_nothing_and_keep_and_te_fused():
    with _cpu_te():
        model = torch.nn.ModuleDict({"ok": te.LayerNormLinear(64, 64, device="cpu"),
                                     "bad": te.LayerNormMLP(64, 128, checkpoint=True, device="cpu")})
        with pytest.raises(cf.CompileFriendlyError, match=r"bad \(LayerNormMLP\): checkpoint=True"):
            cf.compile_friendly(model, strict=True)
        assert type(model["ok"]) is te.LayerNormLinear
        layer = cf.compile_friendly(_layer(), attention="keep")
    recs = {r.module: r for r in cf.rewrite_records(layer)}
    assert recs["self_attention.core_attention"].action == "kept"
    assert recs["layernorm_mlp"].action == "rewritten"
    with _cpu_te():
        cf.compile_friendly(layer, attention="te_fused")  # the kept attention now goes through the fused op
    assert {r.module: r.action for r in cf.rewrite_records(layer)}["self_attention.core_attention"] == "rewritten"
    cf.restore(layer)
    with _cpu_te():
        cf.compile_friendly(layer, attention="keep")
    with pytest.raises(ValueError, match="attention must be one of"):
        cf.compile_friendly(layer, attention="flash")
    with pytest.raises(TypeError, match="strict must be a bool"):
        cf.compile_friendly(layer, strict="no")  # truthy: refused, not read as True
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        cf.compile_friendly("layer")
    # rewriting twice refuses the already rewritten modules
    with _cpu_te():
        cf.compile_friendly(layer)
    assert {r.module: r.reason for r in cf.rewrite_records(layer)}["layernorm_mlp"] == "already rewritten"


def test_every_te_activation_has_an_expression():
    from transformer_engine.pytorch.module.layernorm_mlp import _get_act_func_supported_list

    assert set(_get_act_func_supported_list(None)) == set(norm_act.ACTIVATIONS)


def test_activation_math():
    x = torch.linspace(-9, 9, 41, dtype=torch.float32)
    g = torch.cat([x, x.flip(0)])  # gated: act(first half) * second half
    y = x.flip(0)
    gelu_tanh = 0.5 * x * (1 + torch.tanh(0.79788456 * (x + 0.044715 * x**3)))
    torch.testing.assert_close(norm_act.activation(x, "gelu"), gelu_tanh)
    torch.testing.assert_close(norm_act.activation(g, "geglu"), gelu_tanh * y)
    torch.testing.assert_close(norm_act.activation(x, "qgelu"), x * torch.sigmoid(1.702 * x))
    torch.testing.assert_close(norm_act.activation(x, "srelu"), torch.where(x > 0, x * x, 0))
    torch.testing.assert_close(norm_act.activation(g, "sreglu"), torch.where(x > 0, x * x, 0) * y)
    torch.testing.assert_close(norm_act.activation(g, "swiglu"), x * torch.sigmoid(x) * y)
    torch.testing.assert_close(norm_act.activation(g, "glu"), torch.sigmoid(x) * y)
    p = {"limit": 5.0, "alpha": 1.5, "glu_linear_offset": 0.5}
    xc = x.clamp(max=5.0)
    torch.testing.assert_close(norm_act.activation(g, "clamped_swiglu", p),
                               xc * torch.sigmoid(1.5 * xc) * (y.clamp(-5.0, 5.0) + 0.5))
    xb = x.to(torch.bfloat16)
    assert norm_act.activation(xb, "gelu").dtype == torch.bfloat16


def test_normalize_math():
    x = torch.randn(6, 32, dtype=torch.bfloat16)
    w, b = torch.randn(32, dtype=torch.bfloat16), torch.randn(32, dtype=torch.bfloat16)
    xf = x.float()
    ln = (xf - xf.mean(-1, keepdim=True)) / torch.sqrt(xf.var(-1, unbiased=False, keepdim=True) + 1e-5)
    torch.testing.assert_close(norm_act.normalize(x, w, b, 1e-5, "LayerNorm", False), (ln * w.float() + b.float()).bfloat16())
    torch.testing.assert_close(norm_act.normalize(x, w, b, 1e-5, "LayerNorm", True),
                               (ln * (w.float() + 1) + b.float()).bfloat16())
    rms = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm_act.normalize(x, w, None, 1e-6, "RMSNorm", True), (rms * (w.float() + 1)).bfloat16())
    with pytest.raises(ValueError, match="neither"):
        norm_act.normalize(x, w, b, 1e-5, "BatchNorm", False)


def _reference_attention(q, k, v, causal, scale):
    """Naive attention on [b, h, s, d] (k/v heads repeated for GQA)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1).float(), v.repeat_interleave(rep, 1).float()
    s = q.float() @ k.transpose(-1, -2) * scale
    if causal:
        sq, skv = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, skv, dtype=torch.bool).triu(1), float("-inf"))
    return (s.softmax(-1) @ v).to(q.dtype)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("mask", ["causal", "no_mask"])
@pytest.mark.parametrize("groups", [4, 2, 1])
def test_sdpa_path_matches_reference_attention(fmt, mask, groups):
    torch.manual_seed(0)
    h, d, s, b = 4, 16, 12, 3
    with _cpu_te():
        dpa = te.DotProductAttention(h, d, num_gqa_groups=groups, qkv_format=fmt, attn_mask_type=mask)
        cf.compile_friendly(torch.nn.Sequential(dpa))
    assert cf.is_rewritten(dpa)
    lead = (s, b) if fmt == "sbhd" else (b, s)
    q = torch.randn(*lead, h, d, dtype=torch.float32)
    k, v = (torch.randn(*lead, groups, d, dtype=torch.float32) for _ in range(2))
    out = dpa(q, k, v)
    to_bhsd = (lambda t: t.permute(1, 2, 0, 3)) if fmt == "sbhd" else (lambda t: t.permute(0, 2, 1, 3))
    ref = _reference_attention(to_bhsd(q), to_bhsd(k), to_bhsd(v), mask == "causal", 1 / math.sqrt(d))
    ref = ref.permute(2, 0, 1, 3) if fmt == "sbhd" else ref.permute(0, 2, 1, 3)
    assert out.shape == (*lead, h * d)
    torch.testing.assert_close(out, ref.reshape(*lead, h * d), atol=1e-5, rtol=1e-5)
    if groups == h:  # MultiheadAttention's packed qkv (interleaved: [s, b, h, 3, d] at dim -2)
        packed = torch.stack([q, k, v], dim=-2)
        torch.testing.assert_close(dpa(qkv_layer=packed, qkv_interleave_dim=-2, qkv_format=fmt), out)


def test_sdpa_call_refusals():
    with _cpu_te():
        dpa = te.DotProductAttention(4, 16)
        cf.compile_friendly(torch.nn.Sequential(dpa))
    q = torch.randn(8, 2, 4, 16)
    with pytest.raises(cf.CompileFriendlyError, match="core_attention_bias_type='post_scale_bias'"):
        dpa(q, q, q, core_attention_bias_type="post_scale_bias", core_attention_bias=torch.zeros(1))
    with pytest.raises(cf.CompileFriendlyError, match="attn_mask_type='padding'"):
        dpa(q, q, q, attn_mask_type="padding")
    with pytest.raises(cf.CompileFriendlyError, match="causal_bottom_right"):
        dpa(q, q[:4], q[:4], attn_mask_type="causal_bottom_right")
    with pytest.raises(TypeError, match="unexpected keyword argument 'nonsense'"):
        dpa(q, q, q, nonsense=1)


def test_option_is_refused_with_reason():
    from te_passes.config import TePassesOptionError, TePassesOptions

    with pytest.raises(TePassesOptionError, match=r"te_passes.compile_friendly.*before torch.compile"):
        TePassesOptions.parse({"te_passes.compile_friendly": True})


def test_lazy_reexport():
    import te_passes

    assert te_passes.compile_friendly is cf.compile_friendly


def _run_calls(precision: str, prepare: bool, calls: int = 3, autocast: bool = True, rewrite=cf.compile_friendly):
    """Compile the rewritten layer with a backend that runs the graph (TE's fake impls on fake
    cuda tensors), call it ``calls`` times with fresh inputs; returns (graphs, recompile reasons)."""
    from torch._dynamo.utils import counters
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformer_engine.common import recipe as te_recipe

    from te_passes.compat.untouched.rewrite.te_state import prepare_te_state

    torch._dynamo.reset()  # the same ``step`` code object is compiled by every call of this helper
    counters.clear()
    recipe = te_recipe.Float8CurrentScaling()
    fp8 = precision == "fp8-cs"
    reasons: list[str] = []
    with quiet(), fake_gpu(precision):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode, constructing():
            layer = _layer("cuda")
            rewrite(layer)
            if prepare:
                prepare_te_state(layer, recipe if autocast else None, fp8=fp8)

        def step(inp):
            if not autocast:
                return layer(inp)
            with te.autocast(enabled=fp8, recipe=recipe):
                return layer(inp)

        fn = torch.compile(step, backend=lambda gm, ex: gm.forward, dynamic=False)
        seen = {id(m) for m in torch._dynamo.utils.get_compilation_metrics()}
        for _ in range(calls):
            with mode, constructing():
                x = torch.randn(16, 2, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
            with mode:
                fn(x)
        reasons = [m.recompile_reason for m in torch._dynamo.utils.get_compilation_metrics()
                   if id(m) not in seen and m.recompile_reason]
    return counters["stats"]["unique_graphs"], reasons, sum(counters["graph_break"].values())


@pytest.mark.parametrize("precision", ["bf16", "fp8-cs"])
def test_first_call_lazy_state_recompiles_and_prepare_removes_it(precision):
    graphs, reasons, _ = _run_calls(precision, prepare=False)
    print(reasons)
    # TE initialises state lazily on the first forward: the second call recompiles once
    assert graphs == 2 and len(reasons) == 1, reasons
    assert any(k in reasons[0] for k in ("_cached_repr", "autocast_arguments", "_is_fsdp2", "fp8 ==",
                                         "activation_dtype")), reasons
    graphs, reasons, _ = _run_calls(precision, prepare=True)
    assert graphs == 1 and reasons == []
    if precision == "bf16":  # no te.autocast at all: the rewritten MultiheadAttention's recipe
        graphs, reasons, _ = _run_calls(precision, prepare=True, autocast=False)
        assert graphs == 1 and reasons == []


@pytest.mark.parametrize("precision", ["bf16", "fp8-cs"])
def test_dynamo_stage_passes_run_on_the_rewritten_layer(precision):
    """te_inductor's DYNAMO-stage passes on the one-graph layer (the AOT stages need the GPU: on
    fake cuda Inductor's joint constant folder materialises SDPA's decomposed causal mask)."""
    from te_passes.testing.capture import CapturedGraph, run_pipeline

    graphs, _, _, _ = _capture(precision, lambda: _layer("cuda"), (16, 2, 64))
    cg = CapturedGraph(gm=graphs[0], example_inputs=[], precision=precision, model="stack", layers=1,
                       tokens=32, hidden=64, out_features=64)
    with fake_gpu(precision):
        (report,) = run_pipeline(cg)
    assert report.runs and all(r.status == "ok" for r in report.runs), [(r.name, r.status, r.error) for r in report.runs]


@pytest.mark.parametrize("precision", ["bf16", "fp8-cs"])
def test_prepare_removes_recompiles_of_the_segments_between_eager_islands(precision, monkeypatch):
    """The untouched layout: LayerNormLinear / LayerNormMLP stay eager islands. Their real
    forwards need the GPU, so here they are replaced by disabled stand-ins returning outputs of
    the right shape (attention through SDPA: TE's backend selection needs the driver). The
    compiled segments between the islands recompile on call 2 unless prepare_te_state ran."""

    @torch.compiler.disable
    def lnl(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False):
        return inp.new_empty(*inp.shape[:-1], self.out_features)

    @torch.compiler.disable
    def lnmlp(self, inp, is_first_microbatch=None):
        out = inp.new_empty(inp.shape)
        return (out, self.fc2_bias) if self.return_bias else out

    monkeypatch.setattr(te.LayerNormLinear, "forward", lnl)
    monkeypatch.setattr(te.LayerNormMLP, "forward", lnmlp)

    def sdpa_only(layer):
        rewriters.rewrite_attention(layer.self_attention.core_attention)

    graphs, reasons, breaks = _run_calls(precision, prepare=False, rewrite=sdpa_only)
    assert breaks >= 2 and len(reasons) >= 1 and any("_is_fsdp2" in r or "fp8 ==" in r for r in reasons), reasons
    graphs2, reasons, breaks2 = _run_calls(precision, prepare=True, rewrite=sdpa_only)
    assert reasons == [] and graphs2 < graphs and breaks2 == breaks
