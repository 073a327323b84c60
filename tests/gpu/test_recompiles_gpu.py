"""Issue 15 item 3: no recompile after the first step, with TE's modules untouched and with
``compile_friendly``, once ``te_passes.prepare_te_state`` ran (TE's first-forward lazy state).

Run on the H200 (one node id, every case)::

    pytest -m gpu "tests/gpu/test_recompiles_gpu.py::test_no_recompile_after_first_step" -s

Cases (te_inductor, default mode, fwd+bwd, 4 steps, the recipe built once outside the compiled
function): ``te.TransformerLayer`` untouched in bf16 and fp8 (Float8CurrentScaling), two
untouched layers in fp8 (the per-layer frames of the 4-layer model), the layer rewritten by
``compile_friendly`` in bf16 and fp8 (attention through SDPA, and through TE's fused attention:
``attention="te_fused"``), and the benchmark's stack4 (4 ``te.Linear``) in fp8.
Asserted: 0 recompiles after the first step. Printed: every recompile reason (the ones within the
first step are TE's ``no_torch_dynamo`` ``wrapper`` frame seen with other argument counts; see
docs/usage.md).
"""

from __future__ import annotations

import pytest
import torch

from te_passes.testing.gpu import CompileWatch, build_stack, make_recipe

pytestmark = pytest.mark.gpu

HIDDEN, FFN, HEADS, SEQ, BATCH = 512, 2048, 8, 256, 2
CASES = ["layer-bf16", "layer-fp8", "layer2-fp8", "cf-layer-bf16", "cf-layer-fp8", "cffused-layer-bf16",
         "cffused-layer-fp8", "stack4-fp8"]


def _build(case: str):
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    if case.startswith("stack4"):
        return build_stack(4, HIDDEN)
    layers = 2 if case.startswith("layer2") else 1
    model = torch.nn.Sequential(*[te.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                                                      params_dtype=torch.bfloat16, device="cuda")
                                  for _ in range(layers)])
    if case.startswith("cf"):
        from te_passes.compat.untouched.rewrite.compile_friendly import compile_friendly

        compile_friendly(model, strict=True, attention="te_fused" if case.startswith("cffused") else "sdpa")
    return model


@pytest.mark.parametrize("case", CASES)
def test_no_recompile_after_first_step(case):
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import Float8CurrentScaling

    from te_passes.compat.untouched.rewrite.te_state import prepare_te_state, unprepared_te_state

    fp8 = case.endswith("fp8")
    # TE's MultiheadAttention reads the recipe even in bf16: the layers get one (built outside)
    recipe = make_recipe("fp8") if fp8 else (None if case.startswith("stack4") else Float8CurrentScaling())
    model = _build(case)
    done = prepare_te_state(model, recipe, fp8=fp8)
    assert unprepared_te_state(model, recipe, fp8=fp8) == []

    def fwd(x):
        if recipe is None:
            return model(x)
        with te.autocast(enabled=fp8, recipe=recipe):
            return model(x)

    fn = torch.compile(fwd, backend="te_inductor")
    params = list(model.parameters())
    gen = torch.Generator(device="cuda").manual_seed(3)
    shape = (SEQ * BATCH, HIDDEN) if case.startswith("stack4") else (SEQ, BATCH, HIDDEN)
    torch._dynamo.reset()
    with CompileWatch() as watch:
        for step in range(4):
            x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
            for p in params:
                p.grad = None
            y = fn(x)
            y.backward(torch.randn(y.shape, device="cuda", dtype=y.dtype, generator=gen))
            if step == 0:
                first = watch.snapshot()
        torch.cuda.synchronize()
    st = watch.stats
    print(f"{case}: prepared {done}; graphs {st.graphs}, breaks {st.graph_breaks}, recompiles {st.recompiles} "
          f"({first.recompiles} in step 1)")
    for r in st.recompile_reasons:
        print("  recompile:", r.splitlines()[0][:240])
    assert st.recompiles - first.recompiles == 0, st.recompile_reasons[first.recompiles:]
