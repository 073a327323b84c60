"""The variants every TE benchmark measures, and the one measurement of a variant on a model.

A variant turns ``(model, recipe, x)`` into a training step (``p.grad = None``, forward, backward);
:func:`measure` times it with :mod:`benchmarks.harness` and reports numerics against TE eager,
compile counters and peak memory. Models stay in the scripts. Docs: docs/benchmarks.md "Benchmark harness".
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any, Callable

import harness

#: ``bf16``: no te.autocast; ``fp8``: Float8CurrentScaling; ``fp8-delayed``: DelayedScaling;
#: ``fp8-block``: Float8BlockScaling; ``mxfp8``: MXFP8BlockScaling (Blackwell only; each built once,
#: outside the compiled function).
PRECISIONS = ("bf16", "fp8", "fp8-delayed", "fp8-block", "mxfp8")
#: every variant (what each is: docs/benchmarks.md "Benchmark harness", Variants)
VARIANTS = ("eager", "inductor", "inductor-ro", "te_inductor", "te_inductor-nodirect", "te_inductor-nohoist",
            "te_inductor-nofree",
            "te_inductor-ro", "te_inductor-ro-lean", "te_inductor-ro-trees", "te_step-ro", "te_mgc", "te_mgc-noclone",
            "mgc", "mgc-noclone")
_WITHOUT = {"te_inductor-nodirect": "call_te_impl_directly", "te_inductor-nohoist": "hoist_te_constants",
            "te_inductor-nofree": "insert_early_frees"}
#: variants whose failure may leave TE in CUDA-graph capture state: a fresh worker after one fails
ISOLATE = ("mgc", "mgc-noclone", "te_mgc", "te_mgc-noclone")


def recipe_for(precision: str):
    """The TE recipe of ``precision`` (:data:`PRECISIONS`), ``None`` for bf16."""
    from transformer_engine.common import recipe as r

    return {"bf16": lambda: None, "fp8": r.Float8CurrentScaling, "fp8-delayed": r.DelayedScaling,
            "fp8-block": r.Float8BlockScaling, "mxfp8": r.MXFP8BlockScaling}[precision]()


def forward_of(model, recipe) -> Callable:
    """``x -> model(x)``, inside ``te.autocast(recipe=recipe)`` unless ``recipe`` is None."""
    import transformer_engine.pytorch as te

    if recipe is None:
        return lambda x: model(x)

    def fwd(x):
        with te.autocast(enabled=True, recipe=recipe):
            return model(x)
    return fwd


def _te_compile(fn, mode: str | None, options: dict[str, Any]):
    import torch

    if not options:
        return torch.compile(fn, backend="te_inductor", mode=mode)
    from te_passes.backend import te_inductor  # torch.compile refuses mode= and options= together

    return torch.compile(fn, backend=functools.partial(te_inductor, mode=mode, options=options))


def build_step(variant: str, model, recipe, x, dy, options: dict[str, Any], prepare: bool, *,
               accumulate: bool = False) -> tuple[Callable, dict]:
    """``(step, info)`` for ``variant``: ``step()`` runs ``p.grad = None``, forward, backward and
    returns the output; ``info`` holds ``unavailable`` when the API the variant needs is missing.
    ``prepare``: ``prepare_te_state`` first (compiled ``inductor*`` / ``te_inductor*`` variants only).
    ``accumulate``: parameter gradients are not cleared between steps (backward adds into ``.grad``;
    ``x.grad`` is still cleared)."""
    import torch
    import transformer_engine.pytorch as te

    import te_passes

    params = list(model.parameters())
    fp8 = recipe is not None
    base = forward_of(model, recipe)
    mark = False

    def zero():
        for p in () if accumulate else params:
            p.grad = None
        x.grad = None

    if variant.startswith(("inductor", "te_inductor")) and prepare:
        from te_passes.compat.untouched.rewrite.te_state import prepare_te_state

        prepare_te_state(model, recipe, fp8=fp8)
    if variant == "eager":
        fn = base
    elif variant in ("inductor", "inductor-ro"):
        mark = variant.endswith("-ro")
        fn = torch.compile(base, backend="inductor", mode="reduce-overhead" if mark else None)
    elif variant.startswith("te_inductor"):
        mark = "-ro" in variant
        opts = dict(options)
        if variant in _WITHOUT:
            opts["te_passes.disable"] = [_WITHOUT[variant]]
        elif variant.startswith("te_inductor-ro-"):
            opts["te_passes.cudagraphs"] = variant.rsplit("-", 1)[1]
        elif variant not in ("te_inductor", "te_inductor-ro"):
            raise ValueError(f"unknown variant {variant!r}")
        fn = _te_compile(base, "reduce-overhead" if mark else None, opts)
    elif variant == "te_step-ro":
        compile_step = getattr(te_passes, "compile_step", None)
        if compile_step is None:
            return (lambda: None), {"unavailable": "te_passes.compile_step missing"}

        def whole(x, dy):  # returns nothing: no output copied out of the graph pool (numerics: the grads)
            base(x).backward(dy)

        cstep = compile_step(whole, mode="reduce-overhead", options=options or None)

        def step():
            torch.compiler.cudagraph_mark_step_begin()
            zero()
            return cstep(x, dy)
        return step, {}
    elif variant in ("te_mgc", "te_mgc-noclone", "mgc", "mgc-noclone"):
        kw = dict(num_warmup_iters=3, enabled=fp8, recipe=recipe, clone_param_grads_on_return=not variant.endswith("-noclone"))
        if variant.startswith("te_"):
            make_graphed = getattr(te_passes, "make_graphed", None)
            if make_graphed is None:
                return (lambda: None), {"unavailable": "te_passes.make_graphed missing"}
            graphed = make_graphed(model, (x,), options=options or None, **kw)
        else:
            graphed = te.make_graphed_callables(model, (x,), **kw)
        fn = forward_of(graphed, recipe)
    else:
        raise ValueError(f"unknown variant {variant!r}; known: {sorted(VARIANTS)}")

    def step():
        if mark:
            torch.compiler.cudagraph_mark_step_begin()
        zero()
        y = fn(x)
        y.backward(dy)
        return y
    return step, {}


def outputs(y, x, model) -> dict:
    """``{"y": y, "x": x.grad, "<param>": p.grad}`` (not cloned; ``None`` grads left out)."""
    out = {"y": y, "x": x.grad}
    out.update((n, p.grad) for n, p in model.named_parameters())
    return {k: v for k, v in out.items() if v is not None}


def reference(model, recipe, x, dy) -> dict:
    """TE eager's output and gradients after one step, cloned (the numerics baseline)."""
    step, _ = build_step("eager", model, recipe, x, dy, {}, False)
    y = step()
    ref = {k: v.detach().clone() for k, v in outputs(y, x, model).items()}
    for p in model.parameters():
        p.grad = None
    x.grad = None
    return ref


