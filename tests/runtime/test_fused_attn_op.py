"""The ``transformer_engine_compile::fused_attn`` family te_passes registers with TE's own
``register_custom_op`` (issue 15 part 2): version gate, switch, exact fakes, graph-model decoding.

Runs on CPU: the fakes run under ``FakeTensorMode`` (the real kernel needs a GPU, see
tests/gpu/test_fused_attention_gpu.py, which compares these fakes with the real outputs).
"""

# No ``from __future__ import annotations``: TE parses its dataclasses' real annotations.

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

te = pytest.importorskip("transformer_engine.pytorch")

from te_passes.ops import fused_attn as fop  # noqa: E402
from te_passes.te import fused_attn as tfa  # noqa: E402
from te_passes.te import graph_model as gmod  # noqa: E402
from te_passes.te import op_families as opf  # noqa: E402
from te_passes.te import version as vmod  # noqa: E402

BF16, FP16 = torch.bfloat16, torch.float16


def _op():
    return fop.fused_attention_op()


def fwd_args(q, k, v, fmt, mask="causal", training=True, **over):
    """``FusedAttnFwdArgs`` as ``FusedAttention.forward`` (TE 2.20.2) builds them for sbhd/bshd."""
    from transformer_engine.pytorch.attention.dot_product_attention.backends import FusedAttnFwdArgs
    from transformer_engine.pytorch.cpp_extensions.fused_attn import FusedAttnBackend

    b, sq, skv = (q.shape[0], q.shape[1], k.shape[1]) if fmt == "bshd" else (q.shape[1], q.shape[0], k.shape[0])
    cu = lambda s: torch.arange(0, (b + 1) * s, step=s, dtype=torch.int32, device=q.device)  # noqa: E731
    kw = dict(q=q, k=k, v=v, attn_bias=None, softmax_offset=None, cu_seqlens_q=cu(sq), cu_seqlens_kv=cu(skv),
              cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, page_table_k=None, page_table_v=None,
              packed_qkv=None, packed_kv=None, is_training=training, max_seqlen_q=sq, max_seqlen_kv=skv,
              attn_scale=0.125, dropout_p=0.0, fast_zero_fill=True, qkv_layout=f"{fmt}_{fmt}_{fmt}",
              attn_bias_type="no_bias", attn_mask_type=mask, softmax_type="vanilla",
              window_size=(-1, 0) if "causal" in mask else (-1, -1), bottom_right_diagonal=mask.endswith("right"),
              fused_attention_backend=FusedAttnBackend["F16_arbitrary_seqlen"], deterministic=False,
              use_FAv2_bwd=False, return_max_logit=False, rng_gen=None, fp8=False, fp8_meta=None,
              quantizers=None, fp8_output=False, bf16_backward=False, layer_number=1)
    kw.update(over)
    return FusedAttnFwdArgs(**kw)


def _contig(shape):
    from torch._prims_common import make_contiguous_strides_for

    return tuple(make_contiguous_strides_for(shape))


# fmt, (s_q, s_kv, b, h_q, h_kv, d_qk, d_v), dtype, mask -> what TE's C++ allocates (module doc of
# te_passes/te/fused_attn.py): out q.shape[:-1]+(d_v,) q.dtype; stats [b, h_q, s_q, 1] fp32; rng [2] int64.
# CASES also run on the GPU (tests/gpu/test_fused_attention_gpu.py); CPU_CASES add shapes the
# rewrite never produces (d_v != d_qk), for the fake's own rules.
CASES = [
    ("sbhd", (128, 128, 2, 16, 16, 64, 64), BF16, "causal"),
    ("sbhd", (128, 96, 2, 16, 4, 64, 64), BF16, "no_mask"),
    ("bshd", (64, 64, 3, 8, 8, 128, 128), FP16, "causal"),
    ("bshd", (32, 80, 1, 4, 2, 64, 64), BF16, "causal_bottom_right"),
]
CPU_CASES = CASES + [("sbhd", (128, 96, 2, 16, 4, 64, 32), BF16, "no_mask")]


