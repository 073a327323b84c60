#!/usr/bin/env python3
"""te.TransformerLayer on the GPU, untouched (as users write it) and rewritten by
``compile_friendly``: TE eager vs te_inductor vs TE's make_graphed_callables, side by side.

    source .gpu/s/env.sh; PYTHONPATH=$PWD:$PYTHONPATH python3 benchmarks/bench_transformer_layer.py --out $OUT/tl \
        --models layer1 --precisions bf16 fp8

Models (hidden 2048, ffn 8192, 16 heads, bf16 params, dropout 0, TE defaults otherwise):
``layer1`` = 1 layer, seq 1024 × batch 2; ``stack4`` = 4 layers in a ``torch.nn.Sequential``, seq
2048 × batch 1. Variants (benchmarks/te_variants.py) run on the untouched model: no
``compile_friendly``, no ``prepare_te_state`` (``--prepare``: with it); ``cf-<variant>`` on
``compile_friendly(model, strict=True)`` (SDPA attention, prepared), ``cf-fused-<variant>`` with
``attention="te_fused"``. One worker per (model, precision). Docs: docs/benchmarks.md "Benchmark harness".
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import harness  # noqa: E402
import te_variants as tv  # noqa: E402

#: name -> (layers, seq, batch); hidden / ffn / heads are shared.
MODELS: dict[str, tuple[int, int, int]] = {"layer1": (1, 1024, 2), "stack4": (4, 2048, 1)}
HIDDEN, FFN, HEADS = 2048, 8192, 16
DEFAULT_PRECISIONS = ("bf16", "fp8")
DEFAULT_VARIANTS = ("eager", "te_inductor", "te_inductor-ro", "mgc", "mgc-noclone", "cf-te_inductor-ro")
VARIANTS = tuple(tv.VARIANTS) + tuple(f"cf-{v}" for v in tv.VARIANTS) + tuple(
    f"cf-fused-{v}" for v in ("eager", "te_inductor", "te_inductor-ro"))


def split_variant(variant: str) -> tuple[str | None, str]:
    """``(compile_friendly attention or None, base variant)``: ``"cf-fused-te_inductor-ro"`` ->
    ``("te_fused", "te_inductor-ro")``, ``"cf-mgc"`` -> ``("sdpa", "mgc")``, ``"eager"`` -> ``(None, "eager")``."""
    if variant.startswith("cf-fused-"):
        return "te_fused", variant.removeprefix("cf-fused-")
    if variant.startswith("cf-"):
        return "sdpa", variant.removeprefix("cf-")
    return None, variant


def add_args(ap) -> None:
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=sorted(MODELS))
    ap.add_argument("--precisions", nargs="+", default=list(DEFAULT_PRECISIONS), choices=tv.PRECISIONS)
    ap.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=VARIANTS)
    ap.add_argument("--prepare", action="store_true", help="prepare_te_state before the untouched compiled variants")
    tv.add_args(ap)


def plan(args) -> list[dict]:
    tag = f"+{args.tag}" if args.tag else ""
    tasks = []
    for m in args.models:
        for p in args.precisions:
            order = sorted(args.variants, key=lambda v: split_variant(v)[1] in tv.ISOLATE)  # mgc last
            tasks += [dict(model=m, precision=p, variant=v + (tag if split_variant(v)[1].startswith("te_") else ""),
                           isolate=split_variant(v)[1] in tv.ISOLATE) for v in order]
    return tasks


def build(model: str):
    import torch
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    return torch.nn.Sequential(*[te.TransformerLayer(HIDDEN, FFN, HEADS, params_dtype=torch.bfloat16, device="cuda",
                                                     hidden_dropout=0.0, attention_dropout=0.0)
                                 for _ in range(MODELS[model][0])])


def measure(task: dict, args) -> dict:
    import te_passes
    from te_passes.compat.untouched.rewrite.te_state import unprepared_te_state

    layers, seq, batch = MODELS[task["model"]]
    attention, base = split_variant(task["variant"].split("+")[0])
    prepare = attention is not None or args.prepare

    def rewrite(model):
        if attention is not None:
            te_passes.compile_friendly(model, strict=True, attention=attention)
        return dict(layers=layers, seq=seq, batch=batch, unprepared=[] if prepare or base == "eager" else
                    unprepared_te_state(model, tv.recipe_for(task["precision"]), fp8=task["precision"] != "bf16"))

    return tv.run_task(dict(task, variant=base), args, (task["model"], task["precision"]), lambda: build(task["model"]),
                       (seq, batch, HIDDEN), prepare=prepare, rewrite=rewrite,
                       tag=f"{task['model']}_{task['precision']}_{task['variant']}")


def goals(rows: list[dict]) -> list[tuple[str, str, str]]:
    out: list = []
    for (m, p), g in harness.by_group(rows, ("model", "precision")):
        c, issue, need = f"{m}/{p}", ("issue 24" if p == "fp8-delayed" else "issue 21"), (1.0 if p == "fp8-delayed" else 1.2)
        tv.pair(out, g, f"{issue}: untouched te_inductor-ro ≥ 1.0× mgc, {c}", "te_inductor-ro", "mgc", 1.0)
        tv.pair(out, g, f"{issue}: untouched te_inductor ≥ {need}× TE eager, {c}", "te_inductor", "eager", need)
        if m == "layer1" and p == "fp8":
            for v in ("te_step-ro", "te_mgc", "te_mgc-noclone", "te_inductor-ro"):
                tv.pair(out, g, f"issue 22: {v} ≥ 1.1× mgc, {c}", v, "mgc", 1.1)
        e = g.get("eager")
        for v in ("te_inductor", "te_inductor-ro"):
            r = g.get(v)
            if harness.ok(e) and harness.ok(r):
                tv.goal(out, f"issue 21: {v} peak memory ≤ TE eager + 5%, {c}",
                        1.05 * e["peak_mib"] / max(r["peak_mib"], 1e-9), 1.0, f"{r['peak_mib']:.0f} vs {e['peak_mib']:.0f} MiB")
            if harness.ok(r):
                one = r["graphs"] == 1 and r["graph_breaks"] == 0 and r["recompiles_after_first"] == 0
                out.append((f"issue 21: untouched {v}: 1 graph, 0 breaks, 0 recompiles after step 1, {c}",
                            harness.verdict(one), f"{r['graphs']} / {r['graph_breaks']} / {r['recompiles_after_first']}"))
    return out


BENCH = harness.Bench(
    name="bench_transformer_layer", script=__file__, title="te.TransformerLayer GPU benchmark",
    group=("model", "precision"), columns=tv.COLUMNS, ratios={"× eager": "eager", "× mgc": "mgc"}, mem_vs="eager",
    plan=plan, measure=measure, add_args=add_args, goals=goals, fake=tv.fake, budget_s=420.0,
    worker_split=("model", "precision"),
    notes=lambda a: (f"te.TransformerLayer({HIDDEN}, {FFN}, {HEADS}), bf16 params; untouched variants without "
                     f"prepare_te_state{' (here: with it)' if a.prepare else ''}; median of {a.iters} CUDA-event step "
                     f"times after {a.warmup} warm-up steps."))

if __name__ == "__main__":
    sys.exit(harness.main(BENCH))
