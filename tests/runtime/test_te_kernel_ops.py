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
    from te_passes.runtime.ops.te_act import te_activation
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
    from te_passes.runtime.ops.te_norm import te_norm_fwd

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
