"""A ``te-passes dump`` target that runs for real on a CPU: ``te-passes dump te_passes.examples.cpu_island:main``.

``torch.compile(backend="te_inductor")`` on a small model that calls a Transformer Engine module
Dynamo cannot trace: ``te.Fp8Padding.forward`` is ``@no_torch_dynamo`` in TE 2.20.2
(``transformer_engine/pytorch/module/fp8_padding.py``), so Dynamo breaks the graph around it
and TE runs it eagerly — an *eager island*. With ``align_size=16`` and a 16-row input no
padding is needed and no CUDA kernel runs, so this works without a GPU. A second call with a
new shape recompiles. The dump then shows two graphs, the island with its reason, the graph
breaks it caused and the recompiles with their failed guards.
"""

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
