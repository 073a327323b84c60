"""The ``ub.*`` and ``autocast.*`` rows of the patch table on the real TE 2.20.2 / torch: active, refused with the
version reason outside their ranges, reverted to TE's own objects, swept over TE objects that appear later. Their
effect through ``backend="te_inductor"`` is tested in tests/runtime/test_ub_guard.py (UB recompiles),
test_amax_groups.py / test_usage_flags.py (Linear impls) and test_te_recipe_at_runtime.py (trace hooks)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

pytest.importorskip("transformer_engine.pytorch")
import transformer_engine.pytorch.module.base as te_base  # noqa: E402
import transformer_engine.pytorch.module.linear as te_linear  # noqa: E402

import te_passes.backend  # noqa: E402,F401  (installs the table, as loading te_inductor does)
from te_passes.compat import table  # noqa: E402
from te_passes.compat.autocast import amax_groups, recipe_state, rows as autocast_rows, traced_quantizers  # noqa: E402
from te_passes.compat.ub import reinit, rows as ub_rows  # noqa: E402
from te_passes.te.op_families import TE_OP_NAMESPACE  # noqa: E402

UB_FUNCTIONS = ("initialize_ub", "destroy_ub", "get_ub_is_fp8")
ALL = (*ub_rows.ROWS, *autocast_rows.ROWS)
NAMES = [r.name for r in ALL]


def _original(fn):
    return getattr(fn, "__te_passes_original__", fn)


@pytest.fixture
def reinstalled():
    """Rows reverted by the test are applied again afterwards (and checked); ask for it before ``monkeypatch``
    (torn down after it)."""
    yield
    table.revert(NAMES)
    table.install(ALL)
    assert all(table.refusal(n) is None for n in NAMES), [(s.name, s.reason) for s in table.status()]


def test_rows_are_named_and_active_on_te_2_20_torch_2_15_or_2_14():
    assert NAMES == ["ub.initialize_ub", "ub.destroy_ub", "ub.get_ub_is_fp8", "autocast.linear_impls",
                     "autocast.traced_quantizer_copies", "autocast.trace_hooks"]
    assert {r.kind for r in ALL} == {"rebind"} and all(r.why and r.drop_when and r.target for r in ALL)
    st = {s.name: s for s in table.status()}
    assert all(st[n].active for n in NAMES), [(n, st[n].reason) for n in NAMES]
    # every loaded TE module that holds one of TE's UB functions holds the drop-in
    for name in UB_FUNCTIONS:
        hooked = getattr(te_base, name)
        orig = hooked.__te_passes_original__
        holders = [n for n, m in list(sys.modules.items()) if n.startswith("transformer_engine") and m is not None
                   and getattr(m, name, None) in (hooked, orig)]
        assert holders and all(getattr(sys.modules[n], name) is hooked for n in holders), name
    assert te_linear.get_ub_is_fp8 is te_base.get_ub_is_fp8
    assert getattr(te_linear._linear_forward_impl, "_te_passes_amax_hook", False)
    fakes = [torch._library.custom_ops.OPDEFS[q]._abstract_fn for q in recipe_state.forward_ops()]
    assert fakes and all(getattr(f, recipe_state.HOOK_ATTR, False) for f in fakes if f is not None)


@pytest.mark.parametrize("which, value, reason", [
    ("te_version", "2.21.0", "checked against TE ==2.20.*, installed TE is 2.21.0"),
    ("torch_version_string", "2.16.0", "checked against torch >=2.14,<2.16, installed torch is 2.16.0"),
])
def test_rows_refuse_outside_their_version_range_and_leave_te_alone(reinstalled, monkeypatch, which, value, reason):
    table.revert(NAMES)
    monkeypatch.setattr(table, which, lambda: value)
    table.install(ALL)
    assert {n: table.refusal(n) for n in NAMES} == dict.fromkeys(NAMES, reason)
    for name in UB_FUNCTIONS:
        assert not hasattr(getattr(te_base, name), "__te_passes_original__"), name
    assert not getattr(te_linear._linear_forward_impl, "_te_passes_amax_hook", False)


def test_revert_puts_te_objects_back_and_install_applies_again(reinstalled):
    hooked = {n: getattr(te_base, n) for n in UB_FUNCTIONS}
    impls = {n: getattr(te_linear, n) for n in amax_groups.PER_CALL_GROUP_FIELDS}
    opdefs = [torch._library.custom_ops.OPDEFS[q] for q in recipe_state.forward_ops()]
    fakes = [o._abstract_fn for o in opdefs]
    table.revert(NAMES)
    for n, fn in hooked.items():
        assert getattr(te_base, n) is fn.__te_passes_original__
    assert te_linear.get_ub_is_fp8 is hooked["get_ub_is_fp8"].__te_passes_original__
    for n, fn in impls.items():
        assert getattr(te_linear, n) is fn.__wrapped__
    assert not traced_quantizers.active()  # its wrapper, under delayed_scaling.linear_op's, passes TE's call through
    assert [o._abstract_fn for o in opdefs] == [getattr(f, "__wrapped__", f) for f in fakes]
    assert all(table.refusal(n) == "pending: reverted" for n in NAMES)
    table.install(ALL)
    assert all(table.refusal(n) is None for n in NAMES)
    assert _original(te_base.destroy_ub) is hooked["destroy_ub"].__te_passes_original__


def test_ub_rows_cover_te_modules_loaded_before_and_after_they_are_applied(reinstalled):
    """Applied anew, a row rebinds every loaded TE module holding TE's function; a TE module imported after that
    takes the drop-in from module/base.py (why the ub rows are not sweeps)."""
    table.revert(["ub.get_ub_is_fp8"])
    orig = te_base.get_ub_is_fp8
    early = types.ModuleType("transformer_engine._te_passes_test_early")
    early.get_ub_is_fp8 = orig  # a TE module that imported TE's function before te_passes
    sys.modules[early.__name__] = early
    late = types.ModuleType("transformer_engine._te_passes_test_late")
    try:
        table.install(ub_rows.ROWS)
        assert early.get_ub_is_fp8 is te_base.get_ub_is_fp8 is te_linear.get_ub_is_fp8
        assert early.get_ub_is_fp8.__te_passes_original__ is orig
        exec("from transformer_engine.pytorch.module.base import get_ub_is_fp8", late.__dict__)  # noqa: S102
        assert late.get_ub_is_fp8 is te_base.get_ub_is_fp8
        table.revert(["ub.get_ub_is_fp8"])
        assert early.get_ub_is_fp8 is orig and te_base.get_ub_is_fp8 is orig
    finally:
        del sys.modules[early.__name__]


def test_trace_hooks_row_sweeps_a_te_op_family_defined_later(reinstalled):
    name = f"{TE_OP_NAMESPACE}::te_passes_rowtest"
    for q in (name, name + "_backward"):
        @torch.library.custom_op(q, mutates_args=())
        def op(x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @op.register_fake
        def _(x):
            return torch.empty_like(x)
    opdef = torch._library.custom_ops.OPDEFS[name]
    fake = opdef._abstract_fn
    assert not getattr(fake, recipe_state.HOOK_ATTR, False)
    table.install(autocast_rows.ROWS)
    assert getattr(opdef._abstract_fn, recipe_state.HOOK_ATTR, False) and opdef._abstract_fn.__wrapped__ is fake
    assert torch.ops.transformer_engine_compile.te_passes_rowtest(torch.ones(2)).shape == (2,)
    table.revert([recipe_state.TRACE_HOOKS_ROW])
    assert opdef._abstract_fn is fake


def test_pending_rows_wait_for_te_modules(reinstalled, monkeypatch):
    """While TE's module is not imported the rows say so and install() tries again (the start callback stays)."""
    from te_passes.compat import install as compat_install

    table.revert(["ub.get_ub_is_fp8", amax_groups.ROW])
    monkeypatch.setattr(ub_rows, "te_module", lambda name: None)
    monkeypatch.setattr(amax_groups, "te_module", lambda name: None)
    assert compat_install.install() is False
    assert table.refusal("ub.get_ub_is_fp8") == "pending: transformer_engine.pytorch.module.base is not imported yet"
    assert table.refusal(amax_groups.ROW) == "pending: transformer_engine.pytorch.module.linear is not imported yet"
    monkeypatch.undo()
    assert compat_install.install() is True and table.refusal("ub.get_ub_is_fp8") is None and table.refusal(amax_groups.ROW) is None


