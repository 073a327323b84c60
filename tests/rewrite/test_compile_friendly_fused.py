"""compile_friendly(model, attention="te_fused") on CPU (issue 15 part 2): the rewritten
te.TransformerLayer is one Dynamo graph holding one ``transformer_engine_compile::fused_attn``
node, and what the fused op cannot express is refused module by module (or per call) with the
reason. Numerics against TE eager need the GPU: tests/gpu/test_fused_attention_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from te_passes.compat.untouched.rewrite import compile_friendly as cf
from te_passes.te import version as vmod

te = pytest.importorskip("transformer_engine.pytorch")

from test_compile_friendly import _capture, _cpu_te, _layer, _targets, _with  # noqa: E402


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


# ------------------------------------------------------------------- attention="auto"
def test_auto_picks_the_fused_op_for_a_transformer_layer():
    graphs, records, breaks, _ = _capture("bf16", lambda: _layer("cuda"), (16, 2, 64), attention="auto")
    core = records[2]
    assert core.action == "rewritten" and core.detail.startswith("auto: TE fused attention op"), core
    assert len(graphs) == 1 and breaks == {}
    assert _targets(graphs[0]).count("transformer_engine_compile.fused_attn") == 1


@pytest.mark.parametrize("build,expect", [
    (lambda: te.DotProductAttention(4, 12), "head dim k=12: cuDNN's fused attention takes multiples of 8"),
    (lambda: te.DotProductAttention(2, 512), "head dim k=512"),
])
def test_auto_falls_back_to_sdpa_where_the_fused_op_does_not_fit(build, expect):
    with _cpu_te():
        mod = build()
        holder = torch.nn.Sequential(mod)
        cf.compile_friendly(holder, attention="auto")
    (rec,) = cf.rewrite_records(holder)
    assert rec.action == "rewritten" and rec.detail.startswith("scaled_dot_product_attention"), rec
    assert f"(te_fused not used: {expect}" in rec.detail, rec
    assert "_te_passes_attention_auto" not in mod.__dict__


def test_auto_switched_off_op_uses_sdpa(monkeypatch):
    monkeypatch.setenv("TE_PASSES_FUSED_ATTN", "off")
    with _cpu_te():
        holder = torch.nn.Sequential(te.DotProductAttention(4, 16))
        cf.compile_friendly(holder, attention="auto", strict=True)
    (rec,) = cf.rewrite_records(holder)
    assert rec.action == "rewritten" and "te_fused not used: TE fused-attention op unavailable: switched off" \
        in rec.detail, rec


def test_auto_refuses_with_both_reasons_when_neither_path_fits():
    with _cpu_te():
        mod = te.DotProductAttention(4, 16, attention_dropout=0.1)
        holder = torch.nn.Sequential(mod)
        cf.compile_friendly(holder, attention="auto")
    (rec,) = cf.rewrite_records(holder)
    assert rec.action == "refused" and rec.reason.startswith("te_fused: ") and "; sdpa: " in rec.reason, rec
    assert not cf.is_rewritten(mod)


def test_auto_call_with_fp32_qkv_goes_through_sdpa_and_restore_drops_the_flag():
    """A call the fused op cannot take (fp32 q/k/v) falls back to SDPA under "auto" (under
    "te_fused" it raises, test_fused_call_refusals): same numbers as the SDPA rewrite."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from te_passes.testing.capture import fake_gpu

    with _cpu_te():
        dpa, ref = te.DotProductAttention(4, 16), te.DotProductAttention(4, 16)
        cf.compile_friendly(torch.nn.Sequential(dpa), attention="auto")
        cf.compile_friendly(torch.nn.Sequential(ref), attention="sdpa")
    with fake_gpu("bf16"), FakeTensorMode(allow_non_fake_inputs=True):
        q32 = torch.empty(8, 2, 4, 16, device="cuda")
        out, want = dpa(q32, q32, q32), ref(q32, q32, q32)
    assert out.shape == want.shape == (8, 2, 64) and out.dtype == want.dtype == torch.float32
    q = torch.randn(8, 2, 4, 16)  # CPU fp32: SDPA numerics against the SDPA rewrite
    torch.testing.assert_close(dpa(q, q, q), ref(q, q, q))
    assert cf.restore(torch.nn.Sequential(dpa)) == ["0"] and "_te_passes_attention_auto" not in dpa.__dict__
