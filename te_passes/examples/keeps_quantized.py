"""A ``te-passes dump`` target where ``insert_early_frees`` acts, on a CPU:
``te-passes dump te_passes.examples.keeps_quantized:main``.

See docs/passes/insert_early_frees.md "Where it acts"."""

from __future__ import annotations

import functools

import torch

from te_passes.backend import te_inductor

#: What ``keep_and_gemm`` kept from its last call (the reference a TE version or custom op may hold).
KEPT: list[torch.Tensor] = []


@torch.library.custom_op("te_passes_example::keep_and_gemm", mutates_args=())
def keep_and_gemm(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """An opaque FP8 GEMM that keeps a Python reference to its quantized input after it returns, as
    a TE module does that stores its FP8 input in an object outliving the call (TE frees those by hand
    with ``clear_tensor_data``): ``q`` float8_e4m3fn ``[M, K]``, ``w`` ``[K, N]`` -> ``[M, N]`` in ``w.dtype``."""
    KEPT[:] = [q]
    return q.to(w.dtype) @ w


@keep_and_gemm.register_fake
def _(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return q.new_empty((q.shape[0], w.shape[1]), dtype=w.dtype)


def step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Quantize ``x`` [M, K] to FP8 (an ATen cast), the kept-reference GEMM with ``w`` [K, N], a ReLU."""
    return torch.relu(keep_and_gemm(x.to(torch.float8_e4m3fn), w))


def main(mode: str | None = None) -> None:
    """Compile ``step`` with ``te_inductor`` (FX graph cache off, so the passes run), call it on
    ``[64, 64]`` inputs and check that the FP8 buffer the GEMM kept was emptied by the free.

    Raises:
        RuntimeError: the kept buffer still holds its data (the pass did not free it) or the
            result differs from eager.
    """
    torch.manual_seed(0)
    x, w = torch.randn(64, 64), torch.randn(64, 64)
    # torch.compile refuses mode= with options=: both go to the backend (docs/usage.md "Options")
    backend = functools.partial(te_inductor, mode=mode, options={"fx_graph_cache": False})
    compiled = torch.compile(step, backend=backend)
    out = compiled(x, w)
    kept = KEPT[0].untyped_storage().nbytes()
    want = step(x, w)
    if kept:
        raise RuntimeError(f"keeps_quantized: the FP8 buffer keep_and_gemm kept still holds {kept} bytes "
                           "(insert_early_frees did not free it)")
    if not torch.equal(out, want):
        raise RuntimeError("keeps_quantized: the compiled result differs from eager")
    print(f"keeps_quantized: the {64 * 64}-byte FP8 buffer keep_and_gemm kept was freed after its last use")
