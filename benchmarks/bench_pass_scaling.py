"""How te_passes' pipeline cost scales with graph size, and what it costs next to Inductor.

Run:  python benchmarks/bench_pass_scaling.py [--sizes 1000 10000 100000] [--repeat 3]

Part 1 — scaling. Real TE graphs (a 4-layer fp8 (Float8CurrentScaling) te.Linear stack with GELU,
captured on this CPU machine by te_passes.testing.capture) are replicated K times into one graph
(placeholders shared, every copy's outputs returned) until it has about N nodes; the full
PassManager then runs at the stage each graph belongs to (Dynamo graph: ``dynamo``; AOT forward:
``post_grad_fwd``; AOT backward: ``post_grad_bwd``). Printed per size: nodes, pass time (sum of the
passes' own time, their edit journals included), manager time (passes + lint + ``recompile``),
microseconds per node, the ratio of per-node cost to the smallest size's (1.0 = perfectly
linear), and each pass's own time. Goal: 100k nodes < 1 s. The garbage of building each copy is
collected before its timed run (``gc.collect()``), so a pending full collection of the 100k-node
heap is not charged to the first pass.

Graphs are wrapped as torch.compile wraps them: ``_make_graph_module`` under
``_use_lazy_graph_module(True)`` (Dynamo's and AOTAutograd's default,
``torch._dynamo.config.use_lazy_graph_module``), so the manager's ``gm.recompile()`` defers
Python codegen to the first call, as it does inside torch.compile (Inductor lowers post-grad
graphs from ``gm.graph`` and never calls them; a Dynamo graph is generated once when AOTAutograd
traces it, with or without te_passes). ``--eager-gm`` measures plain ``torch.fx.GraphModule``\ s
instead (codegen inside the manager's time). Every stage is run once on the un-replicated graph
before timing (first-call costs: imports, per-op schema caches).

Part 2 — share of compile time. A torch-only MLP compiled on CPU with ``backend="te_inductor"``:
``time_ms_passes / time_ms_total`` from te_passes' compile report (all stages). Goal: <= 5%.
(TE graphs cannot be compiled by Inductor on a machine without a GPU; benchmarks/bench_gpu.py
reports the same ratio for real TE models on the H200.)
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
import torch.fx

from te_passes.config import TePassesOptions
from te_passes.pipeline.base import PassContext, Stage
from te_passes.fx.graph import copy_graph
from te_passes.passes.order import default_passes
from te_passes.pipeline.manager import PassManager
from te_passes.compat.api import capture_te_state


def replicate(gm: torch.fx.GraphModule, copies: int) -> torch.fx.GraphModule:
    """One graph holding ``copies`` copies of ``gm``'s body (shared placeholders, all outputs)."""
    g = torch.fx.Graph()
    phs = {n: g.placeholder(n.name) for n in gm.graph.find_nodes(op="placeholder")}
    for n, new in phs.items():
        new.meta = dict(n.meta)
    outs = []
    for _ in range(copies):
        val_map = dict(phs)
        out = g.graph_copy(gm.graph, val_map, return_output_node=True)
        outs.extend(out[0] if isinstance(out, tuple) and out and isinstance(out[0], (tuple, list)) else
                    (out if isinstance(out, (tuple, list)) else [out]))
    g.output(tuple(outs))
    return torch.fx.GraphModule(gm, g)


def fresh_module(gm: torch.fx.GraphModule, lazy: bool) -> torch.fx.GraphModule:
    """A copy of ``gm`` wrapped the way torch.compile wraps its graphs (lazy) or eagerly."""
    if not lazy:
        return torch.fx.GraphModule(gm, copy_graph(gm.graph))
    from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module

    with _use_lazy_graph_module(True):
        return _make_graph_module(gm, copy_graph(gm.graph))


