"""Host cost of TE constants built per call vs once (pass ``hoist_te_constants``).

Part 1 (CPU, always): the fp8 (Float8CurrentScaling) stack of 4 ``te.Linear`` (``--hidden``,
``--layers``), captured without a GPU (``te_passes.testing.capture.capture_aot``). Inductor's
wrapper without the pass evaluates every TE constant's ``__fx_repr__`` expression
(``OpaqueValueBundle({...})``, ``_rebuild_quantizer(...)``) on every call; with the pass it reads
module globals. This times exactly those two per-call code paths (the expressions are compiled
once, as in the wrapper module) and prints them side by side.

On the GPU the pass is a bench_gpu.py variant: ``--variants eager te_inductor te_inductor-nohoist``.

    PYTHONPATH=. python benchmarks/bench_hoist_constants.py [--layers 4] [--reps 2000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


def _constants(gm):
    from te_passes.ops.constants import is_liftable_constant

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


def _install() -> None:
    """``runtime.install()``, as the backend does before any pass runs (TE loaded: it wraps TE's
    constant classes' ``__fx_repr__``; without it ``hoist_te_constants`` leaves constants inline)."""
    from te_passes.compat.install import install

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
    t = harness.per_call({"rebuild": rebuild, "hoisted": hoisted}, calls=reps, rounds=7, warmup=0)
    t_rebuild, t_hoisted = t["rebuild"], t["hoisted"]
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64, help="CPU part: capture width (constants do not depend on it)")
    p.add_argument("--reps", type=int, default=2000)
    a = p.parse_args(argv)
    cpu_part(a.layers, a.hidden, a.reps)
    scaling_part()
    return 0


if __name__ == "__main__":
    sys.exit(main())
