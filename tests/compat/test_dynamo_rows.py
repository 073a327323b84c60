"""The Dynamo rows of the patch table: te_passes' one start / end callback pair survives
``torch._dynamo.reset()`` (row ``dynamo.keep_callbacks``), the install happens when the backend loads and
never rebinds inside a trace, and reverting the row restores Dynamo's own ``clear``."""

import torch

import te_passes.backend  # noqa: F401 - the one install moment
from te_passes.compat import table
from te_passes.compat.dynamo import callbacks
from te_passes.compat.dynamo.rows import ROWS


def _ours_registered() -> bool:
    h = torch._dynamo.callback_handler
    return callbacks.on_compile_start in h.start_callbacks and callbacks.on_compile_end in h.end_callbacks


def test_dynamo_rows_are_active_after_the_backend_loads():
    by = {s.name: s for s in table.status()}
    for row in ROWS:
        assert by[row.name].active, (row.name, by[row.name].reason)
    assert _ours_registered()


def test_callbacks_survive_dynamo_reset_and_run():
    seen = []
    real = callbacks.untouched_compile_start

    torch._dynamo.reset()
    assert _ours_registered()
    callbacks.untouched_compile_start = lambda args: seen.append(args)
    try:
        from te_passes.compat import gate

        def backend(gm, example_inputs):
            return gm.forward
        gate.register_backend(backend)
        torch.compile(lambda x: x + 1, backend=backend)(torch.ones(2))
        torch.compile(lambda x: x + 2, backend="eager")(torch.ones(2))
    finally:
        callbacks.untouched_compile_start = real
    assert len(seen) == 1, "the start callback ran TE's lazy init for the registered backend's frame only"


def test_reverting_keep_callbacks_restores_dynamo_clear():
    cls = type(torch._dynamo.callback_handler)
    ours = cls.__dict__["clear"]
    assert ours.__wrapped__ is not None
    table.revert(["dynamo.keep_callbacks"])
    try:
        assert cls.__dict__["clear"] is ours.__wrapped__
        torch._dynamo.reset()
        assert not _ours_registered()
    finally:
        table.install(ROWS)
    assert cls.__dict__["clear"] is not ours.__wrapped__ and _ours_registered()


def test_rows_refuse_outside_their_torch_range(monkeypatch):
    monkeypatch.setattr(table, "torch_version_string", lambda: "2.99.0")
    table.revert(["dynamo.specialize_float"])
    try:
        st = {s.name: s for s in table.install(ROWS)}["dynamo.specialize_float"]
        assert not st.active and "checked against torch >=2.14,<2.16, installed torch is 2.99.0" in st.reason
    finally:
        monkeypatch.undo()
        table.revert(["dynamo.specialize_float"])
        table.install(ROWS)
    assert table.refusal("dynamo.specialize_float") is None


def test_install_inside_a_compile_does_not_rebind_te_names():
    """A backend call (Dynamo's TracingContext is set) must not apply the TE-rebinding rows: the
    trace already read those names and its guards would evaluate the rebound ones. They wait
    ("pending"), install() says it is not settled, and the next install outside a compile applies them."""
    import transformer_engine.pytorch  # noqa: F401 - the rows plan on TE's loaded modules
    from transformer_engine.pytorch.module import linear as te_linear

    from te_passes.compat.delayed_scaling import linear as delayed_linear
    from te_passes.compat.install import install

    # check_recipe_support is a substitution, which torch 2.14 cannot undo: left in place
    rows = [n for n in delayed_linear.ROW_NAMES if n != "delayed_scaling.check_recipe_support"]
    install()
    table.revert(rows)
    te_op = te_linear._linear_op
    seen = {}

    def backend(gm, example_inputs):
        seen["in_compile"] = install()
        seen["op_in_compile"] = te_linear._linear_op
        seen["refusals"] = {n: table.refusal(n) for n in rows}
        return gm.forward

    try:
        torch._dynamo.reset()
        torch.compile(lambda x: x * 2, backend=backend)(torch.ones(2))
    finally:
        settled = install()  # outside a compile they apply
    assert seen["in_compile"] is False and seen["op_in_compile"] is te_op, seen
    assert set(seen["refusals"].values()) == {"pending: install() was called inside a trace"}
    assert settled and all(table.refusal(n) is None for n in rows) and te_linear._linear_op is not te_op
    assert te_linear._linear_op.__wrapped__ is te_op
