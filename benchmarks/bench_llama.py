#!/usr/bin/env python3
"""Llama-class layers at the sizes users train (issue 41): TE eager vs plain Inductor vs te_inductor
(default, reduce-overhead) vs TE's make_graphed_callables, and the competitor (the same block in
plain torch + Inductor, and with torchao float8 training + Inductor), side by side in one run.

    source .gpu/s/env.sh; PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}:$PWD/.whl/site \\
        python3 benchmarks/bench_llama.py --preset gpu1 --budget-s 430 --out $OUT/llama-gpu1
    python3 benchmarks/bench_llama.py --gpu-plan          # the two device commands, with estimates
    python3 benchmarks/bench_llama.py --dry-run --out /tmp/l  # CPU: model checks on fake CUDA + the tables

Rows (``--rows``, ``<model>[-x<layers>]-<seq>[x<batch>]``, input ``[seq, batch, hidden]`` bf16):
``llama8b`` = te.TransformerLayer(4096, 14336, 32 heads, 8 KV groups, RMSNorm, SwiGLU, no bias,
causal, bf16 params, dropout 0), ``llama1b`` = (2048, 8192, 32, 8, same style); ``llama8b-8192`` is
one layer at 8192 × 1 tokens, ``llama1b-x4-4096x2`` four layers at 4096 × 2 (benchmarks/llama_models.py).
Recipes (``--recipes``): ``bf16``, ``fp8`` (Float8CurrentScaling), ``fp8-delayed`` (DelayedScaling),
``mxfp8`` (Blackwell only: left out with the reason on other GPUs). Variants: benchmarks/te_variants.py's
on the TE model (untouched, no ``prepare_te_state``) and :data:`COMPETITORS` on the torch block (torch
rows go with ``bf16``, torchao rows with ``fp8``). Per row: the harness columns, numerics against TE
eager (output and every gradient after step 1), and the kernel list diffed against TE eager's.
Docs: docs/benchmarks.md "Llama-class sizes (issue 41)".
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import harness  # noqa: E402
import kernel_diff  # noqa: E402
import te_variants as tv  # noqa: E402

#: competitor variant -> the recipe group its rows join (torch bf16 + Inductor, torchao float8 + Inductor)
COMPETITORS = {"torch-inductor": "bf16", "torch-eager": "bf16", "torchao-tw-inductor": "fp8",
               "torchao-rw-inductor": "fp8"}
VARIANTS = tuple(tv.VARIANTS) + tuple(COMPETITORS)
ROWS = ("llama8b-8192", "llama8b-4096", "llama8b-x2-8192", "llama8b-x2-4096", "llama1b-x4-2048", "llama1b-x4-4096x2")
RECIPES = ("bf16", "fp8", "fp8-delayed", "mxfp8")
DEFAULT_VARIANTS = ("eager", "inductor", "te_inductor", "te_inductor-ro", "torch-inductor", "torchao-tw-inductor",
                    "torchao-rw-inductor", "mgc")
_ROW = re.compile(r"^(llama8b|llama1b)(?:-x(\d+))?-(\d+)(?:x(\d+))?$")

#: The two device commands (~9 min each on one H100), in priority order; the budget cuts the tail.
#: Each block: (rows, recipes, variants). Issue 41's "Done when" rows.
PRESETS: dict[str, list[tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]]] = {
    "gpu1": [  # llama8b 1 layer: eager / te_inductor / competitor / mgc, Float8CurrentScaling and bf16
        (("llama8b-8192",), ("fp8",), ("eager", "te_inductor", "torchao-tw-inductor", "mgc")),
        (("llama8b-8192",), ("bf16",), ("eager", "te_inductor", "torch-inductor", "mgc")),
        (("llama8b-4096",), ("fp8",), ("eager", "te_inductor", "torchao-tw-inductor", "mgc")),
        (("llama8b-4096",), ("bf16",), ("eager", "te_inductor", "torch-inductor", "inductor", "mgc")),
    ],
    "gpu2": [  # llama1b stack (host-bound: -ro vs mgc), DelayedScaling te_inductor vs eager, then the rest
        (("llama1b-x4-2048",), ("fp8",), ("eager", "te_inductor", "te_inductor-ro", "mgc")),
        (("llama8b-8192",), ("fp8-delayed",), ("eager", "te_inductor")),
        (("llama1b-x4-4096x2",), ("fp8",), ("eager", "te_inductor", "te_inductor-ro", "mgc")),
        (("llama8b-4096",), ("fp8-delayed",), ("eager", "te_inductor")),
        (("llama8b-8192",), ("fp8",), ("torchao-rw-inductor",)),  # joins gpu1's group in --merge
        (("llama1b-x4-2048",), ("bf16",), ("eager", "te_inductor", "te_inductor-ro", "mgc")),
    ],
    "rows": [  # issue 39 item 5: what the early frees and the lean CUDA-graph policy pay for, at Llama sizes
        (("llama8b-8192",), ("fp8",), ("eager", "te_inductor", "te_inductor-nofree", "mgc")),
        (("llama1b-x4-2048",), ("fp8",), ("eager", "te_inductor-ro", "te_inductor-ro-lean", "mgc")),
        (("llama8b-8192",), ("bf16",), ("eager", "te_inductor", "te_inductor-nofree", "mgc")),
    ],
}
GPU_CALL_S, GPU_BUDGET_S = 540.0, 430.0
#: Estimated seconds on one H100, on the safe side: a worker's start (imports, CUDA init, the TE
#: eager reference; 14-20 s for session 15's first rows), a compile + first step of one layer (the
#: lead's figure for a TransformerLayer on H100: 20-40 s; measured on the toy layer (2048, 8192, 16):
#: te_inductor 5.3-7.2 s, -ro 3.4-4.5 s, session 15, docs/benchmarks/h100_2026-12-06_s15/; 4 layers
#: 15-19 s on the H200, session 5) and per further layer, eager / mgc set-up, and 57 steps (1 + warmup 6
#: + 30 timed + 10 profiled + 10 split).
COST_S = dict(worker=20.0, compile=30.0, per_layer=8.0, torchao=10.0, plain=4.0)
#: TE eager ms per 1000 layer-tokens (issue 41's H100 table: 8.63 ms for 4096 llama8b tokens, fp8)
STEP_MS_PER_KTOK = {"llama8b": 2.6, "llama1b": 0.8}


def parse_row(name: str) -> tuple[str, int, int, int]:
    """``"llama1b-x4-4096x2"`` -> ``("llama1b", 4, 4096, 2)`` (model, layers, seq, batch).

    Raises:
        SystemExit: the name does not match ``<llama8b|llama1b>[-x<layers>]-<seq>[x<batch>]``.
    """
    m = _ROW.match(name)
    if not m or int(m.group(3)) < 1 or int(m.group(2) or 1) < 1 or int(m.group(4) or 1) < 1:
        raise SystemExit(f"bad --rows entry {name!r}: want <llama8b|llama1b>[-x<layers>]-<seq>[x<batch>], "
                         f"e.g. {', '.join(ROWS)}")
    return m.group(1), int(m.group(2) or 1), int(m.group(3)), int(m.group(4) or 1)


def _split(values: list[str] | None) -> list[str] | None:
    return None if values is None else [v for s in values for v in s.split(",") if v]


def add_args(ap) -> None:
    ap.add_argument("--rows", nargs="+", help=f"comma- or space-separated; default {','.join(ROWS)}")
    ap.add_argument("--recipes", nargs="+", help=f"of {','.join(RECIPES)}; default all")
    ap.add_argument("--variants", nargs="+", help=f"of {','.join(VARIANTS)}; default {','.join(DEFAULT_VARIANTS)}")
    ap.add_argument("--preset", choices=sorted(PRESETS), help="a device command's task list (--gpu-plan)")
    ap.add_argument("--steps", dest="iters", type=int, default=argparse.SUPPRESS, help="timed steps (= --iters)")
    ap.add_argument("--rope", action="store_true", help="rotary_pos_emb= (TE) / the same RoPE (torch) in every layer")
    ap.add_argument("--accumulate", action="store_true", help="parameter .grad accumulates (default: None each step)")
    ap.add_argument("--gpu-plan", action="store_true", help="print the two device commands with estimates; exit")
    ap.add_argument("--no-cpu-check", action="store_true", help="--dry-run without the model checks on fake CUDA")
    tv.add_args(ap)
    ap.set_defaults(kernel_list=True)


def _order(variants: list[str]) -> list[str]:
    """Run order in a group: TE eager first, the rest as given, captures (mgc: may leave TE in capture
    state after a failure) last."""
    rest = [v for v in variants if v != "eager"]
    return (["eager"] if "eager" in variants else []) + sorted(rest, key=lambda v: v in tv.ISOLATE)


def blocks(args) -> list[tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]]:
    """The (rows, recipes, variants) blocks of the run: ``--preset``'s, or one from the flags.

    Raises:
        SystemExit: ``--preset`` with ``--rows`` / ``--recipes`` / ``--variants``, or an unknown
            row, recipe or variant.
    """
    rows, recipes, variants = _split(args.rows), _split(args.recipes), _split(args.variants)
    if args.preset:
        if rows or recipes or variants:
            raise SystemExit("--preset sets rows, recipes and variants: give either --preset or those flags")
        out = PRESETS[args.preset]
    else:
        out = [(tuple(rows or ROWS), tuple(recipes or RECIPES), tuple(variants or DEFAULT_VARIANTS))]
    for rs, ps, vs in out:
        for r in rs:
            parse_row(r)
        for bad, known, what in ((set(ps) - set(RECIPES), RECIPES, "recipe"), (set(vs) - set(VARIANTS), VARIANTS,
                                                                                  "variant")):
            if bad:
                raise SystemExit(f"unknown {what} {sorted(bad)}; known: {', '.join(known)}")
    return out


def tasks_of(args, drop_mxfp8: str | None = None) -> list[dict]:
    """Tasks in run order: per block, row, recipe: :func:`_order`'s variants; competitor variants
    only in their recipe's group (:data:`COMPETITORS`); ``drop_mxfp8``: leave mxfp8 out (the reason)."""
    tag = f"+{args.tag}" if args.tag else ""
    out = []
    for rows, recipes, variants in blocks(args):
        for r in rows:
            for p in recipes:
                if p == "mxfp8" and drop_mxfp8:
                    continue
                vs = [v for v in _order(list(variants)) if COMPETITORS.get(v, p) == p]
                out += [dict(row=r, precision=p, variant=v + (tag if v.startswith("te_") else ""),
                             isolate=v in tv.ISOLATE) for v in vs]
    return out


