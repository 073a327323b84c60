"""Errors users meet from te_inductor (issue 16, items 10-12): non-tree cudagraphs refused with
the reason, a warning when TE's CUDA-graph-capture state makes compiles fall back to eager, the
documented exceptions exported from ``te_passes`` and reaching ``torch.compile`` callers
unwrapped (not as ``BackendCompilerFailed``)."""

from __future__ import annotations

import functools
import logging
import warnings

import pytest
import torch
from torch._dynamo.exc import BackendCompilerFailed

import te_passes


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_documented_exceptions_are_exported():
    from te_passes.config import TePassesOptionError
    from te_passes.pipeline.manager import TePassError
    from te_passes.te.ub import UbConfigError

    assert te_passes.TePassesOptionError is TePassesOptionError
    assert te_passes.TePassError is TePassError
    assert te_passes.UbConfigError is UbConfigError
    assert {"TePassesOptionError", "TePassError", "UbConfigError", "te_inductor_backend"} <= set(te_passes.__all__)


@pytest.mark.parametrize("how", ["string", "partial"])
def test_option_error_at_first_call_is_unwrapped(how):
    opts = {"te_passes.strict": "yes"}
    backend = functools.partial(te_passes.te_inductor, options=opts) if how == "partial" else "te_inductor"
    kw = {} if how == "partial" else {"options": opts}
    f = torch.compile(lambda x: x + 1, backend=backend, **kw)
    with pytest.raises(te_passes.TePassesOptionError, match="te_passes.strict must be a bool") as ei:
        f(torch.ones(2))
    assert not isinstance(ei.value, BackendCompilerFailed)
    assert isinstance(ei.value, ValueError)


def test_pass_error_under_strict_is_unwrapped(monkeypatch):
    from te_passes.pipeline.base import Stage, TEPass

    class Boom(TEPass):
        name = "fold_ub_predicates"
        stages = frozenset({Stage.DYNAMO})

        def run(self, gm, ctx):
            raise RuntimeError("boom in a pass")

    import te_passes.backend as backend

    monkeypatch.setattr(backend, "configured_passes", lambda cfg=None: [Boom()])
    f = torch.compile(lambda x: x * 2, backend="te_inductor", options={"te_passes.strict": True})
    with pytest.raises(te_passes.TePassError, match="boom in a pass") as ei:
        f(torch.ones(2))
    assert not isinstance(ei.value, BackendCompilerFailed)


def test_backend_factory_validates_eagerly():
    with pytest.raises(te_passes.TePassesOptionError, match="te_passes.strict"):
        te_passes.te_inductor_backend(options={"te_passes.strict": "no"})
    with pytest.raises(te_passes.TePassesOptionError, match="hoist_constants"):
        te_passes.te_inductor_backend(options={"te_passes.pass_config": {"hoist_te_constants":
                                                                        {"hoist_constants": "no"}}})
    with pytest.raises(RuntimeError, match="Unrecognized mode"):
        te_passes.te_inductor_backend(mode="warp-speed")
    b = te_passes.te_inductor_backend(mode="reduce-overhead", options={"te_passes.strict": False})
    assert isinstance(b, functools.partial) and b.func is te_passes.te_inductor
    assert b.keywords == {"mode": "reduce-overhead", "options": {"te_passes.strict": False}}
    f = torch.compile(lambda x: x - 1, backend=te_passes.te_inductor_backend())
    torch.testing.assert_close(f(torch.ones(2)), torch.zeros(2))


@pytest.mark.parametrize("mode, options", [
    (None, {"triton.cudagraphs": True, "triton.cudagraph_trees": False}),
    ("reduce-overhead", {"triton.cudagraph_trees": False}),
])
def test_non_tree_cudagraphs_are_refused_with_the_reason(mode, options):
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    with pytest.raises(te_passes.TePassesOptionError) as ei:
        te_passes.te_inductor(gm, [torch.ones(2)], mode=mode, options=options)
    msg = str(ei.value)
    assert "triton.cudagraph_trees=False" in msg and "same output tensors" in msg and "TE GEMM" in msg, msg
    assert 'mode="reduce-overhead"' in msg
    with pytest.raises(te_passes.TePassesOptionError):
        te_passes.te_inductor_backend(mode=mode, options=options)
    # trees (the default) are fine
    te_passes.te_inductor(gm, [torch.ones(2)], options={"triton.cudagraphs": True})


