"""compat/te220/attention_backend.py: the untouched-model ``DotProductAttention`` polyfill takes TE's fused op only
where TE's own backend selection (``get_attention_backend``, asked eagerly at trace time) picks
FusedAttention with the op's sub-backend; otherwise TE's own (traced) forward runs the backend TE
picked. CPU with a fake Hopper GPU (TE's selection reads the patched device capability and cuDNN's
version); the numerics of the unfused backend against TE eager: ``tests/gpu/test_llama_numerics_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

te = pytest.importorskip("transformer_engine.pytorch")

from te_passes.compat.te220 import attention_backend as ab  # noqa: E402
from te_passes.testing.fake_gpu import fake_gpu, quiet  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SWITCHES_OFF = {"NVTE_FUSED_ATTN": "0", "NVTE_FLASH_ATTN": "0"}


@pytest.fixture
def fresh_selection():
    """TE's own cache of its last selection (eager TE reads it) starts and ends marked stale."""
    from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as dpa

    dpa._attention_backends["backend_selection_requires_update"] = True
    yield
    dpa._attention_backends["backend_selection_requires_update"] = True


def _call():
    """A GQA causal DotProductAttention call (built on the fake GPU): the arguments of
    ``backend_problem``: q [16, 2, 4, 16], k / v [16, 2, 2, 16] (sbhd)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from te_passes.testing.fake_gpu import constructing

    with FakeTensorMode(allow_non_fake_inputs=True), constructing():
        mod = te.DotProductAttention(4, 16, num_gqa_groups=2, attn_mask_type="causal", attention_dropout=0.0)
    q = torch.empty(16, 2, 4, 16, dtype=torch.bfloat16)
    k = torch.empty(16, 2, 2, 16, dtype=torch.bfloat16)
    return mod, "sbhd", "causal", q, k, k, (-1, 0), False


def _key():
    return dict(ab.selection_key(*_call()))


def test_selection_key_is_tes_attention_params():
    """The key holds plain constants, fields of TE's ``AttentionParams``, from q [s, b, h, d] / k, v
    [s, b, g, d] and the module."""
    from dataclasses import fields

    from transformer_engine.pytorch.attention.dot_product_attention.utils import AttentionParams

    with quiet(), fake_gpu("bf16"):
        key = _key()
    assert set(key) <= {f.name for f in fields(AttentionParams)}
    assert (key["batch_size"], key["max_seqlen_q"], key["max_seqlen_kv"], key["num_heads"], key["num_gqa_groups"],
            key["head_dim_qk"], key["qkv_layout"], key["attn_mask_type"], key["window_size"]) == (
        1, 16, 16, 4, 2, 16, "sbhd_sbhd_sbhd", "causal", (-1, 0))  # batch asked as 1 (kept dynamic)


@pytest.mark.parametrize("env,want", [({}, "FusedAttention:F16_arbitrary_seqlen"),
                                      (SWITCHES_OFF, "UnfusedDotProductAttention")], ids=["default", "unfused"])
def test_selected_backend_follows_tes_switches(env, want, monkeypatch, fresh_selection):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with quiet(), fake_gpu("bf16"):
        key = tuple(_key().items())
        assert ab.selected_backend(key) == want
        p = ab.backend_problem(*_call())
    assert (p is None) == (want.endswith(ab.FUSED_OP_BACKEND)), p
    if p is not None:
        assert p == ("TE's attention-backend selection picks UnfusedDotProductAttention for this call, not "
                     "FusedAttention (F16_arbitrary_seqlen)")


def test_no_backend_is_named(monkeypatch, fresh_selection):
    """Every switch off: TE finds no backend; the reason says so (TE's own forward then raises its error)."""
    for k in ("NVTE_FUSED_ATTN", "NVTE_FLASH_ATTN", "NVTE_UNFUSED_ATTN"):
        monkeypatch.setenv(k, "0")
    with quiet(), fake_gpu("bf16"):
        got = ab.selected_backend(tuple(_key().items()))
    assert got.startswith("none: "), got


@pytest.mark.parametrize("env", [{}, SWITCHES_OFF], ids=["default", "unfused"])
def test_transformer_layer_runs_the_backend_te_selects(env, monkeypatch, fresh_selection):
    """An untouched GQA causal te.TransformerLayer through the polyfills (te_inductor's mark): by
    default TE picks FusedAttention (F16_arbitrary_seqlen) and the graph holds the fused op; with
    ``NVTE_FUSED_ATTN=0 NVTE_FLASH_ATTN=0`` TE picks UnfusedDotProductAttention: no fused op, TE's
    torch-ops attention (``baddbmm`` / softmax / ``bmm``) traced into the graph, no break, no island.
    The unfused path recompiles once on call 2: TE's forward fills two global caches on its first
    call (``_attention_backends``, the selection; softmax's ``_default_causal_mask``), whose guards
    the second call fails; calls 2-3 then reuse that graph."""
    from tests.runtime.test_untouched import _layer, _run
    from te_passes.compat.untouched import polyfills as untouched
    from tests.runtime.test_untouched import install_polyfills

    install_polyfills()  # compat.install(): the untouched rows of the patch table
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    untouched.clear_island_records()
    r = _run(lambda: _layer(self_attn_mask_type="causal", num_gqa_groups=2), (16, 2, 64), "bf16")
    fused = [t for t in r["targets"] if "fused_attn" in t]
    assert r["breaks"] == {} and untouched.island_records() == []
    if not env:
        assert fused and r["graphs"] == 1 and r["recompiles"] == [], r["recompiles"]
        return
    assert not fused and any("baddbmm" in t for t in r["targets"]) and any("softmax" in t for t in r["targets"])
    assert r["graphs"] == 2 and len(r["recompiles"]) == 1, r["recompiles"]
    assert "_default_causal_mask" in r["recompiles"][0] or "_attention_backends" in r["recompiles"][0]
