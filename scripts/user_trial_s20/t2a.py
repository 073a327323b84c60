# Step 2a: backend="te_inductor" for real, on fake CUDA (what a CPU user gets)
import sys; sys.path.insert(0, __import__("os").path.dirname(__file__))
from h import *
def real_te_inductor(precision):
    with session(precision) as mode:
        with mode, constructing():
            layer = llama_layer(); rope = te.RotaryPositionEmbedding(16)
            x = torch.randn(16, 2, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        c = torch.compile(layer, backend="te_inductor")
        ac = te.autocast(enabled=True, recipe=R.Float8CurrentScaling()) if precision != "bf16" else contextlib.nullcontext()
        with mode, ac:
            y = c(x, rotary_pos_emb=rope(16))
        return y.shape
trial("te_inductor real, bf16, fake cuda", lambda: real_te_inductor("bf16"))
