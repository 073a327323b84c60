# new recipe object per call: recompiles? warning?
import sys, warnings; sys.path.insert(0, __import__("os").path.dirname(__file__))
from h import *
class M(torch.nn.Module):
    def __init__(self):
        super().__init__(); self.layer = llama_layer(); self.rope = te.RotaryPositionEmbedding(16)
    def forward(self, x):
        return self.layer(x, rotary_pos_emb=self.rope(x.shape[0]))
def run(new_recipe, sizes):
    with session("fp8-cs") as mode, warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with mode, constructing():
            m = M(); xs = [torch.randn(s, 2, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True) for s in sizes]
        rec = Rec(); before = metrics_ids(); c = torch.compile(m, backend=rec.backend)
        r0 = R.Float8CurrentScaling()
        for x in xs:
            with mode, te.autocast(enabled=True, recipe=R.Float8CurrentScaling() if new_recipe else r0):
                c(x)
        s = rec.summary(before)
        s["warnings"] = [str(x.message)[:220] for x in w if "te_passes" in str(x.message)]
        return s
trial("new recipe per call, same shape x3", lambda: run(True, (16, 16, 16)))
trial("one recipe, shapes 16/24/40", lambda: run(False, (16, 24, 40)))
trial("new recipe per call, shapes 16/24/40", lambda: run(True, (16, 24, 40)))