def _table(fmt, dims, dtype):
    sq, skv, b, hq, hkv, dqk, dv = dims
    q = (sq, b, hq, dqk) if fmt == "sbhd" else (b, sq, hq, dqk)
    k = (skv, b, hkv, dqk) if fmt == "sbhd" else (b, skv, hkv, dqk)
    v = (skv, b, hkv, dv) if fmt == "sbhd" else (b, skv, hkv, dv)
    out = (*q[:-1], dv)
    return q, k, v, {"out": (out, dtype), "stats": ((b, hq, sq, 1), torch.float32), "rng": ((2,), torch.int64)}


def test_registers_the_family_on_te_2_20():
    assert vmod.parse_version(vmod.te_version()) == (2, 20)
    assert fop.install_fused_attention_op(import_te=True) and fop.refused_reason() is None
    for suffix, (direction, tier) in opf.FAMILY_SUFFIXES.items():
        fam = opf.te_op_family(fop.OP_NAME + suffix)  # TE's register_custom_op layout, all four ops
        assert (fam.name, fam.direction, fam.tier) == ("fused_attn", direction, tier)
    assert fop.install_fused_attention_op() is True  # idempotent
    assert _op() is _op()


def test_other_te_versions_are_refused(monkeypatch):
    monkeypatch.setattr(vmod, "te_version", lambda: "2.21.0")
    assert "TE 2.21.0" in fop.refused_reason() and "2.20.x" in fop.refused_reason()
    assert fop.install_fused_attention_op(import_te=True) is False
    with pytest.raises(fop.FusedAttentionOpUnavailable, match=r"unavailable: TE 2\.21\.0: .*not registered for "
                                                               r"other versions"):
        fop.fused_attention_op()
    monkeypatch.setattr(vmod, "te_version", lambda: None)
    assert fop.refused_reason() == "Transformer Engine is not installed"


def test_the_switch_is_an_option_not_the_ops(monkeypatch):
    """``TE_PASSES_FUSED_ATTN=0`` (``te_passes.fused_attn``) keeps compiles off the op (its callers read the option:
    tests/compat/test_untouched_rows.py); the op itself stays registered and usable."""
    monkeypatch.setenv("TE_PASSES_FUSED_ATTN", "0")
    assert fop.install_fused_attention_op(import_te=True) and fop.refused_reason() is None


def _flat_forward(args):
    """The base op's flat ``Tensor[]`` (user outputs, then saved tensors) for ``args``."""
    from transformer_engine.pytorch.attention.dot_product_attention.backends import FusedAttnFwdArgs
    from transformer_engine.pytorch.dynamo.custom_op import _parse_arg_type

    plan = _parse_arg_type(FusedAttnFwdArgs)
    slots = plan.pack(args)
    return torch.ops.transformer_engine_compile.fused_attn_base(*[slots[n] for n in plan.slot_names])


def _is_sentinel(t):
    return t.numel() == 0 and t.dtype == torch.complex32


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("fmt,dims,dtype,mask", CPU_CASES)
@pytest.mark.parametrize("training", [True, False])
def test_forward_fake_matches_the_table(fmt, dims, dtype, mask, training):
    _op()
    qs, ks, vs, want = _table(fmt, dims, dtype)
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = (torch.empty(s, dtype=dtype, device="cuda") for s in (qs, ks, vs))
        flat = _flat_forward(fwd_args(q, k, v, fmt, mask, training))
    # (out, max_logit) + 12 saved: q_fp8, k_fp8, v_fp8, out_fp8, q, k, v, out (all None:
    # saved_from), stats, rng_state, bias, softmax_offset.
    assert len(flat) == 14
    got = {"out": flat[0], "stats": flat[10], "rng": flat[11]}
    for name, (shape, dt) in want.items():
        t = got[name]
        assert (tuple(t.shape), t.dtype, t.stride(), t.device.type) == (shape, dt, _contig(shape), "cuda"), name
    assert all(_is_sentinel(flat[i]) for i in (1, *range(2, 10), 12, 13))


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("fmt,dims,dtype,mask", CPU_CASES)
def test_forward_and_backward_through_forward_fn(fmt, dims, dtype, mask):
    """TE's ``forward_fn`` and autograd on fake ``meta`` tensors (the autograd engine needs a
    device guard for fake ``cuda``): out and q/k/v grads as TE's impls return them."""
    fn = _op()
    qs, ks, vs, want = _table(fmt, dims, dtype)
    with FakeTensorMode():
        q, k, v = (torch.empty(s, dtype=dtype, device="meta", requires_grad=True) for s in (qs, ks, vs))
        out, max_logit = fn(fwd_args(q, k, v, fmt, mask))
        assert max_logit is None
        assert (tuple(out.shape), out.dtype, out.stride()) == (want["out"][0], dtype, _contig(want["out"][0]))
        out.sum().backward()
        for t in (q, k, v):
            assert (t.grad.shape, t.grad.dtype, t.grad.stride()) == (t.shape, dtype, t.stride())


