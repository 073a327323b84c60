#!/usr/bin/env python3
"""Host cost of one lean CUDA-graph replay (te_passes/cudagraphs/lean.py), CPU only.

What a replay does on the host — static-input address check, use-count check of the pool's
outputs, copy of the non-static inputs, the replay call, building the outputs (aliases / clones)
— measured with a replay that launches nothing (``NoopEngine``), side by side with the same
number of ``Tensor.detach()`` calls (what ``make_graphed_callables(clone_param_grads_on_return=
False)`` does per output) in one run. Shapes follow stack4's graphs (4 te.Linear: 8 parameters;
forward ~30 outputs, backward ~9 gradients); tensors are tiny CPU tensors, so the copies and
clones are cheap and what is left is Python/dispatcher overhead. ::

    python3 benchmarks/bench_lean_replay_host.py [--calls 20000] [--outputs 30]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import harness  # noqa: E402
import torch  # noqa: E402

from te_passes.cudagraphs.lean import LeanCUDAGraph  # noqa: E402


class NoopEngine:
    """Capture runs the function once; replay does nothing (a replay's host cost without the launch)."""

    def new_pool(self, device_index):
        return object()

    def is_capturing(self):
        return False

    def warmup(self, fn, inputs, device_index):
        return fn(inputs)

    def capture(self, fn, inputs, pool, device_index, kept_inputs=()):
        return object(), fn(inputs)

    def replay(self, graph):
        pass


def _graph(n_static: int, n_out: int, n_clone: int):
    params = [torch.zeros(4) for _ in range(n_static)]

    def model(args):
        args.clear()
        return [torch.zeros(4) for _ in range(n_out)]

    def inputs():
        return [torch.zeros(4), *params]

    runner = LeanCUDAGraph(model, range(1, n_static + 1), name="bench", device_index=0, is_backward=False,
                           is_inference=False, num_clone_outputs=n_clone, engine=NoopEngine())
    return runner, inputs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--outputs", type=int, default=30, help="forward graph outputs (1 cloned, rest aliases)")
    ap.add_argument("--grads", type=int, default=9, help="backward graph outputs (aliases)")
    args = ap.parse_args(argv)
    rows = []
    for name, n_static, n_out, n_clone in (("forward", 8, args.outputs, 1), ("backward", 8 + args.outputs - 1,
                                                                          args.grads, 0)):
        runner, make = _graph(n_static, n_out, n_clone)
        runner(make())
        runner(make())  # warm-up, capture
        x = make()
        outs = [o for _, o in runner._plan]
        t = harness.per_call({"replay": lambda: runner(list(x)), "detach": lambda: [o.detach() for o in outs]},
                             calls=args.calls, warmup=0)
        replay_us, detach_us = t["replay"], t["detach"]
        assert runner.stats["eager"] == 0 and runner.stats["replay"] > args.calls
        rows.append((name, n_static, n_out, replay_us, detach_us))
    print(harness.md_table(["graph", "static inputs", "outputs", "lean replay host µs", "detach of every output µs",
                            "ratio"], [(n, ns, no, f"{r:.1f}", f"{d:.1f}", f"{r / d:.2f}×") for n, ns, no, r, d in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
