"""Worker for tests/gpu/test_step_capture_gpu.py: one te_passes.make_graphed case in a fresh
process (a failed te.make_graphed_callables leaves TE in capture state for its process).

``python _make_graphed_worker.py CASE RECIPE`` prints one ``RESULT {json}`` line. Cases:
``train-clone1`` / ``train-clone0`` (5 steps: loss, x.grad and every .grad against TE eager,
``clone_param_grads_on_return`` True / False), ``shape-change`` (a call with another token
count must raise StepCaptureError).
"""

from __future__ import annotations

import json
import sys
import traceback


def main(case: str, name: str) -> dict:
    import torch

    import te_passes
    from te_passes.compat.te220.capture_state import te_capture_state
    from te_passes.testing.gpu import build_stack, copy_params, ensure_te_inductor_backend, rel_err

    ensure_te_inductor_backend()
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as r
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as M

    recipe, tol = None, "bf16"
    if name != "bf16":
        ok, why = {"fp8-cs": M.is_fp8_available, "fp8-block": M.is_fp8_block_scaling_available,
                   "mxfp8": M.is_mxfp8_available}[name]()
        if not ok:
            return {"skip": f"{name}: {why}"}
        recipe = {"fp8-cs": r.Float8CurrentScaling, "fp8-block": r.Float8BlockScaling,
                  "mxfp8": r.MXFP8BlockScaling}[name]()
        tol = "fp8"
    hidden, tokens = 1024, 256
    ref = build_stack(2, hidden, seed=0)
    model = build_stack(2, hidden, seed=0)
    copy_params(ref, model)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kw = dict(enabled=recipe is not None, recipe=recipe) if recipe is not None else {}
    graphed = te_passes.make_graphed(model, (x,), clone_param_grads_on_return=case != "train-clone0", **kw)

    def run(m, inp):
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            return m(inp)

    if case == "shape-change":
        try:
            run(graphed, torch.randn(tokens // 2, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True))
        except Exception as e:  # noqa: BLE001 - reported to the test
            return {"status": "ok", "error_type": type(e).__name__, "error": str(e)[:500]}
        return {"status": "no error on a shape change"}
    errs = []
    for i in range(5):
        torch.manual_seed(100 + i)
        xi = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        a, b = xi.clone().requires_grad_(), xi.clone().requires_grad_()
        for p in model.parameters():
            p.grad = None
        for p in ref.parameters():
            p.grad = None
        ya = run(graphed, a)
        ya.backward(dy)
        yb = run(ref, b)
        yb.backward(dy)
        errs.append(rel_err(ya, yb))
        errs.append(rel_err(a.grad, b.grad))
        errs += [rel_err(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())]
    return {"status": "ok", "tol": tol, "max_rel_err": max(errs), "capture_state_after": te_capture_state()}


if __name__ == "__main__":
    try:
        res = main(sys.argv[1], sys.argv[2])
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        res = {"status": f"error: {type(e).__name__}: {str(e)[:400]}", "traceback": traceback.format_exc()[-3000:]}
    print("RESULT " + json.dumps(res), flush=True)
