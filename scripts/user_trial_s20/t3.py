# Step 3: swapped parameters after a first compiled call
import sys, warnings; sys.path.insert(0, __import__("os").path.dirname(__file__))
from h import *
from torch.func import functional_call
def build(kind):
    if kind == "Linear": return te.Linear(64, 64, bias=False, params_dtype=torch.bfloat16, device="cuda")
    if kind == "LayerNormLinear": return te.LayerNormLinear(64, 64, normalization="RMSNorm", bias=False, params_dtype=torch.bfloat16, device="cuda")
    if kind == "LayerNormMLP": return te.LayerNormMLP(64, 128, normalization="RMSNorm", activation="swiglu", bias=False, params_dtype=torch.bfloat16, device="cuda")
    return llama_layer()
def run(kind, how, precision):
    with session(precision) as mode:
        with mode, constructing():
            m = build(kind); x = torch.randn(16, 2, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
            new = {n: torch.nn.Parameter(torch.randn_like(p)) for n, p in m.named_parameters()}
        rec = Rec(); before = metrics_ids(); c = torch.compile(m, backend=rec.backend)
        ac = (lambda: te.autocast(enabled=True, recipe=rcp)) if precision != "bf16" else contextlib.nullcontext
        rcp = R.Float8CurrentScaling()
        with mode, ac(): c(x)
        with mode, ac():
            if how == "functional_call":
                functional_call(c, dict(new), (x,))
            elif how == "load_state_dict_assign":
                sd = dict(m.state_dict()); sd.update(new)
                missing = m.load_state_dict(sd, assign=True, strict=False)
                c(x)
            elif how == "setattr_param":
                name = next(iter(new)); owner = m.get_submodule(name.rpartition(".")[0]) if "." in name else m
                setattr(owner, name.rpartition(".")[2], new[name]); new = {name: new[name]}
                c(x)
        last = rec.calls[-1]
        ids = {id(a) for a in last if isinstance(a, torch.Tensor)}
        reached = {n: (id(p) in ids) for n, p in new.items()}
        old_ids = {id(p) for p in m.parameters()}
        s = rec.summary(before)
        return dict(graphs=s["graphs"], recompiles=s["recompiles"], breaks=s["breaks"], islands=s["islands"],
                    new_params_reached_graph=f"{sum(reached.values())}/{len(reached)}",
                    missing=[n for n, v in reached.items() if not v][:6])
for kind in ("Linear", "LayerNormLinear", "LayerNormMLP", "TransformerLayer"):
    for how in ("functional_call", "load_state_dict_assign", "setattr_param"):
        for p in ("bf16", "fp8-cs"):
            trial(f"{kind} {how} {p}", lambda: run(kind, how, p))