@pytest.mark.parametrize("over,match", [
    (dict(qkv_layout="sb3hd"), "packed layouts"),
    (dict(fp8=True), "FP8 attention"),
    (dict(attn_bias_type="post_scale_bias"), "attn_bias_type"),
    (dict(softmax_type="learnable"), "softmax_type"),
    (dict(return_max_logit=True), "return_max_logit"),
    (dict(use_FAv2_bwd=True), "use_FAv2_bwd"),
])
def test_fake_refuses_what_it_cannot_describe(over, match):
    _op()
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(16, 2, 4, 64, dtype=BF16, device="cuda")
        with pytest.raises(tfa.FusedAttnFakeError, match=match):
            _flat_forward(fwd_args(q, q, q, "sbhd", **over))
        q32 = q.float()
        with pytest.raises(tfa.FusedAttnFakeError, match="bf16/fp16 backend only"):
            _flat_forward(fwd_args(q32, q32, q32, "sbhd"))


def _compile_on_fake():
    """Dynamo + AOTAutograd (Inductor's min-cut partitioner) of one sbhd causal attention on fake
    meta tensors; returns (Dynamo graph, {"fw": gm, "bw": gm})."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    fn = _op()
    seen = {}

    def record(name):
        def comp(gm, inputs):
            seen[name] = gm
            return make_boxed_func(gm.forward)
        return comp

    dynamo_graphs = []

    def backend(gm, example_inputs):
        dynamo_graphs.append(gm)
        return aot_module_simplified(gm, example_inputs, fw_compiler=record("fw"), bw_compiler=record("bw"),
                                     partition_fn=min_cut_rematerialization_partition)

    @torch.compile(backend=backend, fullgraph=True, dynamic=False)
    def attn(q, k, v):
        out, _ = fn(fwd_args(q, k, v, "sbhd", "causal"))
        return out.view(*out.shape[:2], -1)

    with FakeTensorMode():
        q, k, v = (torch.empty(64, 2, 8, 64, dtype=BF16, device="meta", requires_grad=True) for _ in range(3))
        out = attn(q, k, v)
        assert out.shape == (64, 2, 512)
        out.sum().backward()
        assert q.grad.shape == q.shape
    (gm,) = dynamo_graphs
    return gm, seen


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_compiled_graphs_decode_the_family():
    """One ``fused_attn`` node forward, one ``fused_attn_backward`` node backward (the forward
    is not recomputed there), decoded by the TE graph model from the schema."""
    gm, seen = _compile_on_fake()
    nodes = [n for n in gm.graph.nodes if gmod.is_te_op_node(n)]
    assert [gmod.te_op_name(n) for n in nodes] == ["fused_attn"]
    call = gmod.decode(nodes[0])
    assert call.module_kind == "fused_attn" and not call.is_backward
    assert {f: t.kind for f, t in call.tq_fields.items()} == {"q": "tensor", "k": "tensor", "v": "tensor"}
    assert call.config["qkv_layout"] == "sbhd_sbhd_sbhd" and call.config["attn_mask_type"] == "causal"
    assert call.config["max_seqlen_q"] == 64 and call.config["fp8"] is False
    assert call.tensors["cu_seqlens_q"] is not None and call.tensors["attn_bias"] is None
    per_graph = {k: [gmod.te_op_name(n) for n in g.graph.nodes if gmod.is_te_op_node(n)] for k, g in seen.items()}
    assert per_graph == {"fw": ["fused_attn"], "bw": ["fused_attn_backward"]}, per_graph
    aot = {gmod.te_op_name(n): gmod.decode(n) for g in seen.values() for n in g.graph.nodes if gmod.is_te_op_node(n)}
    bwd = aot["fused_attn_backward"]
    assert bwd.is_backward and bwd.module_kind == "fused_attn"
    assert {n for n, t in bwd.tensors.items() if t is not None} >= {"grad_output", "q", "k", "v", "out",
                                                                   "softmax_stats", "rng_state"}
    assert bwd.config["dqkv_layout"] == "sbhd_sbhd_sbhd" and bwd.config["nominal_dtype"] == BF16


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_post_grad_pipeline_calls_te_impls_directly():
    """te_passes' configured post-grad pipeline (through the harness, as the backend runs it)
    retargets both wrapper ops to their base ops and marks them for a direct call of TE's
    ``_fused_attn_forward_impl`` / ``_fused_attn_backward_impl``."""
    from te_passes.compat.install import install
    from te_passes.testing.harness import run_passes

    install()
    _, seen = _compile_on_fake()
    impls = {}
    for name, stage in (("fw", "post_grad_fwd"), ("bw", "post_grad_bwd")):
        run = run_passes(seen[name], None, stage)
        (ret,) = run.records("retargeted")
        (direct,) = run.records("direct_call")
        assert ret.data["to"] == ret.data["from"] + "_base"
        impls[name] = direct.data["impl"].rsplit(".", 1)[1]
        assert not run.records("kept")
    assert impls == {"fw": "_fused_attn_forward_impl", "bw": "_fused_attn_backward_impl"}


def test_runtime_install_registers_the_family_in_a_fresh_process():
    """``te_passes.compat.install.install()`` (what the backend calls) registers the family once
    TE's attention module is imported, and the direct-call lowering covers its base ops."""
    import os
    import subprocess
    import sys

    code = ("import torch, transformer_engine.pytorch\n"
            "from torch._library.custom_ops import OPDEFS\n"
            "from te_passes.ops import direct_lowering as dl, te_base as te_base_op\n"
            "from te_passes.compat.install import install\n"
            "assert 'transformer_engine_compile::fused_attn' not in OPDEFS\n"
            "install()\n"
            "ops = [te_base_op.overload(f'transformer_engine_compile::fused_attn{s}') for s in ('_base', '_backward_base')]\n"
            "print(sorted(k for k in OPDEFS if '::fused_attn' in k), [dl.lowering_reason(o) for o in ops])\n")
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TE_PASSES_FUSED_ATTN", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == (
        "['transformer_engine_compile::fused_attn', 'transformer_engine_compile::fused_attn_backward', "
        "'transformer_engine_compile::fused_attn_backward_base', 'transformer_engine_compile::fused_attn_base'] "
        "[None, None]")


def test_switch_that_is_not_a_bool_is_an_option_error(monkeypatch):
    from te_passes.config import TePassesOptionError, TePassesOptions

    monkeypatch.setenv("TE_PASSES_FUSED_ATTN", "maybe")
    with pytest.raises(TePassesOptionError, match="TE_PASSES_FUSED_ATTN='maybe': option te_passes.fused_attn must be "
                                                  "a bool"):
        TePassesOptions.parse(None)
    monkeypatch.setenv("TE_PASSES_FUSED_ATTN", "On")
    assert TePassesOptions.parse(None)[0].fused_attn
    monkeypatch.setenv("TE_PASSES_FUSED_ATTN", "no")
    assert not TePassesOptions.parse(None)[0].fused_attn
