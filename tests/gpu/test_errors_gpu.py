"""Issue 16, items 10-11 on a GPU with real fp8 ``te.Linear`` (``pytest -m gpu tests/gpu/test_errors_gpu.py``;
CPU counterparts: tests/test_backend_errors.py).

* ``options={"triton.cudagraphs": True, "triton.cudagraph_trees": False}``: refused with
  ``TePassesOptionError`` at the first call (unwrapped), before Inductor or TE GEMM run (it used
  to crash in ``getGemmOutputShape``);
* TE left in CUDA-graph-capture state (``transformer_engine.pytorch.graph.set_capture_start()``
  without its end, what a failed ``te.make_graphed_callables`` leaves): the compile warns that it
  falls back to eager; once the state is reset, te_inductor compiles the graph.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import te_passes
from te_passes.report import compile_reports
from te_passes.testing.gpu import build_linear, forward_fn, make_recipe

pytestmark = pytest.mark.gpu


def test_non_tree_cudagraphs_refused_on_fp8_linear():
    lin = build_linear(256)
    fn = forward_fn(lin, "fp8", make_recipe("fp8"))
    f = torch.compile(fn, backend="te_inductor", options={"triton.cudagraphs": True,
                                                         "triton.cudagraph_trees": False})
    x = torch.randn(128, 256, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    with pytest.raises(te_passes.TePassesOptionError, match="same output tensors"):
        f(x)


def test_capture_state_warns_and_reset_compiles():
    import transformer_engine.pytorch.graph as te_graph

    lin = build_linear(256)
    fn = forward_fn(lin, "fp8", make_recipe("fp8"))
    x = torch.randn(128, 256, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    te_graph.set_capture_start()
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            try:
                torch.compile(fn, backend="te_inductor")(x)
            except Exception:  # noqa: BLE001 - TE may refuse to run eagerly in this state; the warning is the point
                pass
        assert any("CUDA-graph-capture state" in str(m.message) for m in w), [str(m.message) for m in w]
    finally:
        te_graph.set_capture_end()
    torch._dynamo.reset()
    n = len(compile_reports())
    y = torch.compile(fn, backend="te_inductor")(x)
    y.sum().backward()
    assert len(compile_reports()) > n
