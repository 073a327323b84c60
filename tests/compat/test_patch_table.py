"""The patch table (te_passes.compat.table): install / revert / status on real objects, version refusals,
sweeps, toggles and the in-trace rule, with rows of a throwaway registry (the real rows are tested with
their capability)."""

from __future__ import annotations

import types

import pytest
import torch

from te_passes.compat import table
from te_passes.compat.table import Lowering, Rebind, Refused, Row, Toggle


def _row(name, plan, **kw):
    base = dict(target="t", kind="rebind", why="w", drop_when="d", te="", torch=">=2.14")
    base.update(kw)
    return Row(name=name, plan=plan, **base)


@pytest.fixture
def mod():
    m = types.SimpleNamespace(f=lambda: "old")
    yield m
    table.revert([n for n in (r.name for r in table.rows()) if n.startswith("test.")])


def test_rebind_installs_reports_and_reverts(mod):
    new = lambda: "new"  # noqa: E731
    (st,) = [s for s in table.install([_row("test.f", lambda: [Rebind(mod, "f", new)])]) if s.name == "test.f"]
    assert st.active and st.changes == 1 and mod.f() == "new" and table.refusal("test.f") is None
    table.install([_row("test.f", lambda: [Rebind(mod, "f", lambda: "other")])])  # idempotent: not re-planned
    assert mod.f() == "new"
    table.revert(["test.f"])
    assert mod.f() == "old" and table.refusal("test.f") == "pending: reverted"


def test_revert_leaves_a_later_rebinding_alone(mod):
    table.install([_row("test.g", lambda: [Rebind(mod, "f", lambda: "ours")])])
    theirs = lambda: "theirs"  # noqa: E731
    mod.f = theirs
    table.revert(["test.g"])
    assert mod.f is theirs


def test_version_range_and_plan_refusals_are_reported_not_applied(mod):
    sts = table.install([
        _row("test.v", lambda: [Rebind(mod, "f", lambda: "x")], torch="<2.0"),
        _row("test.r", lambda: (_ for _ in ()).throw(Refused("TE has no such function"))),
    ])
    by = {s.name: s for s in sts}
    assert mod.f() == "old"
    assert not by["test.v"].active and "checked against torch <2.0" in by["test.v"].reason
    assert by["test.r"].reason == "TE has no such function"


def test_sweep_makes_only_new_changes(mod):
    owners = [types.SimpleNamespace(a=1)]
    row = _row("test.sweep", lambda: [Rebind(o, "a", 2) for o in owners], sweep=True)
    table.install([row])
    owners.append(types.SimpleNamespace(a=1))
    (st,) = [s for s in table.install([row]) if s.name == "test.sweep"]
    assert [o.a for o in owners] == [2, 2] and st.changes == 2
    table.revert(["test.sweep"])
    assert [o.a for o in owners] == [1, 1]


def test_lowering_row_registers_and_restores():
    from torch._inductor import lowering as L

    op = torch.ops.aten.sigmoid.default
    before = L.lowerings.get(op)
    fn = lambda *a, **k: None  # noqa: E731
    table.install([_row("test.low", lambda: [Lowering(op, fn)], kind="lowering")])
    try:
        assert L.lowerings[op] is fn
    finally:
        table.revert(["test.low"])
    assert L.lowerings.get(op) is before


def test_toggles_apply_only_when_asked():
    cfg = types.SimpleNamespace(flag=False)
    table.install([_row("test.tog", lambda: [Toggle(cfg, "flag", True)], kind="toggle")])
    try:
        assert cfg.flag is False
        restore = table.apply_toggles()
        assert cfg.flag is True
        restore()
        assert cfg.flag is False
    finally:
        table.revert(["test.tog"])


def test_inside_a_trace_only_lowerings_install(mod):
    from torch._guards import TracingContext, tracing

    with tracing(TracingContext(None)):
        (st,) = [s for s in table.install([_row("test.trace", lambda: [Rebind(mod, "f", lambda: "x")])])
                 if s.name == "test.trace"]
    assert not st.active and st.reason.startswith("pending") and mod.f() == "old"
    (st,) = [s for s in table.install([_row("test.trace", lambda: [Rebind(mod, "f", lambda: "x")])])
             if s.name == "test.trace"]
    assert st.active and mod.f() == "x"


def test_duplicate_row_names_are_refused():
    r = _row("test.dup", lambda: [])
    with pytest.raises(ValueError, match="duplicate row names"):
        table.install([r, r])


def test_stamps_must_be_registered():
    obj = types.SimpleNamespace()
    with pytest.raises(KeyError, match="not registered"):
        table.stamp(obj, "_te_passes_test_unregistered", 1)
    with pytest.raises(ValueError, match="start with '_te_passes_'"):
        table.register_stamp("other", "why")
    name = table.register_stamp("_te_passes_test_mark", "a test marker")
    table.stamp(obj, name, 1)
    assert obj._te_passes_test_mark == 1
