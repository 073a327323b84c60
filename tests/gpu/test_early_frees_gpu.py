"""insert_early_frees under CUDA graph trees (``mode="reduce-overhead"``) on a GPU.

An opaque op that keeps a reference to its FP8 input (as TE's eager code keeps tensors in
``ctx`` / quantized-storage objects) leaves that tensor in the cudagraph pool after the step:
cudagraph trees' pool assertion (``triton.slow_path_cudagraph_asserts``, on by default) fails
with "... tensor(s) in the cudagraph pool not tracked as outputs". With ``insert_early_frees``
the free after the op empties the very tensor object the op kept (TE's ``clear_tensor_data``
semantics), so the step records and replays cleanly and matches eager.

The free used to empty a duplicate: Inductor copied the unrealized FP8 cast into a buffer of
its own for the custom op (its ``needs_exact_strides`` constraint) and the free's lowering
realized the cast a second time (measured on an H200: the pool assertion still fired). The CPU
counterpart that pins the fix is ``tests/passes/test_insert_early_frees_inductor.py``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

_KEPT: list[torch.Tensor] = []


@torch.library.custom_op("tpq_gpu::keep_and_gemm", mutates_args=())
def keep_and_gemm(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    _KEPT.clear()
    _KEPT.append(q)  # an opaque callee keeping a reference to its quantized argument
    return q.to(torch.bfloat16) @ w


@keep_and_gemm.register_fake
def _(q, w):
    return q.new_empty((q.shape[0], w.shape[1]), dtype=torch.bfloat16)


def _f(x, w):
    q = x.to(torch.float8_e4m3fn)
    return torch.relu(keep_and_gemm(q, w))


def _inputs():
    torch.manual_seed(0)
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    return x, w


def test_free_after_a_retaining_opaque_op_keeps_the_cudagraph_pool_clean():
    from te_passes.report import clear_compile_reports, compile_reports

    x, w = _inputs()
    expect = _f(x, w)
    clear_compile_reports()
    # = mode="reduce-overhead"; FX graph cache off: on a cache hit the passes do not run and
    # leave no records (so a second run of this file on the same machine would fail below).
    torch._dynamo.reset()
    compiled = torch.compile(_f, backend="te_inductor",
                             options={"triton.cudagraphs": True, "fx_graph_cache": False,
                                      "te_passes.cudagraphs": "trees"})  # trees' pool assert is the check
    for _ in range(5):
        out = compiled(x, w)
    torch.cuda.synchronize()
    assert torch.equal(out, expect)
    assert _KEPT and _KEPT[0].numel() == 0  # the kept tensor was emptied by the free
    frees = [r for rep in compile_reports() for r in rep.records("free")]
    assert [(r.data["role"], r.data["after"].startswith("keep_and_gemm")) for r in frees] == [("rowwise_data", True)]


def test_without_the_free_cudagraph_trees_reject_the_kept_tensor():
    x, w = _inputs()
    torch._dynamo.reset()
    # torch.compile refuses mode= together with options= ("Either mode or options can be
    # specified"); triton.cudagraphs=True is what mode="reduce-overhead" sets (docs/usage.md).
    compiled = torch.compile(_f, backend="te_inductor",
                             options={"triton.cudagraphs": True, "te_passes.cudagraphs": "trees",
                                      "te_passes.disable": ["insert_early_frees"]})
    with pytest.raises(Exception, match="not tracked as outputs"):
        for _ in range(5):
            compiled(x, w)
        torch.cuda.synchronize()


def test_the_free_and_the_opaque_op_get_the_same_single_fp8_buffer():
    """The output code (default mode) allocates one float8 buffer, computes the cast once, and
    passes that buffer to the opaque op and then to the free."""
    import re

    from torch._inductor.utils import run_and_get_code

    x, w = _inputs()
    torch._dynamo.reset()
    compiled = torch.compile(_f, backend="te_inductor", options={"fx_graph_cache": False})
    out, (code,) = run_and_get_code(compiled, x, w)
    assert _KEPT and _KEPT[0].numel() == 0
    assert torch.equal(out, _f(x, w))
    (buf,) = re.findall(r"^\s*(buf\d+) = empty_strided_cuda\([^\n]*torch\.float8_e4m3fn\)", code, re.M)
    assert re.findall(r"torch\.ops\.tpq_gpu\.keep_and_gemm\.default\((\w+)", code) == [buf]
    assert re.findall(r"torch\.ops\.te_passes\.free_storage\.default\((\w+)", code) == [buf]
