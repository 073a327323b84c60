import sys, warnings; sys.path.insert(0, __import__("os").path.dirname(__file__))
from h import *
def run_island():
    with session("bf16") as mode:
        with mode, constructing():
            m = llama_layer(attention_dropout=0.1); x = torch.randn(16, 2, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        rec = Rec(); c = torch.compile(m, backend=rec.backend)
        with mode: c(x)
        return [str(i) for i in island_records()]
def run_ac():
    with session("bf16") as mode:
        with mode, constructing():
            m = llama_layer(params_dtype=torch.float32); x = torch.randn(16, 2, 64, device="cuda", requires_grad=True)
        rec = Rec(); before = metrics_ids(); c = torch.compile(m, backend=rec.backend)
        for _ in range(2):
            with mode, torch.autocast("cuda", dtype=torch.bfloat16): c(x)
        return rec.summary(before)
trial("island text", run_island)
trial("torch.autocast around fp32 llama layer", run_ac)
