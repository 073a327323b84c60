"""What recipe TE's impls read at run time when compiled code calls them (finding, issue 13).

TE 2.20.2's ``_linear_forward_impl`` reads ``FP8GlobalStateManager.get_fp8_recipe()`` while it
runs (``module/linear.py:611``: ``recipe.fp8_gemm_fprop.use_split_accumulator``; ``:414`` for
``save_original_input``). Eager runs it inside ``te.autocast``; compiled code runs the TE op
after Dynamo traced the ``te.autocast`` away, so the state is not set around the op and TE falls
back to ``get_default_fp8_recipe()`` (on an H200: ``DelayedScaling``, no ``fp8_gemm_fprop``, so
``_2X_ACC_FPROP = False``). Same result for Float8CurrentScaling (its fprop is ``False`` too),
not for Float8BlockScaling (``True``, required by its ``__post_init__``). A probe custom op
called where TE's op would be shows the state such an impl sees (CPU, TE's device checks faked).
"""

from __future__ import annotations

import pytest
import torch

te = pytest.importorskip("transformer_engine.pytorch")


@pytest.mark.xfail(strict=True, reason="TE 2.20.2: compiled code runs TE ops outside te.autocast's "
                   "state; an impl reads the default recipe (linear.py:611)")
def test_op_called_from_compiled_code_sees_the_autocast_recipe():
    from transformer_engine.common import recipe as R
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as M

    from te_passes.testing import fake_gpu as FG

    seen = []

    @torch.library.custom_op("te_passes_test::recipe_probe", mutates_args=())
    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append(type(M.get_fp8_recipe()))
        return x + 1

    @probe.register_fake
    def _(x):
        return torch.empty_like(x)

    rec = R.Float8BlockScaling()

    def f(x):
        with te.autocast(enabled=True, recipe=rec):
            return probe(x)

    with FG.fake_gpu("fp8-cs"):
        x = torch.randn(4)
        f(x)
        assert seen == [R.Float8BlockScaling]  # eager: the autocast's recipe
        seen.clear()
        torch._dynamo.reset()
        torch.compile(f, backend="te_inductor")(x)
        torch._dynamo.reset()
    assert seen == [R.Float8BlockScaling], f"compiled code's op saw {seen}"