def mxfp8_reason() -> str | None:
    """Why this machine cannot run MXFP8 (no GPU, or TE's ``is_mxfp8_available`` says no: Blackwell
    only), or None."""
    import torch

    if not torch.cuda.is_available():
        return "MXFP8: no CUDA device"
    import transformer_engine.pytorch as te

    ok, why = te.is_mxfp8_available(return_reason=True)
    return None if ok else f"MXFP8 unavailable on {torch.cuda.get_device_name()} ({why}): mxfp8 rows left out"


def estimate_s(task: dict) -> float:
    """Seconds one task takes on an H100, from :data:`COST_S` (worker start not included)."""
    model, layers, seq, batch = parse_row(task["row"])
    v = task["variant"].split("+")[0]
    fp8 = 0.8 if task["precision"] != "bf16" else 1.0  # FP8 GEMMs: ~0.8× the bf16 step (issue 41's table)
    steps_s = 57 * STEP_MS_PER_KTOK[model] * fp8 * layers * seq * batch / 1000 / 1000
    if v in ("eager", "mgc", "mgc-noclone", "torch-eager"):
        return COST_S["plain"] + steps_s
    extra = COST_S["torchao"] if v.startswith("torchao") else 0.0
    return COST_S["compile"] + COST_S["per_layer"] * (layers - 1) + extra + steps_s


