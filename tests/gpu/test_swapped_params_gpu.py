"""Swapped parameters under te_inductor on a GPU (session 20's user trial): after a first compiled step,
the module's parameters are replaced — ``torch.func.functional_call``, ``load_state_dict(..., assign=True)``,
``owner.name = nn.Parameter(...)`` — and the next compiled step must compute with the new values.

The CPU tests (tests/runtime/test_untouched_dynamic_params.py) show the new ``Parameter`` objects reach the
Dynamo graph's arguments; what they cannot show is that nothing after Dynamo (AOTAutograd, Inductor,
te_passes' ``hoist_te_constants`` / ``call_te_impl_directly``, TE's own weight caches) still computes with
the old values. Here an eager twin gets the same new values in place and the compiled step's output and
every gradient (input and the new parameters) must match it within ``REL_TOL[precision]``, with no
recompile after the first step (the CPU captures compile nothing for a swap).

Run: ``source .gpu/s/env.sh; python3 -m pytest tests/gpu/test_swapped_params_gpu.py -m gpu -s``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from te_passes.testing.gpu import CompileWatch, copy_params, fwd_bwd, make_recipe

from _gpu_checks import assert_close  # tests/_helpers

pytestmark = pytest.mark.gpu

HIDDEN, FFN, HEADS, GROUPS, SEQ, BATCH = 512, 1024, 8, 4, 128, 2


def _build(kind: str) -> torch.nn.Module:
    import transformer_engine.pytorch as te

    common = dict(params_dtype=torch.bfloat16, device="cuda")
    if kind == "Linear":
        return te.Linear(HIDDEN, HIDDEN, bias=False, **common)
    if kind == "LayerNormLinear":
        return te.LayerNormLinear(HIDDEN, HIDDEN, normalization="RMSNorm", bias=False, **common)
    if kind == "LayerNormMLP":
        return te.LayerNormMLP(HIDDEN, FFN, normalization="RMSNorm", activation="swiglu", bias=False, **common)
    return te.TransformerLayer(HIDDEN, FFN, HEADS, num_gqa_groups=GROUPS, hidden_dropout=0.0,
                               attention_dropout=0.0, self_attn_mask_type="causal", normalization="RMSNorm",
                               activation="swiglu", bias=False, **common)


def _shape(kind: str) -> tuple[int, ...]:
    return (SEQ, BATCH, HIDDEN) if kind == "TransformerLayer" else (SEQ * BATCH, HIDDEN)


def _new_values(model: torch.nn.Module, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Values far from the current ones: sign flipped, scaled, plus noise of the parameter's own size."""
    out = {}
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, device=p.device, dtype=p.dtype, generator=gen)
        out[name] = (-1.5 * p.detach() + 0.5 * p.detach().float().std().to(p.dtype) * noise).contiguous()
    return out


def _swap(model: torch.nn.Module, how: str, values: dict[str, torch.Tensor]) -> dict[str, torch.nn.Parameter]:
    """Install ``values`` into ``model`` as new ``Parameter`` objects (``setattr`` / ``load_state_dict``);
    for ``functional_call`` only build them. Returns the new parameters by name."""
    new = {n: torch.nn.Parameter(v.clone()) for n, v in values.items()}
    if how == "load_state_dict_assign":
        state = dict(model.state_dict())
        state.update(new)
        model.load_state_dict(state, assign=True)
    elif how == "setattr":
        for name, p in new.items():
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, attr, p)
    return new


def _step_functional(fn, new, x, dy):
    from torch.func import functional_call

    for p in new.values():
        p.grad = None
    x.grad = None
    y = functional_call(fn, new, (x,))
    y = y[0] if isinstance(y, tuple) else y
    y.backward(dy)
    grads = {"x": x.grad.detach().clone(), **{n: p.grad.detach().clone() for n, p in new.items()}}
    return y.detach().clone(), grads


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("how", ["functional_call", "load_state_dict_assign", "setattr"])
@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP", "TransformerLayer"])
def test_compiled_step_uses_swapped_parameters(kind, how, precision):
    import transformer_engine.pytorch as te
    from te_passes.compat.install import install

    recipe = make_recipe(precision)

    def outer():
        return te.autocast(enabled=True, recipe=recipe) if recipe is not None else contextlib.nullcontext()

    torch.manual_seed(0)
    ref, cand = _build(kind), _build(kind)
    copy_params(ref, cand)
    torch._dynamo.reset()
    install()
    compiled = torch.compile(cand, backend="te_inductor")
    gen = torch.Generator(device="cuda").manual_seed(5)
    shape = _shape(kind)

    def data():
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
        return x, torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    with CompileWatch() as watch:
        x, dy = data()
        with outer():
            y, _ = fwd_bwd(compiled, cand, x, dy)
            y_ref, _ = fwd_bwd(ref, ref, x, dy)
        assert_close("step 0 out", y, y_ref, precision)
        first = watch.snapshot()

        values = _new_values(ref, gen)
        with torch.no_grad():  # the eager twin: same new values, in place
            for name, p in ref.named_parameters():
                p.copy_(values[name])
        new = _swap(cand, how, values)
        for step in (1, 2):
            x, dy = data()
            with outer():
                if how == "functional_call":
                    y, g = _step_functional(compiled, new, x, dy)
                else:
                    assert all(dict(cand.named_parameters())[n] is p for n, p in new.items())
                    y, g = fwd_bwd(compiled, cand, x, dy)
                y_ref, g_ref = fwd_bwd(ref, ref, x, dy)
            out_err = assert_close(f"step {step} out", y, y_ref, precision)
            assert g.keys() == g_ref.keys(), (sorted(g), sorted(g_ref))
            grad_err = max(assert_close(f"step {step} grad {k}", g[k], g_ref[k], precision) for k in g_ref)
            print(f"{kind} {how} {precision} step {step}: out {out_err:.2e} grad {grad_err:.2e}")
        torch.cuda.synchronize()
    st = watch.stats
    assert st.graph_breaks == 0, st.break_reasons
    assert st.recompiles == first.recompiles, st.recompile_reasons  # the swap compiled nothing
