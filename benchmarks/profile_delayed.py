#!/usr/bin/env python3
"""Where a DelayedScaling step's host time goes: cProfile of stack4 under te_inductor (H200).

    source .gpu/s/env.sh; PYTHONPATH=$PWD:$PYTHONPATH python3 benchmarks/profile_delayed.py --out DIR

Per mode (TE eager, default, reduce-overhead with ``te.autocast`` inside the compiled function or around the
compiled model): median step ms over ``--steps`` steps, Inductor's cudagraph
skip reasons (its ``perf_hints`` log), and cProfile's top functions by own and cumulative time
(``DIR/profile_<mode>.txt``). Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import logging
import pstats
import statistics
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402  (import torch before transformer_engine)


class _Skips(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "cudagraph" in msg.lower() and "skip" in msg.lower():
            self.reasons.append(msg)


def run(mode: str, args, out: Path) -> str:
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as r

    from te_passes.testing.gpu import build_stack, ensure_te_inductor_backend

    ensure_te_inductor_backend()

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_stack(args.layers, args.hidden)
    x = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    recipe = r.DelayedScaling()

    def fwd(x):
        with te.autocast(enabled=True, recipe=recipe):
            return model(x)

    ro, outside = mode.startswith("ro"), mode.endswith("-outside")
    if mode.endswith("-prepared"):  # the state prepared (and marked static) by the user, not at compile start
        from te_passes.runtime.delayed.state import prepare_delayed_scaling

        prepare_delayed_scaling(model, recipe)
    if mode == "eager":  # TE eager, the baseline the compiled modes are compared with
        compiled = fwd
    else:
        compiled = torch.compile(model if outside else fwd, backend="te_inductor",
                                 mode="reduce-overhead" if ro else None)
    params = list(model.parameters())

    def step():
        if ro:
            torch.compiler.cudagraph_mark_step_begin()
        for p in params:
            p.grad = None
        x.grad = None
        if outside:
            with te.autocast(enabled=True, recipe=recipe):
                y = compiled(x)
        else:
            y = compiled(x)
        y.backward(dy)

    skips = _Skips()
    for name in ("torch._inductor", "torch._inductor.cudagraph_utils", "te_passes"):
        logging.getLogger(name).addHandler(skips)
    torch._logging.set_logs(perf_hints=True)
    from torch._inductor import cudagraph_utils

    original = cudagraph_utils.log_cudagraph_skip_and_bump_counter

    def record(msg, *a, **k):  # Inductor's one place for a skip: its reason, whatever the logging setup
        skips.reasons.append(f"[inductor] {msg}")
        return original(msg, *a, **k)

    for name in ("compile_fx", "cudagraph_trees", "output_code"):  # they import the function by name
        importlib.import_module(f"torch._inductor.{name}")
    for mod in list(sys.modules.values()):
        if getattr(mod, "log_cudagraph_skip_and_bump_counter", None) is original:
            mod.log_cudagraph_skip_and_bump_counter = record
    for _ in range(8):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(45)
    st.sort_stats("cumulative").print_stats(60)
    counters = dict(torch._dynamo.utils.counters["inductor"])
    head = (f"mode {mode}: median {statistics.median(times):.3f} ms/step over {args.steps} steps "
            f"(tokens {args.tokens}, {args.layers} x te.Linear({args.hidden}), DelayedScaling)\n"
            f"inductor counters: {counters}\ncudagraph skip reasons: {skips.reasons or 'none logged'}\n")
    tp = ""
    if args.torch_profiler:  # per-op host time: TE's and our custom ops, their dispatch and inner aten ops
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as tprof:
            for _ in range(10):
                step()
            torch.cuda.synchronize()
        tp = ("\ntorch.profiler, 10 steps, by self CPU time:\n"
              + tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
              + "\nby total CPU time:\n" + tprof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
    if args.spin:  # a steady loop for a sampling profiler (py-spy): its stacks pass through spin()
        spin(step, args.spin)
    (out / f"profile_{mode}.txt").write_text(head + s.getvalue() + tp)
    return head


def spin(step, seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        step()
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--torch-profiler", action="store_true", help="also torch.profiler's per-op CPU table")
    ap.add_argument("--spin", type=float, default=0.0, help="then run steps for this many seconds (py-spy)")
    ap.add_argument("--modes", nargs="+", default=["default", "ro", "ro-prepared", "ro-outside"],
                    choices=["eager", "default", "ro", "ro-prepared", "ro-outside"],
                    help="ro-outside: te.autocast around the compiled model instead of inside the function; "
                         "ro-prepared: prepare_delayed_scaling(model, recipe) before compiling")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for mode in args.modes:
        print(run(mode, args, args.out), flush=True)


if __name__ == "__main__":
    main()