def time_stage(gm: torch.fx.GraphModule, stage: Stage, repeat: int,
               lazy: bool = True) -> tuple[float, float, int, dict[str, float]]:
    """Median (pass ms, manager ms) over ``repeat`` runs on fresh copies; node count; median
    ms per pass."""
    pass_ms, total_ms, per = [], [], {}
    for _ in range(repeat):
        work = fresh_module(gm, lazy)
        # Collect the garbage of building the copy (and of the previous run) now: a collection
        # left pending would be charged to whichever pass allocates first (measured: 0.2 s of
        # fold_ub_predicates' 1.5 s at 83k nodes was its own work; the rest a full collection).
        gc.collect()
        ctx = PassContext(stage, TePassesOptions(), capture_te_state())
        t0 = time.perf_counter()
        rep = PassManager(default_passes()).run(work, ctx)
        total_ms.append((time.perf_counter() - t0) * 1e3)
        pass_ms.append(sum(r.time_ms for r in rep.runs))
        for r in rep.runs:
            per.setdefault(r.name, []).append(r.time_ms)
    return (statistics.median(pass_ms), statistics.median(total_ms), len(gm.graph.nodes),
            {k: statistics.median(v) for k, v in per.items()})


_SHORT = {"fold_ub_predicates": "fold_ub", "fold_recipe_lookups": "lookups", "remove_quantizer_setattrs": "setattrs",
          "hoist_te_constants": "hoist", "insert_early_frees": "frees",
          "check_cudagraph_pool": "pool"}


def part1(sizes: list[int], repeat: int, lazy: bool = True) -> None:
    from te_passes.testing.capture import capture_aot, capture_dynamo

    dyn = capture_dynamo(model="stack", precision="fp8-cs", layers=4)
    aot = capture_aot(model="stack", precision="fp8-cs", layers=4)
    from te_passes.compat.install import install

    install()  # as the backend does before any pass runs (TE loaded now: the constant classes get wrapped)
    bases = [("dynamo", dyn.gm, Stage.DYNAMO), ("aot fwd", aot.forward, Stage.POST_GRAD_FWD),
             ("aot bwd", aot.backward, Stage.POST_GRAD_BWD)]
    print(f"graph modules: {'lazy (as in torch.compile)' if lazy else 'eager (codegen on recompile)'}; "
          f"per-pass columns: own ms ({', '.join(f'{v} = {k}' for k, v in _SHORT.items())})")
    print(f"{'graph':8} {'nodes':>8} {'passes ms':>10} {'manager ms':>11} {'us/node':>8} {'vs smallest':>11}  per pass")
    for label, base, stage in bases:
        time_stage(base, stage, 1, lazy)  # warm-up: first-call costs are not per-node costs
        per = len(base.graph.nodes)
        first = None
        for n in sizes:
            big = replicate(base, max(1, n // per))
            p_ms, t_ms, nodes, by_pass = time_stage(big, stage, repeat, lazy)
            us = t_ms * 1e3 / nodes
            first = first or us
            passes = "  ".join(f"{_SHORT.get(k, k)} {v:.0f}" for k, v in by_pass.items())
            print(f"{label:8} {nodes:>8} {p_ms:>10.1f} {t_ms:>11.1f} {us:>8.2f} {us / first:>11.2f}  {passes}",
                  flush=True)


def part2(repeat: int) -> None:
    from torch._inductor.utils import fresh_cache

    from te_passes.report import clear_compile_reports, compile_reports

    model = torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(256, 256), torch.nn.GELU())])
    x = torch.randn(64, 256)
    shares = []
    for _ in range(repeat):
        torch._dynamo.reset()
        clear_compile_reports()
        with fresh_cache():
            torch.compile(model, backend="te_inductor")(x).sum().backward()
        (rep,) = compile_reports()
        shares.append((rep.time_ms_passes, rep.time_ms_total))
    p, t = statistics.median(s[0] for s in shares), statistics.median(s[1] for s in shares)
    print(f"\nMLP 8x(Linear 256 + GELU), CPU, fwd+bwd compile: passes {p:.1f} ms of {t:.0f} ms "
          f"te_inductor total = {100 * p / t:.2f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--eager-gm", action="store_true",
                    help="plain torch.fx.GraphModules: the manager's recompile generates code at once")
    ap.add_argument("--skip-compile", action="store_true", help="part 1 only")
    args = ap.parse_args()
    part1(args.sizes, args.repeat, lazy=not args.eager_gm)
    if args.skip_compile:
        return
    part2(args.repeat)


if __name__ == "__main__":
    main()
