"""insert_early_frees under CUDA graph trees (``mode="reduce-overhead"``) on a GPU.

An opaque op that keeps a reference to its FP8 input (as TE's eager code keeps tensors in
``ctx`` / quantized-storage objects) leaves that tensor in the cudagraph pool after the step:
cudagraph trees' pool assertion (``triton.slow_path_cudagraph_asserts``, on by default) fails
with "... tensor(s) in the cudagraph pool not tracked as outputs". With ``insert_early_frees``
the free after the op empties the very tensor object the op kept (TE's ``clear_tensor_data``
semantics), so the step records and replays cleanly and matches eager.

NOTE: written without GPU access in its session (the device budget was spent); first run pending.
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
    from te_passes.report import compile_reports

    x, w = _inputs()
    expect = _f(x, w)
    compiled = torch.compile(_f, backend="te_inductor", mode="reduce-overhead")
    for _ in range(5):
        out = compiled(x, w)
    torch.cuda.synchronize()
    assert torch.equal(out, expect)
    assert _KEPT and _KEPT[0].numel() == 0  # the kept tensor was emptied by the free
    frees = [r for rep in compile_reports() for r in rep.records("free")]
    assert [(r.data["role"], r.data["after"].startswith("keep_and_gemm")) for r in frees] == [("rowwise_data", True)]


def test_without_the_free_cudagraph_trees_reject_the_kept_tensor():
    x, w = _inputs()
    compiled = torch.compile(_f, backend="te_inductor", mode="reduce-overhead",
                             options={"te_passes.disable": ["insert_early_frees"]})
    with pytest.raises(Exception, match="not tracked as outputs"):
        for _ in range(5):
            compiled(x, w)
        torch.cuda.synchronize()