_refs: dict = {}  # worker: key -> (reference model, x, dy, its eager outputs); one key at a time


def run_task(task: dict, args, key: tuple, build: Callable, shape: tuple, *, prepare: bool, tag: str,
             rewrite: Callable | None = None) -> dict[str, Any]:
    """One task in a worker: the reference model, inputs (bf16, ``shape``) and TE eager outputs of
    ``key`` built once, then a fresh ``build()`` with the reference's weights (``rewrite(model)``
    applied) measured under ``task["variant"]`` (a ``+tag`` suffix ignored)."""
    import torch

    from te_passes.testing.gpu import copy_params, ensure_te_inductor_backend, fresh_compile_state

    ensure_te_inductor_backend()
    if key not in _refs:
        _refs.clear()
        torch.cuda.empty_cache()
        ref = build()
        g = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        dy = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
        _refs[key] = (ref, x, dy, reference(ref, recipe_for(task["precision"]), x, dy))
    ref, x, dy, out = _refs[key]
    with fresh_compile_state():
        model = build()
        copy_params(ref, model)
        extra = rewrite(model) if rewrite is not None else {}
        row = measure(dict(task, variant=task["variant"].split("+")[0]), args, model, x, dy, out, prepare=prepare,
                      tag=tag)
        x.grad = None
        del model
    return dict(row, **extra)


