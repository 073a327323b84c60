"""How te_passes' pipeline cost scales with graph size, and what it costs next to Inductor.

Run:  python benchmarks/bench_pass_scaling.py [--sizes 1000 10000 100000] [--repeat 3]

Part 1 — scaling. Real TE graphs (a 4-layer fp8 (Float8CurrentScaling) te.Linear stack with GELU,
captured on this CPU machine by te_passes.testing.capture) are replicated K times into one graph
(placeholders shared, every copy's outputs returned) until it has about N nodes; the full
PassManager then runs at the stage each graph belongs to (Dynamo graph: ``dynamo``; AOT forward:
``post_grad_fwd``; AOT backward: ``post_grad_bwd``). Printed per size: nodes, pass time (sum of the
passes' own time), manager time (passes + rollback copies + lint), microseconds per node, and the
ratio of per-node cost to the smallest size's (1.0 = perfectly linear). Goal: 100k nodes < 1 s.

Part 2 — share of compile time. A torch-only MLP compiled on CPU with ``backend="te_inductor"``:
``time_ms_passes / time_ms_total`` from te_passes' compile report (all stages). Goal: <= 5%.
(TE graphs cannot be compiled by Inductor on a machine without a GPU; benchmarks/bench_gpu.py
reports the same ratio for real TE models on the H200.)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.fx

from te_passes.config import TePassesOptions
from te_passes.passes.base import PassContext, Stage
from te_passes.passes.manager import PassManager, copy_graph
from te_passes.te.state import TEState


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


def time_stage(gm: torch.fx.GraphModule, stage: Stage, repeat: int) -> tuple[float, float, int]:
    """Median (pass ms, manager ms) over ``repeat`` runs on fresh copies; and node count."""
    pass_ms, total_ms = [], []
    for _ in range(repeat):
        work = torch.fx.GraphModule(gm, copy_graph(gm.graph))
        ctx = PassContext(stage, TePassesOptions(), TEState.capture())
        t0 = time.perf_counter()
        rep = PassManager().run(work, ctx)
        total_ms.append((time.perf_counter() - t0) * 1e3)
        pass_ms.append(sum(r.time_ms for r in rep.runs))
    return statistics.median(pass_ms), statistics.median(total_ms), len(gm.graph.nodes)


def part1(sizes: list[int], repeat: int) -> None:
    from te_passes.testing.capture import capture_aot, capture_dynamo

    dyn = capture_dynamo(model="stack", precision="fp8-cs", layers=4)
    aot = capture_aot(model="stack", precision="fp8-cs", layers=4)
    bases = [("dynamo", dyn.gm, Stage.DYNAMO), ("aot fwd", aot.forward, Stage.POST_GRAD_FWD),
             ("aot bwd", aot.backward, Stage.POST_GRAD_BWD)]
    print(f"{'graph':8} {'nodes':>8} {'passes ms':>10} {'manager ms':>11} {'us/node':>8} {'vs smallest':>11}")
    for label, base, stage in bases:
        per = len(base.graph.nodes)
        first = None
        for n in sizes:
            big = replicate(base, max(1, n // per))
            p_ms, t_ms, nodes = time_stage(big, stage, repeat)
            us = t_ms * 1e3 / nodes
            first = first or us
            print(f"{label:8} {nodes:>8} {p_ms:>10.1f} {t_ms:>11.1f} {us:>8.2f} {us / first:>11.2f}")


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
    args = ap.parse_args()
    part1(args.sizes, args.repeat)
    part2(args.repeat)


if __name__ == "__main__":
    main()
