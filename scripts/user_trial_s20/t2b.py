# Step 2b: the Llama layer, seq 16 -> 24 -> 40, default / dynamic=True / mark_dynamic; bf16 and fp8-cs
import sys; sys.path.insert(0, __import__("os").path.dirname(__file__))
from h import *
class M(torch.nn.Module):
    def __init__(self):
        super().__init__(); self.layer = llama_layer(); self.rope = te.RotaryPositionEmbedding(16)
    def forward(self, x):
        return self.layer(x, rotary_pos_emb=self.rope(x.shape[0]))
def seqs(precision, dynamic, mark):
    with session(precision) as mode:
        with mode, constructing():
            m = M(); xs = [torch.randn(s, 2, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True) for s in (16, 24, 40)]
        rec = Rec(); before = metrics_ids()
        c = torch.compile(m, backend=rec.backend, dynamic=dynamic)
        ac = (lambda: te.autocast(enabled=True, recipe=R.Float8CurrentScaling())) if precision != "bf16" else contextlib.nullcontext
        out = []
        for x in xs:
            if mark: torch._dynamo.mark_dynamic(x, 0)
            with mode, ac():
                out.append(tuple(c(x).shape))
        s = rec.summary(before); s["shapes"] = out
        s["graph_inputs"] = [[tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in g.graph.find_nodes(op="placeholder")][:0] for g in rec.graphs]
        return s
for p in ("bf16", "fp8-cs"):
    for dyn, mark in ((None, False), (True, False), (None, True)):
        trial(f"{p} dynamic={dyn} mark_dynamic={mark}", lambda: seqs(p, dyn, mark))
