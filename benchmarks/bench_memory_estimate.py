"""Memory estimate and pass cost: insert_early_frees / check_cudagraph_pool on real TE graphs.

Prints, side by side:

1. for a ``layers``-deep ``te.Linear`` stack (GELU between; default 24 layers,
   tokens=8192, hidden=4096) in each precision, captured without a GPU
   (``te_passes.testing.capture.capture_aot``): per AOT graph (forward / backward) the node
   count, the estimated peak live bytes before and after ``insert_early_frees`` and their
   ratio, the graph inputs, the quantized bytes live at the peak, the number of frees, and
   the run time of liveness, the estimate and both passes (median of ``--repeat`` runs);
2. a symbolic estimate: the same kind of stack written with ATen casts to float8 and an
   opaque GEMM (``bench_q::qgemm``), traced with symbolic sizes: the peak as a sympy
   expression in the token count, then evaluated at 256 / 8192 tokens, before and after the
   pass (policy ``all``; the frees are real here);
3. scaling: pass time for synthetic graphs of 10k and 100k nodes and the time per node ratio
   (linear scaling means a ratio near 1).

Usage::

    python benchmarks/bench_memory_estimate.py [--layers 24] [--tokens 8192] [--hidden 4096]
        [--precisions bf16,fp8-cs,mxfp8] [--repeat 5] [--scaling 10000,100000] [--skip-te]

Needs Transformer Engine for section 1 (``--skip-te`` runs 2 and 3 only). No GPU needed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.fx

from te_passes.analyses.liveness import analyze
from te_passes.analyses.memory import estimate
from te_passes.config import TePassesOptions
from te_passes.pipeline.base import PassContext, Stage
from te_passes.passes.check_cudagraph_pool import CheckCudagraphPool
from te_passes.passes.insert_early_frees import InsertEarlyFrees
from te_passes.te.state import TEState

MiB = 1024 * 1024
F8 = torch.float8_e4m3fn


@torch.library.custom_op("bench_q::qgemm", mutates_args=())
def qgemm(q: torch.Tensor, scale_inv: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (q.to(torch.bfloat16) * scale_inv.to(torch.bfloat16)) @ w


@qgemm.register_fake
def _(q, scale_inv, w):
    return q.new_empty((q.shape[0], w.shape[1]), dtype=torch.bfloat16)


def _median_ms(fn, repeat: int, setup=None) -> float:
    """Median wall time of ``fn(setup())`` (or ``fn()``) in ms; ``setup`` is not timed."""
    times = []
    for _ in range(repeat):
        arg = setup() if setup is not None else None
        t0 = time.perf_counter()
        fn(arg) if setup is not None else fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    new = torch.fx.GraphModule(gm, torch.fx.Graph())
    vm: dict = {}
    out = new.graph.graph_copy(gm.graph, vm, return_output_node=True)
    new.graph.output(out[0] if isinstance(out, tuple) else out)
    for old, n in vm.items():
        n.meta = dict(old.meta)
    new.recompile()
    return new


def _ctx(stage: Stage) -> PassContext:
    return PassContext(stage, TePassesOptions(), TEState(), None, "bench")


def _run_passes(gm, stage, policy="opaque"):
    res_free = InsertEarlyFrees(policy=policy).run(gm, _ctx(stage))
    res_pool = CheckCudagraphPool().run(gm, _ctx(stage))
    return res_free, res_pool


def _fmt_bytes(v) -> str:
    return f"{v / MiB:10.1f}" if isinstance(v, int) else str(v)


def bench_te(layers: int, tokens: int, hidden: int, precisions: list[str], repeat: int) -> None:
    from te_passes.testing.capture import capture_aot

    print(f"\n== 1. te.Linear stack x{layers}, tokens={tokens}, hidden={hidden} (estimated peak live MiB) ==")
    hdr = (f"{'precision':9} {'graph':4} {'nodes':>5} {'peak before':>11} {'peak after':>10} {'after/before':>12} "
           f"{'inputs':>10} {'quant@peak':>10} {'frees':>5} {'liveness ms':>11} {'estimate ms':>11} "
           f"{'frees ms':>8} {'pool ms':>7} {'capture s':>9}")
    print(hdr)
    for prec in precisions:
        t0 = time.perf_counter()
        cap = capture_aot("stack" if layers > 1 else "linear", prec, layers=layers, tokens=tokens, hidden=hidden)
        cap_s = time.perf_counter() - t0
        for name, gm, stage in (("fwd", cap.forward, Stage.POST_GRAD_FWD), ("bwd", cap.backward, Stage.POST_GRAD_BWD)):
            lv_ms = _median_ms(lambda: analyze(gm, stage=stage.value), repeat)
            lv = analyze(gm, stage=stage.value)
            est_ms = _median_ms(lambda: estimate(lv), repeat)
            free_ms = _median_ms(lambda g: InsertEarlyFrees().run(g, _ctx(stage)), repeat, lambda: _copy(gm))
            pool_ms = _median_ms(lambda: CheckCudagraphPool().run(gm, _ctx(stage)), repeat)
            res_free, _ = _run_passes(_copy(gm), stage)
            (mem,) = [r for r in res_free.records if r.kind == "memory"]
            frees = sum(1 for r in res_free.records if r.kind == "free")
            b, a = mem.data["peak_before_concrete"], mem.data["peak_after_concrete"]
            q = estimate(lv).quantized_bytes_at_peak
            print(f"{prec:9} {name:4} {len(gm.graph.nodes):5d} {_fmt_bytes(b):>11} {_fmt_bytes(a):>10} "
                  f"{a / b:12.3f} {_fmt_bytes(mem.data['input_bytes']):>10} {_fmt_bytes(q):>10} {frees:5d} "
                  f"{lv_ms:11.2f} {est_ms:11.2f} {free_ms:8.2f} {pool_ms:7.2f} {cap_s:9.1f}")


def _aten_stack(layers: int):
    def f(x, *ws):
        h = x
        for w in ws:
            amax = torch.ops.aten.amax.default(torch.ops.aten.abs.default(h), [0, 1], True)
            sinv = torch.ops.aten.div.Tensor(amax, 448.0)
            q = torch.ops.aten._to_copy.default(torch.ops.aten.div.Tensor(h, sinv), dtype=F8)
            y = qgemm(q, torch.ops.aten.reshape.default(sinv, [1]), w)
            h = torch.ops.aten.gelu.default(y)
        return (h,)

    return f


def bench_symbolic(layers: int, hidden: int) -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    print(f"\n== 2. symbolic estimate: ATen FP8 cast + opaque GEMM stack x{layers}, hidden={hidden} ==")
    f = _aten_stack(layers)
    ws = [torch.empty(hidden, hidden, dtype=torch.bfloat16, device="meta") for _ in range(layers)]
    x = torch.empty(64, hidden, dtype=torch.bfloat16, device="meta")
    gm = make_fx(f, tracing_mode="symbolic")(x, *ws)
    tok = gm.graph.find_nodes(op="placeholder")[0].meta["val"].shape[0].node.expr
    lv = analyze(gm, stage="post_grad_fwd")
    before = estimate(lv)
    res = InsertEarlyFrees(policy="all").run(gm, _ctx(Stage.POST_GRAD_FWD))
    after = estimate(analyze(gm, stage="post_grad_fwd"))
    frees = sum(1 for r in res.records if r.kind == "free")
    print(f"tokens symbol: {tok}; other symbols (hidden) evaluated at {hidden}")
    print(f"peak before: {before.peak}")
    print(f"peak after : {after.peak}   ({frees} frees)")
    print(f"{'tokens':>8} {'before MiB':>11} {'after MiB':>10} {'after/before':>12}")
    syms = {str(s) for s in getattr(before.peak, "free_symbols", ())}
    for t in (256, 8192):
        sizes = {s: (t if s == str(tok) else hidden) for s in syms}
        b = estimate(lv, sizes=sizes).peak_concrete
        a = estimate(analyze(gm), sizes=sizes).peak_concrete
        print(f"{t:8d} {b / MiB:11.2f} {a / MiB:10.2f} {a / b:12.3f}")


def _synthetic(n_nodes: int) -> torch.fx.GraphModule:
    """A chain of (cast to fp8 -> opaque gemm -> gelu) blocks with metadata, ~n_nodes nodes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = torch.fx.Graph()
    mode = FakeTensorMode()
    with mode:
        xv = torch.empty(256, 256, dtype=torch.bfloat16)
        wv = torch.empty(256, 256, dtype=torch.bfloat16)
        sv = torch.empty(1, dtype=torch.float32)
        qv = torch.empty(256, 256, dtype=F8)
    x = g.placeholder("x")
    x.meta["val"] = xv
    w = g.placeholder("w")
    w.meta["val"] = wv
    s = g.placeholder("s")
    s.meta["val"] = sv
    h = x
    aten = torch.ops.aten
    while len(g.nodes) < n_nodes:
        q = g.call_function(aten._to_copy.default, (h,), {"dtype": F8})
        q.meta["val"] = qv
        t = g.call_function(aten.t.default, (q,))
        t.meta["val"] = qv
        y = g.call_function(torch.ops.bench_q.qgemm.default, (t, s, w))
        y.meta["val"] = xv
        h = g.call_function(aten.gelu.default, (y,))
        h.meta["val"] = xv
    g.output((h,))
    return torch.fx.GraphModule({}, g)


