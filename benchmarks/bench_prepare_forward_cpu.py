#!/usr/bin/env python3
"""CPU: what patch-table row ``untouched.prepare_forward`` adds to every *eager* TE module call (issue 38).

    PYTHONPATH=$PWD python3 benchmarks/bench_prepare_forward_cpu.py [--calls N] [--rounds R]

The row rebinds ``TransformerEngineBaseModule.prepare_forward`` on the class
(te_passes/compat/untouched/forward_state.py), so once te_passes is installed every TE module's forward in the
process — eager ones too — calls the polyfill, which asks ``torch.compiler.is_compiling()`` and then calls TE's
function. Side by side in one run (``harness.per_call``: interleaved rounds, the fastest round's µs per call:
on a shared machine the minimum is the least disturbed), on a real
te.Linear(64, 64) built on the fake GPU (``te_passes.testing.fake_gpu``; a bf16 CPU input answering ``is_cuda``
True: TE reads only its device, dtype and contiguity here; ``torch.cuda.is_current_stream_capturing``, which
DelayedScaling's path asks, answers ``False`` without the driver):

* ``TE``      — TE 2.20.2's own ``prepare_forward`` (the function the row keeps: ``forward_state.TE_FUNCTION[0]``);
* ``row``     — the polyfill (``forward_state.prepare_forward``), what ``module.prepare_forward`` runs now;
* ``floor``   — a Python function that only calls TE's (what any rebind of a Python method costs at least: the
  polyfill must be a Python function for Dynamo to inline it; row − floor is its ``is_compiling()`` check);
* ``method``  — ``module.prepare_forward(inp)`` as TE's forwards call it (the class attribute: the row's polyfill).

per recipe state: bf16 (no te.autocast), Float8CurrentScaling and DelayedScaling (te.autocast entered around the
calls, the module already initialised, as in every step after the first). The difference TE → row is the cost.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
from pathlib import Path
from unittest import mock

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import harness  # noqa: E402
import torch  # noqa: E402


class _CudaLooking(torch.Tensor):
    """A CPU tensor that answers ``is_cuda`` True (TE's device check) with no ``__torch_function__`` on its
    methods: ``dtype`` / ``is_contiguous()`` at C speed, as on a real CUDA tensor (a FakeTensor input's Python
    dispatch made TE's function 25 µs here)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def is_cuda(self) -> bool:
        return True


def measure(calls: int, rounds: int) -> list[list[str]]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from te_passes.compat import table
    from te_passes.compat.install import install
    from te_passes.compat.untouched import forward_state
    from te_passes.testing.fake_gpu import constructing, fake_gpu, import_te, quiet

    te = import_te()
    from transformer_engine.common import recipe as R
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    install()
    if table.refusal("untouched.prepare_forward") is not None:
        raise SystemExit(f"row untouched.prepare_forward is not active: {table.refusal('untouched.prepare_forward')}")
    assert TransformerEngineBaseModule.__dict__["prepare_forward"] is forward_state.prepare_forward
    te_fn, row_fn = forward_state.TE_FUNCTION[0], forward_state.prepare_forward

    def floor(self, inp, num_gemms=1, allow_non_contiguous=False, allow_different_data_and_param_types=False):
        return te_fn(self, inp, num_gemms, allow_non_contiguous, allow_different_data_and_param_types)

    rows = []
    cases = [("bf16", None), ("fp8 current scaling", R.Float8CurrentScaling()), ("fp8 delayed scaling",
                                                                                  R.DelayedScaling())]
    # DelayedScaling's prepare_forward asks torch.cuda.is_current_stream_capturing() (a driver call): False here
    with quiet(), fake_gpu("fp8-cs"), torch.no_grad(), \
            mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: False):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        for name, recipe in cases:
            FP8GlobalStateManager.reset()
            with mode, constructing():
                m = te.Linear(64, 64, params_dtype=torch.bfloat16, device="cuda")
            inp = torch.randn(32, 64, dtype=torch.bfloat16).as_subclass(_CudaLooking)
            ctx = te.autocast(enabled=True, recipe=recipe) if recipe is not None else contextlib.nullcontext()
            with mode, ctx:
                got = harness.per_call({"TE": lambda: te_fn(m, inp), "row": lambda: row_fn(m, inp),
                                        "floor": lambda: floor(m, inp), "method": lambda: m.prepare_forward(inp)},
                                       calls=calls, rounds=rounds, stat=min)
            assert m.fp8 is (recipe is not None), (name, m.fp8)
            rows.append([name, f"{got['TE']:.3f}", f"{got['row']:.3f}", f"{got['floor']:.3f}", f"{got['method']:.3f}",
                         f"{got['row'] - got['TE']:+.3f}", f"{got['row'] / got['TE']:.3f}x"])
        FP8GlobalStateManager.reset()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=41)
    args = ap.parse_args()
    import transformer_engine

    print(f"# bench_prepare_forward_cpu: torch {torch.__version__}, TE {transformer_engine.__version__}, "
          f"python {platform.python_version()}, {platform.processor() or platform.machine()}; "
          f"{args.calls} calls x {args.rounds} interleaved rounds, fastest round's us per call (the 2-core machine "
          f"is shared: the minimum is the least disturbed; load {os.getloadavg()[0]:.1f})")
    rows = measure(args.calls, args.rounds)
    print(harness.md_table(["state", "TE us", "row us", "floor us", "method us", "row - TE us", "row / TE"], rows))
    check = harness.per_call({"is_compiling": torch.compiler.is_compiling}, calls=args.calls * 5, rounds=args.rounds,
                             stat=min)
    print(f"torch.compiler.is_compiling() alone (the row's eager check): {check['is_compiling']:.3f} us per call")


if __name__ == "__main__":
    main()
