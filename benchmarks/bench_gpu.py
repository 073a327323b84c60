#!/usr/bin/env python3
"""stack4 on the GPU: TE eager vs Inductor vs te_inductor (default, reduce-overhead, whole-step,
make_graphed) vs TE's make_graphed_callables, side by side in one run.

    source .gpu/s/env.sh; PYTHONPATH=$PWD:$PYTHONPATH python3 benchmarks/bench_gpu.py --out $OUT/gpu [--configs 256:fp8 ...]

Model "stack4": 4 × ``te.Linear(4096, 4096)`` (bf16 params, bias) with GELU between
(``te_passes.testing.gpu.build_stack``); input ``[tokens, 4096]`` bf16; a step = ``p.grad = None``,
forward, ``backward(dy)``. Variants and precisions: benchmarks/te_variants.py; compiled
``inductor*`` / ``te_inductor*`` variants run ``prepare_te_state`` first (``--no-prepare``: not).
Writes ``bench_gpu.json`` / ``.md`` under ``--out``; ``--dry-run`` needs no GPU. Docs:
docs/benchmarks.md "Benchmark harness" (columns, goals), benchmarks/gpu_plan.md (the device session).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import harness  # noqa: E402
import te_variants as tv  # noqa: E402

DEFAULT_CONFIGS = ("256:fp8", "8192:fp8", "256:bf16", "8192:bf16")
DEFAULT_VARIANTS = ("eager", "inductor", "inductor-ro", "te_inductor", "te_inductor-nodirect", "te_inductor-ro",
                    "te_inductor-ro-lean", "te_inductor-ro-trees", "te_step-ro", "te_mgc", "te_mgc-noclone",
                    "mgc", "mgc-noclone")


def add_args(ap) -> None:
    ap.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), metavar="TOKENS:PRECISION",
                    help=f"precision one of {tv.PRECISIONS}; run in this order")
    ap.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=tv.VARIANTS)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--no-prepare", action="store_true", help="compile without prepare_te_state")
    tv.add_args(ap)


def plan(args) -> list[dict]:
    for cfg in args.configs:
        t, _, p = cfg.partition(":")
        if not t.isdigit() or p not in tv.PRECISIONS:
            raise SystemExit(f"bad --configs entry {cfg!r}: want TOKENS:PRECISION, precision in {tv.PRECISIONS}")
    tag = f"+{args.tag}" if args.tag else ""
    order = [v for v in args.variants if v not in tv.ISOLATE] + [v for v in args.variants if v in tv.ISOLATE]
    return [dict(tokens=int(c.split(":")[0]), precision=c.split(":")[1],
                 variant=v + (tag if v.startswith("te_") else ""), isolate=v in tv.ISOLATE)
            for c in args.configs for v in order]


def measure(task: dict, args) -> dict:
    from te_passes.testing.gpu import build_stack

    return tv.run_task(task, args, (task["tokens"], task["precision"]), lambda: build_stack(args.layers, args.hidden),
                       (task["tokens"], args.hidden), prepare=not args.no_prepare,
                       tag=f"{task['tokens']}_{task['precision']}_{task['variant']}")


def goals(rows: list[dict]) -> list[tuple[str, str, str]]:
    out: list = []
    for (t, p), g in harness.by_group(rows, ("tokens", "precision")):
        c = f"{t}/{p}"
        tv.pair(out, g, f"te_inductor default ≥ 1.0× TE eager, {c}", "te_inductor", "eager", 1.0)
        tv.pair(out, g, f"te_inductor-ro ≥ 1.0× mgc, {c}", "te_inductor-ro", "mgc", 1.0)
        for v in ("te_step-ro", "te_mgc-noclone", "te_mgc"):  # issue 22
            if t > 256:
                tv.pair(out, g, f"issue 22: {v} not slower than te_inductor-ro, {c}", v, "te_inductor-ro", 1.0)
                continue
            tv.pair(out, g, f"issue 22: {v} ≥ 1.0× mgc-noclone, {c}", v, "mgc-noclone", 1.0)
            r = g.get(v)
            if r is not None:
                k = r["median_ms"] / r["kernel_ms"] if harness.ok(r) and r.get("kernel_ms") else None
                tv.goal(out, f"issue 22: {v} within 1.3× of the kernel-time sum, {c}",
                        None if k is None else 1.3 / k, 1.0, "-" if k is None else f"{k:.2f}× the kernel sum")
        if p == "fp8-block":  # issue 26: numerics against eager (0 = bit-identical)
            for v in ("te_inductor", "te_inductor-ro"):
                if harness.ok(g.get(v)):
                    out.append((f"issue 26: {v} numerics vs TE eager, {c}", "INFO",
                                f"max rel err {g[v]['max_rel_err']:.2e} ({g[v]['worst']}), "
                                f"{g[v].get('bit_identical', '?')} tensors bit-identical"))
        tv.pair(out, g, f"te_inductor-ro ≥ 0.8× mgc-noclone, {c}", "te_inductor-ro", "mgc-noclone", 0.8)
        tv.pair(out, g, f"lean ≥ 1.0× trees, {c}", "te_inductor-ro-lean", "te_inductor-ro-trees", 1.0)
        e = g.get("eager")
        for v in ("te_inductor", "te_inductor-ro"):
            r = g.get(v)
            if harness.ok(e) and harness.ok(r):
                tv.goal(out, f"{v} peak memory ≤ TE eager, {c}", e["peak_mib"] / max(r["peak_mib"], 1e-9), 1.0,
                        f"{r['peak_mib']:.0f} vs {e['peak_mib']:.0f} MiB")
    shares = [r["passes_ms"] / r["te_compile_ms"] for r in rows if r.get("te_compile_ms")]
    tv.goal(out, "te_passes passes ≤ 5% of te_inductor compile time", None if not shares else 0.05 / max(shares), 1.0,
            "-" if not shares else f"max {100 * max(shares):.2f}% over {len(shares)} compiles")
    bad = [f"{r['tokens']}/{r['precision']}/{r['variant']}: {r['graph_breaks']} breaks, {r['cudagraph_skips']} skips"
           for r in rows if harness.ok(r) and r["variant"] not in ("eager", "mgc", "mgc-noclone")
           and (r.get("graph_breaks") or r.get("cudagraph_skips"))]
    out.append(("compiled rows: 0 graph breaks, 0 cudagraph skips",
                harness.verdict(None if not any(harness.ok(r) for r in rows) else not bad), "; ".join(bad) or "all zero"))
    return out


BENCH = harness.Bench(
    name="bench_gpu", script=__file__, title="te_passes GPU benchmark: stack4", group=("tokens", "precision"),
    columns=tv.COLUMNS, ratios={"× eager": "eager", "× mgc-noclone": "mgc-noclone"}, mem_vs="eager",
    plan=plan, measure=measure, add_args=add_args, goals=goals, fake=tv.fake, budget_s=400.0,
    worker_split=("tokens", "precision"),  # a capture (mgc, te_mgc) never shares a process with the next config
    notes=lambda a: (f"stack{a.layers}: {a.layers} × te.Linear({a.hidden}) + GELU, fwd + bwd; median of {a.iters} "
                     f"CUDA-event step times after {a.warmup} warm-up steps; kernel ms = device time per step "
                     f"under torch.profiler; ÷ kernel = median / kernel ms."))

if __name__ == "__main__":
    sys.exit(harness.main(BENCH))
