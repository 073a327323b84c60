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
        from te_passes.compat.delayed_scaling.state import prepare_delayed_scaling

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
    if args.sections:  # wall time per call of our op code's and TE's functions (timers, no profiler)
        tp += sections(step, args.steps)
    if args.torch_profiler:  # per-op host time: TE's and our custom ops, their dispatch and inner aten ops
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as tprof:
            for _ in range(10):
                step()
            torch.cuda.synchronize()
        tp += ("\ntorch.profiler, 10 steps, by self CPU time:\n"
              + tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
              + "\nby total CPU time:\n" + tprof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
    if args.spin:  # a steady loop for a sampling profiler (py-spy): its stacks pass through spin()
        spin(step, args.spin)
    (out / f"profile_{mode}.txt").write_text(head + s.getvalue() + tp)
    return head


#: (module, attribute path) of the functions :func:`sections` times; absent ones are skipped.
SECTION_TARGETS = (
    ("te_passes.compat.delayed_scaling.args", "fwd_args"), ("te_passes.compat.delayed_scaling.args", "bwd_args"),
    ("te_passes.compat.delayed_scaling.args", "_output_plan"), ("te_passes.compat.delayed_scaling.args", "expected_layout"),
    ("te_passes.compat.delayed_scaling.args", "on_device"), ("te_passes.compat.delayed_scaling.args", "_quantizer"),
    ("te_passes.compat.delayed_scaling.linear", "fwd_args"), ("te_passes.compat.delayed_scaling.linear", "bwd_args"),
    ("te_passes.compat.delayed_scaling.linear", "expected_layout"), ("te_passes.compat.delayed_scaling.linear", "on_device"),
    ("te_passes.compat.delayed_scaling.args", "release_call_state"),
    ("transformer_engine.pytorch.module.linear", "_linear_forward_impl"),
    ("transformer_engine.pytorch.module.linear", "_linear_backward_impl"),
    ("transformer_engine.pytorch.module.linear", "_linear_setup_ctx"),
    ("transformer_engine.pytorch.module.linear", "_Linear.forward"),
    ("transformer_engine.pytorch.module.linear", "_Linear.backward"),
    ("transformer_engine.pytorch.dynamo.custom_op", "_pack_fwd_result"),
    ("transformer_engine.pytorch.dynamo.custom_op", "_pack_bwd_result"),
    ("transformer_engine.pytorch.dynamo.custom_op", "_OutputPlan.saved_tensors"),
    ("transformer_engine.pytorch.dynamo.custom_op", "_spec_view"),
)
#: custom ops whose whole backend call (impl included) :func:`sections` times.
SECTION_OPS = ("te_passes::delayed_linear_fwd", "te_passes::delayed_linear_bwd", "te_passes::delayed_scaling_update")


def sections(step, steps: int) -> str:
    """Run ``steps`` steps with a wall-clock timer (``perf_counter_ns``, inclusive) around each
    :data:`SECTION_TARGETS` function and each :data:`SECTION_OPS` op's backend; returns the table
    (calls per step, µs per call, µs per step) and the step's own median."""
    from torch._library import custom_ops

    acc: dict[str, list] = {}

    def timed(name, fn):
        rec = acc.setdefault(name, [0, 0])

        def wrapper(*a, **k):
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                rec[0] += 1
                rec[1] += time.perf_counter_ns() - t0

        return wrapper

    undo = []
    for modname, path in SECTION_TARGETS:
        try:
            owner = importlib.import_module(modname)
        except ImportError:  # another te_passes version (an A/B run): not timed
            continue
        *parents, attr = path.split(".")
        for p in parents:
            owner = getattr(owner, p, None)
        fn = getattr(owner, attr, None) if owner is not None else None
        if fn is None:
            continue
        raw = owner.__dict__.get(attr, fn) if isinstance(owner, type) else fn
        new = timed(f"{modname.rsplit('.', 1)[-1]}.{path}", fn)
        setattr(owner, attr, staticmethod(new) if isinstance(raw, staticmethod) else new)
        undo.append((owner, attr, raw))
    for name in SECTION_OPS:
        opdef = custom_ops.OPDEFS.get(name)
        for dev, fn in list(getattr(opdef, "_backend_fns", {}).items()):
            opdef._backend_fns[dev] = timed(f"op {name}", fn)
            undo.append((opdef._backend_fns, dev, fn))
    times = []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(1e6 * (time.perf_counter() - t0))
    finally:
        for owner, attr, raw in reversed(undo):
            if isinstance(owner, dict):
                owner[attr] = raw
            else:
                setattr(owner, attr, raw)
    lines = [f"\nsections (inclusive wall time, {steps} steps, median step {statistics.median(times):.0f} µs "
             "with the timers):", f"{'function':<48} {'calls/step':>10} {'µs/call':>9} {'µs/step':>9}"]
    for name, (n, ns) in sorted(acc.items(), key=lambda kv: -kv[1][1]):
        if n:
            lines.append(f"{name:<48} {n / steps:>10.1f} {ns / n / 1e3:>9.1f} {ns / steps / 1e3:>9.1f}")
    return "\n".join(lines) + "\n"


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
    ap.add_argument("--sections", action="store_true", help="also wall time per call of our and TE's functions")
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
