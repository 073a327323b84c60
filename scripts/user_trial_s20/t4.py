# Step 4: training-loop shapes, forward only (the backward needs a CUDA device guard on CPU)
import sys, warnings; sys.path.insert(0, __import__("os").path.dirname(__file__))
from h import *
import torch.utils.checkpoint as ckpt
class Net(torch.nn.Module):
    def __init__(self, checkpoint=False):
        super().__init__(); self.layers = torch.nn.ModuleList([llama_layer(layer_number=i+1) for i in range(2)])
        self.rope = te.RotaryPositionEmbedding(16); self.ck = checkpoint
    def forward(self, x):
        e = self.rope(x.shape[0])
        for l in self.layers:
            x = ckpt.checkpoint(l, x, use_reentrant=False, rotary_pos_emb=e) if self.ck else l(x, rotary_pos_emb=e)
        return x
def run(recipe_name, where, eval_between=False, checkpoint=False, disabled=False, steps=3):
    prec = "bf16" if recipe_name is None else "fp8-cs"
    with session(prec) as mode, warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with mode, constructing():
            m = Net(checkpoint); x = torch.randn(16, 2, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        rcp = None if recipe_name is None else getattr(R, recipe_name)()
        def ac():
            if disabled: return te.autocast(enabled=False)
            return te.autocast(enabled=True, recipe=rcp) if rcp is not None else contextlib.nullcontext()
        def inner(x):
            with ac(): return m(x)
        rec = Rec(); before = metrics_ids()
        fn = torch.compile(inner if where == "inside" else m, backend=rec.backend)
        first = None
        for s in range(steps):
            with mode:
                if where == "inside": fn(x)
                else:
                    with ac(): fn(x)
                if eval_between:
                    m.eval()
                    with torch.no_grad():
                        if where == "inside": fn(x)
                        else:
                            with ac(): fn(x)
                    m.train()
            if first is None: first = metrics_ids()
        s = rec.summary(before)
        later = s["recompiles"][len([1 for _ in range(0)]):]
        from torch._dynamo.utils import get_compilation_metrics
        s["after_step1"] = [ (mm.recompile_reason or "new frame")[:250] for mm in get_compilation_metrics() if id(mm) not in first]
        del s["recompiles"]
        s["warnings"] = sorted({str(x.message)[:300] for x in w if "te_passes" in str(x.message) or "TE" in str(x.message)})
        return s
trial("Float8CurrentScaling outside", lambda: run("Float8CurrentScaling", "outside"))
trial("Float8CurrentScaling inside", lambda: run("Float8CurrentScaling", "inside"))
trial("DelayedScaling outside", lambda: run("DelayedScaling", "outside"))
trial("DelayedScaling inside", lambda: run("DelayedScaling", "inside"))
trial("bf16 te.autocast(enabled=False) outside", lambda: run(None, "outside", disabled=True))
trial("bf16 te.autocast(enabled=False) inside", lambda: run(None, "inside", disabled=True))
trial("bf16 eval+no_grad between", lambda: run(None, "outside", eval_between=True))
trial("fp8-cs eval+no_grad between", lambda: run("Float8CurrentScaling", "outside", eval_between=True))
trial("bf16 checkpoint per layer", lambda: run(None, "outside", checkpoint=True))
trial("fp8-cs checkpoint per layer", lambda: run("Float8CurrentScaling", "outside", checkpoint=True))
trial("DelayedScaling checkpoint per layer", lambda: run("DelayedScaling", "outside", checkpoint=True))
