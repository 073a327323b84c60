#!/usr/bin/env python3
"""What Dynamo's guards cost a compiled TE frame, and what skipping / filtering them saves (CPU, issue 22).

    PYTHONPATH=$PWD python benchmarks/bench_guards_cpu.py [--reps 2000] [--layers 4]

Part A — guard evaluation alone, real te.Linear stacks (fp8 current scaling and bf16, traced on
the fake GPU, ``te_passes.testing.fake_gpu``): the frame's guard tree is checked against the
same inputs (``CacheEntry.guard_manager.check(f_locals)``, what Dynamo runs before every call),
per guard_filter_fn: all guards; without the guards on TE's global state (``te.autocast``'s
``FP8GlobalStateManager`` fields, recipe objects); ``torch.compiler.skip_guard_on_all_nn_modules_unsafe``;
``torch.compiler.keep_tensor_guards_unsafe``. Prints guards kept, us per check, ratio to all.

Part B — whole calls on CPU, a toy TE op family (tests/_helpers/_toy_te_op.py, TE's ``register_custom_op``)
compiled by te_inductor: a compiled forward, the same under
``set_stance(skip_guard_eval_unsafe=True)``, and ``te_passes.compile_step`` with
``te_passes.guards`` = ``all`` / ``skip_unsafe``. Prints us per call and ratios side by side.

Part C — the direct call's dispatch guard: one view op inside TE's impl under the old guard
(``_AutoDispatchBelowAutograd``, view replay on as AOTAutograd sets it) and the new one
(``_AutoDispatchBelowADInplaceOrView``), and a toy direct call under both.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _best_us(fn, reps: int, rounds: int = 7) -> float:
    best = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best.append((time.perf_counter() - t0) * 1e6 / reps)
    return min(best)


# --------------------------------------------------------------------------- part A
TE_STATE_MARKERS = ("FP8GlobalStateManager", "quantization_state", "recipe", "transformer_engine")


def _is_te_global_state(entry) -> bool:
    return entry.is_global and any(m in entry.name for m in TE_STATE_MARKERS)


def drop_te_global_state(entries):
    """guard_filter_fn: keep every guard except those on TE's global state (module-level TE objects)."""
    return [not _is_te_global_state(e) for e in entries]


def _count_leaf_guards(mgr) -> int:
    n = len(mgr.get_leaf_guards())
    for child in mgr.get_child_managers():
        n += _count_leaf_guards(child)
    return n


def part_a(reps: int, layers: int) -> list[dict]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from te_passes.testing.dynamo_capture import fresh_function
    from te_passes.testing.fake_gpu import capture_lock, constructing, fake_gpu, import_te, make_recipe, quiet

    te = import_te()
    filters = {"all guards": None, "no TE global-state guards": drop_te_global_state,
               "skip_guard_on_all_nn_modules_unsafe": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
               "keep_tensor_guards_unsafe": torch.compiler.keep_tensor_guards_unsafe}
    rows = []
    for precision in ("fp8-cs", "bf16"):
        recipe = make_recipe(precision)
        with capture_lock, quiet(), fake_gpu(precision):
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            with mode, constructing():
                mods = torch.nn.ModuleList(te.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda")
                                           for _ in range(layers))
                x = torch.randn(64, 256, dtype=torch.bfloat16, device="cuda", requires_grad=True)

            def step(inp):
                import contextlib

                with (te.autocast(enabled=True, recipe=recipe) if recipe is not None else contextlib.nullcontext()):
                    for i, lin in enumerate(mods):
                        if i:
                            inp = torch.nn.functional.gelu(inp)
                        inp = lin(inp)
                return inp

            base = None
            for name, flt in filters.items():
                torch._dynamo.reset()
                fn = fresh_function(step)
                kept = []

                def backend(gm, ex):
                    return gm.forward

                compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False,
                                         options={"guard_filter_fn": flt} if flt else None)
                with mode:
                    compiled(x)
                    entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__)
                    gm = entries[0].guard_manager
                    f_locals = {"inp": x}
                    ok = gm.check(f_locals)
                    us = _best_us(lambda: gm.check(f_locals), reps)
                kept.append(_count_leaf_guards(gm.root))
                base = base or us
                # a check that fails on the inputs it was built from exits early: its time is not the
                # guard cost (seen outside a real GPU: the fake GPU's patched state) -> not reported
                rows.append(dict(part="A", precision=precision, variant=name, guards=kept[0], check_ok=ok,
                                 us=round(us, 2) if ok else "n/a (check failed)",
                                 ratio=round(us / base, 2) if ok else "n/a"))
    torch._dynamo.reset()
    return rows


