"""Shared helpers for the liveness / insert_early_frees / check_cudagraph_pool tests.

* two opaque custom ops in the ``tpq`` namespace that behave like TE's quantized ops on CPU:
  ``tpq::quantize2(x) -> (data float8_e4m3fn, scale_inv f32[1])`` (a multi-output quantize)
  and ``tpq::qgemm(q, scale_inv, w) -> f32`` (an opaque consumer of a quantized tensor);
* :func:`record_vals` — run a graph on real CPU tensors and store each node's value in
  ``meta['val']`` (what FakeTensorProp would give, with real data);
* :func:`real_aot` — cached real TE AOT graphs (``te_passes.testing.capture.capture_aot``),
  skipping the test when Transformer Engine is not installed.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.fx

F8 = torch.float8_e4m3fn


@torch.library.custom_op("tpq::quantize2", mutates_args=())
def quantize2(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.abs().amax().clamp(min=1e-12).reshape(1)
    scale = 448.0 / amax
    return (x * scale).to(F8), (1.0 / scale).to(torch.float32)


@quantize2.register_fake
def _(x):
    return x.new_empty(x.shape, dtype=F8), x.new_empty((1,), dtype=torch.float32)


@torch.library.custom_op("tpq::qgemm", mutates_args=())
def qgemm(q: torch.Tensor, scale_inv: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (q.to(torch.float32) * scale_inv) @ w


@qgemm.register_fake
def _(q, scale_inv, w):
    return q.new_empty((q.shape[0], w.shape[1]), dtype=torch.float32)


QUANTIZE2 = torch.ops.tpq.quantize2.default
QGEMM = torch.ops.tpq.qgemm.default


def record_vals(gm: torch.fx.GraphModule, *args) -> None:
    """Run ``gm`` on ``args`` and set ``meta['val']`` of every node to its value."""

    class _Rec(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            n.meta["val"] = out
            return out

    _Rec(gm, garbage_collect_values=False).run(*args)


def te_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


@functools.lru_cache(maxsize=None)
def _capture(precision: str, layers: int):
    from te_passes.testing.capture import capture_aot

    return capture_aot("stack" if layers > 1 else "linear", precision, layers=layers)


def real_aot(precision: str, layers: int):
    """The real TE AOT graphs (``CapturedAOT``) of a ``te.Linear`` stack, captured once per
    process; a copy, so tests may rewrite it. Skips without Transformer Engine."""
    if not te_available():
        pytest.skip("transformer_engine not installed")
    return _capture(precision, layers).copy()