def measure(task: dict, args, model, x, dy, ref: dict, *, prepare: bool, tag: str) -> dict[str, Any]:
    """One row: first call (compile / capture + one step) and its numerics against ``ref``, timed
    steps, kernel-time sum, host / GPU split, compile counters, peak memory (MiB over what was
    allocated before ``model`` was handed in; ``peak_mib`` steady state, ``first_peak_mib`` the
    first call). ``args``: warmup, iters, kernel_steps, split_steps, te_option, profile, trace, out;
    optional: ``accumulate`` (:func:`build_step`), ``kernel_list`` (``row["kernels"]``: kernel name ->
    ``[launches, µs]`` per step, :func:`harness.kernel_sum_ms`)."""
    import torch

    from te_passes.report import clear_compile_reports
    from te_passes.testing.gpu import CompileWatch, grad_rel_err

    clear_compile_reports()
    row: dict[str, Any] = {}
    recipe = recipe_for(task["precision"])
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with CompileWatch() as watch:
        t0 = time.perf_counter()
        step, info = build_step(task["variant"], model, recipe, x, dy, harness.parse_kv(args.te_option), prepare,
                                accumulate=getattr(args, "accumulate", False))
        if info:
            return info
        y = step()
        torch.cuda.synchronize()
        row["first_call_s"] = round(time.perf_counter() - t0, 2)
        row["first_peak_mib"] = (torch.cuda.max_memory_allocated() - start) / 2**20
        got = {k: v for k, v in outputs(y, x, model).items() if k in ref}
        errs = {k: grad_rel_err(k, v, ref[k], ref) for k, v in got.items()}  # key biases on the query bias's scale
        worst = max(errs, key=errs.get) if errs else None
        row.update(max_rel_err=errs.get(worst), worst=worst, y_rel_err=errs.get("y"),
                   bit_identical=f"{sum(torch.equal(v, ref[k]) for k, v in got.items())}/{len(got)}")
        del got
        del y
        first = watch.snapshot()
        torch.cuda.reset_peak_memory_stats()
        row.update(harness.time_steps(step, warmup=args.warmup, iters=args.iters))
        row["peak_mib"] = (torch.cuda.max_memory_allocated() - start) / 2**20
        if args.kernel_steps:
            trace = Path(args.out) / f"trace_{tag}.txt" if tag in args.trace else None
            kernels: dict | None = {} if getattr(args, "kernel_list", False) else None
            row["kernel_ms"] = harness.kernel_sum_ms(step, args.kernel_steps, trace, by_name=kernels)
            if kernels is not None:
                row["kernels"] = kernels
        if args.split_steps:
            row.update(harness.host_gpu_split(step, args.split_steps))
        if tag in args.profile:
            harness.cprofile(step, Path(args.out) / f"profile_{tag}.txt")
    st = watch.stats
    row.update(graphs=st.graphs, graph_breaks=st.graph_breaks, recompiles=st.recompiles,
               recompiles_after_first=st.recompiles - first.recompiles, cudagraph_skips=st.cudagraph_skips,
               break_reasons={k.split("\n")[0][:200]: n for k, n in list(st.break_reasons.items())[:8]},
               recompile_reasons=[r.split("\n")[0][:300] for r in st.recompile_reasons[:8]])
    if task["variant"].startswith("te_"):
        row.update(_report_fields())
    return row


def _report_fields() -> dict[str, Any]:
    """te_passes' own compile reports: pass ms against te_inductor's total, failed passes."""
    from te_passes.report import compile_reports

    reps = compile_reports()
    failed = [(r.graph_id, run.name, run.error) for r in reps for s in r.stages for run in s.runs
              if run.status == "failed"]
    return dict(passes_ms=sum(r.time_ms_passes for r in reps), te_compile_ms=sum(r.time_ms_total for r in reps),
                **({"pass_failures": str(failed)[:400]} if failed else {}))


def add_args(ap) -> None:
    """The options every TE benchmark takes (after harness's own)."""
    ap.add_argument("--te-option", action="append", metavar="KEY=VALUE",
                    help="te_passes option for every te_inductor / te_step / te_mgc variant "
                         "(e.g. the untouched-model norm switch); repeatable")
    ap.add_argument("--tag", default="", help="appended to every variant name in the rows (+TAG), to merge "
                                              "runs with different --te-option side by side")
    ap.add_argument("--kernel-steps", type=int, default=10, help="steps under torch.profiler for kernel ms (0: off)")
    ap.add_argument("--split-steps", type=int, default=10, help="steps of the host / GPU split (0: off)")
    ap.add_argument("--profile", nargs="*", default=[], metavar="TAG",
                    help="cProfile 20 steps of these rows (TAG: <tokens or model>_<precision>_<variant>, "
                         "e.g. 256_fp8_te_inductor-ro) to profile_TAG.txt")
    ap.add_argument("--trace", nargs="*", default=[], metavar="TAG",
                    help="the profiler tables of these rows' kernel-sum steps to trace_TAG.txt")


