"""The DelayedScaling rows of the patch table (te_passes.compat.delayed_scaling.rows) on the installed TE / torch:
active, what they replace, refusals (versions, layout, TE not imported yet), revert. Their effect through
``backend="te_inductor"`` is tests/runtime/test_delayed_scaling.py's and test_delayed_linear.py's."""

from __future__ import annotations

import pytest
import torch

from te_passes.compat import table
from te_passes.compat.delayed_scaling import linear, rows, state
from te_passes.compat.install import install

NAMES = [r.name for r in rows.ROWS]
#: the substitution of check_recipe_support cannot be undone on torch 2.14 (no _unregister_substitute_in_graph)
REVERTIBLE = [n for n in NAMES if n != "delayed_scaling.check_recipe_support"
              or hasattr(torch._dynamo.decorators, "_unregister_substitute_in_graph")]


@pytest.fixture
def te():
    import transformer_engine.pytorch as te_pt
    from transformer_engine.pytorch import quantization as Q
    from transformer_engine.pytorch.module import linear as lin
    from transformer_engine.pytorch.tensor import float8_tensor as f8

    install()
    yield Q, lin, f8
    table.revert(REVERTIBLE)
    install()
    assert all(table.refusal(n) is None for n in NAMES), {n: table.refusal(n) for n in NAMES}


def _ours(Q, lin, f8) -> dict[str, object]:
    """What each rebinding row put in place (``None`` where TE's own object is there)."""
    def wrapped(fn):
        return fn if getattr(fn, "__wrapped__", None) is not None else None
    update = Q.FP8GlobalStateManager.__dict__["reduce_and_update_fp8_tensors"].__func__
    return {
        "delayed_scaling.reduce_and_update": wrapped(update),
        "delayed_scaling.make_quantizers": wrapped(Q.DelayedScalingRecipeState.__dict__["make_quantizers"]),
        "delayed_scaling.compile_unsupported_reason": wrapped(lin.LinearFwdArgs.__dict__["compile_unsupported_reason"]),
        "delayed_scaling.linear_op": wrapped(lin._linear_op),
        "delayed_scaling.float8_quantizer_specs": f8.Float8Quantizer.__dict__.get("storage_metadata"),
    }


def test_rows_active_on_the_installed_te_and_torch(te):
    Q, lin, f8 = te
    assert linear.ROW_NAMES == tuple(NAMES) and linear.refused_reason() is None
    st = {s.name: s for s in table.status()}
    assert all(st[n].active for n in NAMES), {n: st[n].reason for n in NAMES}
    ours = _ours(Q, lin, f8)
    assert all(v is not None for v in ours.values())
    current = f8.Float8CurrentScalingQuantizer.__dict__
    assert ours["delayed_scaling.float8_quantizer_specs"] is current["storage_metadata"]
    assert st["delayed_scaling.float8_quantizer_specs"].changes == 2
    # the markers it stamps on TE objects are registered
    assert {state.TAG, state.DELAYED_ATTR} <= set(table.STAMPS)


def test_revert_restores_te_objects_and_install_brings_ours_back(te):
    Q, lin, f8 = te
    before = _ours(Q, lin, f8)
    table.revert(REVERTIBLE)
    after = _ours(Q, lin, f8)
    assert all(v is None for v in after.values()), after
    assert lin._linear_op is before["delayed_scaling.linear_op"].__wrapped__
    assert "storage_metadata" not in f8.Float8Quantizer.__dict__  # inherited again, as in TE 2.20
    assert "pending: reverted" in linear.refused_reason()
    install()
    assert linear.refused_reason() is None and all(v is not None for v in _ours(Q, lin, f8).values())


@pytest.mark.parametrize("what, value, needle", [
    ("te_version", "2.21.0", "checked against TE ==2.20.*, installed TE is 2.21.0"),
    ("torch_version_string", "2.16.0", "checked against torch >=2.14,<2.16, installed torch is 2.16.0"),
])
def test_rows_refuse_other_versions_and_change_nothing(te, monkeypatch, what, value, needle):
    Q, lin, f8 = te
    table.revert(REVERTIBLE)
    monkeypatch.setattr(table, what, lambda: value)
    assert install() is True  # refused rows are settled: nothing to retry
    for n in REVERTIBLE:
        assert table.refusal(n) == needle
    assert all(v is None for v in _ours(Q, lin, f8).values())
    assert needle in linear.refused_reason()


def test_rows_refuse_an_unchecked_layout(te, monkeypatch):
    Q, lin, f8 = te
    table.revert(REVERTIBLE)
    monkeypatch.setattr(rows, "layout_unchecked_reason", lambda q: "FP8GlobalState has no global_amax_buffer")
    install()
    assert {table.refusal(n) for n in REVERTIBLE} == {"FP8GlobalState has no global_amax_buffer"}
    assert all(v is None for v in _ours(Q, lin, f8).values())


def test_rows_wait_while_te_is_not_imported(te, monkeypatch):
    """TE imported after te_passes: the rows stay pending (install() is not settled, so the backend's
    compile-start callback retries) and apply once TE's modules are there."""
    Q, lin, f8 = te
    table.revert(REVERTIBLE)
    with monkeypatch.context() as m:
        m.setattr(rows, "te_module", lambda name, import_te=False: None)
        assert install() is False
        assert table.refusal("delayed_scaling.reduce_and_update") == \
            "pending: transformer_engine.pytorch.quantization is not imported yet"
    assert install() is True and linear.refused_reason() is None
