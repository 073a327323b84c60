"""The CPU capture (te_passes.testing.capture) against a real compilation on the GPU.

On the H200, the same te.Linear / stack is compiled for real through Inductor
(``torch._inductor.compile_fx.compile_fx`` with recording ``joint_custom_pre_pass`` /
``post_grad_custom_pre_pass`` hooks — where te_inductor's passes run) and run forward +
backward; the graphs the hooks saw must equal, line for line, what ``capture_aot`` produces
with fake tensors (source-comment lines and the class header ignored). This is what licenses
using the captured graphs as "real" in the CPU test suite.

Set ``TE_PASSES_GPU_OUT=<dir>`` to also write both versions of every graph there.
"""

from __future__ import annotations

import contextlib
import difflib
import os

import pytest
import torch

pytestmark = pytest.mark.gpu

CASES = [("bf16", 1), ("fp8-cs", 1), ("bf16", 4), ("fp8-cs", 4)]


def normalize(text: str) -> list[str]:
    out = []
    for line in text.splitlines():
        s = line.rstrip()
        if not s.strip() or s.strip().startswith("#") or s.startswith("class "):
            continue
        out.append(s)
    return out


def _real_hook_graphs(precision: str, layers: int, tokens: int = 32, hidden: int = 64) -> dict[str, str]:
    import transformer_engine.pytorch as te
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from te_passes.testing.fake_gpu import make_recipe

    out_features = 2 * hidden if layers == 1 else hidden
    dims = [hidden] * layers + [out_features]
    mods = torch.nn.ModuleList(te.Linear(dims[i], dims[i + 1], params_dtype=torch.bfloat16, device="cuda")
                               for i in range(layers))
    recipe = make_recipe(precision)
    gelu = torch.nn.functional.gelu

    def step(inp):  # same shape and closure names as capture_dynamo's, so Dynamo names match
        with (te.autocast(enabled=True, recipe=recipe) if recipe is not None else contextlib.nullcontext()):
            for i, lin in enumerate(mods):
                if i:
                    inp = gelu(inp)
                inp = lin(inp)
        return inp

    seen: dict[str, str] = {}

    class Record(CustomGraphPass):
        def __init__(self, joint: bool) -> None:
            self.joint = joint

        def __call__(self, graph, is_inference: bool = False) -> None:
            gm = graph.owning_module
            if self.joint:
                key = "joint"
            else:
                key = "backward" if any(str(n.target).startswith("tangents")
                                        for n in graph.find_nodes(op="placeholder")) else "forward"
            seen[key] = gm.print_readable(print_output=False)

        def uuid(self) -> str:
            return f"record-{self.joint}"

    def backend(gm, example_inputs):
        seen["dynamo"] = gm.print_readable(print_output=False)
        return compile_fx(gm, example_inputs, config_patches={
            "joint_custom_pre_pass": Record(True), "post_grad_custom_pre_pass": Record(False),
            "fx_graph_cache": False})

    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    y = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)(x)
    y.float().sum().backward()
    return seen


@pytest.mark.parametrize("precision,layers", CASES)
def test_captured_graphs_equal_real_compilation(precision, layers):
    from te_passes.testing.capture import capture_aot

    real = _real_hook_graphs(precision, layers)
    cap = capture_aot(precision=precision, layers=layers)
    mine = {"dynamo": cap.dynamo.gm, "joint": cap.joint, "forward": cap.forward, "backward": cap.backward}
    mine = {k: v.print_readable(print_output=False) for k, v in mine.items()}
    out_dir = os.environ.get("TE_PASSES_GPU_OUT")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        for k in mine:
            for tag, texts in (("real", real), ("capture", mine)):
                with open(os.path.join(out_dir, f"{precision}_{layers}_{k}_{tag}.txt"), "w") as f:
                    f.write(texts.get(k, "<missing>"))
    assert set(real) == {"dynamo", "joint", "forward", "backward"}
    diffs = {}
    for k in ("dynamo", "joint", "forward", "backward"):
        a, b = normalize(real[k]), normalize(mine[k])
        if a != b:
            diffs[k] = "\n".join(list(difflib.unified_diff(a, b, "real", "capture", lineterm="", n=1))[:40])
    assert not diffs, "\n\n".join(f"== {k}\n{d}" for k, d in diffs.items())
