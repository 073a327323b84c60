#!/usr/bin/env python3
"""te.TransformerLayer benchmark (issue 15): TE eager vs te_inductor vs TE's make_graphed_callables,
with and without ``te_passes.compile_friendly``, side by side in one run.

One command (H200, torch 2.14.1 + TE 2.20.2, gpu-kit env)::

    source .gpu/s/env.sh; PYTHONPATH=$PWD python3 benchmarks/bench_transformer_layer.py --out DIR [--quick]

The full table in device calls of < 500 s each: ``--print-chunks`` (then ``--merge``).

Models (hidden 2048, ffn 8192, 16 heads, bf16 params, dropout 0, fwd+bwd; ``TransformerLayer``
defaults otherwise): ``layer1`` = 1 layer, seq 1024 × batch 2; ``stack4`` = 4 layers in a
``torch.nn.Sequential``, seq 2048 × batch 1. Precisions: ``bf16``, ``fp8``
(``Float8CurrentScaling``). Every forward runs inside ``te.autocast(enabled=fp8, recipe=r)`` with
one recipe object built outside the compiled function (in bf16 too: TE's MultiheadAttention reads
the recipe and would otherwise build a default one inside the compiled region — a graph break).

Before each compiled variant, ``te_passes.rewrite.te_state.prepare_te_state`` does TE's
first-forward lazy initialisation (else every frame recompiles on step 2; ``--no-prepare`` shows
that). Variants: ``eager``, ``te_inductor``, ``te_inductor-ro`` (``mode="reduce-overhead"``),
``inductor-ro``, ``mgc`` (``te.make_graphed_callables``), ``mgc-nc`` (the same with
``clone_param_grads_on_return=False``), and each again on the model rewritten by
``te_passes.compile_friendly(model, strict=True)`` (prefix ``cf-``; core attention through torch's
SDPA), and ``cf-fused-eager`` / ``cf-fused-te_inductor`` / ``cf-fused-te_inductor-ro`` on the model
rewritten with ``attention="te_fused"`` (TE's cuDNN attention as the ``fused_attn`` custom op; not
in the default set: ask for them with ``--variants``). SDPA vs fused in one run (< 500 s)::

    PYTHONPATH=$PWD python3 benchmarks/bench_transformer_layer.py --out DIR --models layer1 \
        --variants eager cf-te_inductor-ro cf-fused-te_inductor-ro cf-fused-eager mgc

Isolation: each (model, precision) runs its compiled variants one after the other in one worker
process (``torch._dynamo.reset()`` between them) and its make_graphed_callables variants in
another: a failed make_graphed_callables leaves TE in graph-capture state for that process (later
compiles would silently run eager), so a worker stops at the first mgc failure and the remaining
variants go to a fresh worker. The key variants (``QUICK_VARIANTS``) of every model/precision run
first, the others after them. A run has a wall-clock budget (``--budget-s``, default 420 s):
variants that would start after it are written as skipped, never silently dropped (the worker
checks it before each variant too), and a worker still running ``GRACE_S`` after it is killed: a run
takes at most ``--budget-s`` + ``GRACE_S`` seconds (plus the table). ``--worker-timeout-s`` is per
variant.

The whole table (issue 15) does not fit in one 600-s device call: :data:`ISSUE_CHUNKS` splits it
into calls of < 500 s each; ``--print-chunks`` prints their commands and ``--merge DIR ...``
writes one table from their ``--out`` directories.

Per variant: median CUDA-event ms per step (host time included: the end event is enqueued after
the step's last launch), median host ms, speed-up vs eager and vs mgc of the same model/precision
(>1 is faster), Dynamo graphs / graph breaks / recompiles (all, and after the first step),
cudagraph skips, first-call seconds (compile / capture + one step), peak memory
(``torch.cuda.max_memory_allocated`` minus what was allocated before the variant started), and the
first step's relative output error against eager. Writes ``bench_transformer_layer.json`` (after
every variant) and ``.md`` under ``--out``. ``--dry-run`` prints the task plan without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

#: name -> (layers, seq, batch); hidden / ffn / heads are shared.
MODELS: dict[str, tuple[int, int, int]] = {"layer1": (1, 1024, 2), "stack4": (4, 2048, 1)}
HIDDEN, FFN, HEADS = 2048, 8192, 16
PRECISIONS = ("bf16", "fp8")
BASE_VARIANTS = ("eager", "te_inductor", "te_inductor-ro", "inductor-ro", "mgc", "mgc-nc")
DEFAULT_VARIANTS = BASE_VARIANTS + tuple("cf-" + v for v in BASE_VARIANTS)
#: ``compile_friendly(model, attention="te_fused")`` variants (only when asked for).
FUSED_VARIANTS = ("cf-fused-eager", "cf-fused-te_inductor", "cf-fused-te_inductor-ro")
VARIANTS = DEFAULT_VARIANTS + FUSED_VARIANTS
#: The subset ``--quick`` runs (layer1 only): the issue's "done when" comparisons.
QUICK_VARIANTS = ("eager", "te_inductor", "te_inductor-ro", "cf-te_inductor", "cf-te_inductor-ro", "mgc", "cf-mgc")
#: Seconds a worker may run past ``--budget-s`` (one variant started just before it) before it is killed.
GRACE_S = 100.0
#: The issue-15 table as device calls of < 500 s each (``--budget-s`` + ``GRACE_S``):
#: (name, models, precisions, variants, budget_s). Together: layer1 and stack4, bf16 and fp8,
#: every variant of the issue's table plus ``cf-te_inductor-ro`` and ``cf-fused-te_inductor-ro``.
_TABLE_VARIANTS = ("eager", "te_inductor", "te_inductor-ro", "cf-te_inductor-ro", "mgc", "mgc-nc")
ISSUE_CHUNKS: tuple[tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...], float], ...] = (
    ("layer1", ("layer1",), PRECISIONS, _TABLE_VARIANTS + ("inductor-ro",), 380.0),
    ("stack4-bf16", ("stack4",), ("bf16",), _TABLE_VARIANTS, 380.0),
    ("stack4-fp8", ("stack4",), ("fp8",), _TABLE_VARIANTS, 380.0),
    ("stack4-inductor-ro", ("stack4",), PRECISIONS, ("inductor-ro",), 380.0),
    ("cf-fused", tuple(MODELS), PRECISIONS, ("cf-fused-te_inductor-ro",), 380.0),  # issue 15 part 2
)


def chunk_commands(out_root: str = "/root/out/tl") -> list[str]:
    """One shell command per :data:`ISSUE_CHUNKS` entry (run from the repo root), then the merge."""
    cmds = [f"PYTHONPATH=$PWD python3 benchmarks/bench_transformer_layer.py --out {out_root}/{name} "
            f"--models {' '.join(m)} --precisions {' '.join(p)} --variants {' '.join(v)} --budget-s {b:.0f}"
            for name, m, p, v, b in ISSUE_CHUNKS]
    dirs = " ".join(f"{out_root}/{name}" for name, *_ in ISSUE_CHUNKS)
    return cmds + [f"python3 benchmarks/bench_transformer_layer.py --out {out_root}/all --merge {dirs}"]


def split_variant(variant: str) -> tuple[str | None, str]:
    """``(compile_friendly attention or None, base variant)``: ``"cf-fused-te_inductor-ro"`` ->
    ``("te_fused", "te_inductor-ro")``, ``"cf-mgc"`` -> ``("sdpa", "mgc")``, ``"eager"`` -> ``(None, "eager")``."""
    if variant.startswith("cf-fused-"):
        return "te_fused", variant.removeprefix("cf-fused-")
    if variant.startswith("cf-"):
        return "sdpa", variant.removeprefix("cf-")
    return None, variant


def is_mgc(variant: str) -> bool:
    return split_variant(variant)[1].startswith("mgc")


def plan(models, precisions, variants) -> list[list[dict[str, str]]]:
    """Worker groups: per (model, precision) one group of compiled/eager variants, one of mgc ones."""
    groups = []
    for m in models:
        for p in precisions:
            normal = [dict(model=m, precision=p, variant=v) for v in variants if not is_mgc(v)]
            mgc = [dict(model=m, precision=p, variant=v) for v in variants if is_mgc(v)]
            groups.extend(g for g in (normal, mgc) if g)
    return groups


# --------------------------------------------------------------------------- worker
def _worker(tasks: list[dict[str, str]], warmup: int, iters: int, prepare: bool, deadline: float | None = None) -> int:
    """Run ``tasks`` in this process, one JSON line per task on stdout (prefix ``RESULT ``); a task
    that would start after ``deadline`` (``time.time()``) is written as skipped.
    Returns 3 after a failed make_graphed_callables variant (the rest must run elsewhere)."""
    import torch
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import Float8CurrentScaling

    import te_passes
    from te_passes.rewrite.te_state import prepare_te_state, unprepared_te_state
    from te_passes.testing.gpu import CompileWatch, ensure_te_inductor_backend, fresh_compile_state, rel_err, train_step

    ensure_te_inductor_backend()
    recipe = Float8CurrentScaling()
    refs: dict[tuple[str, str], Any] = {}

    def build(model: str):
        layers, _, _ = MODELS[model]
        torch.manual_seed(0)
        return torch.nn.Sequential(*[te.TransformerLayer(HIDDEN, FFN, HEADS, params_dtype=torch.bfloat16,
                                                         device="cuda", hidden_dropout=0.0, attention_dropout=0.0)
                                     for _ in range(layers)])

    def fwd_of(model, fp8: bool):
        def fwd(x):
            with te.autocast(enabled=fp8, recipe=recipe):
                return model(x)
        return fwd

    def time_steps(fn, x, dy, params, mark):
        for _ in range(warmup):
            train_step(fn, x, dy, params, mark_step=mark)
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        host = []
        for i in range(iters):
            t0 = time.perf_counter()
            starts[i].record()
            train_step(fn, x, dy, params, mark_step=mark)
            ends[i].record()
            host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) for a, b in zip(starts, ends)), statistics.median(host)

    for task in tasks:
        if deadline is not None and time.time() > deadline:
            print("RESULT " + json.dumps(dict(task, skipped="budget spent")), flush=True)
            continue
        model_name, precision, variant = task["model"], task["precision"], task["variant"]
        layers, seq, batch = MODELS[model_name]
        fp8 = precision == "fp8"
        attention, base = split_variant(variant)
        row: dict[str, Any] = dict(task, layers=layers, seq=seq, batch=batch, hidden=HIDDEN,
                                   prepared=prepare and not is_mgc(variant) and base != "eager")
        try:
            gen = torch.Generator(device="cuda").manual_seed(1)
            x0 = torch.randn(seq, batch, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
            dy = torch.randn(seq, batch, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
            key = (model_name, precision)
            if key not in refs:  # the eager output of the first step, for the error column
                ref = build(model_name)
                xr = x0.clone().requires_grad_(True)
                refs[key] = fwd_of(ref, fp8)(xr).detach().float()
                del ref, xr
                torch.cuda.empty_cache()
            with fresh_compile_state():
                base_mem = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                model = build(model_name)
                if attention is not None:
                    te_passes.compile_friendly(model, strict=True, attention=attention)
                params = list(model.parameters())
                x = x0.clone().requires_grad_(True)
                mark = base.endswith("-ro")
                if base.startswith("mgc"):
                    model = te.make_graphed_callables(model, (x,), num_warmup_iters=3, enabled=fp8,
                                                      recipe=recipe if fp8 else None,
                                                      clone_param_grads_on_return=base == "mgc")
                    fn = fwd_of(model, fp8)
                elif base == "eager":
                    fn = fwd_of(model, fp8)
                else:
                    if prepare:  # TE's first-forward lazy state, so step 2 does not recompile
                        prepare_te_state(model, recipe, fp8=fp8)
                    row["unprepared"] = unprepared_te_state(model, recipe, fp8=fp8)  # [] once prepared
                    backend = "inductor" if base.startswith("inductor") else "te_inductor"
                    fn = torch.compile(fwd_of(model, fp8), backend=backend,
                                       mode="reduce-overhead" if mark else None)
                with CompileWatch() as watch:
                    t0 = time.perf_counter()
                    y = train_step(fn, x, dy, params, mark_step=mark)
                    torch.cuda.synchronize()
                    row["first_s"] = round(time.perf_counter() - t0, 2)
                    row["rel_err_vs_eager"] = float(f"{rel_err(y.detach().float(), refs[key]):.3e}")
                    del y
                    after_first = watch.snapshot()
                    med, host = time_steps(fn, x, dy, params, mark)
                st = watch.stats
                row.update(median_ms=round(med, 4), host_ms=round(host, 4), graphs=st.graphs,
                           graph_breaks=st.graph_breaks, recompiles=st.recompiles,
                           recompiles_after_first=st.recompiles - after_first.recompiles,
                           graphs_after_first=st.graphs - after_first.graphs,
                           cudagraph_skips=st.cudagraph_skips,
                           break_reasons=dict(list(st.break_reasons.items())[:8]),
                           recompile_reasons=st.recompile_reasons[:8],
                           peak_mib=round((torch.cuda.max_memory_allocated() - base_mem) / 2**20))
                del fn, model, params, x
        except Exception as exc:  # noqa: BLE001 - reported per variant
            row.update(error=f"{type(exc).__name__}: {exc}"[:800], tb=traceback.format_exc()[-1500:])
            print("RESULT " + json.dumps(row), flush=True)
            if base.startswith("mgc"):
                return 3
            continue
        print("RESULT " + json.dumps(row), flush=True)
    return 0


# --------------------------------------------------------------------------- parent
def _table(rows: list[dict[str, Any]]) -> str:
    by = {(r["model"], r["precision"], r["variant"]): r for r in rows}
    head = ("| model | prec | variant | ms/step | host ms | vs eager | vs mgc | graphs / breaks / recompiles "
            "(after 1st) | cg skips | peak MiB | first s | rel err |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        m, p, v = r["model"], r["precision"], r["variant"]
        if "median_ms" not in r:
            lines.append(f"| {m} | {p} | {v} | {r.get('error') or r.get('skipped', '?')} |" + " |" * 8)
            continue
        eager = by.get((m, p, "eager"), {}).get("median_ms")
        mgc = by.get((m, p, "mgc"), {}).get("median_ms")
        vs_e = f"{eager / r['median_ms']:.2f}x" if eager else "-"
        vs_m = f"{mgc / r['median_ms']:.2f}x" if mgc else "-"
        lines.append(f"| {m} | {p} | {v} | {r['median_ms']:.3f} | {r['host_ms']:.3f} | {vs_e} | {vs_m} | "
                     f"{r['graphs']} / {r['graph_breaks']} / {r['recompiles']} ({r['recompiles_after_first']}) | "
                     f"{r['cudagraph_skips']} | {r['peak_mib']} | {r['first_s']} | {r['rel_err_vs_eager']} |")
    return "\n".join(lines)


def _merge(dirs: list[str], out: Path) -> int:
    """Concatenate the rows of ``DIR/bench_transformer_layer.json`` for every ``dirs`` entry
    (chunks of one run) into ``out`` (JSON with each chunk's meta, and the table)."""
    rows, metas = [], []
    for d in dirs:
        f = Path(d) / "bench_transformer_layer.json"
        if not f.is_file():
            raise SystemExit(f"--merge: {f} does not exist (chunk not run?)")
        data = json.loads(f.read_text())
        rows.extend(data["rows"])
        metas.append(data["meta"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_transformer_layer.json").write_text(json.dumps({"meta": {"merged": metas}, "rows": rows}, indent=1))
    (out / "bench_transformer_layer.md").write_text(_table(rows) + "\n")
    print(_table(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=False, default="/tmp/bench_transformer_layer")
    ap.add_argument("--quick", action="store_true", help="layer1 only, the key variants, fewer steps")
    ap.add_argument("--models", nargs="*", choices=sorted(MODELS))
    ap.add_argument("--precisions", nargs="*", choices=PRECISIONS)
    ap.add_argument("--variants", nargs="*", choices=VARIANTS)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--iters", type=int)
    ap.add_argument("--budget-s", type=float, default=420.0, help="no variant starts after this many seconds")
    ap.add_argument("--worker-timeout-s", type=float, default=300.0, help="per variant")
    ap.add_argument("--no-prepare", action="store_true",
                    help="skip te_passes.rewrite.te_state.prepare_te_state before compiling (shows TE's "
                         "first-forward recompiles)")
    ap.add_argument("--dry-run", action="store_true", help="print the task plan as JSON; no GPU needed")
    ap.add_argument("--print-chunks", action="store_true",
                    help="print the device-call commands that together run the issue-15 table")
    ap.add_argument("--merge", nargs="+", metavar="DIR", help="merge the JSON of these --out dirs into --out")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # JSON task list: run in this process
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)  # worker: time.time() budget end
    args = ap.parse_args(argv)
    if args.print_chunks:
        print("\n".join(chunk_commands()))
        return 0
    if args.merge:
        return _merge(args.merge, Path(args.out))
    warmup = args.warmup if args.warmup is not None else (3 if args.quick else 5)
    iters = args.iters if args.iters is not None else (10 if args.quick else 20)
    if args.worker:
        return _worker(json.loads(args.worker), warmup, iters, not args.no_prepare, args.deadline)

    models = args.models or (["layer1"] if args.quick else list(MODELS))
    precisions = args.precisions or list(PRECISIONS)
    variants = args.variants or list(QUICK_VARIANTS if args.quick else DEFAULT_VARIANTS)
    # Two passes: the key comparisons (QUICK_VARIANTS) for every model/precision first, then the
    # rest, so a budget cut drops secondary variants rather than whole models.
    groups = plan(models, precisions, [v for v in variants if v in QUICK_VARIANTS]) + \
        plan(models, precisions, [v for v in variants if v not in QUICK_VARIANTS])
    if args.dry_run:
        print(json.dumps({"groups": groups, "warmup": warmup, "iters": iters, "budget_s": args.budget_s,
                          "max_wall_s": args.budget_s + GRACE_S}, indent=1))
        return 0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    t_start, wall_start = time.perf_counter(), time.time()
    meta = {"command": " ".join(sys.argv), "warmup": warmup, "iters": iters, "hidden": HIDDEN, "ffn": FFN,
            "heads": HEADS, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "commit": os.environ.get("TE_PASSES_COMMIT"), "prepare_te_state": not args.no_prepare}

    def save():
        (out / "bench_transformer_layer.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        (out / "bench_transformer_layer.md").write_text(_table(rows) + "\n")

    for group in groups:
        pending = list(group)
        while pending:
            if time.perf_counter() - t_start > args.budget_s:
                rows.extend(dict(t, skipped=f"budget {args.budget_s:.0f}s spent") for t in pending)
                break
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(pending),
                   "--warmup", str(warmup), "--iters", str(iters), "--deadline", str(wall_start + args.budget_s)
                   ] + (["--no-prepare"] if args.no_prepare else [])
            left = max(10.0, min(args.worker_timeout_s * len(pending),
                                 args.budget_s + GRACE_S - (time.perf_counter() - t_start)))
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left, cwd=_ROOT)
                stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
            except subprocess.TimeoutExpired as e:
                stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
                stderr, rc = f"worker timed out after {left:.0f}s", -9
            done = [json.loads(ln[len("RESULT "):]) for ln in stdout.splitlines() if ln.startswith("RESULT ")]
            for r in done:
                print(json.dumps({k: v for k, v in r.items() if k != "tb"}), flush=True)
            rows.extend(done)
            finished = {(r["model"], r["precision"], r["variant"]) for r in done}
            rest = [t for t in pending if (t["model"], t["precision"], t["variant"]) not in finished]
            if rc not in (0, 3) or (rc == 0 and rest):
                tail = (stderr or "").strip().splitlines()[-6:]
                if rest:  # the worker died on rest[0]: record it, go on with the others
                    rows.append(dict(rest[0], error=f"worker rc={rc}: " + " | ".join(tail)[-700:]))
                    rest = rest[1:]
            pending = rest
            save()
    meta["wall_s"] = round(time.perf_counter() - t_start, 1)
    save()
    print(_table(rows))
    print(f"wrote {out / 'bench_transformer_layer.json'} ({meta['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