def bench_scaling(sizes: list[int], repeat: int) -> None:
    print("\n== 3. scaling (synthetic cast/opaque-gemm chains) ==")
    print(f"{'nodes':>8} {'frees':>6} {'insert_early_frees ms':>21} {'check_cudagraph_pool ms':>23} {'us/node':>8} {'vs first':>8}")
    first = None
    for n in sizes:
        gm = _synthetic(n)
        free_ms = _median_ms(lambda g: InsertEarlyFrees().run(g, _ctx(Stage.POST_GRAD_FWD)),
                             max(1, repeat // 2), lambda: _copy(gm))
        pool_ms = _median_ms(lambda: CheckCudagraphPool().run(gm, _ctx(Stage.POST_GRAD_FWD)), max(1, repeat // 2))
        res, _ = _run_passes(_copy(gm), Stage.POST_GRAD_FWD)
        frees = sum(1 for r in res.records if r.kind == "free")
        per_node = (free_ms + pool_ms) * 1e3 / len(gm.graph.nodes)
        first = first or per_node
        print(f"{len(gm.graph.nodes):8d} {frees:6d} {free_ms:21.1f} {pool_ms:23.1f} {per_node:8.2f} {per_node / first:8.2f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--precisions", default="bf16,fp8-cs,mxfp8")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--scaling", default="10000,100000")
    p.add_argument("--skip-te", action="store_true", help="skip the real TE graphs (no TE installed)")
    a = p.parse_args(argv)
    from te_passes.compat.install import install

    install()  # as the backend does before any pass runs (the free op's Inductor lowering)
    print(f"torch {torch.__version__}")
    if not a.skip_te:
        bench_te(a.layers, a.tokens, a.hidden, [s for s in a.precisions.split(",") if s], a.repeat)
    bench_symbolic(a.layers, 1024)
    bench_scaling([int(s) for s in a.scaling.split(",") if s], a.repeat)


if __name__ == "__main__":
    main()
