"""The TE-kernel ops of the untouched polyfills (``te_passes::te_act_fwd`` / ``_bwd``,
``te_passes::te_norm_fwd`` / ``_bwd``) on CPU: TE's kernels are CUDA-only, so
``transformer_engine_torch``'s functions are replaced by recording CPU stand-ins; what is checked is
the ops' own code: which TE function each calls with which arguments (``activation_params``
included), the shapes they hand back (the statistics shaped like ``x`` without its last dim, and
flattened again for TE's backward), autograd, and ``torch.library.opcheck`` of the schema / fake.
TE's kernels themselves: the GPU tests (``tests/gpu/test_untouched_gpu.py``)."""

from __future__ import annotations

import pytest
import torch

from te_passes.testing.capture import capture_skip_reason

pytestmark = pytest.mark.skipif(capture_skip_reason() is not None, reason=str(capture_skip_reason()))


def marker(grad, x):
    """The stand-in backward kernels' result: ``grad`` (both halves for a gated one) times ``x``."""
    g = torch.cat([grad, grad], -1) if grad.shape[-1] != x.shape[-1] else grad
    return (g.float() * x.float()).to(x.dtype)


@pytest.fixture
def tex(monkeypatch):
    """TE's extension with CPU stand-ins for the activation and norm kernels; ``tex.calls`` records
    ``(function, shapes / dtypes, kwargs)``."""
    from te_passes.testing.fake_gpu import import_te

    import_te()
    import transformer_engine_torch as tex
    from te_passes.te.norm_act import ACTIVATIONS

    calls: list = []

    def act(name):
        def f(x, quantizer, **kw):
            assert quantizer is None and x.is_contiguous()
            calls.append((name, x.dtype, kw))
            return ACTIVATIONS[name](x.float(), kw).to(x.dtype)
        return f

    def dact(name):
        def f(grad, x, quantizer, **kw):
            assert quantizer is None and grad.is_contiguous() and x.is_contiguous()
            calls.append((name, grad.dtype, kw))
            return marker(grad, x)
        return f

    for name in ("gelu", "swiglu", "clamped_swiglu"):
        monkeypatch.setattr(tex, name, act(name))
        back = "clamped_dswiglu" if name == "clamped_swiglu" else f"d{name}"
        monkeypatch.setattr(tex, back, dact(back))

    def layernorm_fwd(x, w, b, eps, out, q, otype, sm, zcg):
        calls.append(("layernorm_fwd", tuple(x.shape)))
        xf = x.float()
        mu, var = xf.mean(-1), xf.var(-1, unbiased=False)
        rs = torch.rsqrt(var + eps)
        return ((xf - mu[:, None]) * rs[:, None] * (w.float() + zcg) + b.float()).to(x.dtype), mu, rs

    def layernorm_bwd(dy, x, mu, rs, w, sm, zcg):
        calls.append(("layernorm_bwd", tuple(dy.shape), tuple(mu.shape), tuple(rs.shape)))
        return torch.zeros_like(x), torch.zeros_like(w), torch.zeros_like(w)

    monkeypatch.setattr(tex, "layernorm_fwd", layernorm_fwd)
    monkeypatch.setattr(tex, "layernorm_bwd", layernorm_bwd)
    tex.calls = calls
    yield tex
    del tex.calls


@pytest.mark.parametrize("name", ["gelu", "swiglu", "clamped_swiglu"])
def test_activation_op_calls_tes_function_and_differentiates(tex, name):
    from te_passes.ops.te_act import te_activation
    from te_passes.te.norm_act import activation

    params = {"limit": 3.0, "alpha": 1.5, "glu_linear_offset": 0.5} if name == "clamped_swiglu" else None
    x = torch.randn(4, 3, 8, dtype=torch.bfloat16).transpose(0, 1).requires_grad_()  # non-contiguous
    y = te_activation(x, name, params)
    want = activation(x.detach(), name, params)
    assert torch.equal(y, want) and y.shape == (3, 4, 4 if name != "gelu" else 8)
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.equal(x.grad, marker(g, x.detach()))  # the op's backward: TE's function on (grad, x)
    kw = {"limit": 3.0, "alpha": 1.5, "glu_linear_offset": 0.5} if name == "clamped_swiglu" else {}
    back = "clamped_dswiglu" if name == "clamped_swiglu" else f"d{name}"
    assert tex.calls == [(name, torch.bfloat16, kw), (back, torch.bfloat16, kw)]
    torch.library.opcheck(torch.ops.te_passes.te_act_fwd.default,
                          (torch.randn(4, 8, requires_grad=True), name, 3.0, 1.5, 0.5))