def test_warning_when_te_is_left_in_graph_capture_state(caplog):
    pytest.importorskip("transformer_engine")
    import transformer_engine.pytorch.graph as te_graph
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    from te_passes.te.capture_state import te_capture_state

    assert te_capture_state() == []
    f = torch.compile(lambda x: x + 3, backend="te_inductor")
    te_graph.set_capture_start()  # what a failed te.make_graphed_callables leaves behind
    try:
        assert te_capture_state() == ["transformer_engine.pytorch.graph.is_graph_capturing() is True "
                                      "(te.make_graphed_callables started a capture and did not finish)"]
        with warnings.catch_warnings(record=True) as w, caplog.at_level(logging.WARNING, logger="te_passes"):
            warnings.simplefilter("always")
            f(torch.ones(2))
        msgs = [str(x.message) for x in w if "CUDA-graph-capture state" in str(x.message)]
        assert msgs, [str(x.message) for x in w]
        assert "falls back to eager" in msgs[0] and "is_graph_capturing" in msgs[0]
        assert any("CUDA-graph-capture state" in r.getMessage() for r in caplog.records)
    finally:
        te_graph.set_capture_end()
    qs = FP8GlobalStateManager.quantization_state
    old = qs.fp8_graph_capturing
    qs.fp8_graph_capturing = True
    try:
        assert any("fp8_graph_capturing" in r for r in te_capture_state())
    finally:
        qs.fp8_graph_capturing = old
    assert te_capture_state() == []


@pytest.mark.parametrize("value, match", [
    (42, r"option te_passes.ub_snapshot: te_passes.ub_snapshot must be a UbSnapshot, dict or JSON path, got int"),
    ("/nonexistent/ub.json", r"option te_passes.ub_snapshot: cannot read UB snapshot '/nonexistent/ub.json'"),
    ({"bogus": 1}, r"option te_passes.ub_snapshot: UB snapshot has unknown keys \['bogus'\]"),
])
def test_bad_ub_snapshot_is_an_option_error(value, match):
    """A te_passes.ub_snapshot that cannot be loaded is refused as an option: by
    te_inductor_backend at construction, and unwrapped (not BackendCompilerFailed) at the first
    call of torch.compile(backend="te_inductor")."""
    with pytest.raises(te_passes.TePassesOptionError, match=match):
        te_passes.te_inductor_backend(options={"te_passes.ub_snapshot": value})
    f = torch.compile(lambda x: x + 1, backend="te_inductor", options={"te_passes.ub_snapshot": value})
    with pytest.raises(te_passes.TePassesOptionError, match=match) as ei:
        f(torch.ones(2))
    assert not isinstance(ei.value, BackendCompilerFailed)
    # a loadable snapshot is accepted
    te_passes.te_inductor_backend(options={"te_passes.ub_snapshot": {"initialized": False}})


@pytest.mark.parametrize("via", ["option", "env"])
def test_unwritable_dump_dir_is_an_option_error(via, tmp_path, monkeypatch):
    """A dump directory that cannot be created is refused naming the option (or variable) and
    why, as TePassesOptionError at the first call (not BackendCompilerFailed(DumpDirError))."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    opts = {}
    if via == "option":
        opts = {"te_passes.dump_dir": str(afile / "sub")}
    else:
        monkeypatch.setenv("TE_PASSES_DUMP_DIR", str(afile / "sub"))
    f = torch.compile(lambda x: x * 3, backend="te_inductor", options=opts)
    where = "option te_passes.dump_dir" if via == "option" else "environment variable TE_PASSES_DUMP_DIR"
    with pytest.raises(te_passes.TePassesOptionError, match=f"{where}: dump directory .*afile/sub is not writable") as ei:
        f(torch.ones(2))
    assert not isinstance(ei.value, BackendCompilerFailed)
