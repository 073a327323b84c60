"""Untouched TE models under te_inductor on a GPU (issue 21): numerics against TE eager, one graph.

Run on the H200: ``pytest -m gpu tests/gpu/test_untouched_gpu.py -s`` (skipped elsewhere).

The models are built as a user writes them: no ``compile_friendly``, no ``prepare_te_state``;
bf16 runs without ``te.autocast``, fp8 with ``te.autocast(recipe=Float8CurrentScaling())``
around the compiled call. Asserted, over 3 steps against an eager twin with identical parameters:
output and every gradient (input and parameters) within ``REL_TOL[precision]``; 1 Dynamo graph,
0 graph breaks, 0 recompiles (after step 1 too), 0 cudagraph skips under reduce-overhead; the
same module under ``backend="inductor"`` keeps TE's eager islands (graph breaks, as before).
``TE_PASSES_UNTOUCHED_NORM=te`` (TE's norm kernels) is checked too and both norm errors printed.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from te_passes.testing.compile_watch import assert_one_graph
from te_passes.testing.gpu import CompileWatch, copy_params, fwd_bwd, make_recipe, symmetry_reference

from _gpu_checks import assert_close as _close  # tests/_helpers

pytestmark = pytest.mark.gpu

HIDDEN, FFN, HEADS, SEQ, BATCH = 512, 2048, 8, 256, 2


def _te():
    import transformer_engine.pytorch as te

    return te


def _grads_close(tag, g, g_ref, precision):
    worst = 0.0
    for k in g_ref:
        ref = symmetry_reference(k)
        scale = g_ref.get(ref) if ref else None
        worst = max(worst, _close(f"{tag} grad {k}", g[k], g_ref[k], precision, scale))
    return worst


def _outer(precision, recipe):
    te = _te()
    return te.autocast(enabled=True, recipe=recipe) if precision == "fp8" else contextlib.nullcontext()


def _compare(build, shape, precision, mode="default", steps=3):
    """Eager twin vs ``torch.compile(model, backend="te_inductor")``; returns (stats, worst errors)."""
    from te_passes.compat.install import install

    recipe = make_recipe(precision)
    torch.manual_seed(0)
    ref = build()
    cand = build()
    copy_params(ref, cand)
    torch._dynamo.reset()
    install()  # the patch table (the untouched rows); the start callback survives reset()
    fn = torch.compile(cand, backend="te_inductor", mode=None if mode == "default" else mode)
    gen = torch.Generator(device="cuda").manual_seed(11)
    w = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with _outer(precision, recipe):  # warm TE's own jit helpers outside the watch; the output's shape
        y0 = ref(w)
        y0 = y0[0] if isinstance(y0, tuple) else y0
        out_shape = tuple(y0.shape)  # te.LayerNormLinear(HIDDEN, FFN): not the input's
        y0.backward(torch.randn_like(y0))
    worst_out = worst_grad = 0.0
    with CompileWatch() as watch:
        for step in range(steps):
            x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
            dy = torch.randn(*out_shape, device="cuda", dtype=torch.bfloat16, generator=gen)
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            with _outer(precision, recipe):
                y, g = fwd_bwd(fn, cand, x, dy)
                y_ref, g_ref = fwd_bwd(ref, ref, x, dy)
            worst_out = max(worst_out, _close(f"step {step} out", y, y_ref, precision))
            assert g.keys() == g_ref.keys()
            worst_grad = max(worst_grad, _grads_close(f"step {step}", g, g_ref, precision))
            if step == 0:
                first = watch.snapshot()
        torch.cuda.synchronize()
    return watch.stats, first, (worst_out, worst_grad)


def _layer(**kw):
    te = _te()
    args = dict(hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.bfloat16, device="cuda")
    args.update(kw)
    return te.TransformerLayer(HIDDEN, FFN, HEADS, **args)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("layers", [1, 4], ids=["x1", "x4"])
def test_untouched_transformer_layer(layers, precision, mode):
    build = (lambda: _layer()) if layers == 1 else \
        (lambda: torch.nn.Sequential(*[_layer(layer_number=i + 1) for i in range(layers)]))
    st, first, errs = _compare(build, (SEQ, BATCH, HIDDEN), precision, mode)
    print(f"untouched TransformerLayer x{layers} {precision} {mode}: out {errs[0]:.2e} grad {errs[1]:.2e} "
          f"{st.to_json()}")
    assert_one_graph(st, first, cudagraphs=mode == "reduce-overhead")


@pytest.mark.parametrize("kw", [dict(self_attn_mask_type="causal"), dict(fuse_qkv_params=True)],
                         ids=["causal", "fused_qkv"])
def test_untouched_transformer_layer_variants(kw):
    st, first, errs = _compare(lambda: _layer(**kw), (SEQ, BATCH, HIDDEN), "bf16")
    print(f"untouched TransformerLayer {kw}: out {errs[0]:.2e} grad {errs[1]:.2e}")
    assert_one_graph(st, first, cudagraphs=False)


@pytest.mark.parametrize("norm", ["torch", "te"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_untouched_layernorm_linear(normalization, zero_centered_gamma, norm, monkeypatch):
    te = _te()
    monkeypatch.setenv("TE_PASSES_UNTOUCHED_NORM", norm)
    st, first, errs = _compare(lambda: te.LayerNormLinear(HIDDEN, FFN, normalization=normalization,
                                                          zero_centered_gamma=zero_centered_gamma,
                                                          params_dtype=torch.bfloat16, device="cuda"),
                               (SEQ * BATCH, HIDDEN), "bf16")
    print(f"LayerNormLinear {normalization} zcg={zero_centered_gamma} norm={norm}: out {errs[0]:.2e} "
          f"grad {errs[1]:.2e}")
    assert_one_graph(st, first, cudagraphs=False)


ACTIVATIONS = ["gelu", "geglu", "qgelu", "qgeglu", "relu", "reglu", "srelu", "sreglu", "silu", "swiglu",
               "clamped_swiglu", "glu"]


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_untouched_layernorm_mlp(act):
    te = _te()
    from transformer_engine.pytorch.module.layernorm_mlp import _get_act_func_supported_list

    if act not in _get_act_func_supported_list(None):
        pytest.skip(f"TE has no activation {act!r}")
    st, first, errs = _compare(lambda: te.LayerNormMLP(HIDDEN, FFN, activation=act, params_dtype=torch.bfloat16,
                                                       device="cuda"), (SEQ * BATCH, HIDDEN), "bf16")
    print(f"LayerNormMLP {act}: out {errs[0]:.2e} grad {errs[1]:.2e}")
    assert_one_graph(st, first, cudagraphs=False)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_untouched_multihead_attention(precision):
    te = _te()
    st, first, errs = _compare(lambda: te.MultiheadAttention(HIDDEN, HEADS, attention_dropout=0.0,
                                                             params_dtype=torch.bfloat16, device="cuda"),
                               (SEQ, BATCH, HIDDEN), precision)
    print(f"MultiheadAttention {precision}: out {errs[0]:.2e} grad {errs[1]:.2e}")
    assert_one_graph(st, first, cudagraphs=False)


def test_inductor_backend_keeps_te_islands():
    """backend='inductor' after te_passes was imported: TE's eager islands as before, numerics = eager."""
    from te_passes.compat.install import install

    install()  # the polyfills registered (taken by te_inductor frames only)

    te = _te()
    torch.manual_seed(0)
    ref = te.LayerNormLinear(HIDDEN, HIDDEN, params_dtype=torch.bfloat16, device="cuda")
    cand = te.LayerNormLinear(HIDDEN, HIDDEN, params_dtype=torch.bfloat16, device="cuda")
    copy_params(ref, cand)
    torch._dynamo.reset()
    fn = torch.compile(cand, backend="inductor")
    x = torch.randn(SEQ, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with CompileWatch() as watch:
        y, g = fwd_bwd(fn, cand, x, torch.ones(SEQ, HIDDEN, device="cuda", dtype=torch.bfloat16))
    y_ref, g_ref = fwd_bwd(ref, ref, x, torch.ones(SEQ, HIDDEN, device="cuda", dtype=torch.bfloat16))
    assert torch.equal(y, y_ref)  # TE's own eager forward ran
    assert watch.stats.graph_breaks >= 1, watch.stats.to_json()
