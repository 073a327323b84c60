"""Host cost of TE constants built per call vs once (pass ``hoist_te_constants``).

Part 1 (CPU, always): the fp8 (Float8CurrentScaling) stack of 4 ``te.Linear`` (``--hidden``,
``--layers``), captured without a GPU (``te_passes.testing.capture.capture_aot``). Inductor's
wrapper without the pass evaluates every TE constant's ``__fx_repr__`` expression
(``OpaqueValueBundle({...})``, ``_rebuild_quantizer(...)``) on every call; with the pass it reads
module globals. This times exactly those two per-call code paths (the expressions are compiled
once, as in the wrapper module) and prints them side by side.

Part 2 (``--gpu``, needs CUDA + TE's compile path): median ms per forward+backward step of
TE eager, ``te_inductor`` default mode with the pass disabled, and ``te_inductor`` default mode
with it, measured in one process, with ratios.

    PYTHONPATH=. python benchmarks/bench_hoist_constants.py [--layers 4] [--reps 2000] [--gpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def _constants(gm):
    from te_passes.runtime.constants import is_liftable_constant

    out = []
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "output"):
            continue
        args = n.args[0] if n.op == "output" else n.args
        for a in list(args) + list(n.kwargs.values()):
            if is_liftable_constant(a):
                out.append(a)
    return out


def _per_call_functions(consts):
    """(rebuild_fn, hoisted_fn): the wrapper's per-call work for these constants without / with
    the pass, compiled once like the generated module."""
    exprs, env = [], {}
    for c in consts:
        e, g = c.__fx_repr__()
        exprs.append(e)
        env.update(g)
    rebuild_src = "def rebuild():\n    return (" + ", ".join(exprs) + ",)\n"
    hoisted_env = {f"_te_const_{i}": c for i, c in enumerate(consts)}
    hoisted_src = "def hoisted():\n    return (" + ", ".join(hoisted_env) + ",)\n"
    exec(compile(rebuild_src, "<wrapper-rebuild>", "exec"), env)  # noqa: S102 - our own generated code
    exec(compile(hoisted_src, "<wrapper-hoisted>", "exec"), hoisted_env)  # noqa: S102
    return env["rebuild"], hoisted_env["hoisted"]


def _time_us(fn, reps: int, rounds: int = 7) -> float:
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        samples.append((time.perf_counter() - t0) / reps * 1e6)
    return statistics.median(samples)


def _install() -> None:
    """``runtime.install()``, as the backend does before any pass runs (TE loaded: it wraps TE's
    constant classes' ``__fx_repr__``; without it ``hoist_te_constants`` leaves constants inline)."""
    from te_passes.runtime.install import install

    install()


def cpu_part(layers: int, hidden: int, reps: int) -> None:
    from te_passes.testing.capture import capture_aot

    aot = capture_aot("stack" if layers > 1 else "linear", "fp8-cs", layers=layers, hidden=hidden, tokens=256)
    _install()
    fwd, bwd = _constants(aot.forward), _constants(aot.backward)
    consts = fwd + bwd
    n_q = sum(type(c).__name__.endswith("Quantizer") for c in consts)
    n_b = len(consts) - n_q
    rebuild, hoisted = _per_call_functions(consts)
    # The nested quantizers inside bundles are rebuilt too: count every construction.
    from transformer_engine.pytorch.dynamo import quantizer_opaque

    calls = {"n": 0}
    orig = quantizer_opaque._rebuild_quantizer

    def counting(cls, items):
        calls["n"] += 1
        return orig(cls, items)

    rebuild.__globals__["_rebuild_quantizer"] = counting
    rebuild()
    nested_q = calls["n"]
    rebuild.__globals__["_rebuild_quantizer"] = orig
    t_rebuild = _time_us(rebuild, reps)
    t_hoisted = _time_us(hoisted, reps)
    print(f"fp8-cs stack x{layers} (hidden {hidden}): forward+backward step, per-call TE constant work")
    print(f"  top-level constants in the wrappers: {len(consts)} ({n_b} OpaqueValueBundle, {n_q} quantizers); "
          f"_rebuild_quantizer calls per step incl. those inside bundles: {nested_q}")
    print(f"  {'':28s}{'per step (us)':>14s}")
    print(f"  {'rebuilt per call (no pass)':28s}{t_rebuild:14.1f}")
    print(f"  {'built once (hoisted)':28s}{t_hoisted:14.2f}")
    print(f"  ratio rebuilt/hoisted: {t_rebuild / max(t_hoisted, 1e-9):.0f}x; host time saved per step: "
          f"{t_rebuild - t_hoisted:.1f} us")


def scaling_part() -> None:
    """Pass time vs graph size (synthetic chains of ``operator.add``; the real TE nodes of a
    captured fp8 te.Linear appended), both stages."""
    import operator

    import torch.fx

    from te_passes.config import TePassesOptions
    from te_passes.pipeline.base import PassContext, Stage
    from te_passes.passes.fold_recipe_lookups import FoldRecipeLookups
    from te_passes.passes.hoist_te_constants import HoistTEConstants
    from te_passes.passes.remove_quantizer_setattrs import RemoveQuantizerSetattrs
    from te_passes.te import recipes
    from te_passes.te.state import TEState

    # the Dynamo-stage recipe passes, then the post-grad one (until issue 12 one pass)
    by_stage = {Stage.DYNAMO: [FoldRecipeLookups(fp8_state=recipes.Fp8State()), RemoveQuantizerSetattrs()],
                Stage.POST_GRAD_FWD: [HoistTEConstants()]}
    _install()
    print("pass time vs graph size (best of 3):")
    print(f"  {'nodes':>8s}{'dynamo (ms)':>14s}{'post-grad (ms)':>16s}")
    for n in (1_000, 10_000, 100_000):
        g = torch.fx.Graph()
        y = g.placeholder("x")
        for _ in range(n):
            y = g.call_function(operator.add, (y, 1.0))
        g.output(y)
        gm = torch.fx.GraphModule(torch.nn.Module(), g)
        row = []
        for stage in (Stage.DYNAMO, Stage.POST_GRAD_FWD):
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                for p in by_stage[stage]:
                    p.run(gm, PassContext(stage, TePassesOptions(), TEState()))
                best = min(best, time.perf_counter() - t0)
            row.append(best * 1e3)
        print(f"  {n:8d}{row[0]:14.1f}{row[1]:16.1f}")


def gpu_part(layers: int, hidden: int, tokens: int, steps: int) -> None:
    from te_passes.testing import gpu as h

    reason = h.gpu_skip_reason()
    if reason is not None:
        print(f"GPU part skipped: {reason}")
        return
    h.ensure_te_inductor_backend()
    recipe = h.make_recipe("fp8")
    eager = h.build_stack(layers, hidden)
    rows = {}
    models = {"TE eager": eager}
    fns = {"TE eager": h.forward_fn(eager, "fp8", recipe)}
    for tag, opts in (("te_inductor, pass off", {"te_passes.disable": ["hoist_te_constants"]}),
                      ("te_inductor, hoisted", {})):
        m = h.build_stack(layers, hidden, seed=1)
        h.copy_params(eager, m)
        models[tag] = m
        fns[tag] = torch.compile(h.forward_fn(m, "fp8", recipe), backend="te_inductor", options=opts)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    for tag, fn in fns.items():
        params = list(models[tag].parameters())
        for _ in range(5):
            h.train_step(fn, x, dy, params)
        torch.cuda.synchronize()
    times = {tag: [] for tag in fns}
    for _ in range(steps):  # interleaved, so drift hits every row alike
        for tag, fn in fns.items():
            params = list(models[tag].parameters())
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            h.train_step(fn, x, dy, params)
            torch.cuda.synchronize()
            times[tag].append((time.perf_counter() - t0) * 1e3)
    for tag, ts in times.items():
        rows[tag] = statistics.median(ts)
    base = rows["TE eager"]
    print(f"GPU ({torch.cuda.get_device_name()}): fp8-cs stack x{layers}, {tokens} tokens, hidden {hidden}, "
          f"median ms per fwd+bwd step over {steps}")
    for tag, ms in rows.items():
        print(f"  {tag:24s}{ms:9.3f} ms   x{ms / base:5.2f} of eager")
    print(f"  hoisted vs pass off: x{rows['te_inductor, hoisted'] / rows['te_inductor, pass off']:.2f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64, help="CPU part: capture width (constants do not depend on it)")
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--gpu-hidden", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=50)
    a = p.parse_args(argv)
    cpu_part(a.layers, a.hidden, a.reps)
    scaling_part()
    if a.gpu:
        gpu_part(a.layers, a.gpu_hidden, a.tokens, a.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
