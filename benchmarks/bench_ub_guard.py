"""Per-call cost of te_passes' UB guards, measured side by side in one process.

What is timed (median over ``--repeats`` runs of ``--calls`` back-to-back calls, ns per call):

* ``trivial call``            — ``f(x)`` where ``f`` returns ``x`` (the floor of any Python call);
* ``UB-guarded trivial call`` — the same ``f`` behind :func:`te_passes.compat.ub.graph_guard.make_guarded`
  (layer 2, fast path: one integer compare per call);
* ``compiled graph``          — a ``te_inductor``-compiled graph (CPU, 16 floats) called directly,
  and the same compiled callable behind the UB guard;
* ``torch.compile'd module``  — a module whose forward reads ``get_ub_is_fp8`` (layer 1: Dynamo
  guards the UB state token) vs the same module without the query (needs TE; stand-in UB);
* (pairs are timed interleaved, a/b/a/b, so machine noise hits both alike)
* ``CUDA graph replay``       — ``torch.cuda.CUDAGraph.replay()`` of one small kernel, when a GPU
  is present: the reference the guard must be negligible against;
* the pass's own time on 1k / 10k / 100k-node graphs without UB (these rows are in ms, not ns).

Run: ``PYTHONPATH=. python benchmarks/bench_ub_guard.py [--calls 200000] [--repeats 7]``.
The guard's cost is reported as the difference to its unguarded twin and as a ratio.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


def pair_ns(fa, fb, arg, calls: int, repeats: int) -> tuple[float, float]:
    """Median ns per call of ``fa(arg)`` and ``fb(arg)``, runs interleaved (harness.per_call)."""
    r = harness.per_call({"a": fa, "b": fb}, calls=calls, rounds=repeats, warmup=min(calls, 1000), args=(arg,))
    return r["a"] * 1e3, r["b"] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    calls, reps = args.calls, args.repeats

    from te_passes.compat.ub import guard as guards
    from te_passes.compat.ub.guard import UbFold
    from te_passes.compat.ub.graph_guard import UbDependence, UbGuard, make_guarded

    rows: list[tuple[str, float, str]] = []

    def trivial(x):
        return x

    dep = UbDependence(folds=[UbFold("is_ub_initialized", (), False)])
    fp = guards.live_snapshot().fingerprint()
    g_trivial = make_guarded(UbGuard("bench", trivial, dep, fp, "recompile", None))
    x = torch.zeros(16)
    t_triv, t_gtriv = pair_ns(trivial, g_trivial, x, calls, reps)
    rows += [("trivial call", t_triv, "1.00x"),
             ("UB-guarded trivial call", t_gtriv, f"{t_gtriv / t_triv:.2f}x  (+{t_gtriv - t_triv:.0f} ns)")]

    # layer 2 around a real te_inductor-compiled graph
    c_calls = max(calls // 20, 1000)
    try:
        from te_passes.backend import te_inductor

        gm = torch.fx.symbolic_trace(lambda t: t + 1)
        compiled = te_inductor(gm, [x])
    except Exception as e:  # noqa: BLE001 - e.g. a torch without what te_inductor needs
        rows.append((f"compiled graph: skipped ({type(e).__name__}: {str(e)[:60]})", float("nan"), ""))
    else:
        g_compiled = make_guarded(UbGuard("bench2", compiled, dep, fp, "recompile", None))
        t_comp, t_gcomp = pair_ns(compiled, g_compiled, x, c_calls, reps)
        rows += [("compiled graph (te_inductor, CPU)", t_comp, "1.00x"),
                 ("  + UB guard", t_gcomp, f"{t_gcomp / t_comp:.3f}x  (+{t_gcomp - t_comp:.0f} ns)")]

    # layer 1: Dynamo guard on the UB state token
    try:
        import transformer_engine.pytorch.module.base as te_base

        from te_passes.testing.ub import StandInCommunicator, ub_registry
    except Exception as e:  # noqa: BLE001 - TE not installed here
        rows.append((f"torch.compile'd module with get_ub_is_fp8: skipped ({type(e).__name__})", float("nan"), ""))
    else:
        class WithQuery(torch.nn.Module):
            def forward(self, t):
                return t + 1 if te_base.get_ub_is_fp8("proj_fprop", True) else t - 1

        class Without(torch.nn.Module):
            def forward(self, t):
                return t + 1

        with ub_registry({("proj_fprop", "fp8"): StandInCommunicator(fp8_ubuf=True)}):
            from te_passes.backend import te_inductor as backend  # (also without the entry point installed)

            cw = torch.compile(WithQuery(), backend=backend)
            co = torch.compile(Without(), backend=backend)
            cw(x), co(x)
            t_o, t_w = pair_ns(co, cw, x, c_calls, reps)
            rows += [("torch.compile'd module, no UB query", t_o, "1.00x"),
                     ("torch.compile'd module, get_ub_is_fp8 (token guard)", t_w,
                      f"{t_w / t_o:.3f}x  (+{t_w - t_o:.0f} ns)")]
            if torch.cuda.is_available():
                xc = torch.randn(4096, device="cuda")
                rw = torch.compile(WithQuery(), backend=backend, mode="reduce-overhead")
                ro = torch.compile(Without(), backend=backend, mode="reduce-overhead")
                for _ in range(5):
                    rw(xc), ro(xc)
                torch.cuda.synchronize()
                t_ro, t_rw = pair_ns(ro, rw, xc, c_calls, reps)
                torch.cuda.synchronize()
                rows += [("reduce-overhead module (CUDA graph tree), no UB query", t_ro, "1.00x"),
                         ("reduce-overhead module, get_ub_is_fp8 (token guard)", t_rw,
                          f"{t_rw / t_ro:.3f}x  (+{t_rw - t_ro:.0f} ns)")]
                gx = te_inductor(torch.fx.symbolic_trace(lambda t: t + 1), [xc], mode="reduce-overhead")
                dep_now = UbDependence(folds=[UbFold("is_ub_initialized", (), True)])
                g_gx = make_guarded(UbGuard("bench3", gx, dep_now, guards.live_snapshot().fingerprint(),
                                            "recompile", None))
                for _ in range(5):
                    gx(xc), g_gx(xc)
                t_gx, t_ggx = pair_ns(gx, g_gx, xc, c_calls, reps)
                torch.cuda.synchronize()
                rows += [("reduce-overhead graph (te_inductor, CUDA graph tree)", t_gx, "1.00x"),
                         ("  + UB guard (layer 2)", t_ggx, f"{t_ggx / t_gx:.3f}x  (+{t_ggx - t_gx:.0f} ns)")]

    if torch.cuda.is_available():
        s = torch.cuda.Stream()
        y = torch.zeros(1024, device="cuda")
        with torch.cuda.stream(s):
            for _ in range(3):
                y.add_(1)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y.add_(1)

        def replay(_):
            graph.replay()

        t_rep = pair_ns(replay, replay, None, max(calls // 20, 1000), reps)[0]
        torch.cuda.synchronize()
        guard_ns = t_gtriv - t_triv
        rows += [("CUDA graph replay (1 kernel, host side)", t_rep, "1.00x"),
                 ("  UB guard cost / replay", guard_ns, f"{guard_ns / t_rep:.4f}x")]
    else:
        rows.append(("CUDA graph replay: skipped (no GPU)", float("nan"), ""))

    # the pass itself on graphs without UB (what every compile pays): ms per run vs graph size
    import operator

    from te_passes.config import TePassesOptions
    from te_passes.pipeline.base import PassContext, Stage
    from te_passes.passes.fold_ub_predicates import FoldUbPredicates
    from te_passes.compat.api import capture_te_state

    ctx = PassContext(Stage.DYNAMO, TePassesOptions(), capture_te_state(), None, "gbench")
    base_ms = None
    pass_rows: list[tuple[int, float, str]] = []
    for n in (1_000, 10_000, 100_000):
        g = torch.fx.Graph()
        y = g.placeholder("x")
        for i in range(n):
            y = g.call_function(torch.relu, (y,)) if i % 2 else g.call_function(operator.add, (y, 1))
        g.output(y)
        gm = torch.fx.GraphModule(torch.nn.Module(), g)
        t0 = time.perf_counter()
        FoldUbPredicates().run(gm, ctx)
        ms = (time.perf_counter() - t0) * 1e3
        base_ms = base_ms or ms
        pass_rows.append((n, ms, f"{ms / base_ms:.1f}x the 1k-node time, {ms * 1e6 / n:.0f} ns/node"))

    width = max(len(r[0]) for r in rows)
    print(f"torch {torch.__version__}; {calls} calls x {reps} repeats (compiled rows: {c_calls} calls)")
    print(f"{'what':<{width}}  {'ns/call':>10}  ratio")
    for name, ns, ratio in rows:
        print(f"{name:<{width}}  {ns:>10.0f}  {ratio}")
    print()
    print(f"{'fold_ub_predicates on a graph without UB':<{width}}  {'ms':>10}")
    for n, ms, ratio in pass_rows:
        print(f"{f'  {n} nodes':<{width}}  {ms:>10.1f}  {ratio}")


if __name__ == "__main__":
    main()