def estimate_plan(tasks: list[dict]) -> float:
    """Seconds for ``tasks``: :func:`estimate_s` each plus one worker start per (row, recipe)."""
    groups = {(t["row"], t["precision"]) for t in tasks}
    return COST_S["worker"] * len(groups) + sum(estimate_s(t) for t in tasks)


def gpu_plan_text() -> str:
    """The two device commands (gpu-kit environment, torchao from the carried ``.whl/site``), each
    with its tasks and estimated seconds against :data:`GPU_BUDGET_S`."""
    out = ["Device commands (one H100, after the gpu-kit bring-up; carry .gpu/s and .whl/site):"]
    for name in ("gpu1", "gpu2"):
        ns = argparse.Namespace(rows=None, recipes=None, variants=None, preset=name, tag="")
        tasks, t = tasks_of(ns), 0.0
        out += ["", f"## {name}: est. {estimate_plan(tasks):.0f} s for every task, budget {GPU_BUDGET_S:.0f} s "
                    f"(no task starts after it; a run ends within budget + 100 s ≤ {GPU_CALL_S:.0f} s)",
                f"source .gpu/s/env.sh; PYTHONPATH=$PWD${{PYTHONPATH:+:$PYTHONPATH}}:$PWD/.whl/site python3 "
                f"benchmarks/bench_llama.py --preset {name} --budget-s {GPU_BUDGET_S:.0f} --out $OUT/llama-{name}"]
        seen: set = set()
        for task in tasks:  # a task that starts before the budget runs (the harness's rule)
            g = (task["row"], task["precision"])
            t += COST_S["worker"] if g not in seen else 0.0
            seen.add(g)
            cut = "  (starts past the budget: skipped)" if t > GPU_BUDGET_S else ""
            t += estimate_s(task)
            out.append(f"  {t:5.0f} s  {task['row']:<18} {task['precision']:<12} {task['variant']}{cut}")
    out += ["", "Then: python3 benchmarks/bench_llama.py --merge $OUT/llama-gpu1 $OUT/llama-gpu2 --out $OUT/llama"]
    return "\n".join(out)


