"""Llama-class TE layers under te_inductor in one Dynamo graph (issue 38), CPU with a fake GPU: RoPE
(``te.MultiheadAttention``'s ``apply_rotary_pos_emb(..., fused=True)`` -> ``te_passes::te_rope_fwd``) and
TE's ``te.ops`` norms (``te.RMSNorm`` / ``te.LayerNorm``: the final norm of a stack, ``output_layernorm``,
``qk_norm_type``) -> ``te_passes::te_ops_norm_fwd`` (compat/untouched/rope_norm.py).

Each model is compiled as a user writes it and called three times on fake cuda tensors (helpers of
tests/runtime/test_untouched.py): one graph, no break, no recompile, every TE GEMM a
``transformer_engine_compile.linear`` node, no island. Numerics against TE eager: tests/gpu/test_untouched_llama_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

te = pytest.importorskip("transformer_engine.pytorch")

from te_passes.compat import table  # noqa: E402
from te_passes.compat.untouched import polyfills as untouched  # noqa: E402
from te_passes.compat.untouched import rope_norm  # noqa: E402
from tests.runtime.test_untouched import (_fullgraph, _one_graph, _plain_backend, _run, _te_backend,  # noqa: E402
                                         install_polyfills)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

HIDDEN, FFN, HEADS, GQA, SEQ, BATCH = 64, 256, 4, 2, 16, 2
HEAD_DIM = HIDDEN // HEADS


@pytest.fixture(autouse=True)
def _polyfills():
    install_polyfills()
    untouched.clear_island_records()
    yield


def _count(targets, name):
    return sum(name in t for t in targets)


def _llama_layer(layer_number=1, **kw):
    """TE's Llama-style layer: RMSNorm, SwiGLU, GQA, causal, no bias."""
    args = dict(normalization="RMSNorm", activation="swiglu", num_gqa_groups=GQA, self_attn_mask_type="causal",
                bias=False, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.bfloat16, device="cuda",
                layer_number=layer_number)
    args.update(kw)
    return te.TransformerLayer(HIDDEN, FFN, HEADS, **args)


class _Llama(torch.nn.Module):
    """``layers`` Llama-style te.TransformerLayers with RoPE (TE's ``RotaryPositionEmbedding(head_dim)``,
    made per call from the sequence length as Megatron / NeMo do, or given once as ``freqs``) and an
    optional final ``te.RMSNorm``."""

    def __init__(self, layers=1, final_norm=False, precomputed=False, qkv_format="sbhd", **kw):
        super().__init__()
        from transformer_engine.pytorch.attention.rope import RotaryPositionEmbedding

        self.layers = torch.nn.ModuleList(_llama_layer(i + 1, attn_input_format=qkv_format, **kw)
                                          for i in range(layers))
        self.rope = RotaryPositionEmbedding(HEAD_DIM)
        self.freqs = self.rope(4 * SEQ) if precomputed else None
        self.seq_dim = 0 if qkv_format == "sbhd" else 1
        self.norm = te.RMSNorm(HIDDEN, eps=1e-5, params_dtype=torch.bfloat16, device="cuda") if final_norm else None

    def forward(self, x):
        freqs = self.freqs if self.freqs is not None else self.rope(x.shape[self.seq_dim])
        for layer in self.layers:
            x = layer(x, rotary_pos_emb=freqs)
        return self.norm(x) if self.norm is not None else x


# --------------------------------------------------------------------------- RoPE
@pytest.mark.parametrize("precision", ["bf16", "fp8-cs"])
def test_llama_layer_with_rope_is_one_graph(precision):
    r = _run(lambda: _Llama(), (SEQ, BATCH, HIDDEN), precision)
    _one_graph(r, 4)  # qkv, proj, fc1, fc2
    assert _count(r["targets"], "te_rope_fwd") == 2, [t for t in r["targets"] if "te_" in t]  # q and k
    assert _count(r["targets"], "fused_attn") >= 1
    assert _count(r["targets"], "te_act_fwd") == 1  # swiglu, TE's kernel


@pytest.mark.parametrize("qkv_format", ["sbhd", "bshd"])
@pytest.mark.parametrize("precomputed", [False, True], ids=["freqs_per_call", "freqs_given"])
def test_rope_formats(qkv_format, precomputed):
    shape = (SEQ, BATCH, HIDDEN) if qkv_format == "sbhd" else (BATCH, SEQ, HIDDEN)
    r = _run(lambda: _Llama(precomputed=precomputed, qkv_format=qkv_format), shape)
    _one_graph(r, 4)
    assert _count(r["targets"], "te_rope_fwd") == 2


