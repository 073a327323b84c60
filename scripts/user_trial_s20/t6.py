# Step 5f / extras: other recipes, torch.autocast around TE, attention dropout in training
import sys, warnings; sys.path.insert(0, __import__("os").path.dirname(__file__))
from h import *
def run(build, recipe=None, torch_autocast=False, prec="fp8-cs"):
    with session(prec) as mode, warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with mode, constructing():
            m = build(); x = torch.randn(16, 2, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        rec = Rec(); before = metrics_ids(); c = torch.compile(m, backend=rec.backend)
        for _ in range(2):
            with mode, (te.autocast(enabled=True, recipe=recipe) if recipe is not None else contextlib.nullcontext()), \
                 (torch.autocast("cuda", dtype=torch.bfloat16) if torch_autocast else contextlib.nullcontext()):
                c(x)
        s = rec.summary(before)
        s["warnings"] = sorted({str(x.message)[:400] for x in w if "lru_cache" not in str(x.message)})[:4]
        return s
lin = lambda: te.Linear(64, 64, params_dtype=torch.bfloat16, device="cuda")
for name in ("Float8BlockScaling", "NVFP4BlockScaling", "MXFP8BlockScaling"):
    trial(f"te.Linear under {name}", lambda: run(lin, getattr(R, name)()))
trial("llama layer under torch.autocast (bf16)", lambda: run(lambda: llama_layer(params_dtype=torch.float32), None, True, "bf16"))
trial("llama layer attention_dropout=0.1 training (bf16)", lambda: run(lambda: llama_layer(attention_dropout=0.1), None, False, "bf16"))
