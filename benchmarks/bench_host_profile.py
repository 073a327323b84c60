#!/usr/bin/env python3
"""Host-time split of one training step: where the Python/host time of stack4 goes (issue 13).

    source .gpu/s/env.sh; PYTHONPATH=$PWD:$PYTHONPATH python3 benchmarks/bench_host_profile.py --out DIR   # H200
    PYTHONPATH=$PWD python3 benchmarks/bench_host_profile.py --dry-run --out DIR                  # CPU

Nesting-aware ``perf_counter`` timers monkeypatched around the boundary functions of TE eager,
``backend="inductor"``, te_inductor and ``te_inductor-nodirect`` (stack4, 256 tokens, fp8 and bf16);
each layer's exclusive µs per step. ``--dry-run`` checks every timer attaches to TE's real ``linear``
family, then runs the same code with tests/_helpers/_toy_te_op.py's toy family on CPU. Layers, method and
results: docs/benchmarks.md "Issue 13: host-time split per step".
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402  (import torch before transformer_engine)

sys.path.insert(0, str(_ROOT / "benchmarks"))
import harness  # noqa: E402

NS = "transformer_engine_compile"
VARIANTS = ("eager", "inductor", "te_inductor", "te_inductor-nodirect")
LAYER_ORDER = (
    "step: python", "fwd: dynamo (frame, guards, call)", "bwd: autograd engine (+AOT bwd)",
    "aot: runtime wrappers (fwd)", "inductor: wrapper code", "te op: wrapper op dispatch",
    "te op: base op dispatch (retargeted, not direct)", "te op: alias check",
    "te op: wrapper kernel + base dispatch", "te op: base kernel glue", "te: _ArgPlan.unpack",
    "te: _storage_unflatten", "te: impl", "te impl: quantize (Quantizer.__call__)", "te impl: quantize_weight",
    "te impl: general_gemm", "te impl: finalize_weight_grads", "te impl: clear_tensor_data",
    "python: gc (generation 0)", "python: gc (generation 1)", "python: gc (generation 2)",
    "te: pack_result", "te_passes: DirectTECall", "eager: _linear_eager (apply)", "eager: _Linear.forward",
    "eager: _Linear.backward", "te.Linear.forward",
)


#: TE 2.20.2 ``module/linear.py`` globals the impls call, timed as their own layers (the GEMM
#: wrapper and its C++ call, weight quantization, wgrad finalisation, tensor-data clearing).
IMPL_CALLEES = (
    ("general_gemm", "te impl: general_gemm"),
    ("quantize_weight", "te impl: quantize_weight"),
    ("finalize_weight_grads", "te impl: finalize_weight_grads"),
    ("clear_tensor_data", "te impl: clear_tensor_data"),
)


class HookMissing(RuntimeError):
    """A function the profile must time is not where TE / torch keep it (the message names it)."""


# --------------------------------------------------------------------------- timers
class Timers:
    """Nesting-aware perf_counter accumulation: ``wrap(fn, label)`` returns a timed ``fn``. Per
    label: inclusive and exclusive seconds (minus timed calls inside it, and top-level timed calls
    on other threads while it was the main thread's innermost frame), calls, and ``timer``: the
    calibrated timer cost (:meth:`calibrate`) subtracted per timed child. ``on`` switches recording."""

    def __init__(self) -> None:
        self.incl: dict[str, float] = defaultdict(float)
        self.excl: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.timer: dict[str, float] = defaultdict(float)
        self.on = False
        self.overhead_s = 0.0
        self._tls = threading.local()
        self._main = threading.main_thread()
        self._foreign = 0.0
        self._lock = threading.Lock()

    def reset(self) -> None:
        self.incl.clear(), self.excl.clear(), self.calls.clear(), self.timer.clear()
        self._foreign = 0.0

    def _stack(self) -> list:
        st = getattr(self._tls, "stack", None)
        if st is None:
            st = self._tls.stack = []
        return st

    def _enter(self) -> list:
        st = self._stack()
        # child seconds, foreign at entry, foreign inside children, timed children, main thread
        fr = [0.0, self._foreign, 0.0, 0, threading.current_thread() is self._main]
        st.append(fr)
        return fr

    def _exit(self, label: str, fr: list, dt: float) -> None:
        st = self._stack()
        st.pop()
        charged = fr[3] * self.overhead_s
        own = dt - fr[0] - charged
        if fr[4]:
            f = self._foreign - fr[1]
            own -= f - fr[2]
            if st:
                st[-1][2] += f
        self.incl[label] += dt
        self.excl[label] += own
        self.calls[label] += 1
        self.timer[label] += charged
        if st:
            st[-1][0] += dt
            st[-1][3] += 1
        elif not fr[4]:
            with self._lock:
                self._foreign += dt

    @contextlib.contextmanager
    def frame(self, label: str):
        if not self.on:
            yield
            return
        fr = self._enter()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._exit(label, fr, time.perf_counter() - t0)

    def wrap(self, fn: Callable, label: str) -> Callable:
        timers = self
        enter, exit_, clock = self._enter, self._exit, time.perf_counter

        @functools.wraps(fn)
        def timed(*a, **k):
            if not timers.on:
                return fn(*a, **k)
            fr = enter()
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                exit_(label, fr, clock() - t0)

        timed._bench_timed = True  # type: ignore[attr-defined]
        return timed

    # -- Python's cyclic garbage collector: its pauses are their own layer
    def _gc_callback(self, phase: str, info: dict) -> None:
        if not self.on:
            return
        if phase == "start":
            self._tls.gc_t0 = time.perf_counter()
            return
        t0 = getattr(self._tls, "gc_t0", None)
        if t0 is None:
            return
        self._tls.gc_t0 = None
        dt = time.perf_counter() - t0
        label = f"python: gc (generation {info.get('generation', '?')})"
        self.incl[label] += dt
        self.excl[label] += dt
        self.calls[label] += 1
        st = self._stack()
        if st:  # a child of the innermost open frame on this thread, like a timed call
            st[-1][0] += dt
        elif threading.current_thread() is not self._main:
            with self._lock:
                self._foreign += dt

    @contextlib.contextmanager
    def gc_layer(self):
        """Report collector pauses as ``python: gc (generation N)`` instead of in whichever
        frame happened to allocate when one was due (a generation-2 pass over Dynamo's and
        Inductor's objects costs milliseconds and would dominate the frame it lands in)."""
        import gc

        gc.callbacks.append(self._gc_callback)
        try:
            yield
        finally:
            gc.callbacks.remove(self._gc_callback)

    def calibrate(self, n: int = 20000, rounds: int = 5) -> float:
        """Set and return :attr:`overhead_s`: seconds a timed call adds to its parent's
        exclusive time, beyond its own measured interval (median of ``rounds`` parents of ``n``
        timed no-op calls each, minus the same parent with ``n`` plain calls)."""
        def noop():
            return None

        timed = self.wrap(noop, "_calibrate child")
        plain = self.wrap(lambda: [noop() for _ in range(n)], "_calibrate plain")
        nested = self.wrap(lambda: [timed() for _ in range(n)], "_calibrate nested")
        was, self.on, self.overhead_s = self.on, True, 0.0
        est = []
        try:
            for _ in range(rounds):
                self.reset()
                plain(), nested()
                est.append((self.excl["_calibrate nested"] - self.excl["_calibrate plain"]) / n)
        finally:
            self.on = was
            self.reset()
        est.sort()
        self.overhead_s = max(0.0, est[len(est) // 2])
        return self.overhead_s


@dataclasses.dataclass
class Hook:
    """One monkeypatch: ``setter(new)`` installs, ``restore()`` undoes; ``what`` names it."""

    what: str
    restore: Callable[[], None]


class Hooks:
    """The timers attached to TE's / torch's boundary functions for one op family."""

    def __init__(self, timers: Timers, family: str = "linear", *, eager_module: str | None = "linear") -> None:
        self.t, self.family, self.eager_module = timers, family, eager_module
        self.installed: list[Hook] = []

    # -- primitives
    def _attr(self, owner: Any, name: str, label: str, *, static: bool = False, what: str | None = None) -> None:
        what = what or f"{getattr(owner, '__name__', owner)}.{name}"
        if owner is None or name not in vars(owner) and not hasattr(owner, name):
            raise HookMissing(f"{what} not found")
        own = name in vars(owner)
        raw = vars(owner)[name] if own else getattr(owner, name)
        fn = raw.__func__ if isinstance(raw, staticmethod) else raw
        if not callable(fn):
            raise HookMissing(f"{what} is not callable ({type(fn).__name__})")
        timed = self.t.wrap(fn, label)
        setattr(owner, name, staticmethod(timed) if static or isinstance(raw, staticmethod) else timed)
        self.installed.append(Hook(what, (lambda: setattr(owner, name, raw)) if own else (lambda: delattr(owner, name))))

    def _cell(self, qualname: str, var: str, label: str) -> None:
        from torch._library.custom_ops import OPDEFS

        opdef = OPDEFS.get(qualname)
        if opdef is None:
            raise HookMissing(f"OPDEFS[{qualname!r}] not found")
        fn = opdef._init_fn
        cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
        if var not in cells:
            raise HookMissing(f"{qualname}: kernel {fn.__qualname__} closes over no {var!r} "
                              f"(has {fn.__code__.co_freevars})")
        cell = cells[var]
        orig = cell.cell_contents
        cell.cell_contents = self.t.wrap(orig, label)
        self.installed.append(Hook(f"{qualname} closure {var}", lambda: setattr(cell, "cell_contents", orig)))

    def _backend_fn(self, qualname: str, label: str) -> None:
        from torch._library.custom_ops import OPDEFS

        opdef = OPDEFS.get(qualname)
        if opdef is None or None not in getattr(opdef, "_backend_fns", {}):
            raise HookMissing(f"OPDEFS[{qualname!r}]._backend_fns[None] not found")
        orig = opdef._backend_fns[None]
        opdef._backend_fns[None] = self.t.wrap(orig, label)
        self.installed.append(Hook(f"{qualname} kernel", lambda: opdef._backend_fns.__setitem__(None, orig)))

    def _overload(self, op: str, label: str) -> None:
        ns = getattr(torch.ops, NS)
        try:
            packet = getattr(ns, op)
            orig = packet.default
        except (AttributeError, RuntimeError) as e:
            raise HookMissing(f"torch.ops.{NS}.{op}.default not found ({e})") from None
        # The wrapper code evaluates ``torch.ops.<ns>.<op>.default`` on every call: an instance
        # attribute of the packet (where OpOverloadPacket caches its overloads).
        packet.default = self.t.wrap(orig, label)
        self.installed.append(Hook(f"torch.ops.{NS}.{op}.default", lambda: setattr(packet, "default", orig)))

    # -- the sets
    def install(self, *, call_sites: bool = True, eager: bool = True) -> "Hooks":
        """Attach every timer (``call_sites`` / ``eager``: also those two groups); on any
        missing target, detach what was attached and raise :class:`HookMissing`."""
        try:
            self._install_runtime()
            if call_sites:
                self.install_call_sites()
            if eager:
                self.install_eager()
        except Exception:
            self.uninstall()
            raise
        return self

    def install_call_sites(self) -> None:
        """``torch.ops.<ns>.<op>.default`` as the wrapper code evaluates it. Only between
        compilations: tracing must see the real ``OpOverload`` objects there."""
        fam = self.family
        for op in (fam, f"{fam}_backward"):
            self._overload(op, "te op: wrapper op dispatch")
            self._overload(f"{op}_base", "te op: base op dispatch (retargeted, not direct)")
        self.install_impl_split()

    def install_impl_split(self) -> None:
        """TE's impls' callees, on both paths (eager and compiled run the same impl code with
        the same module globals): ``te: impl`` becomes the impls' own Python, and these layers
        say where a difference between the paths is. Only between compilations (the fake
        impls share some of these globals)."""
        if not self.eager_module:
            return
        from transformer_engine.pytorch import quantized_tensor as qt

        mod = sys.modules[f"transformer_engine.pytorch.module.{self.eager_module}"]
        for name, label in IMPL_CALLEES:
            self._attr(mod, name, label, what=f"module.{self.eager_module}.{name}")
        self._attr(qt.Quantizer, "__call__", "te impl: quantize (Quantizer.__call__)", what="Quantizer.__call__")

    def install_eager(self) -> None:
        """Eager te.Linear's Python functions. Only for the eager variant: Dynamo traces
        ``te.Linear.forward`` (a timer there would be traced and guarded on)."""
        if not self.eager_module:
            return
        import transformer_engine.pytorch as te

        mod = sys.modules[f"transformer_engine.pytorch.module.{self.eager_module}"]
        self._attr(mod, "_linear_eager", "eager: _linear_eager (apply)")
        self._attr(mod._Linear, "forward", "eager: _Linear.forward", static=True, what="_Linear.forward")
        self._attr(mod._Linear, "backward", "eager: _Linear.backward", static=True, what="_Linear.backward")
        self._attr(mod, "_linear_forward_impl", "te: impl")
        self._attr(mod, "_linear_backward_impl", "te: impl")
        self._attr(te.Linear, "forward", "te.Linear.forward", what="te.Linear.forward")

    def uninstall_group(self, start: int) -> None:
        """Detach the hooks installed after the first ``start`` ones."""
        while len(self.installed) > start:
            self.installed.pop().restore()

    def _install_runtime(self) -> None:
        import torch._library.utils as lu
        from torch._inductor.output_code import CompiledFxGraph

        from te_passes.ops.direct_call import DirectTECall

        try:
            import transformer_engine.pytorch as te
            from transformer_engine.pytorch.dynamo import custom_op as tco
        except ImportError as e:
            raise HookMissing(f"transformer_engine.pytorch does not import ({e})") from None
        del te
        fam = self.family
        self._attr(CompiledFxGraph, "__call__", "inductor: wrapper code", what="CompiledFxGraph.__call__")
        self._attr(lu, "_c_check_aliasing_constraint", "te op: alias check")
        self._attr(tco._ArgPlan, "unpack", "te: _ArgPlan.unpack", what="_ArgPlan.unpack")
        # TE's unpack calls the module global; a DirectTECall reads it when it is built (compile
        # time, after this), so both paths' quantized-storage rebuilds land here.
        self._attr(tco, "_storage_unflatten", "te: _storage_unflatten", what="custom_op._storage_unflatten")
        self._attr(DirectTECall, "__call__", "te_passes: DirectTECall", what="DirectTECall.__call__")
        for op in (fam, f"{fam}_backward"):
            self._backend_fn(f"{NS}::{op}", "te op: wrapper kernel + base dispatch")
            self._backend_fn(f"{NS}::{op}_base", "te op: base kernel glue")
            self._cell(f"{NS}::{op}_base", "impl", "te: impl")
            self._cell(f"{NS}::{op}_base", "pack_result", "te: pack_result")

    def uninstall(self) -> None:
        for h in reversed(self.installed):
            h.restore()
        self.installed.clear()


# --------------------------------------------------------------------------- measurement
def _backend(variant: str, timers: Timers):
    """The ``torch.compile`` backend for ``variant``, its returned callable timed as the AOT layer."""
    from torch._inductor.compile_fx import compile_fx

    from te_passes.backend import te_inductor

    if variant == "inductor":
        real = compile_fx
    elif variant == "te_inductor":
        real = te_inductor
    elif variant == "te_inductor-nodirect":
        real = functools.partial(te_inductor, options={"te_passes.disable": ["call_te_impl_directly"]})
    else:
        raise ValueError(variant)

    def backend(gm, example_inputs):
        return timers.wrap(real(gm, example_inputs), "aot: runtime wrappers (fwd)")

    return backend


def measure(variant: str, fn_eager: Callable, x, dy, params, hooks: "Hooks", *, warmup: int, iters: int,
            sync: Callable[[], None]) -> dict[str, Any]:
    """Per-step exclusive µs / calls of every timed layer for one variant (timers reset first).

    ``hooks`` has its runtime timers installed; the call-site timers are attached after the
    warm-up (which compiles) and the eager ones only for ``variant == "eager"``."""
    timers = hooks.t
    start = len(hooks.installed)
    try:
        if variant == "eager":
            hooks.install_eager()
            return _measure(variant, fn_eager, x, dy, params, hooks, warmup=warmup, iters=iters, sync=sync)
        fwd = torch.compile(fn_eager, backend=_backend(variant, timers))
        return _measure(variant, fwd, x, dy, params, hooks, warmup=warmup, iters=iters, sync=sync)
    finally:
        hooks.uninstall_group(start)


def _measure(variant, fwd, x, dy, params, hooks, *, warmup, iters, sync) -> dict[str, Any]:
    timers = hooks.t
    fwd_t = timers.wrap(fwd, "fwd: dynamo (frame, guards, call)")

    def step():
        with timers.frame("step: python"):
            for p in params:
                p.grad = None
            x.grad = None
            y = fwd_t(x)
            with timers.frame("bwd: autograd engine (+AOT bwd)"):
                y.backward(dy)

    timers.on = False
    for _ in range(warmup):
        step()
    sync()
    hooks.install_call_sites()
    import gc

    gc.collect()  # the compile's objects: a full collection due now would land in the timed steps
    timers.reset()
    timers.on = True
    with timers.gc_layer():
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        host = time.perf_counter() - t0
    timers.on = False
    sync()
    out = {"host_us_per_step": host * 1e6 / iters,
           "timer_overhead_us_per_call": timers.overhead_s * 1e6,
           "timer_us_per_step": sum(timers.timer.values()) * 1e6 / iters,
           "layers": {k: {"excl_us": timers.excl[k] * 1e6 / iters, "incl_us": timers.incl[k] * 1e6 / iters,
                          "calls": timers.calls[k] / iters, "timer_us": timers.timer[k] * 1e6 / iters}
                      for k in timers.excl}}
    out["guard_us_per_step"] = _guard_time(step, iters, sync) if variant != "eager" else 0.0
    return out


def _guard_time(step: Callable[[], None], iters: int, sync) -> float | None:
    """µs per step in torch's ``TorchDynamo Cache Lookup`` events (guard evaluation; under the
    profiler, so an upper bound)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(iters):
                step()
            sync()
    except Exception:  # noqa: BLE001 - the split above stands without it
        return None
    total = sum(e.cpu_time_total for e in prof.key_averages() if "Cache Lookup" in e.key)
    return total / iters


# --------------------------------------------------------------------------- report
def table(results: dict[str, dict[str, Any]]) -> str:
    cols = [(p, v) for p in results for v in results[p]]
    head = "| layer (µs/step, exclusive) | " + " | ".join(f"{p} {v}" for p, v in cols) + " |"
    lines = [head, "|---|" + "---|" * len(cols)]
    labels = [l for l in LAYER_ORDER if any(l in results[p][v]["layers"] for p, v in cols)]
    labels += sorted({l for p, v in cols for l in results[p][v]["layers"]} - set(labels))
    for l in labels:
        vals = []
        for p, v in cols:
            d = results[p][v]["layers"].get(l)
            vals.append("" if d is None else f"{d['excl_us']:.1f} ({d['calls']:g})")
        lines.append(f"| {l} | " + " | ".join(vals) + " |")
    lines.append("| **sum of layers** | " + " | ".join(
        f"{sum(d['excl_us'] for d in results[p][v]['layers'].values()):.1f}" for p, v in cols) + " |")
    lines.append("| timer cost (calibrated, subtracted above) | " + " | ".join(
        f"{results[p][v].get('timer_us_per_step', 0.0):.1f}" for p, v in cols) + " |")
    lines.append("| **host time per step** | " + " | ".join(f"{results[p][v]['host_us_per_step']:.1f}" for p, v in cols) + " |")
    lines.append("| guard eval (profiler, bound) | " + " | ".join(
        "" if results[p][v].get("guard_us_per_step") is None else f"{results[p][v]['guard_us_per_step']:.1f}"
        for p, v in cols) + " |")
    return "\n".join(lines)


def _per_op(results: dict[str, dict[str, Any]]) -> list[str]:
    """The host cost of one TE op call, compiled vs eager (issue 13's ≤ 1.1× goal)."""
    out = []
    te_layers = ("te op:", "te:", "te impl:", "te_passes:")
    for p, by in results.items():
        eager = by.get("eager", {}).get("layers", {})
        # the apply path's layers, exclusive (so the timers' own cost is out on both sides)
        e = sum(d["excl_us"] for k, d in eager.items() if k.startswith(("eager: ", "te: impl", "te impl:")))
        for v in ("te_inductor", "te_inductor-nodirect"):
            if v not in by:
                continue
            c = sum(d["excl_us"] for k, d in by[v]["layers"].items() if k.startswith(te_layers))
            if e:
                out.append(f"- {p} {v}: TE op calls {c:.1f} µs/step (dispatch + glue + impl) vs eager "
                           f"_linear_eager + _Linear.forward / backward + impl {e:.1f} µs/step: {c / e:.2f}×")
        for v in ("te_inductor", "te_inductor-nodirect"):
            if v not in by or not eager:
                continue
            diff = [f"{k} {by[v]['layers'][k]['excl_us'] - eager[k]['excl_us']:+.1f}"
                    for k in LAYER_ORDER if k.startswith(("te: impl", "te impl:")) and k in eager
                    and k in by[v]["layers"]]
            if diff:
                out.append(f"  - {p} {v} minus eager, inside TE's impls (µs/step): " + ", ".join(diff))
    return out


# --------------------------------------------------------------------------- runs
_state: dict[str, Any] = {}  # worker: timers + hooks (installed once per process), inputs per precision


def _hooks(args) -> "Hooks":
    """Calibrate the timers, check every timer attaches to TE's linear family (else
    :class:`HookMissing` naming it), then install the runtime timers (toy family in a dry run)."""
    if "hooks" not in _state:
        import te_passes.backend  # noqa: F401  (installs te_passes' TE hooks before the timers wrap them)

        timers = Timers()
        _state["overhead"] = timers.calibrate()
        probe = Hooks(timers, "linear").install()
        _state["attached"] = [h.what for h in probe.installed]
        probe.uninstall()
        if args.dry_run:
            sys.path.insert(0, str(_ROOT / "tests" / "_helpers"))
            import _toy_te_op

            hooks = Hooks(timers, _toy_te_op.OP_NAME, eager_module=None)
        else:
            hooks = Hooks(timers, "linear")
        _state["hooks"] = hooks.install(call_sites=False, eager=False)
    return _state["hooks"]


def _result(res: dict[str, Any]) -> dict[str, Any]:
    return dict(res, median_ms=res["host_us_per_step"] / 1e3, timers_attached=len(_state["attached"]),
                timer_overhead_us_per_call=_state["overhead"] * 1e6)


def measure_task(task: dict, args) -> dict[str, Any]:
    from te_passes.testing.gpu import (build_stack, copy_params, ensure_te_inductor_backend, forward_fn,
                                       fresh_compile_state, gpu_skip_reason, make_recipe)

    reason = gpu_skip_reason()
    if reason:
        raise RuntimeError(f"cannot run: {reason}")
    ensure_te_inductor_backend()
    hooks = _hooks(args)
    p = task["precision"]
    if _state.get("key") != p:
        ref = build_stack(args.layers, args.hidden, seed=0)
        g = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        dy = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16, generator=g)
        _state.update(key=p, inputs=(ref, x, dy))
    ref, x, dy = _state["inputs"]
    with fresh_compile_state():
        model = build_stack(args.layers, args.hidden, seed=0)
        copy_params(ref, model)
        fn = forward_fn(model, p, make_recipe(p))
        return _result(measure(task["variant"], fn, x, dy, list(model.parameters()), hooks, warmup=args.warmup,
                               iters=args.iters, sync=torch.cuda.synchronize))


def toy_task(task: dict, i: int) -> dict[str, Any]:
    """``--dry-run``: the same measurement on CPU with the toy op family (2 toy linears + tanh)."""
    hooks = _hooks(argparse.Namespace(dry_run=True))
    import _toy_te_op as toy

    g = torch.Generator().manual_seed(0)
    w1, b1, w2, b2 = (torch.randn(s, generator=g).requires_grad_() for s in ((64, 32), (64,), (64, 64), (64,)))
    x = torch.randn(16, 32, generator=g).requires_grad_()
    torch._dynamo.reset()
    try:
        return _result(measure(task["variant"], lambda inp: toy.model(inp, w1, b1, w2, b2), x,
                               torch.randn(16, 64, generator=g), [w1, b1, w2, b2], hooks, warmup=2, iters=5,
                               sync=lambda: None))
    finally:
        torch._dynamo.reset()


def add_args(ap) -> None:
    ap.add_argument("--precisions", nargs="+", default=["fp8", "bf16"], choices=["fp8", "bf16"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)


def _appendix(rows: list[dict]) -> str:
    results: dict[str, dict[str, Any]] = {}
    for r in rows:
        if harness.ok(r):
            results.setdefault(r["precision"], {})[r["variant"]] = r
    if not results:
        return ""
    return "\n".join(["Exclusive µs per step (calls per step); host time per step = sum of layers + timer cost "
                      "(each timed call's calibrated cost, subtracted from its parent).", "", table(results), "",
                      *_per_op(results)])


BENCH = harness.Bench(
    name="host_profile", script=__file__, title="host-time split per step (stack4)", group=("precision",),
    columns=[harness.Col("host ms / step", "median_ms", "{:.3f}"),
             harness.Col("guard µs (profiler, bound)", "guard_us_per_step", "{:.1f}"),
             harness.Col("timer cost µs", "timer_us_per_step", "{:.1f}"),
             harness.Col("timers attached", "timers_attached")],
    ratios={"× eager": "eager"}, plan=lambda a: [dict(precision=p, variant=v) for p in a.precisions for v in a.variants],
    measure=measure_task, fake=toy_task, add_args=add_args, appendix=_appendix, warmup=10, iters=40,
    notes=lambda a: ("DRY RUN: CPU toy op family (2 toy linears + tanh, 16 tokens, 5 steps after 2): the code path, "
                     "not a measurement" if a.dry_run else
                     f"stack{a.layers}, {a.tokens} tokens, {a.iters} steps after {a.warmup} warm-up"))

if __name__ == "__main__":
    sys.exit(harness.main(BENCH))
