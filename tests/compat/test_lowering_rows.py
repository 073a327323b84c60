"""The rows of te_passes' own ops (te_passes.compat.lowering_rows) on the installed TE / torch: active, what the
passes read of them (Inductor's lowering table, the classes' ``__fx_repr__``), refusals and revert. Their effect
through Inductor / ``backend="te_inductor"``: tests/passes/test_insert_early_frees.py,
test_call_te_impl_directly.py, test_hoist_te_constants.py."""

from __future__ import annotations

import pytest
import torch

from te_passes.compat import lowering_rows, table
from te_passes.compat.install import install
from te_passes.ops import constants, direct_lowering as dl, free

NAMES = [r.name for r in lowering_rows.ROWS]


@pytest.fixture
def lowerings():
    import transformer_engine.pytorch  # noqa: F401 - TE's op families and constant classes
    from torch._inductor import lowering as L

    install()
    yield L
    table.revert(NAMES)
    install()
    assert all(table.refusal(n) is None for n in NAMES), {n: table.refusal(n) for n in NAMES}


def _te_base_ops():
    return [torch.ops.transformer_engine_compile.linear_base.default,
            torch.ops.transformer_engine_compile.linear_backward_base.default]


def test_rows_active_and_read_by_the_passes(lowerings):
    L = lowerings
    assert all(table.refusal(n) is None for n in NAMES), {n: table.refusal(n) for n in NAMES}
    assert free.lowering_reason() is None and getattr(L.lowerings[free.free_storage], free.LOWERING_MARK)
    for op in _te_base_ops():
        assert op in dl.base_ops() and dl.lowering_reason(op) is None and dl.is_direct_lowering(L.lowerings[op])
        assert L.maybe_layout_constraints(op) is not None  # make_fallback's layout constraint, as before
    classes = constants.te_constant_classes()
    assert classes and all(constants.is_named_fx_repr(c.__dict__["__fx_repr__"]) for c in classes)


def test_revert_restores_inductor_and_te_classes(lowerings):
    L = lowerings
    table.revert(NAMES)
    assert free.free_storage not in L.lowerings and "not installed" in free.lowering_reason()
    assert all(op not in L.lowerings and dl.lowering_reason(op).startswith("direct-call lowering not installed")
               for op in _te_base_ops())
    te_reprs = {c: c.__dict__["__fx_repr__"] for c in constants.te_constant_classes()}
    assert not any(constants.is_named_fx_repr(f) for f in te_reprs.values())
    install()
    assert free.lowering_reason() is None and all(dl.lowering_reason(op) is None for op in _te_base_ops())
    table.revert(["lowering.named_constants"])
    assert {c: c.__dict__["__fx_repr__"] for c in te_reprs} == te_reprs  # TE's own functions, not copies


def test_rows_refuse_another_torch_and_change_nothing(lowerings, monkeypatch):
    L = lowerings
    table.revert(NAMES)
    monkeypatch.setattr(table, "torch_version_string", lambda: "2.16.0")
    install()
    assert {table.refusal(n) for n in NAMES} == {"checked against torch >=2.14,<2.16, installed torch is 2.16.0"}
    assert free.free_storage not in L.lowerings and not any(op in L.lowerings for op in _te_base_ops())
    assert not any(constants.is_named_fx_repr(c.__dict__["__fx_repr__"]) for c in constants.te_constant_classes())


def test_free_row_leaves_a_foreign_lowering_alone(lowerings, monkeypatch):
    L = lowerings
    table.revert(["lowering.free_storage"])

    def theirs(t):
        return None

    monkeypatch.setitem(L.lowerings, free.free_storage, theirs)
    install()
    assert table.refusal("lowering.free_storage") == \
        "te_passes::free_storage already has an Inductor lowering that is not te_passes'"
    assert L.lowerings[free.free_storage] is theirs and "not te_passes'" in free.lowering_reason()
