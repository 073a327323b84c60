"""compile_friendly(model, attention="te_fused") on CPU (issue 15 part 2): the rewritten
te.TransformerLayer is one Dynamo graph holding one ``transformer_engine_compile::fused_attn``
node, and what the fused op cannot express is refused module by module (or per call) with the
reason. Numerics against TE eager need the GPU: tests/gpu/test_fused_attention_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from te_passes.rewrite import compile_friendly as cf
from te_passes.te import version as vmod

te = pytest.importorskip("transformer_engine.pytorch")

from tests.test_compile_friendly import _capture, _cpu_te, _layer, _targets, _with  # noqa: E402


@pytest.mark.parametrize("precision", ["bf16", "fp8-cs"])
def test_transformer_layer_is_one_graph_with_one_fused_attn_node(precision):
    graphs, records, breaks, _ = _capture(precision, lambda: _layer("cuda"), (16, 2, 64), attention="te_fused")
    assert [r.action for r in records] == ["rewritten"] * 4, records
    core = records[2]
    assert core.module == "self_attention.core_attention" and "transformer_engine_compile::fused_attn" in core.detail
    assert len(graphs) == 1 and breaks == {}
    t = _targets(graphs[0])
    assert t.count("transformer_engine_compile.fused_attn") == 1
    assert t.count("transformer_engine_compile.linear") == 4
    assert not any("scaled_dot_product_attention" in s for s in t)


def test_bshd_layer_is_one_graph():
    graphs, records, breaks, _ = _capture("bf16", lambda: _layer("cuda", attn_input_format="bshd"), (2, 16, 64),
                                          attention="te_fused")
    assert len(graphs) == 1 and breaks == {}
    (node,) = [n for n in graphs[0].graph.nodes if str(n.target) == "transformer_engine_compile.fused_attn"]
    from te_passes.te import graph_model as gmod

    call = gmod.decode(node)
    assert call.config["qkv_layout"] == "bshd_bshd_bshd" and call.config["attn_mask_type"] == "causal"
    assert call.config["window_size"] == (-1, 0) and call.config["bottom_right_diagonal"] is False
    assert call.config["max_seqlen_q"] == 16 and call.config["is_training"] is True


@pytest.mark.parametrize("build,expect", [
    (lambda: te.DotProductAttention(4, 16, attention_dropout=0.1), "attention_dropout=0.1: the te_fused op"),
    (lambda: te.DotProductAttention(4, 16, qkv_format="thd", attn_mask_type="padding"),
     "qkv_format='thd' (te_fused path"),
    (lambda: te.DotProductAttention(4, 16, attn_mask_type="padding_causal"), "attn_mask_type='padding_causal'"),
    (lambda: te.DotProductAttention(4, 16, window_size=(8, 0)), "sliding window"),
    (lambda: _with(te.DotProductAttention(4, 16), softmax_type="off-by-one"), "softmax_type='off-by-one'"),
    (lambda: te.DotProductAttention(4, (16, 8)), "different K and V head dims"),
    (lambda: _with(te.DotProductAttention(4, 16), cp_group=object()), "context parallelism"),
])
def test_fused_refusals_leave_the_module_as_it_was(build, expect):
    with _cpu_te():
        mod = build()
        cls = type(mod)
        holder = torch.nn.Sequential(mod)
        cf.compile_friendly(holder, attention="te_fused")
    (rec,) = cf.rewrite_records(holder)
    assert rec.action == "refused" and expect in rec.reason, rec
    assert type(mod) is cls and not cf.is_rewritten(mod)


def test_fav2_backward_and_unavailable_op_are_refused(monkeypatch):
    with _cpu_te():
        mod = te.DotProductAttention(4, 16)
        mod.fused_attention.use_FAv2_bwd = True
        holder = torch.nn.Sequential(mod)
        cf.compile_friendly(holder, attention="te_fused")
        assert "NVTE_FUSED_ATTN_USE_FAv2_BWD=1" in cf.rewrite_records(holder)[0].reason
        monkeypatch.setattr(vmod, "te_version", lambda: "2.21.0")
        holder = torch.nn.Sequential(te.DotProductAttention(4, 16))
        with pytest.raises(cf.CompileFriendlyError):  # compile_friendly itself mirrors TE 2.20.x
            cf.compile_friendly(holder, attention="te_fused")
        monkeypatch.setattr(cf, "is_supported", lambda: True)
        cf.compile_friendly(holder, attention="te_fused")
    (rec,) = cf.rewrite_records(holder)
    assert rec.action == "refused" and "fused-attention op unavailable: TE 2.21.0" in rec.reason


def test_switched_off_op_is_refused(monkeypatch):
    monkeypatch.setenv("TE_PASSES_FUSED_ATTN", "off")
    with _cpu_te():
        holder = torch.nn.Sequential(te.DotProductAttention(4, 16))
        with pytest.raises(cf.CompileFriendlyError, match=r"0 \(DotProductAttention\): TE fused-attention op "
                                                          r"unavailable: switched off"):
            cf.compile_friendly(holder, attention="te_fused", strict=True)


def test_fused_call_refusals():
    with _cpu_te():
        dpa = te.DotProductAttention(4, 16)
        cf.compile_friendly(torch.nn.Sequential(dpa), attention="te_fused")
    q = torch.randn(8, 2, 4, 16, dtype=torch.bfloat16)
    with pytest.raises(cf.CompileFriendlyError, match=r"attn_mask_type='padding' \(te_fused path"):
        dpa(q, q, q, attn_mask_type="padding")
    with pytest.raises(cf.CompileFriendlyError, match=r"alibi_slopes=.* not expressed by the te_fused path"):
        dpa(q, q, q, alibi_slopes=torch.zeros(4))
    with pytest.raises(cf.CompileFriendlyError, match="q is torch.bfloat16 on cpu"):
        dpa(q, q, q)
    from te_passes.testing.capture import fake_gpu
    from torch._subclasses.fake_tensor import FakeTensorMode

    with fake_gpu("bf16"), FakeTensorMode(allow_non_fake_inputs=True):
        q32 = torch.empty(8, 2, 4, 16, device="cuda")
        with pytest.raises(cf.CompileFriendlyError, match="q is torch.float32 on cuda"):
            dpa(q32, q32, q32)
