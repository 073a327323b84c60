import sys, warnings; sys.path.insert(0, __import__("os").path.dirname(__file__))
from h import *
def run_ac(steps, use_ac, dtype):
    with session("bf16") as mode:
        with mode, constructing():
            m = llama_layer(params_dtype=dtype); x = torch.randn(16, 2, 64, device="cuda", dtype=dtype, requires_grad=True)
        rec = Rec(); before = metrics_ids(); c = torch.compile(m, backend=rec.backend)
        for _ in range(steps):
            with mode, (torch.autocast("cuda", dtype=torch.bfloat16) if use_ac else contextlib.nullcontext()): c(x)
        s = rec.summary(before); s["recompiles"] = [r[:140] for r in s["recompiles"]]; return s
trial("torch.autocast, fp32 params, 5 steps", lambda: run_ac(5, True, torch.float32))
trial("no autocast, fp32 params, 5 steps", lambda: run_ac(5, False, torch.float32))