def fake(task: dict, i: int) -> dict[str, Any]:
    """Made-up measurements for ``--dry-run`` (the code path, never a result)."""
    if task["variant"].startswith(("te_step", "te_mgc")) and i % 5 == 4:
        return {"unavailable": "dry run: pretend the API is missing"}
    ms = 4.0 / (1 + i % 7)
    return dict(median_ms=ms, p10_ms=ms * 0.95, p90_ms=ms * 1.1, b2b_ms=ms, host_ms=ms * 0.8, kernel_ms=0.4,
                peak_mib=300.0 + 10 * (i % 3), first_peak_mib=400.0, first_call_s=0.1 * i, max_rel_err=0.0,
                worst="y", bit_identical="3/3", graphs=1, graph_breaks=0, recompiles=0, recompiles_after_first=0, cudagraph_skips=0)


def ratio(rows: dict, a: str, b: str) -> float | None:
    """``rows[b].median_ms / rows[a].median_ms`` (how much faster ``a`` is than ``b``), or None."""
    ra, rb = rows.get(a), rows.get(b)
    return rb["median_ms"] / ra["median_ms"] if harness.ok(ra) and harness.ok(rb) else None


def pair(out: list, g: dict, text: str, a: str, b: str, need: float) -> None:
    """:func:`goal` for "``a`` ≥ ``need`` × ``b``" in group ``g`` (variant -> row); nothing when
    either variant was not in the run."""
    if a in g and b in g:
        r = ratio(g, a, b)
        goal(out, text, r, need, "-" if r is None else
             f"{b} {g[b]['median_ms']:.3f} ms / {a} {g[a]['median_ms']:.3f} ms = {r:.2f}×")


def goal(out: list, text: str, r: float | None, need: float, measured: str = "") -> None:
    """Append ``(text, verdict, measured)``: MET when ``r >= need``."""
    out.append((text, harness.verdict(None if r is None else r >= need),
                "-" if r is None else (measured or f"{r:.2f}×")))


COLUMNS = [
    harness.Col("median ms", "median_ms", "{:.3f}"),
    harness.Col("host ms", "host_ms", "{:.3f}"),
    harness.Col("kernel ms", "kernel_ms", "{:.3f}"),
    harness.Col("÷ kernel", "", lambda r: f"{r['median_ms'] / r['kernel_ms']:.2f}"
                if r.get("median_ms") and r.get("kernel_ms") else "-"),
    harness.Col("p10–p90 ms", "", lambda r: f"{r['p10_ms']:.3f}–{r['p90_ms']:.3f}" if r.get("p10_ms") else "-"),
    harness.Col("split host / GPU ms (waited)", "", lambda r: f"{r['split_host_ms']:.3f} / {r['split_gpu_ms']:.3f} "
                f"({'y' if r['host_waited'] else 'n'})" if r.get("split_host_ms") is not None else "-"),
    harness.Col("graphs / breaks / recompiles (after 1st)", "", lambda r: f"{r['graphs']} / {r['graph_breaks']} / "
                f"{r['recompiles']} ({r['recompiles_after_first']})" if r.get("graphs") is not None else "-"),
    harness.Col("cg skips", "cudagraph_skips"),
    harness.Col("peak MiB", "peak_mib", "{:.0f}"),
    harness.Col("first-call peak MiB", "first_peak_mib", "{:.0f}"),
    harness.Col("first call s", "first_call_s", "{:.1f}"),
    harness.Col("passes / compile ms", "", lambda r: f"{r['passes_ms']:.1f} / {r['te_compile_ms']:.0f}"
                if r.get("te_compile_ms") else "-"),
    harness.Col("max rel err (worst; bit-identical tensors)", "", lambda r: f"{r['max_rel_err']:.2e} ({r['worst']}; "
                f"{r.get('bit_identical', '?')})" if r.get("max_rel_err") is not None else "-"),
]
