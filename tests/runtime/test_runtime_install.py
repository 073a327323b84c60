"""compat.install(): te_passes' start callbacks survive torch._dynamo.reset(), and the parts that
rebind TE names never run while Dynamo compiles a frame (a backend call)."""

import torch

from te_passes.compat.delayed_scaling import linear as delayed_linear, scaling as delayed_scaling
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


def test_install_inside_a_compile_does_not_rebind_te_names(monkeypatch):
    """A backend call (Dynamo's TracingContext is set) must not run the TE-rebinding installs: the
    trace already read those names and its guards would evaluate the rebound ones."""
    calls = []
    monkeypatch.setattr(delayed_scaling, "install_delayed_scaling", lambda: calls.append("scaling") or False)
    monkeypatch.setattr(delayed_linear, "install_delayed_linear", lambda: calls.append("linear") or False)
    monkeypatch.setattr(delayed_scaling, "installed", lambda: False)
    monkeypatch.setattr(delayed_scaling, "refused_reason", lambda: None)
    seen = {}

    def backend(gm, example_inputs):
        seen["in_compile"] = install()
        seen["calls_in_compile"] = list(calls)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda x: x * 2, backend=backend)(torch.ones(2))
    assert seen["calls_in_compile"] == [] and seen["in_compile"] is False
    assert install() is False and calls == ["scaling", "linear"]  # outside a compile they run