def test_compiler_reset_row_is_applied_only_inside_keep_compiled_graphs(monkeypatch):
    real = torch.compiler.reset
    calls = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: calls.append("dynamo"))
    with reinit.keep_compiled_graphs():
        assert table.refusal("ub.compiler_reset") is None and torch.compiler.reset is not real
        with reinit.keep_compiled_graphs():  # nested: the outer block's row stays
            torch.compiler.reset()
        assert table.refusal("ub.compiler_reset") is None
        torch.compiler.reset()
    assert torch.compiler.reset is real and table.refusal("ub.compiler_reset") == "pending: reverted"
    assert calls == []
    assert "ub.compiler_reset" not in NAMES  # not in the registry: compat.install() never applies it


def test_keep_compiled_graphs_says_why_when_its_row_is_refused(reinstalled, monkeypatch):
    monkeypatch.setattr(table, "te_version", lambda: "2.21.0")
    with pytest.raises(RuntimeError, match=r"cannot keep compiled graphs over TE's destroy_ub\(\): patch "
                                           r"ub.compiler_reset is not applied \(checked against TE ==2.20.\*, "
                                           r"installed TE is 2.21.0\)"):
        with reinit.keep_compiled_graphs():
            pass
    table.revert(["ub.compiler_reset"])
    monkeypatch.undo()
    with reinit.keep_compiled_graphs():
        assert table.refusal("ub.compiler_reset") is None