def plan(args) -> list[dict]:
    if args.gpu_plan:
        print(gpu_plan_text())
        raise SystemExit(0)
    drop = None
    if "mxfp8" in {p for _, ps, _ in blocks(args) for p in ps} and not args.dry_run and not args.plan:
        drop = mxfp8_reason()
        if drop:
            print(drop, file=sys.stderr)
    args.plan_notes = [drop] if drop else []
    tasks = tasks_of(args, drop)
    if args.dry_run and not args.no_cpu_check:
        import llama_cpu_check

        report, failed = llama_cpu_check.check(tasks, rope=args.rope, parse_row=parse_row)
        print(report, flush=True)
        if failed:
            raise SystemExit("CPU check failed (above): fix the script before a GPU run")
    return tasks


# ---------------------------------------------------------------------------------- in the worker
_refs: dict = {}  # (row, precision, rope) -> (TE reference model, x, dy, TE eager outputs, rope); one at a time


def _reference(task: dict, args):
    import torch

    import llama_models as lm

    key = (task["row"], task["precision"], args.rope)
    if key not in _refs:
        _refs.clear()
        torch.cuda.empty_cache()
        model, layers, seq, batch = parse_row(task["row"])
        shape = lm.SHAPES[model]
        rope = lm.rope_freqs(seq, shape.head_dim) if args.rope else None
        torch.manual_seed(0)
        ref = lm.TEStack(shape, layers, rope)
        g = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(seq, batch, shape.hidden, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        dy = torch.randn(seq, batch, shape.hidden, device="cuda", dtype=torch.bfloat16, generator=g)
        _refs[key] = (ref, x, dy, tv.reference(ref, tv.recipe_for(task["precision"]), x, dy), rope)
    return _refs[key]


def _unavailable(task: dict) -> str | None:
    import llama_models as lm

    if task["precision"] == "mxfp8":
        return mxfp8_reason()
    if lm.TORCHAO_RECIPES.get(task["variant"].split("+")[0]):
        return lm.torchao_skip_reason()
    return None


def measure(task: dict, args) -> dict:
    import torch

    import llama_models as lm
    from te_passes.testing.gpu import copy_params, ensure_te_inductor_backend, fresh_compile_state

    why = _unavailable(task)
    if why:
        return {"unavailable": why}
    ensure_te_inductor_backend()
    ref, x, dy, out, rope = _reference(task, args)
    model_name, layers, seq, batch = parse_row(task["row"])
    variant = task["variant"].split("+")[0]
    tag = f"{task['row']}_{task['precision']}_{task['variant']}"
    extra = dict(layers=layers, tokens=seq * batch, rope=args.rope, accumulate=args.accumulate)
    with fresh_compile_state():
        if variant in COMPETITORS:
            model = lm.TorchStack(lm.SHAPES[model_name], layers, rope)
            lm.load_from_te(model, ref)
            recipe = lm.TORCHAO_RECIPES[variant]
            if recipe:
                import torchao

                extra.update(float8_linears=lm.to_float8(model, recipe), torchao=torchao.__version__)
            base = "inductor" if variant.endswith("-inductor") else "eager"
            row = tv.measure(dict(task, variant=base, precision="bf16"), args, model, x, dy,
                             lm.reference_for_torch(out, model), prepare=False, tag=tag)
        else:
            model = lm.TEStack(lm.SHAPES[model_name], layers, rope)
            copy_params(ref, model)
            row = tv.measure(dict(task, variant=variant), args, model, x, dy, out, prepare=False, tag=tag)
        x.grad = None
        del model
    torch.cuda.empty_cache()
    return dict(row, **extra)


def fake(task: dict, i: int) -> dict:
    """Made-up measurements for ``--dry-run`` (the code path, never a result), with a kernel list."""
    row = tv.fake(dict(task, variant="eager"), i)
    v = task["variant"].split("+")[0]
    row["kernels"] = {"gemm_kernel": [6.0, 900.0], "rmsnorm_fwd": [2.0, 40.0], "cast_transpose": [4.0, 60.0]}
    if v != "eager":
        row["kernels"].pop("rmsnorm_fwd")
        row["kernels"][f"triton_poi_fused_add_mul_{i}"] = [1.0, 20.0 + i]
    return row


# ---------------------------------------------------------------------------------------- report
def goals(rows: list[dict]) -> list[tuple[str, str, str]]:
    from te_passes.testing.gpu import REL_TOL

    out: list = []
    for (r, p), g in harness.by_group(rows, ("row", "precision")):
        c, model = f"{r}/{p}", r.split("-")[0]
        e = g.get("eager")
        if model == "llama8b":
            tv.pair(out, g, f"te_inductor ≥ 1.0× TE eager (goal 1.05×), {c}", "te_inductor", "eager", 1.0)
            _mem(out, g, "te_inductor", "eager", 1.02, c)
            if r.endswith("-8192"):
                tv.pair(out, g, f"te_inductor ≥ 1.0× torchao float8 tensorwise + Inductor, {c}", "te_inductor",
                        "torchao-tw-inductor", 1.0)
                tv.pair(out, g, f"te_inductor ≥ 1.0× torch + Inductor, {c}", "te_inductor", "torch-inductor", 1.0)
            f, i = g.get("te_inductor"), g.get("inductor")
            if harness.ok(f) and harness.ok(i):
                tv.goal(out, f"te_inductor first call ≤ 1.2× plain Inductor's on the TE model, {c}",
                        1.2 * i["first_call_s"] / max(f["first_call_s"], 1e-9), 1.0,
                        f"{f['first_call_s']:.1f} vs {i['first_call_s']:.1f} s")
        else:
            tv.pair(out, g, f"te_inductor-ro ≥ 1.0× mgc, {c}", "te_inductor-ro", "mgc", 1.0)
            _mem(out, g, "te_inductor-ro", "mgc", 1.10, c)
            tv.pair(out, g, f"te_inductor ≥ 1.2× TE eager, {c}", "te_inductor", "eager", 1.2)
        tol = REL_TOL["bf16" if p == "bf16" else "fp8"]
        for v, row in g.items():
            if not harness.ok(row) or v == "eager" or row.get("max_rel_err") is None:
                continue
            if v.startswith("te_"):
                if p == "fp8-delayed":
                    n = row.get("bit_identical", "0/1").split("/")
                    out.append((f"{v} bit-identical to TE eager, {c}", harness.verdict(n[0] == n[1]),
                                f"{row['bit_identical']} tensors, max rel err {row['max_rel_err']:.2e}"))
                else:
                    tv.goal(out, f"{v} within {tol:g} of TE eager (output, every gradient), {c}",
                            tol / max(row["max_rel_err"], 1e-30), 1.0, f"{row['max_rel_err']:.2e} ({row['worst']})")
            elif v in COMPETITORS and p == "bf16" and e is not None:
                tv.goal(out, f"{v} is TE's layer (bf16 within 5e-2 of TE eager), {c}",
                        5e-2 / max(row["max_rel_err"], 1e-30), 1.0, f"{row['max_rel_err']:.2e} ({row['worst']})")
            elif v in COMPETITORS:
                out.append((f"{v} against TE eager {p} (another FP8 implementation), {c}", "INFO",
                            f"max rel err {row['max_rel_err']:.2e} ({row['worst']})"))
            if v.startswith("te_inductor"):
                one = row["graphs"] == 1 and row["graph_breaks"] == 0 and row["recompiles_after_first"] == 0
                out.append((f"{v}: 1 graph, 0 breaks, 0 recompiles after step 1, {c}", harness.verdict(one),
                            f"{row['graphs']} / {row['graph_breaks']} / {row['recompiles_after_first']}"))
    shares = [r["passes_ms"] / r["te_compile_ms"] for r in rows if r.get("te_compile_ms")]
    tv.goal(out, "te_passes passes ≤ 5% of te_inductor compile time", None if not shares else 0.05 / max(shares), 1.0,
            "-" if not shares else f"max {100 * max(shares):.2f}% over {len(shares)} compiles")
    return out


def _mem(out: list, g: dict, v: str, base: str, allow: float, c: str) -> None:
    r, b = g.get(v), g.get(base)
    if harness.ok(r) and harness.ok(b):
        tv.goal(out, f"{v} peak memory ≤ {base} + {100 * (allow - 1):.0f}%, {c}",
                allow * b["peak_mib"] / max(r["peak_mib"], 1e-9), 1.0,
                f"{r['peak_mib']:.0f} vs {b['peak_mib']:.0f} MiB")


def notes(args) -> str:
    return (f"Llama-class layers (benchmarks/llama_models.py), forward + backward, parameter `.grad` "
            f"{'accumulated' if args.accumulate else 'set to None'} each step, RoPE {'on' if args.rope else 'off'}; "
            f"median of {args.iters} CUDA-event step times after {args.warmup} warm-up steps; kernel ms and the "
            f"kernel lists: device time per step under torch.profiler ({args.kernel_steps} steps). torch-* / "
            f"torchao-* rows: the same weights in a plain-torch block, numerics against TE eager of the group. "
            + " ".join(getattr(args, "plan_notes", [])))


BENCH = harness.Bench(
    name="bench_llama", script=__file__, title="Llama-class layers: te_inductor vs TE eager, mgc, torch / torchao",
    group=("row", "precision"), columns=tv.COLUMNS, ratios={"× eager": "eager", "× mgc": "mgc"}, mem_vs="eager",
    plan=plan, measure=measure, add_args=add_args, goals=goals, fake=fake, budget_s=GPU_BUDGET_S, notes=notes,
    appendix=lambda rows: kernel_diff.appendix(rows, ("row", "precision")), worker_split=("row", "precision"),
    worker_timeout_s=300.0, start_s=30.0)

if __name__ == "__main__":
    sys.exit(harness.main(BENCH))
