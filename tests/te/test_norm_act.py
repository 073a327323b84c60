"""te/norm_act.py against TE 2.20.2: which LayerNormMLP activations TE fuses with an FP8 cast in
the backward under DelayedScaling (``DBIAS_FUSED``), which are gated (``GATED``), and the
``te_passes::te_act_*`` fakes built on them."""

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


@pytest.mark.skipif(capture_skip_reason() is not None, reason=str(capture_skip_reason()))
def test_fused_quantize_follows_tes_tables():
    """``fused_quantize``'s gradient rule exists exactly where TE's table for that recipe has a
    ``dbias_d*`` kernel (``_get_act_func_supported_list``: DelayedScaling and MXFP8, not current /
    block scaling), its quantizer classes are TE's (``transformer_engine.pytorch``) and
    ``QUANTIZER_RECIPES`` names TE's recipe classes; a class TE's code was not read for and an unknown
    source are refused with the names."""
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as R
    from transformer_engine.pytorch.module.layernorm_mlp import _get_act_func_supported_list

    for qcls, recipe_name in norm_act.QUANTIZER_RECIPES.items():
        assert isinstance(getattr(te, qcls), type) and isinstance(getattr(R, recipe_name), type), qcls
        table = _get_act_func_supported_list(getattr(R, recipe_name)())
        fused = {k for k, (_, _, dbias) in table.items() if dbias is not None}
        assert {a for a in table if norm_act.fused_quantize(qcls, "dact", a)} == fused, qcls
    assert set(norm_act.FUSED_QUANTIZE) == set(norm_act.QUANTIZER_RECIPES)
    assert norm_act.fused_quantize("Float8CurrentScalingQuantizer", "act") == "amax"
    assert norm_act.fused_quantize("Float8CurrentScalingQuantizer", "norm") is None
    assert norm_act.fused_quantize("Float8Quantizer", "norm") == norm_act.fused_quantize("MXFP8Quantizer", "act") == "fp32"
    with pytest.raises(KeyError, match="quantizer class 'NVFP4Quantizer': which values TE's fused kernels quantize"):
        norm_act.fused_quantize("NVFP4Quantizer", "act")
    with pytest.raises(ValueError, match="source 'gemm' is not 'norm', 'act' or 'dact'"):
        norm_act.fused_quantize("Float8Quantizer", "gemm")


@pytest.mark.skipif(capture_skip_reason() is not None, reason=str(capture_skip_reason()))
@pytest.mark.parametrize("name", sorted(norm_act.ACTIVATIONS))
def test_gated_and_the_te_op_fake_follow_tes_kernels(name):
    """``GATED`` is the activations whose TE kernel halves the last dim: TE's LayerNormMLP makes
    their fc1 twice ``ffn_hidden_size`` wide (``module/layernorm_mlp.py``), the torch-ops
    activation's shape says it, and the ``te_passes::te_act_fwd`` / ``_bwd`` fakes give that shape (forward) and
    the input's (backward) in the input dtype, the pybind function they call exists in TE's
    extension."""
    import transformer_engine_torch as tex

    from te_passes.ops import te_act

    from torch._subclasses.fake_tensor import FakeTensorMode

    from te_passes.testing.fake_gpu import capture_lock, constructing, fake_gpu, import_te, quiet

    te = import_te()
    with capture_lock, quiet(), fake_gpu("bf16"), FakeTensorMode(allow_non_fake_inputs=True), constructing():
        mlp = te.LayerNormMLP(64, 32, activation=name, params_dtype=torch.bfloat16, device="cuda")
        fc1_rows = mlp.fc1_weight.shape[0]
    assert (fc1_rows == 64) == (name in norm_act.GATED), (name, fc1_rows)  # TE's fc1 is twice ffn wide: gated
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    params = {"limit": 7.0, "alpha": 1.702} if name == "clamped_swiglu" else None
    n = norm_act.activation(x, name, params).shape[-1]
    assert (n == 4) == (name in norm_act.GATED), (name, n)
    assert callable(getattr(tex, name)) and callable(getattr(tex, te_act.backward_kernel(name)))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fx = torch.empty(4, 8, dtype=torch.bfloat16)
        y = torch.ops.te_passes.te_act_fwd(fx, name, 7.0, 1.702, 1.0)
        dx = torch.ops.te_passes.te_act_bwd(torch.empty_like(y), fx, name, 7.0, 1.702, 1.0)
    assert (tuple(y.shape), y.dtype) == ((4, n), torch.bfloat16)
    assert (tuple(dx.shape), dx.dtype) == ((4, 8), torch.bfloat16)
    with pytest.raises(KeyError, match="'tanh' is not one of TE's LayerNormMLP activations"):
        te_act.te_activation(x, "tanh")


@pytest.mark.parametrize("name", sorted(norm_act.ACTIVATIONS))
def test_both_paths_compute_the_same(name):
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    params = {"limit": 7.0, "alpha": 1.702} if name == "clamped_swiglu" else None
    want = norm_act.ACTIVATIONS[name](x.float(), params or {}).to(x.dtype)
    assert torch.equal(norm_act.activation(x, name, params), want)
