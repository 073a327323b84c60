"""te/norm_act.py against TE 2.20.2: which LayerNormMLP activations TE fuses with an FP8 cast in
the backward under DelayedScaling (``DBIAS_FUSED``), and the provenance the passes read from it."""

from __future__ import annotations

import pytest
import torch

from te_passes.te import norm_act
from te_passes.testing.capture import capture_skip_reason


@pytest.mark.skipif(capture_skip_reason() is not None, reason=str(capture_skip_reason()))
def test_dbias_fused_is_tes_list():
    """``DBIAS_FUSED`` is exactly the activations TE's DelayedScaling table gives a ``dbias_d*``
    kernel (``_get_act_func_supported_list``); a TE release that adds or drops one fails here."""
    from transformer_engine.common import recipe as R
    from transformer_engine.pytorch.module.layernorm_mlp import _get_act_func_supported_list

    table = _get_act_func_supported_list(R.DelayedScaling())
    assert set(table) == set(norm_act.ACTIVATIONS)
    assert {k for k, (_, _, dbias) in table.items() if dbias is not None} == norm_act.DBIAS_FUSED


def test_provenance_from_the_innermost_frame():
    """The provenance reads the innermost ``File ..., in <function>`` line of ``meta["stack_trace"]``."""
    g = torch.fx.Graph()
    n = g.placeholder("x")

    def frame(fn):
        return f'  File "{fn.__code__.co_filename}", line 1, in {fn.__code__.co_name}\n    code\n'

    user = '  File "/u/model.py", line 3, in forward\n    y = f(x)\n'
    for meta, want in [(None, "no stack trace"), (user, "elsewhere"),
                       (user + frame(norm_act.activation) + frame(norm_act._activation_dbias_fused), "dbias_fused"),
                       (user + frame(norm_act._activation_backward_unfused), "backward_unfused"),
                       (frame(norm_act._activation_dbias_fused) + user, "elsewhere")]:
        n.meta["stack_trace"] = meta
        assert norm_act.activation_provenance(n) == want, (meta, want)


@pytest.mark.parametrize("name", sorted(norm_act.ACTIVATIONS))
def test_both_paths_compute_the_same(name):
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    params = {"limit": 7.0, "alpha": 1.702} if name == "clamped_swiglu" else None
    want = norm_act.ACTIVATIONS[name](x.float(), params or {}).to(x.dtype)
    assert torch.equal(norm_act.activation(x, name, params), want)
