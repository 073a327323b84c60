"""Per-call cost of te_passes' amax-group hooks on TE's eager Linear impls, side by side.

The hooks (:mod:`te_passes.compat.autocast.amax_groups`) wrap ``_linear_forward_impl`` /
``_linear_backward_impl`` of TE 2.20.2; every *eager* te.Linear call pays the wrapper. Timed
here, interleaved (a/b/a/b, so machine noise hits both alike), ns per call, best of
``--repeats`` runs of ``--calls`` calls:

* ``unwrapped``          — a stand-in impl that returns its args (the floor of a Python call);
* ``forward wrapper``    — the same stand-in behind the forward wrapper as installed (group of
  the input quantizer; usage flags of the input and weight quantizers);
* ``backward wrapper``   — behind the backward wrapper (groups of the input + grad-output
  quantizers; usage flags of those and the weight quantizer);

each with ``sequence_parallel`` True (quantizers hold a fake TP group of size 2 while the call
runs) and False (TE sets no group; the usage flags are still put back). The stand-in sets the
input quantizer's usage as TE's column-parallel SP forward does (``set_usage(columnwise=False)``,
linear.py:488), so the restore writes on every call. The
quantizers are TE's real ``Float8CurrentScalingQuantizer`` (constructed on CPU). A real eager
te.Linear call costs tens of microseconds of Python; the overhead column is what matters.

Run: ``PYTHONPATH=. python benchmarks/bench_amax_hooks.py [--calls 20000] [--repeats 7]``.
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    import transformer_engine.pytorch  # noqa: F401  (torch first, then TE)
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.module._common import set_quantizer_amax_reduction_group
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    from te_passes.compat.autocast import amax_groups
    from te_passes.compat.autocast import quantizer_usage

    def quantizer():
        return Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, device=torch.device("cpu"))

    print(f"{'case':<40} {'ns/call':>10} {'overhead ns':>12} {'ratio':>7}")
    for sp in (True, False):
        a = types.SimpleNamespace(input_quantizer=quantizer(), grad_output_quantizer=quantizer(),
                                  weight_quantizer=quantizer(), weight=torch.zeros(1), saved_weight=torch.zeros(1),
                                  sequence_parallel=sp)

        def impl(x, _sp=sp):  # like TE's impls: set the group and the usage at the start of the call
            if _sp:
                set_quantizer_amax_reduction_group(x.input_quantizer, dist.group.WORLD)
            x.input_quantizer.set_usage(rowwise=True, columnwise=False)
            return x

        def wrapped(name):  # what row autocast.linear_impls builds for TE's impl ``name``
            return amax_groups._wrap_impl(impl, amax_groups.PER_CALL_GROUP_FIELDS[name],
                                          quantizer_usage.PER_CALL_USAGE_FIELDS[name], quantizer_usage.WEIGHT_FIELD[name])
        fwd, bwd = wrapped("_linear_forward_impl"), wrapped("_linear_backward_impl")
        best = harness.per_call({"unwrapped": impl, "forward wrapper": fwd, "backward wrapper": bwd},
                                calls=args.calls, rounds=args.repeats, args=(a,), stat=min)
        base = best["unwrapped"] * 1e3
        for name, t in best.items():
            t *= 1e3
            print(f"{name + (' (SP)' if sp else ' (no SP)'):<40} {t:>10.0f} {t - base:>12.0f} {t / base:>7.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
