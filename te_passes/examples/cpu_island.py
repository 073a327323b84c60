"""A ``te-passes dump`` target that runs for real on a CPU: ``te-passes dump te_passes.examples.cpu_island:main``.

See docs/internals.md#te_passesexamplescpu_islandpy."""

from __future__ import annotations

import torch


def main(mode: str | None = None) -> None:
    """Compile and run the model: a forward+backward on ``[16, 16]``, then a forward on
    ``[32, 16]`` (recompile). ``mode`` is passed to ``torch.compile``."""
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16)
    pad = te.Fp8Padding(1, align_size=16)

    def step(x: torch.Tensor) -> torch.Tensor:
        y = lin(x)
        y, _ = pad(y, [x.shape[0]])  # TE eager island: graph break before and after
        return torch.relu(y) * 2

    compiled = torch.compile(step, backend="te_inductor", mode=mode, dynamic=False)
    x = torch.randn(16, 16, requires_grad=True)
    compiled(x).sum().backward()
    compiled(torch.randn(32, 16))
