# Step 5: bad input through the public backend on a plain CPU function
import torch, functools, warnings, os
import te_passes
def f(x): return torch.relu(x) * 2
def trial(name, fn):
    print(f"=== {name}", flush=True)
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            r = fn()
        print("    ->", r, [str(x.message)[:300] for x in w if "te_passes" in str(x.message) or "te-passes" in str(x.message)], flush=True)
    except Exception as e:
        print("    !! EXC", type(e).__module__, type(e).__name__, str(e)[:700], flush=True)
x = torch.randn(8)
def comp(**kw):
    torch._dynamo.reset()
    return torch.compile(f, backend="te_inductor", **kw)(x).shape
trial("plain CPU fn, te_inductor works", lambda: comp())
trial("options typo te_passes.typo", lambda: comp(options={"te_passes.typo": 1}))
trial("options typo te_passes.stict", lambda: comp(options={"te_passes.stict": True}))
trial("options te_passes.disable nonexistent", lambda: comp(options={"te_passes.disable": ["fold_everything"]}))
trial("options te_passes.disable as str", lambda: comp(options={"te_passes.disable": "hoist_te_constants"}))
trial("options te_passes.disable find_autocast_state", lambda: comp(options={"te_passes.disable": ["find_autocast_state"]}))
trial("inductor key typo", lambda: comp(options={"trition.cudagraphs": True}))
trial("te_inductor_backend typo", lambda: te_passes.te_inductor_backend(options={"te_passes.typo": 1}))
trial("te_inductor_backend bad mode", lambda: te_passes.te_inductor_backend(mode="reduce_overhead"))
trial("compile bad mode", lambda: comp(mode="reduce_overhead"))
trial("te_inductor_backend disable nonexistent", lambda: te_passes.te_inductor_backend(options={"te_passes.disable": ["nope"]}))
trial("strict as str", lambda: te_passes.te_inductor_backend(options={"te_passes.strict": "false"}))
trial("cudagraphs bad value", lambda: te_passes.te_inductor_backend(options={"te_passes.cudagraphs": "tree"}))
trial("non-tree cudagraphs", lambda: te_passes.te_inductor_backend(mode="reduce-overhead", options={"triton.cudagraph_trees": False}))
trial("pass_config unknown pass", lambda: te_passes.te_inductor_backend(options={"te_passes.pass_config": {"nope": {}}}))
trial("pass_config unknown field", lambda: te_passes.te_inductor_backend(options={"te_passes.pass_config": {"hoist_te_constants": {"nope": 1}}}))
def envtry(k, v):
    os.environ[k] = v
    try: return comp()
    finally: del os.environ[k]
trial("env TE_PASSES_DISABLE=nope", lambda: envtry("TE_PASSES_DISABLE", "nope"))
trial("env TE_PASSES_DISABLED=x", lambda: envtry("TE_PASSES_DISABLED", "x"))
trial("env TE_PASSES_STRICT=maybe", lambda: envtry("TE_PASSES_STRICT", "maybe"))
trial("reduce-overhead on CPU fn", lambda: comp(mode="reduce-overhead"))
trial("options + mode together", lambda: comp(mode="reduce-overhead", options={"te_passes.strict": True}))
trial("options not a dict", lambda: comp(options=[("te_passes.strict", True)]))
