#!/usr/bin/env python3
"""GPU benchmark: TE eager vs Inductor vs te_inductor vs TE's make_graphed_callables, one run.

One command (on a CUDA machine with torch 2.14.1 + TE 2.20.2)::

    python3 benchmarks/bench_gpu.py --out OUT_DIR

Model: "stack4" = 4 × ``te.Linear(4096, 4096)`` (bf16 params, bias) with ``torch.nn.GELU`` between
(te_passes/testing/gpu.py ``build_stack``); input ``[tokens, 4096]`` bf16 with ``requires_grad``.
One step = ``p.grad = None`` for every parameter, forward, ``backward(dy)``.

Variants, measured one after the other in the same process on the same weights and inputs
(``torch._dynamo.reset()`` and ``torch.cuda.empty_cache()`` between them):

============== ===========================================================================
eager          TE eager
inductor       ``torch.compile(backend="inductor")``
inductor-ro    ``torch.compile(backend="inductor", mode="reduce-overhead")`` (cudagraph trees)
te_inductor    ``torch.compile(backend="te_inductor")``
te_inductor-nodirect  the same with ``options={"te_passes.disable": ["call_te_impl_directly"]}``
               (TE ops called through the dispatcher; issue 13)
te_inductor-ro ``torch.compile(backend="te_inductor", mode="reduce-overhead")`` (the default replay,
               ``te_passes.cudagraphs="trees"``: Inductor's cudagraph trees)
te_inductor-ro-lean   the same with ``te_passes.cudagraphs="lean"`` (te_passes' lean CUDA-graph
               replay, opt-in; issue 14)
te_inductor-ro-trees  the same with ``te_passes.cudagraphs="trees"`` named explicitly
mgc            ``te.make_graphed_callables(model, (x,), enabled=fp8, recipe=recipe)`` (TE's own
               CUDA-graph capture; default ``clone_param_grads_on_return=True``)
mgc-noclone    the same with ``clone_param_grads_on_return=False`` (returned parameter grads alias
               the graph's static buffers)
============== ===========================================================================

Every compiled variant (not ``eager``, not ``mgc*``) first runs
``te_passes.prepare_te_state(model, recipe, fp8=...)`` — TE's first-forward lazy state and the
recipe's cached repr — so the step after the first does not recompile (issue 15).

Per variant and configuration (tokens × precision) it reports: the median of per-step times
from CUDA events (ms; host time is included, since the end event is enqueued after the step's
last launch), the back-to-back mean, the speed-up against TE eager (eager ms / variant ms, >1 is
faster), ``torch.cuda.max_memory_allocated`` and
its excess over the memory allocated before it started (the peak of the warm-up and timed
steps; the first call's peak, compile / capture included, in its own column), Dynamo graphs / graph breaks /
recompiles / cudagraph skips, first-call wall time (compile + capture + one step), te_passes'
pass time against te_inductor's total compile time (``te_passes.report.compile_reports()``:
``time_ms_passes`` / ``time_ms_total``), and the first step's relative error against eager.

Writes ``bench_gpu.json`` (after every variant, so a killed run keeps what it measured) and
``bench_gpu.md`` under ``--out``; per variant also the host / GPU split of a step (``_split``:
host ms, GPU ms, whether the host had to wait for the GPU) and, for lean rows, each lean graph's
``stats`` (replays, calls without the graph by reason in the records' counts, wrapper host µs per
replay, pool MiB its outputs hold) under ``cudagraph_records``; prints the markdown table and the goal checks of
shared GOALS / issue 7. ``--dry-run`` exercises the table and goal logic on made-up numbers
without a GPU (it is labelled as such everywhere it prints).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402  (import torch before transformer_engine)

# -- issue 13: te_inductor without call_te_impl_directly (dispatcher calls of the TE ops), next to
#    te_inductor so the pass's gain prints side by side; issue 14: lean and trees named explicitly
NODIRECT = "te_inductor-nodirect"
LEAN = "te_inductor-ro-lean"
ALL_VARIANTS = ("eager", "inductor", "inductor-ro", "te_inductor", NODIRECT, "te_inductor-ro", LEAN,
                "te_inductor-ro-trees", "mgc", "mgc-noclone")
DEFAULT_VARIANTS = ALL_VARIANTS
#: ``--profile`` default: cProfile text of these (tokens:precision:variant) under --out
DEFAULT_PROFILE = ("256:fp8:te_inductor", "256:fp8:te_inductor-ro-lean", "256:fp8:te_inductor-ro-trees", "256:fp8:mgc")
#: Configurations in the order they run: the launch-bound fp8 row first (the goals' key row).
DEFAULT_CONFIGS = ("256:fp8", "8192:fp8", "256:bf16", "8192:bf16")


@dataclasses.dataclass
class Row:
    """One variant × configuration measurement (units in the field names; None = not measured)."""

    tokens: int
    precision: str
    variant: str
    status: str = "ok"            # "ok" | "failed: <error>" | "not run: <reason>"
    median_ms: float | None = None
    p10_ms: float | None = None
    p90_ms: float | None = None
    b2b_ms: float | None = None
    speedup_vs_eager: float | None = None
    peak_mib: float | None = None         # max_memory_allocated over the warm-up + timed steps
    peak_first_mib: float | None = None   # ... over the first call (compile / capture + one step)
    start_mib: float | None = None        # memory_allocated before the variant's first call
    graphs: int | None = None
    graph_breaks: int | None = None
    recompiles: int | None = None
    recompiles_after_first: int | None = None  # issue 15: 0 once prepare_te_state ran
    cudagraph_skips: int | None = None
    cudagraph_recordings: int | None = None
    first_call_s: float | None = None
    passes_ms: float | None = None
    te_compile_ms: float | None = None
    max_rel_err: float | None = None
    iters: int = 0
    recompile_reasons: list[str] = dataclasses.field(default_factory=list)  # JSON only
    # --- issue 14: lean cudagraph records (CompileReport.cudagraphs) that are not "lean"/"captured"
    cudagraph_fallbacks: int | None = None
    cudagraph_records: list[dict] = dataclasses.field(default_factory=list)  # JSON only
    # --- issue 14: host / GPU split of a step (``_split``): which side bounds the step
    host_ms: float | None = None          # median host (Python) time per step, queue kept full
    gpu_ms: float | None = None           # median GPU time per step with the host ahead of it
    host_waited: bool | None = None       # the host caught up with the GPU during the split (a sync)
    lean_saved_mib: float | None = None   # pool memory lean forwards hold for their lifetime

    @property
    def excess_mib(self) -> float | None:
        return None if self.peak_mib is None or self.start_mib is None else self.peak_mib - self.start_mib


# --------------------------------------------------------------------------------------------- GPU
def _variant_fn(variant: str, model, precision: str, recipe, x):
    """Return ``(fn, mark_step)`` for ``variant``; builds (but does not call) the compiled function."""
    from te_passes.testing.gpu import forward_fn

    base = forward_fn(model, precision, recipe)
    if variant == "eager":
        return base, False
    if not variant.startswith("mgc"):  # TE's first-forward lazy state: else step 2 recompiles (issue 15)
        from te_passes.rewrite.te_state import prepare_te_state

        prepare_te_state(model, recipe, fp8=precision == "fp8")
    if variant == NODIRECT:  # issue 13: the same compile with the direct-call pass switched off
        return torch.compile(base, backend="te_inductor",
                             options={"te_passes.disable": ["call_te_impl_directly"]}), False
    if variant in ("te_inductor-ro-trees", LEAN):  # issue 14: lean replay and trees, named explicitly
        import functools

        from te_passes.backend import te_inductor

        return torch.compile(base, backend=functools.partial(
            te_inductor, mode="reduce-overhead",
            options={"te_passes.cudagraphs": variant.rsplit("-", 1)[1]})), True
    if variant in ("inductor", "inductor-ro", "te_inductor", "te_inductor-ro"):
        backend = "te_inductor" if variant.startswith("te_") else "inductor"
        mode = "reduce-overhead" if variant.endswith("-ro") else None
        return torch.compile(base, backend=backend, mode=mode), mode is not None
    if variant in ("mgc", "mgc-noclone"):
        import transformer_engine.pytorch as te

        te.make_graphed_callables(model, (x,), num_warmup_iters=3, enabled=precision == "fp8", recipe=recipe,
                                  clone_param_grads_on_return=variant == "mgc")
        return base, False  # make_graphed_callables replaced model.forward with the graph replay
    raise ValueError(f"unknown variant {variant!r}; known: {ALL_VARIANTS}")


def _measure(variant: str, tokens: int, precision: str, ref_model, x, dy, ref_out, args) -> Row:
    from te_passes.report import clear_compile_reports, compile_reports
    from te_passes.testing.gpu import (CompileWatch, build_stack, copy_params, fresh_compile_state,
                                       grads_of, make_recipe, rel_err, train_step)

    row = Row(tokens, precision, variant)
    with fresh_compile_state():
        model = build_stack(args.layers, args.hidden, seed=0)
        copy_params(ref_model, model)
        params = list(model.parameters())
        recipe = make_recipe(precision)
        clear_compile_reports()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        row.start_mib = torch.cuda.memory_allocated() / 2**20
        with CompileWatch() as watch:
            t0 = time.perf_counter()
            fn, mark = _variant_fn(variant, model, precision, recipe, x)
            y = train_step(fn, x, dy, params, mark_step=mark)
            torch.cuda.synchronize()
            row.first_call_s = time.perf_counter() - t0
            first = watch.snapshot()
            row.peak_first_mib = torch.cuda.max_memory_allocated() / 2**20
            # numerics against eager: fp32 copies of weight grads are large, so the peak of the
            # steps is measured only after this check (reset below)
            got = {"y": y.detach().clone(), **grads_of(x, model)}
            row.max_rel_err = max(rel_err(got[k], ref_out[k]) for k in ref_out)
            del got, y
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            for _ in range(args.warmup):
                train_step(fn, x, dy, params, mark_step=mark)
            torch.cuda.synchronize()
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(args.iters)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(args.iters)]
            for i in range(args.iters):
                starts[i].record()
                train_step(fn, x, dy, params, mark_step=mark)
                ends[i].record()
            torch.cuda.synchronize()
            if args.split_steps:
                row.host_ms, row.gpu_ms, row.host_waited = _split(fn, x, dy, params, mark, args.split_steps)
            if f"{tokens}:{precision}:{variant}" in args.profile:
                _profile_host(fn, x, dy, params, mark, f"{tokens}:{precision}:{variant}", args)
            if f"{tokens}:{precision}:{variant}" in args.trace:
                _trace(fn, x, dy, params, mark, f"{tokens}:{precision}:{variant}", Path(args.out))
        times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
        row.iters = len(times)
        row.median_ms = statistics.median(times)
        row.p10_ms = times[int(0.1 * (len(times) - 1))]
        row.p90_ms = times[int(0.9 * (len(times) - 1))]
        row.b2b_ms = starts[0].elapsed_time(ends[-1]) / len(times)
        row.peak_mib = torch.cuda.max_memory_allocated() / 2**20
        st = watch.stats
        row.graphs, row.graph_breaks, row.recompiles = st.graphs, st.graph_breaks, st.recompiles
        row.recompiles_after_first = st.recompiles - first.recompiles
        row.cudagraph_skips, row.cudagraph_recordings = st.cudagraph_skips, st.cudagraph_recordings
        row.recompile_reasons = [r.split("\n")[0][:300] for r in st.recompile_reasons]
        if variant.startswith("te_inductor"):
            reps = compile_reports()
            row.passes_ms = sum(r.time_ms_passes for r in reps)
            row.te_compile_ms = sum(r.time_ms_total for r in reps)
            failed = [(r.graph_id, run.name, run.error) for r in reps for s in r.stages for run in s.runs
                      if run.status == "failed"]
            if failed:
                row.status = f"ok, but te_passes pass(es) failed: {failed}"
            recs = [r for rep in reps for r in rep.cudagraphs]
            row.cudagraph_records = recs
            row.cudagraph_fallbacks = sum(r["count"] for r in recs
                                          if r["event"] not in ("lean", "captured", "dataflow"))
            # lean replay counters per graph (replays / calls run without the CUDA graph / input copies)
            from te_passes.runtime.cudagraphs import lean_runners

            ids = {r.graph_id for r in reps}
            mine = [lr for lr in lean_runners() if lr.name.split(".")[0] in ids]
            row.cudagraph_records += [{"graph": lr.name, "event": "stats", "count": 0, **lr.stats,
                                       "replay_host_us_per_call": (lr.stats["replay_host_ns"] / 1e3 / lr.stats["replay"]
                                                                   if lr.stats["replay"] else None),
                                       "launch_host_us_per_call": (lr.stats["launch_host_ns"] / 1e3 / lr.stats["replay"]
                                                                   if lr.stats["replay"] else None),
                                       "held_mib": lr.held_bytes / 2**20} for lr in mine]
            if mine:
                row.lean_saved_mib = sum(lr.held_bytes for lr in mine if lr.name.endswith(".fwd")) / 2**20
        x.grad = None
        del fn, model, params
    return row


def _split(fn, x, dy, params, mark, steps: int) -> tuple[float, float, bool]:
    """Host and GPU time per step, apart: a long ``torch.cuda._sleep`` is queued first, so the
    host enqueues ``steps`` steps while the GPU is still asleep, then the GPU runs them back to
    back. Returns ``(host_ms, gpu_ms, host_waited)``: the median host time to enqueue one step
    (``time.perf_counter``), the median GPU time of one step (CUDA events between steps, the GPU
    never starved), and whether the GPU had already finished the sleep when the host was done
    enqueueing — ``True`` means a step waited for the GPU (a synchronisation in the step, or
    more launches than the launch queue holds: eager variants), so ``host_ms`` is not pure host
    time."""
    from te_passes.testing.gpu import train_step

    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    torch.cuda._sleep(int(5e8))  # ~0.25 s at H200 clocks: longer than enqueueing the steps
    ev[0].record()
    host = []
    for i in range(steps):
        t0 = time.perf_counter()
        train_step(fn, x, dy, params, mark_step=mark)
        ev[i + 1].record()
        host.append((time.perf_counter() - t0) * 1e3)
    waited = ev[0].query()
    torch.cuda.synchronize()
    gpu = [ev[i].elapsed_time(ev[i + 1]) for i in range(steps)]
    return statistics.median(host), statistics.median(gpu), bool(waited)


def _trace(fn, x, dy, params, mark, tag: str, out: Path, steps: int = 10) -> str:
    """``torch.profiler`` over ``steps`` steps (CPU, and CUDA when available): operator / runtime
    call / kernel counts and times, sorted by device time and by host time, to
    ``trace_<tag>.txt`` under ``out`` (returned too). What it answers for lean against trees:
    launches per step (``cudaGraphLaunch``, stray kernels or ``Memcpy`` outside the graphs),
    synchronisations (``cudaStreamSynchronize`` / ``cudaDeviceSynchronize`` / ``cudaMemcpy``),
    and GPU time per kernel."""
    from torch.profiler import ProfilerActivity, profile

    from te_passes.testing.gpu import train_step

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            train_step(fn, x, dy, params, mark_step=mark)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    ka = prof.key_averages()
    dev = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    text = (f"torch.profiler, {steps} steps, {tag}\n\n## by device time\n"
            + ka.table(sort_by=dev, row_limit=40)
            + "\n## by host time\n" + ka.table(sort_by="self_cpu_time_total", row_limit=40))
    print(text)
    (out / f"trace_{tag.replace(':', '_')}.txt").write_text(text)
    return text


def _profile_host(fn, x, dy, params, mark, tag: str, args) -> None:
    """cProfile 20 steps (host side: where the Python time of one step goes); top 30 by own time
    to stdout and ``profile_<tag>.txt`` under --out."""
    import cProfile
    import io
    import pstats

    from te_passes.testing.gpu import train_step

    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(20):
        train_step(fn, x, dy, params, mark_step=mark)
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    text = f"host profile, 20 steps, {tag}\n" + buf.getvalue()
    print(text)
    (Path(args.out) / f"profile_{tag.replace(':', '_')}.txt").write_text(text)


def _eager_reference(ref_model, x, dy, precision):
    from te_passes.testing.gpu import forward_fn, grads_of, make_recipe, train_step

    fn = forward_fn(ref_model, precision, make_recipe(precision))
    y = train_step(fn, x, dy, list(ref_model.parameters()))
    out = {"y": y.detach().clone(), **grads_of(x, ref_model)}
    for p in ref_model.parameters():
        p.grad = None
    x.grad = None
    return out


def run_gpu(args, rows: list[Row], meta: dict[str, Any], save) -> None:
    from te_passes.testing.gpu import build_stack, ensure_te_inductor_backend, gpu_skip_reason

    reason = gpu_skip_reason()
    if reason:
        sys.exit(f"bench_gpu: cannot run: {reason}")
    meta["te_inductor_backend"] = ensure_te_inductor_backend()
    t_start = time.perf_counter()
    for cfg in args.configs:
        tokens_s, precision = cfg.split(":")
        tokens = int(tokens_s)
        torch.manual_seed(0)
        ref_model = build_stack(args.layers, args.hidden, seed=0)
        gen = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(tokens, args.hidden, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        dy = torch.randn(tokens, args.hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
        ref_out = _eager_reference(ref_model, x, dy, precision)
        for variant in args.variants:
            elapsed = time.perf_counter() - t_start
            if elapsed > args.budget_s:
                rows.append(Row(tokens, precision, variant, status=f"not run: time budget {args.budget_s:.0f}s spent"))
                save()
                continue
            print(f"[bench +{elapsed:5.0f}s] {tokens} tokens {precision} {variant} ...", flush=True)
            try:
                row = _measure(variant, tokens, precision, ref_model, x, dy, ref_out, args)
            except Exception as exc:  # one variant failing must not lose the others; reported as failed
                import traceback

                traceback.print_exc()
                row = Row(tokens, precision, variant, status=f"failed: {type(exc).__name__}: {str(exc)[:300]}")
                torch._dynamo.reset()
            rows.append(row)
            _fill_speedups(rows)
            save()
            print(f"    -> {row.status}; median {_f(row.median_ms)} ms, first call {_f(row.first_call_s, 1)} s, "
                  f"peak {_f(row.peak_mib, 0)} MiB, graphs {row.graphs} breaks {row.graph_breaks} "
                  f"recompiles {row.recompiles} ({row.recompiles_after_first} after 1st) "
                  f"cg-skips {row.cudagraph_skips} max rel err {_f(row.max_rel_err, 4)}",
                  flush=True)
        del ref_model, x, dy, ref_out
        torch.cuda.empty_cache()


# -------------------------------------------------------------------------------------- reporting
def _f(v, nd: int = 2) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{nd}f}"


def _fill_speedups(rows: list[Row]) -> None:
    eager = {(r.tokens, r.precision): r.median_ms for r in rows if r.variant == "eager" and r.median_ms}
    for r in rows:
        e = eager.get((r.tokens, r.precision))
        r.speedup_vs_eager = e / r.median_ms if e and r.median_ms else None


def markdown_table(rows: list[Row]) -> str:
    """The results as one markdown table, rows grouped by configuration."""
    head = ("| tokens | precision | variant | median ms | × eager | b2b ms | p10–p90 ms | peak MiB | "
            "excess MiB | first-call peak MiB | graphs | breaks | recompiles | cg skips | first call s | passes ms / te_inductor ms | "
            "max rel err | cg fallbacks | host ms | GPU ms | host waited | status |")
    sep = "|" + "---|" * (head.count("|") - 1)
    lines = [head, sep]
    for r in rows:
        share = (f"{r.passes_ms:.1f} / {r.te_compile_ms:.0f} ({100 * r.passes_ms / r.te_compile_ms:.2f}%)"
                 if r.passes_ms is not None and r.te_compile_ms else "-")
        spread = f"{_f(r.p10_ms)}–{_f(r.p90_ms)}" if r.p10_ms is not None else "-"
        lines.append(
            f"| {r.tokens} | {r.precision} | {r.variant} | {_f(r.median_ms)} | {_f(r.speedup_vs_eager)}× | "
            f"{_f(r.b2b_ms)} | {spread} | {_f(r.peak_mib, 0)} | {_f(r.excess_mib, 0)} | {_f(r.peak_first_mib, 0)} | "
            f"{_v(r.graphs)} | {_v(r.graph_breaks)} | {_v(r.recompiles)} | {_v(r.cudagraph_skips)} | "
            f"{_f(r.first_call_s, 1)} | {share} | {_f(r.max_rel_err, 4)} | {_v(r.cudagraph_fallbacks)} | "
            f"{_f(r.host_ms)} | {_f(r.gpu_ms)} | {_v(r.host_waited)} | {r.status} |")
    return "\n".join(lines)


def _v(x) -> str:
    return "-" if x is None else str(x)


def goal_checks(rows: list[Row]) -> list[tuple[str, str, str]]:
    """``(goal, verdict, measured)`` for issue 7's and issue 13's goals; verdict is MET / NOT MET /
    NOT MEASURED (INFO for the direct-call pass's gain, which is a measurement, not a goal)."""
    by = {(r.tokens, r.precision, r.variant): r for r in rows if r.median_ms is not None}
    out: list[tuple[str, str, str]] = []

    def verdict(ok: bool | None) -> str:
        return "NOT MEASURED" if ok is None else ("MET" if ok else "NOT MET")

    cfgs = sorted({(r.tokens, r.precision) for r in rows})
    # te_inductor default >= 1.0x TE eager on every row
    vals = [(t, p, by[(t, p, "te_inductor")].speedup_vs_eager) for t, p in cfgs
            if (t, p, "te_inductor") in by and by[(t, p, "te_inductor")].speedup_vs_eager]
    ok = None if len(vals) < len(cfgs) or not vals else all(v >= 1.0 for _, _, v in vals)
    out.append(("te_inductor default ≥ 1.0× TE eager on every row", verdict(ok),
                ", ".join(f"{t}/{p}: {v:.2f}×" for t, p, v in vals) or "-"))
    # -- issue 13: issue 13's thresholds, and the direct-call pass's gain (te_inductor-nodirect ms / te_inductor ms)
    for t, p in cfgs:
        a, b, c = by.get((t, p, "te_inductor")), by.get((t, p, NODIRECT)), by.get((t, p, "inductor"))
        need = 1.0 if t >= 8192 else 0.9
        out.append((f"issue 13: te_inductor default ≥ {need}× TE eager, {t}/{p}",
                    verdict(None if a is None or not a.speedup_vs_eager else a.speedup_vs_eager >= need),
                    f"{a.speedup_vs_eager:.2f}×" if a is not None and a.speedup_vs_eager else "-"))
        if p == "fp8":
            out.append((f"issue 13: te_inductor ≥ 1.5× plain inductor, {t}/{p}",
                        verdict(None if a is None or c is None else c.median_ms / a.median_ms >= 1.5),
                        f"{c.median_ms / a.median_ms:.2f}×" if a is not None and c is not None else "-"))
        if a is not None and b is not None:
            out.append((f"issue 13: call_te_impl_directly gain, {t}/{p} (nodirect / direct)", "INFO",
                        f"{b.median_ms:.2f} / {a.median_ms:.2f} ms = {b.median_ms / a.median_ms:.2f}×"))
    # -- end issue 13
    for tokens, need in ((256, 3.5), (8192, 1.3)):
        r = by.get((tokens, "fp8", "te_inductor-ro"))
        s = r.speedup_vs_eager if r else None
        out.append((f"te_inductor reduce-overhead ≥ {need}× TE eager, {tokens}-token fp8 stack",
                    verdict(None if s is None else s >= need), "-" if s is None else f"{s:.2f}×"))
    # vs TE's make_graphed_callables on the launch-bound rows, and never slower on large shapes
    for t, p in cfgs:
        a, b = by.get((t, p, "te_inductor-ro")), by.get((t, p, "mgc"))
        if a and b:
            ratio = b.median_ms / a.median_ms
            out.append((f"te_inductor-ro at least as fast as make_graphed_callables, {t}/{p}",
                        verdict(ratio >= 1.0), f"mgc {b.median_ms:.2f} ms / te_inductor-ro {a.median_ms:.2f} ms "
                        f"= {ratio:.2f}×"))
    # issue 14: >= 0.8x make_graphed_callables(clone_param_grads_on_return=False), never slower
    # than plain inductor-ro; lean against trees shown for reference
    for t, p in cfgs:
        a = by.get((t, p, "te_inductor-ro"))
        for other, need in (("mgc-noclone", 0.8), ("inductor-ro", 1.0), ("te_inductor-ro-trees", 1.0)):
            b = by.get((t, p, other))
            if a and b:
                ratio = b.median_ms / a.median_ms
                out.append((f"te_inductor-ro ≥ {need}× {other}, {t}/{p}", verdict(ratio >= need),
                            f"{other} {b.median_ms:.2f} ms / te_inductor-ro {a.median_ms:.2f} ms = {ratio:.2f}×"))
    # issue 14: lean replay (opt-in) against trees (the default): what would make lean the default
    for t, p in cfgs:
        a, b = by.get((t, p, LEAN)), by.get((t, p, "te_inductor-ro-trees"))
        if a and b:
            out.append((f"lean ≥ 1.0× trees (te_inductor-ro-lean vs te_inductor-ro-trees), {t}/{p}",
                        verdict(b.median_ms / a.median_ms >= 1.0),
                        f"trees {b.median_ms:.2f} ms / lean {a.median_ms:.2f} ms = {b.median_ms / a.median_ms:.2f}×; "
                        f"host ms lean {_f(a.host_ms)} / trees {_f(b.host_ms)}, GPU ms lean {_f(a.gpu_ms)} / "
                        f"trees {_f(b.gpu_ms)}, host waited lean {_v(a.host_waited)} / trees {_v(b.host_waited)}"))
        c = by.get((t, p, "mgc-noclone"))
        if a and c:
            out.append((f"lean ≥ 0.8× mgc-noclone, {t}/{p}", verdict(c.median_ms / a.median_ms >= 0.8),
                        f"mgc-noclone {c.median_ms:.2f} ms / lean {a.median_ms:.2f} ms = {c.median_ms / a.median_ms:.2f}×"))
    # peak memory <= eager (te_inductor variants), and <= inductor reduce-overhead (ro)
    for t, p in cfgs:
        e = by.get((t, p, "eager"))
        for v in ("te_inductor", "te_inductor-ro", LEAN, "te_inductor-ro-trees"):
            r = by.get((t, p, v))
            if e and r and r.peak_mib is not None and e.peak_mib is not None:
                out.append((f"{v} peak memory ≤ TE eager, {t}/{p}", verdict(r.peak_mib <= e.peak_mib),
                            f"{r.peak_mib:.0f} vs {e.peak_mib:.0f} MiB"))
        a, b = by.get((t, p, "te_inductor-ro")), by.get((t, p, "inductor-ro"))
        if a and b and a.peak_mib is not None and b.peak_mib is not None:
            out.append((f"te_inductor-ro peak memory ≤ inductor-ro, {t}/{p}", verdict(a.peak_mib <= b.peak_mib),
                        f"{a.peak_mib:.0f} vs {b.peak_mib:.0f} MiB"))
        # lean's documented memory bound: trees' excess plus the saved tensors lean forwards hold
        a, b = by.get((t, p, LEAN)), by.get((t, p, "te_inductor-ro-trees"))
        if a and b and a.excess_mib is not None and b.excess_mib is not None and a.lean_saved_mib is not None:
            bound = b.excess_mib * 1.05 + a.lean_saved_mib + 8
            out.append((f"lean peak excess ≤ trees' + held saved tensors (+5%, +8 MiB), {t}/{p}",
                        verdict(a.excess_mib <= bound),
                        f"lean {a.excess_mib:.0f} MiB vs trees {b.excess_mib:.0f} + saved {a.lean_saved_mib:.0f} MiB"))
    shares = [r.passes_ms / r.te_compile_ms for r in rows if r.passes_ms is not None and r.te_compile_ms]
    out.append(("te_passes passes ≤ 5% of te_inductor compile time",
                verdict(None if not shares else max(shares) <= 0.05),
                "-" if not shares else f"max {100 * max(shares):.2f}% over {len(shares)} compiles"))
    breaks = [(r.tokens, r.precision, r.variant, r.graph_breaks, r.cudagraph_skips) for r in rows
              if r.variant.startswith(("inductor", "te_inductor")) and r.graphs is not None]
    out.append(("compiled rows: 0 graph breaks, 0 cudagraph skips",
                verdict(None if not breaks else all(b == 0 and (s or 0) == 0 for *_, b, s in breaks)),
                "; ".join(f"{t}/{p}/{v}: {b} breaks, {s} skips" for t, p, v, b, s in breaks if b or s) or "all zero"))
    return out


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                           "cuda": torch.version.cuda, "commit": os.environ.get("TE_PASSES_COMMIT")}
    try:
        import transformer_engine

        out["transformer_engine"] = transformer_engine.__version__
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        out["transformer_engine"] = f"not importable ({type(exc).__name__})"
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        out["triton"] = None
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def _fake_rows(args) -> list[Row]:
    """Made-up numbers for --dry-run (exercise formatting and goal logic only)."""
    rows = []
    for cfg in args.configs:
        t, p = cfg.split(":")
        for i, v in enumerate(args.variants):
            ms = 4.0 / (1 + i) if int(t) == 256 else 5.0 - 0.2 * i
            rows.append(Row(int(t), p, v, median_ms=ms, p10_ms=ms * 0.95, p90_ms=ms * 1.1, b2b_ms=ms,
                            peak_mib=500 + 10 * i, peak_first_mib=600.0, start_mib=300.0, graphs=0 if v in ("eager", "mgc") else 2,
                            graph_breaks=0, recompiles=0 if v in ("eager", "mgc") else 1, cudagraph_skips=0,
                            first_call_s=0.1 * i, passes_ms=1.5 if v.startswith("te_") else None,
                            te_compile_ms=3000.0 if v.startswith("te_") else None, max_rel_err=0.0, iters=args.iters))
    _fill_speedups(rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS),
                    help="TOKENS:PRECISION (precision bf16 or fp8), run in this order")
    ap.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=ALL_VARIANTS)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps after the first call")
    ap.add_argument("--iters", type=int, default=50, help="timed steps (median of per-step CUDA-event times)")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="stop starting new variants after this many seconds (they are listed as not run)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="directory for bench_gpu.json/.md")
    ap.add_argument("--profile", nargs="*", default=None,
                    help="TOKENS:PRECISION:VARIANT to cProfile for 20 extra (untimed) steps; without a value "
                         f"(or without the flag): {' '.join(DEFAULT_PROFILE)}; 'none': no profile")
    ap.add_argument("--trace", nargs="*", default=[],
                    help="TOKENS:PRECISION:VARIANT to run 10 extra steps of under torch.profiler (CPU + CUDA): "
                         "trace_<tag>.txt under --out (kernel / runtime-call counts and times)")
    ap.add_argument("--split-steps", type=int, default=20,
                    help="steps of the host / GPU split per variant (host ms, GPU ms, host waited); 0: none")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: made-up numbers through the reporting code")
    args = ap.parse_args(argv)
    if not args.profile:  # no flag, or the flag without a value
        args.profile = list(DEFAULT_PROFILE)
    elif args.profile == ["none"]:
        args.profile = []
    for tag in [*args.profile, *args.trace]:
        t, _, rest = tag.partition(":")
        p, _, v = rest.partition(":")
        if not t.isdigit() or p not in ("bf16", "fp8") or v not in ALL_VARIANTS:
            ap.error(f"bad --profile / --trace entry {tag!r}: want TOKENS:bf16|fp8:VARIANT with VARIANT one of {ALL_VARIANTS}")
    for cfg in args.configs:
        t, _, p = cfg.partition(":")
        if not t.isdigit() or p not in ("bf16", "fp8"):
            ap.error(f"bad --configs entry {cfg!r}: want TOKENS:bf16 or TOKENS:fp8")
    if "eager" not in args.variants:
        ap.error("--variants must include eager (speed-ups are against it)")
    if args.iters < 1 or args.warmup < 0:
        ap.error("--iters must be >= 1 and --warmup >= 0")

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    meta: dict[str, Any] = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(), "hidden": args.hidden, "layers": args.layers, "warmup": args.warmup,
        "iters": args.iters, "dry_run": args.dry_run,
    }

    def save() -> None:
        doc = {"meta": meta, "rows": [{**dataclasses.asdict(r), "excess_mib": r.excess_mib} for r in rows],
               "goals": [dict(zip(("goal", "verdict", "measured"), g)) for g in goal_checks(rows)]}
        (out_dir / "bench_gpu.json").write_text(json.dumps(doc, indent=1))

    if args.dry_run:
        rows.extend(_fake_rows(args))
        save()
    else:
        run_gpu(args, rows, meta, save)
    _fill_speedups(rows)
    save()
    label = "DRY RUN (made-up numbers) — " if args.dry_run else ""
    md = [f"# {label}te_passes GPU benchmark", "",
          f"`{meta['command']}` — {meta['date_utc']}", "",
          "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()), "",
          f"stack{args.layers}: {args.layers} × te.Linear({args.hidden}, {args.hidden}) + GELU; one step = fwd + bwd; "
          f"median of {args.iters} per-step CUDA-event times after {args.warmup} warm-up steps.", "",
          markdown_table(rows), "", "## Goals", "", "| goal | verdict | measured |", "|---|---|---|"]
    md += [f"| {g} | {v} | {m} |" for g, v, m in goal_checks(rows)]
    text = "\n".join(md) + "\n"
    (out_dir / "bench_gpu.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
