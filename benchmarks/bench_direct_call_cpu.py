#!/usr/bin/env python3
"""CPU: host cost of one TE op call's *framework* part — dispatcher path vs DirectTECall.

    PYTHONPATH=$PWD python3 benchmarks/bench_direct_call_cpu.py [--iters N]

Takes the real ``linear`` / ``linear_backward`` nodes of captured te.Linear post-grad graphs
(fp8 Float8CurrentScaling and bf16; te_passes.testing.capture, with hoist_te_constants run so
the bundles are the hoisted objects), builds their flat arguments with CPU tensors of the
nodes' shapes, and replaces TE's impl in the base op's closure cell by a stub that returns a
result of the right shape (TE's real impl needs a GPU). Then, side by side in one run, µs per
call of:

* ``wrapper op``  — ``torch.ops.transformer_engine_compile.<op>.default(*flat)``: what
  Inductor's wrapper calls without ``call_te_impl_directly`` (both dispatcher round trips,
  autograd kernels, slot forwarder, alias checks, ``_ArgPlan.unpack``, ``pack_result``);
* ``base op``     — ``<op>_base.default(*flat)`` (retargeted, no direct call);
* ``DirectTECall`` — what the pass makes Inductor call.

The stub's own time is in all three (it is the same function). The difference is what the pass
removes per TE op call; a real step has 4 forward + 4 backward calls in stack4.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import harness  # noqa: E402
import torch  # noqa: E402

NS = "transformer_engine_compile"


def _flat_args(node):
    def real(v):
        if isinstance(v, torch.fx.Node):
            val = v.meta["val"]
            return torch.zeros(val.shape, dtype=val.dtype)
        if isinstance(v, (list, tuple)):
            return [real(x) for x in v]
        return v
    return [real(a) for a in node.args]


def _stub(is_bwd: bool):
    a, b, c = torch.zeros(1), torch.zeros(1), torch.zeros(1)  # distinct: torch's aliasing check
    if is_bwd:
        return lambda args: (a, b, None)
    return lambda args: (a, None, [b, c], None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args(argv)
    from torch._library.custom_ops import OPDEFS

    from te_passes.passes.call_te_impl_directly import CallTEImplDirectly
    from te_passes.passes.hoist_te_constants import HoistTEConstants
    from te_passes.ops import direct_call as dc
    from te_passes.ops.te_base import overload
    from te_passes.compat.install import install
    from te_passes.testing.capture import capture_aot, run_pipeline

    rows = []
    for precision in ("fp8-cs", "bf16"):
        a = capture_aot(precision=precision, layers=1)
        install()  # as the backend does before any pass runs (TE's op families are defined now)
        reps = run_pipeline(a, stages=["post_grad_fwd", "post_grad_bwd"],
                            passes=[HoistTEConstants(), CallTEImplDirectly()])
        for rep in reps:
            (node,) = [n for n in rep.gm.graph.nodes if n.op == "call_function" and dc.META_KEY in n.meta]
            call = node.meta[dc.META_KEY]
            base_q = call.qualname
            wrapper_q = base_q.removesuffix("_base")
            flat = _flat_args(node)
            init = OPDEFS[base_q]._init_fn
            cell = dict(zip(init.__code__.co_freevars, init.__closure__))["impl"]
            orig = cell.cell_contents
            cell.cell_contents = _stub("backward" in base_q)
            try:
                res = harness.per_call({"wrapper op": overload(wrapper_q), "base op": overload(base_q),
                                        "DirectTECall": call}, calls=args.iters, rounds=1, args=tuple(flat))
            finally:
                cell.cell_contents = orig
            rows.append((precision, wrapper_q.split("::")[1], res))
    print(f"µs per call (CPU, {args.iters} calls, TE impl stubbed; torch {torch.__version__})")
    print(harness.md_table(["precision", "op", "wrapper op", "base op", "DirectTECall", "wrapper / direct"],
                           [(p, op, *(f"{r[k]:.1f}" for k in r), f"{r['wrapper op'] / r['DirectTECall']:.1f}×")
                            for p, op, r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