@pytest.mark.parametrize("kw", [dict(rotary_pos_interleaved=True), dict(num_gqa_groups=HEADS),
                                dict(fuse_qkv_params=True, num_gqa_groups=HEADS)],
                         ids=["interleaved", "mha", "fused_qkv"])
def test_rope_variants(kw):
    r = _run(lambda: _Llama(**kw), (SEQ, BATCH, HIDDEN))
    _one_graph(r, 4)
    assert _count(r["targets"], "te_rope_fwd") == 2


@pytest.mark.parametrize("precision", ["bf16", "fp8-cs"])
def test_llama_stack_with_final_rmsnorm_is_one_graph(precision):
    r = _run(lambda: _Llama(layers=4, final_norm=True), (SEQ, BATCH, HIDDEN), precision)
    _one_graph(r, 16)
    assert _count(r["targets"], "te_rope_fwd") == 8
    assert _count(r["targets"], "te_norm_fwd") == 8  # 2 per layer: LayerNormLinear, LayerNormMLP
    assert _count(r["targets"], "te_ops_norm_fwd") == 1  # the final te.RMSNorm


def _rope_fn(fused, fmt="sbhd", cu_seqlens=None):
    from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb

    class Rope(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.freqs = torch.randn(2 * SEQ, 1, 1, HEAD_DIM, device="cuda")

        def forward(self, t):
            return apply_rotary_pos_emb(t, self.freqs, fmt, fused=fused, cu_seqlens=cu_seqlens) * 2
    return Rope()


def test_rope_polyfill_only_under_te_inductor():
    """Another backend meets TE's FusedRoPEFunc (its pybind kernel: Dynamo cannot trace it) as without
    te_passes; te_inductor's frame holds the op; the unfused path (fused=False) is TE's torch code in both."""
    shape = (SEQ, BATCH, HEADS, HEAD_DIM)
    graphs, err = _fullgraph(lambda: _rope_fn(True), shape, _plain_backend)
    assert graphs == [] and err is not None and "fused_rope_forward" in err, err
    assert "te_passes_untouched_island" not in err and "te_rope" not in err, err
    graphs, err = _fullgraph(lambda: _rope_fn(True), shape, _te_backend)
    assert err is None and len(graphs) == 1, err
    assert _count([str(n.target) for n in graphs[0].graph.nodes], "te_rope_fwd") == 1
    for backend in (_plain_backend, _te_backend):
        graphs, err = _fullgraph(lambda: _rope_fn(False), shape, backend)
        assert err is None and len(graphs) == 1, err
        assert _count([str(n.target) for n in graphs[0].graph.nodes], "te_rope") == 0
    assert table.refusal("untouched.apply_rotary_pos_emb") is None


def test_rope_thd_is_a_named_island():
    cu = None

    def build():
        nonlocal cu
        cu = torch.tensor([0, 5, SEQ * BATCH], dtype=torch.int32, device="cuda")
        return _rope_fn(True, "thd", cu)

    graphs, err = _fullgraph(build, (SEQ * BATCH, HEADS, HEAD_DIM), _te_backend)
    assert err is not None and "te_passes_untouched_island[apply_rotary_pos_emb]" in err, err
    (island,) = untouched.island_records()
    assert island.te_module == "te.apply_rotary_pos_emb" and "thd" in island.reason and island.fix, island


# --------------------------------------------------------------------------- te.ops norms
def _norm(kind, **kw):
    cls = {"RMSNorm": te.RMSNorm, "LayerNorm": te.LayerNorm}[kind]
    return cls(HIDDEN, params_dtype=torch.bfloat16, device="cuda", **kw)


@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
@pytest.mark.parametrize("precision", ["bf16", "fp8-cs"])
def test_te_norm_module_is_one_graph(kind, zero_centered_gamma, precision):
    r = _run(lambda: _norm(kind, zero_centered_gamma=zero_centered_gamma), (SEQ, BATCH, HIDDEN), precision)
    _one_graph(r, 0)
    assert _count(r["targets"], "te_ops_norm_fwd") == 1, r["targets"]


@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
def test_te_norm_module_torch_ops_switch(kind, monkeypatch):
    monkeypatch.setenv(untouched.NORM_ENV, "torch")
    r = _run(lambda: _norm(kind), (SEQ, BATCH, HIDDEN))
    _one_graph(r, 0)
    assert _count(r["targets"], "norm_fwd") == 0 and _count(r["targets"], "norm") >= 1, r["targets"]


def test_te_norm_module_only_under_te_inductor():
    graphs, err = _fullgraph(lambda: _norm("RMSNorm"), (SEQ, BATCH, HIDDEN), _plain_backend)
    assert graphs == [] and err is not None and "rmsnorm_fwd" in err, err
    assert "te_passes_untouched_island" not in err and "te_norm" not in err, err
    graphs, err = _fullgraph(lambda: _norm("RMSNorm"), (SEQ, BATCH, HIDDEN), _te_backend)
    assert err is None and len(graphs) == 1, err
    for name in ("untouched.rmsnorm_forward", "untouched.layernorm_forward", "untouched.l2normalization_forward"):
        assert table.refusal(name) is None
    assert te.RMSNorm.forward is rope_norm.te_ops_norm_forward


def test_te_norm_module_sm_margin_is_a_named_island():
    graphs, err = _fullgraph(lambda: _norm("RMSNorm", sm_margin={"backward": 8}), (SEQ, BATCH, HIDDEN),
                             _te_backend)
    assert err is not None and "te_passes_untouched_island[BasicOperation.forward]" in err, err
    (island,) = untouched.island_records()
    assert island.te_module == "te.RMSNorm" and "sm_margin" in island.reason, island


@pytest.mark.parametrize("precision", ["bf16", "fp8-cs"])
@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_output_layernorm_is_one_graph(normalization, precision):
    r = _run(lambda: _llama_layer(output_layernorm=True, normalization=normalization), (SEQ, BATCH, HIDDEN), precision)
    _one_graph(r, 4)
    assert _count(r["targets"], "te_norm_fwd") == 1, r["targets"]  # LayerNormMLP's
    assert _count(r["targets"], "te_ops_norm_fwd") == 1, r["targets"]  # the output norm


@pytest.mark.parametrize("precision", ["bf16", "fp8-cs"])
@pytest.mark.parametrize("qk_norm_type", ["RMSNorm", "LayerNorm", "L2Normalization"])
@pytest.mark.parametrize("before_rope", [False, True], ids=["after_rope", "before_rope"])
def test_qk_norm_is_one_graph(qk_norm_type, before_rope, precision):
    r = _run(lambda: _Llama(qk_norm_type=qk_norm_type, qk_norm_before_rope=before_rope), (SEQ, BATCH, HIDDEN),
             precision)
    _one_graph(r, 4)
    assert _count(r["targets"], "te_rope_fwd") == 2
    assert _count(r["targets"], "te_norm_fwd") == 2, r["targets"]  # LayerNormLinear, LayerNormMLP
    assert _count(r["targets"], "te_ops_norm_fwd") == (0 if qk_norm_type == "L2Normalization" else 2)  # q, k


@pytest.mark.usefixtures("reset_te_fp8_state")  # _capture leaves the DelayedScaling buffers registered
def test_te_ops_norm_output_is_quantized_rounded_under_delayed_scaling():
    """A DelayedScaling te.Linear after a standalone te.RMSNorm quantizes the norm's bf16 output, as TE eager does
    (the one-op fuser has no next op to fuse the cast with): ``widen_quantized_inputs`` feeds fp32 only from
    LayerNormLinear / LayerNormMLP's ``te_norm_fwd``, not from ``te_ops_norm_fwd`` (real AOT graph, CPU capture)."""
    from tests.passes.test_widen_quantized_inputs import _run as run_pass
    from tests.runtime.test_delayed_linear import _capture

    def build():
        return torch.nn.Sequential(_norm("RMSNorm"), te.Linear(HIDDEN, HIDDEN, params_dtype=torch.bfloat16,
                                                               device="cuda"))

    aot = _capture(("HYBRID", 16, "max"), 0, prepare=False, build=build)["aot"]
    gm, run = run_pass(aot)
    (lin,) = [n for n in gm.graph.nodes if str(n.target) == "te_passes.delayed_linear_fwd.default"]
    src = lin.args[1]
    assert str(src.args[0].target) == "te_passes.te_ops_norm_fwd.default" and src.args[1] == 0, src
    assert not [r for r in run.records if r.kind == "fed_fp32"], run.records