# --------------------------------------------------------------------------- part B
def part_b(reps: int) -> list[dict]:
    sys.path.insert(0, str(ROOT / "tests" / "_helpers"))
    import _toy_te_op as toy

    import te_passes

    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 16, generator=g)
    ps = [torch.randn(s, generator=g).requires_grad_() for s in ((32, 16), (32,), (32, 32), (32,))]
    opts = {"fx_graph_cache": False}

    def fwd(x, ps):
        return toy.model(x, *ps)

    def step(x, ps):
        loss = toy.model(x, *ps).sum()
        loss.backward()
        return loss

    rows = []
    torch._dynamo.reset()
    cf = torch.compile(fwd, backend="te_inductor", options=opts)
    with torch.no_grad():
        for _ in range(3):
            cf(x, ps)
        fwd_all = _best_us(lambda: cf(x, ps), reps)
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            fwd_skip = _best_us(lambda: cf(x, ps), reps)
        eager = _best_us(lambda: fwd(x, ps), reps)
    rows += [dict(part="B", variant="eager forward (no grad)", us=round(eager, 2), ratio=round(eager / fwd_all, 2)),
             dict(part="B", variant="compiled forward, all guards", us=round(fwd_all, 2), ratio=1.0),
             dict(part="B", variant="compiled forward, skip_guard_eval_unsafe", us=round(fwd_skip, 2),
                  ratio=round(fwd_skip / fwd_all, 2))]
    base = None
    for guards in ("all", "skip_unsafe"):
        torch._dynamo.reset()
        cs = te_passes.compile_step(step, mode=None, options={**opts, "te_passes.guards": guards})

        def one(cs=cs):
            for p in ps:
                p.grad = None
            cs(x, ps)

        for _ in range(4):
            one()
        us = _best_us(one, max(1, reps // 4))
        base = base or us
        rows.append(dict(part="B", variant=f"compile_step, te_passes.guards={guards}", us=round(us, 2),
                         ratio=round(us / base, 2)))

    def eager_step():
        for p in ps:
            p.grad = None
        step(x, ps)

    us = _best_us(eager_step, max(1, reps // 4))
    rows.append(dict(part="B", variant="eager step (forward + backward)", us=round(us, 2), ratio=round(us / base, 2)))
    torch._dynamo.reset()
    return rows


# --------------------------------------------------------------------------- part C
def part_c(reps: int) -> list[dict]:
    t = torch.randn(256, 1024)

    def views():
        y = t.view(-1)
        z = y.view(256, 1024)
        z.t().t()

    rows = []
    prev = torch._C._is_view_replay_enabled()
    base = None
    for name, guard, replay in (("BelowAutograd, view replay off (eager's context)", torch._C._AutoDispatchBelowAutograd, False),
                                ("BelowAutograd, view replay on (old direct call)", torch._C._AutoDispatchBelowAutograd, True),
                                ("BelowADInplaceOrView, view replay on (new direct call)",
                                 torch._C._AutoDispatchBelowADInplaceOrView, True)):
        torch._C._set_view_replay_enabled(replay)
        try:
            with guard():
                us = _best_us(views, reps) / 4
        finally:
            torch._C._set_view_replay_enabled(prev)
        base = base or us
        rows.append(dict(part="C", variant=f"one view op: {name}", us=round(us, 3), ratio=round(us / base, 2)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--parts", default="ABC")
    a = ap.parse_args()
    rows = []
    if "C" in a.parts:
        rows += part_c(a.reps * 10)
    if "A" in a.parts:
        rows += part_a(a.reps, a.layers)
    if "B" in a.parts:
        rows += part_b(a.reps)
    keys = ["part", "precision", "variant", "guards", "check_ok", "us", "ratio"]
    keys = [k for k in keys if any(k in r for r in rows)]
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |")
    print(f"\ntorch {torch.__version__}; us: best of 7 rounds; ratio: us / the first row of its part "
          "(and precision)")


if __name__ == "__main__":
    main()
