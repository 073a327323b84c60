# User trial session 20 (docs/user_trial_s20.md): shared harness. Run each tN.py as
#   cd <checkout> && PYTHONPATH=$PWD python scripts/user_trial_s20/tN.py   (CPU, fake GPU; TE 2.20.2)
"""Trial harness: a user model on fake CUDA, a recording backend marked as te_inductor's (polyfills)."""
import contextlib, warnings, traceback
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from te_passes.compat.dynamo.hooks import mark_untouched_backend
from te_passes.compat.install import install as install_runtime
from te_passes.compat.untouched.gate import clear_island_records, island_records
from te_passes.testing.fake_gpu import constructing, fake_gpu, quiet
import transformer_engine.pytorch as te
from transformer_engine.common import recipe as R

GEMM = ("transformer_engine_compile.linear", "te_passes.delayed_linear_fwd", "te_passes::delayed_linear_fwd")

def count(gm, prefixes):
    return sum(1 for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes
               if n.op == "call_function" and "backward" not in str(n.target) and str(n.target).startswith(prefixes))

class Rec:
    def __init__(self):
        self.graphs = []; self.calls = []
        def backend(gm, ex):
            self.graphs.append(gm)
            def run(*args):
                self.calls.append(args)
                return gm.forward(*args)
            return run
        mark_untouched_backend(backend)
        self.backend = backend
    def summary(self, metrics_before):
        from torch._dynamo.utils import counters, get_compilation_metrics
        ms = [m for m in get_compilation_metrics() if id(m) not in metrics_before]
        breaks = {**dict(counters["unimplemented"]), **dict(counters["graph_break"])}
        return dict(graphs=len(self.graphs), gemms=[count(g, GEMM) for g in self.graphs],
                    attn=[count(g, ("transformer_engine_compile.fused_attn",)) for g in self.graphs],
                    breaks={k[:160]: v for k, v in breaks.items()}, islands=[str(i)[:200] for i in island_records()],
                    recompiles=[(m.recompile_reason or f"new frame {m.co_name}")[:300] for m in ms])

def llama_layer(device="cuda", **kw):
    args = dict(num_gqa_groups=2, hidden_dropout=0.0, attention_dropout=0.0, self_attn_mask_type="causal",
                normalization="RMSNorm", activation="swiglu", bias=False, params_dtype=torch.bfloat16, device=device)
    args.update(kw)
    return te.TransformerLayer(64, 128, 4, **args)

@contextlib.contextmanager
def session(precision="fp8-cs"):
    with quiet(), fake_gpu(precision):
        torch._dynamo.reset(); install_runtime(); clear_island_records()
        from torch._dynamo.utils import counters; counters.clear()
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        yield mode

def metrics_ids():
    from torch._dynamo.utils import get_compilation_metrics
    return {id(m) for m in get_compilation_metrics()}

def trial(name, fn):
    print(f"=== {name}", flush=True)
    try:
        r = fn()
        print("    ->", r, flush=True)
    except Exception as e:
        print("    !! EXC", type(e).__name__, str(e)[:1500].replace("\n", "\n       "), flush=True)
