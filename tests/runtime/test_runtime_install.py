"""compat.install(): te_passes' start callbacks survive torch._dynamo.reset(), and the parts that
rebind TE names never run while Dynamo compiles a frame (a backend call)."""

import torch

from te_passes.compat.delayed_scaling import linear as delayed_linear
from te_passes.compat.dynamo import hooks as dynamo_hooks
from te_passes.compat.dynamo.callbacks import drop_start_callback, keep_start_callback
from te_passes.compat.install import install


def test_kept_start_callback_survives_dynamo_reset():
    seen = []

    def cb(_args):
        seen.append(1)

    keep_start_callback(cb)
    try:
        torch._dynamo.reset()
        assert cb in torch._dynamo.callback_handler.start_callbacks
        torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))
        assert seen, "the kept callback did not run after reset()"
    finally:
        drop_start_callback(cb)
    torch._dynamo.reset()
    assert cb not in torch._dynamo.callback_handler.start_callbacks


def test_backend_callbacks_are_back_after_reset():
    import te_passes.backend  # noqa: F401 - registers the callbacks

    torch._dynamo.reset()
    assert dynamo_hooks.on_compile_start_capture in torch._dynamo.callback_handler.start_callbacks


def test_install_inside_a_compile_does_not_rebind_te_names():
    """A backend call (Dynamo's TracingContext is set) must not apply the TE-rebinding rows: the
    trace already read those names and its guards would evaluate the rebound ones. They wait
    ("pending"), install() says it is not settled, and the next install outside a compile applies them."""
    import transformer_engine.pytorch  # noqa: F401 - the rows plan on TE's loaded modules
    from transformer_engine.pytorch.module import linear as te_linear

    from te_passes.compat import table

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

    start_cb = dynamo_hooks.on_compile_start_install  # it would install at the compile's start (no trace yet)
    had_cb = start_cb in torch._dynamo.callback_handler.start_callbacks
    drop_start_callback(start_cb)
    try:
        torch._dynamo.reset()
        torch.compile(lambda x: x * 2, backend=backend)(torch.ones(2))
    finally:
        settled = install()  # outside a compile they apply
        if had_cb:
            keep_start_callback(start_cb)
    assert seen["in_compile"] is False and seen["op_in_compile"] is te_op, seen
    assert set(seen["refusals"].values()) == {"pending: install() was called inside a trace"}
    assert settled and all(table.is_active(n) for n in rows) and te_linear._linear_op is not te_op
    assert te_linear._linear_op.__wrapped__ is te_op