def test_norm_op_statistics_shaped_like_the_rows(tex):
    from te_passes.ops.te_norm import te_norm_fwd

    x = torch.randn(5, 2, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(16, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(16, dtype=torch.bfloat16, requires_grad=True)
    y, mu, rs = te_norm_fwd(x, w, b, 1e-5, False, False, 0)
    assert (y.shape, mu.shape, rs.shape) == ((5, 2, 16), (5, 2), (5, 2))
    torch.testing.assert_close(mu, x.float().mean(-1))
    y.sum().backward()
    assert tex.calls == [("layernorm_fwd", (10, 16)), ("layernorm_bwd", (10, 16), (10,), (10,))]
    torch.library.opcheck(torch.ops.te_passes.te_norm_fwd.default, (x.detach(), w.detach(), b.detach(), 1e-5,
                                                                      False, False, 0))


# --------------------------------------------------------------------------- RoPE (te_passes::te_rope_fwd / _bwd)
@pytest.fixture
def tex_rope(monkeypatch):
    """TE's extension with CPU stand-ins for ``fused_rope_forward`` / ``_backward``: TE's unfused formula
    (``attention/rope.py`` ``_apply_rotary_pos_emb_base``); the backward is the rotation by ``-freqs`` (the
    transpose of the forward's). ``tex.calls`` records ``(function, format, interleaved, strides)``."""
    from te_passes.testing.fake_gpu import import_te

    import_te()
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.attention import rope
    from transformer_engine.pytorch.cpp_extensions.fused_attn import QKVFormat

    names = {QKVFormat[f]: f for f in ("sbhd", "bshd")}
    calls: list = []

    def apply(name, t, freqs, start_positions, fmt, interleaved, cu_seqlens, cp_size, cp_rank):
        assert start_positions is None and cu_seqlens is None and (cp_size, cp_rank) == (1, 0)
        assert freqs.dtype == torch.float32
        calls.append((name, names[fmt], interleaved, t.stride()))
        seq = t.shape[0] if names[fmt] == "sbhd" else t.shape[1]
        f = freqs[:seq] if name == "fused_rope_forward" else -freqs[:seq]
        return rope._apply_rotary_pos_emb_base(t, f, names[fmt], interleaved=interleaved)

    monkeypatch.setattr(tex, "fused_rope_forward", lambda *a: apply("fused_rope_forward", *a))
    monkeypatch.setattr(tex, "fused_rope_backward", lambda *a: apply("fused_rope_backward", *a))
    tex.calls = calls
    yield tex
    del tex.calls


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_op_calls_tes_kernel_and_differentiates(tex_rope, fmt, interleaved):
    """The op against TE's unfused path (torch autograd): values and gradient; a non-contiguous input (MHA's
    q / k views) reaches TE's kernel as is; freqs are cast to fp32 as FusedRoPEFunc does."""
    from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb
    from te_passes.ops.te_rope import te_rope

    base = torch.randn(6, 3, 2, 16, dtype=torch.bfloat16)
    x = (base if fmt == "sbhd" else base.transpose(0, 1))[..., 4:12].requires_grad_()  # a strided view
    assert not x.is_contiguous()
    f = torch.randn(10, 1, 1, 4, dtype=torch.float64)  # RoPE's layout (RotaryPositionEmbedding); not fp32: cast
    freqs = f.repeat_interleave(2, dim=-1) if interleaved else torch.cat([f, f], dim=-1)
    y = te_rope(x, freqs, fmt, interleaved=interleaved)
    xr = x.detach().clone().requires_grad_()
    want = apply_rotary_pos_emb(xr, freqs.float(), fmt, interleaved=interleaved, fused=False)
    assert y.is_contiguous() and y.dtype == x.dtype and y.shape == x.shape
    torch.testing.assert_close(y, want)
    g = torch.randn_like(y)
    y.backward(g)
    want.backward(g)
    torch.testing.assert_close(x.grad, xr.grad)
    assert [c[:3] for c in tex_rope.calls] == [("fused_rope_forward", fmt, interleaved),
                                                ("fused_rope_backward", fmt, interleaved)]
    torch.library.opcheck(torch.ops.te_passes.te_rope_fwd.default,
                          (torch.randn(6, 3, 2, 8, requires_grad=True), torch.randn(10, 1, 1, 8), None, fmt,
                           interleaved, None, 1, 0))


def test_rope_op_rejects_bad_format():
    from te_passes.ops.te_rope import te_rope

    with pytest.raises(ValueError, match="tensor_format 'sbdh'"):
        te_rope(torch.randn(2, 2, 2, 4), torch.randn(2, 1, 1, 4), "sbdh")
    with pytest.raises(ValueError, match="needs cu_seqlens"):
        te_rope(torch.randn(4, 2, 4), torch.randn(4, 1, 1, 4), "thd")


def _te_marked_backend(graphs):
    from te_passes.compat.dynamo.hooks import mark_untouched_backend

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    return mark_untouched_backend(backend)


def test_rope_polyfill_runs_tes_fused_call_through_the_op(tex_rope):
    """CPU tensors, compiled for a backend taking the polyfills: TE's ``apply_rotary_pos_emb(fused=True)`` becomes
    the op (TE's arguments in TE's order) and gives TE eager's fused values and gradient (FusedRoPEFunc on the same
    stand-in kernels)."""
    from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb
    from tests.runtime.test_untouched import install_polyfills

    install_polyfills()
    freqs = torch.randn(12, 1, 1, 8)

    def f(t):
        return apply_rotary_pos_emb(t, freqs, "bshd", fused=True, interleaved=True) * 3

    torch._dynamo.reset()
    graphs: list = []
    x = torch.randn(2, 5, 3, 8, dtype=torch.bfloat16, requires_grad=True)
    y = torch.compile(f, backend=_te_marked_backend(graphs), fullgraph=True)(x)
    assert len(graphs) == 1 and any("te_rope_fwd" in str(n.target) for n in graphs[0].graph.nodes)
    y.sum().backward()
    xr = x.detach().clone().requires_grad_()
    want = f(xr)  # eager: TE's FusedRoPEFunc
    want.sum().backward()
    assert torch.equal(y, want) and torch.equal(x.grad, xr.grad)
    assert [c[0] for c in tex_rope.calls] == ["fused_rope_forward", "fused_rope_backward"] * 2


# --------------------------------------------------------------------------- te.ops norms (te.RMSNorm / te.LayerNorm)
@pytest.fixture
def tex_norms(tex, monkeypatch):
    """``tex``'s stand-ins plus ``rmsnorm_fwd`` / ``_bwd``, also where TE's ``te.ops`` norms imported them by name."""
    from transformer_engine.pytorch.ops.basic import layer_norm, rmsnorm

    def rmsnorm_fwd(x, w, eps, out, q, otype, sm, zcg):
        tex.calls.append(("rmsnorm_fwd", tuple(x.shape), x.dtype, sm))
        xf = x.float()
        rs = torch.rsqrt(xf.pow(2).mean(-1) + eps)
        return (xf * rs[:, None] * (w.float() + zcg)).to(x.dtype), None, rs

    def rmsnorm_bwd(dy, x, rs, w, sm, zcg):
        tex.calls.append(("rmsnorm_bwd", tuple(dy.shape), tuple(rs.shape)))
        return (dy.float() * rs[:, None]).to(x.dtype), (dy.float() * x.float()).sum(0).to(w.dtype)

    monkeypatch.setattr(tex, "rmsnorm_fwd", rmsnorm_fwd)
    monkeypatch.setattr(tex, "rmsnorm_bwd", rmsnorm_bwd)
    monkeypatch.setattr(rmsnorm, "rmsnorm_fwd", rmsnorm_fwd)
    monkeypatch.setattr(rmsnorm, "rmsnorm_bwd", rmsnorm_bwd)
    monkeypatch.setattr(layer_norm, "layernorm_fwd", tex.layernorm_fwd)
    monkeypatch.setattr(layer_norm, "layernorm_bwd", tex.layernorm_bwd)
    for m in (layer_norm, rmsnorm):  # TE eager frees its saved tensors into empty CUDA tensors
        monkeypatch.setattr(m, "clear_tensor_data", lambda *tensors: None)
    yield tex


@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
def test_te_ops_norm_forward_matches_te_eager(tex_norms, kind, in_dtype):
    """CPU: ``te.RMSNorm`` / ``te.LayerNorm`` (2-d normalized_shape, zero-centred gamma) compiled for a backend
    taking the polyfills runs ``te_passes::te_ops_norm_fwd`` on TE's casts (input and weight to the weight's dtype)
    and gives TE eager's output and every gradient on the same stand-in kernels."""
    import transformer_engine.pytorch as te
    from tests.runtime.test_untouched import install_polyfills

    install_polyfills()
    torch.manual_seed(0)
    mod = getattr(te, kind)((2, 8), params_dtype=torch.bfloat16, device="cpu", zero_centered_gamma=True)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn_like(p))
    torch._dynamo.reset()
    graphs: list = []
    x = torch.randn(3, 4, 2, 8, dtype=in_dtype, requires_grad=True)
    y = torch.compile(mod, backend=_te_marked_backend(graphs), fullgraph=True)(x)
    assert len(graphs) == 1 and any("te_ops_norm_fwd" in str(n.target) for n in graphs[0].graph.nodes)
    g = torch.randn_like(y)
    y.backward(g)
    got = [x.grad] + [p.grad for p in mod.parameters()]
    mod.zero_grad()
    xr = x.detach().clone().requires_grad_()
    want = mod(xr)  # eager: TE's BasicOperation.forward
    want.backward(g)
    assert y.dtype == want.dtype == torch.bfloat16 and y.shape == want.shape == x.shape
    assert torch.equal(y, want)
    for a, b in zip(got, [xr.grad] + [p.grad for p in mod.parameters()]):
        assert a is not None and torch.equal(a, b)
    fwd = [c for c in tex_norms.calls if c[0].endswith("_fwd")]
    assert len(fwd) == 2 and fwd[0][:2] == fwd[1][:2] == (fwd[0][0], (12, 16)), tex_norms.calls
    w = torch.randn(16, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.te_passes.te_ops_norm_fwd.default,
                          (torch.randn(3, 16, dtype=torch.bfloat16, requires_grad=True), w,
                           None if kind == "RMSNorm" else torch.randn_like(w), 1e-5, kind == "RMSNorm", True, 0))


def test_l2_normalization_forward_is_tes_formulas():
    """CPU: ``te.ops.L2Normalization`` compiled for a backend taking the polyfills computes TE's ``jit.py``
    forward (``l2normalization_fwd_fused_``) and TE's hand-written backward (``l2normalization_backward_fused_``)
    exactly (the functions TE's ``lazy_compile`` wraps, called uncompiled)."""
    from transformer_engine.pytorch import jit
    from transformer_engine.pytorch.ops import L2Normalization
    from tests.runtime.test_untouched import install_polyfills

    install_polyfills()
    mod = L2Normalization(eps=1e-6)
    torch._dynamo.reset()
    graphs: list = []
    x = torch.randn(5, 2, 3, 16, dtype=torch.bfloat16, requires_grad=True)
    y = torch.compile(mod, backend=_te_marked_backend(graphs), fullgraph=True)(x)
    assert len(graphs) == 1
    g = torch.randn_like(y)
    y.backward(g)
    want, rsqrt_norm = jit.l2normalization_fwd_fused_.__wrapped__(x.detach(), 1e-6)
    dx = jit.l2normalization_backward_fused_.__wrapped__(g, x.detach(), rsqrt_norm, 1e-6)
    assert y.dtype == torch.bfloat16 and torch.equal(y, want) and torch.equal(x.grad, dx)
