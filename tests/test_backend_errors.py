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

    from te_passes.compat.te220.capture_state import te_capture_state

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
    (42, r"^option te_passes.ub_snapshot must be a UbSnapshot, a dict or a JSON file path, got 42 \(int\)$"),
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


# --------------------------------------------------------------------------- issue 43: edges, one line each
def test_options_that_are_not_a_mapping_name_the_expected_dict():
    msg = ("options must be a dict {option name: value} (e.g. {'te_passes.strict': True}), "
           "got list: [('te_passes.strict', True)]")
    with pytest.raises(te_passes.TePassesOptionError) as ei:
        te_passes.te_inductor_backend(options=[("te_passes.strict", True)])
    assert str(ei.value) == msg
    f = torch.compile(lambda x: x + 1, backend=functools.partial(te_passes.te_inductor,
                                                                 options=[("te_passes.strict", True)]))
    with pytest.raises(te_passes.TePassesOptionError) as ei:
        f(torch.ones(2))
    assert str(ei.value) == msg and not isinstance(ei.value, BackendCompilerFailed)


def test_ub_snapshot_of_a_wrong_type_names_the_key_once():
    with pytest.raises(te_passes.TePassesOptionError) as ei:
        te_passes.te_inductor_backend(options={"te_passes.ub_snapshot": 5})
    assert str(ei.value) == "option te_passes.ub_snapshot must be a UbSnapshot, a dict or a JSON file path, got 5 (int)"
    from te_passes.te.ub import UbSnapshot

    te_passes.te_inductor_backend(options={"te_passes.ub_snapshot": UbSnapshot()})  # the real class is accepted


def test_numpy_bools_are_bools():
    np = pytest.importorskip("numpy")
    from te_passes.config import TePassesOptions

    opts, _ = TePassesOptions.parse({"te_passes.strict": np.bool_(True), "te_passes.untouched": np.False_})
    assert opts.strict is True and opts.untouched is False
    te_passes.te_inductor_backend(options={"te_passes.strict": np.bool_(True)})
    with pytest.raises(te_passes.TePassesOptionError) as ei:
        te_passes.te_inductor_backend(options={"te_passes.strict": np.int64(1)})
    assert str(ei.value) == "option te_passes.strict must be a bool (True or False), got np.int64(1) (int64)"


def test_prepare_te_state_without_a_model_is_one_clear_error():
    with pytest.raises(TypeError) as ei:
        te_passes.prepare_te_state(None, None, fp8=False)
    assert str(ei.value) == ("prepare_te_state: model must be a torch.nn.Module (the model about to be "
                             "compiled), got NoneType")


NORM_MSG = ("environment variable TE_PASSES_UNTOUCHED_NORM='bogus': option te_passes.untouched_norm must be one of "
            "['te', 'torch'], got 'bogus'")


def test_bad_untouched_norm_is_an_option_error_at_the_first_call(monkeypatch):
    """No TE module in the graph: refused with the options, at the first call, unwrapped."""
    monkeypatch.setenv("TE_PASSES_UNTOUCHED_NORM", "bogus")
    with pytest.raises(te_passes.TePassesOptionError) as ei:
        te_passes.te_inductor_backend()
    assert str(ei.value) == NORM_MSG
    f = torch.compile(lambda x: x * 5, backend="te_inductor")
    try:
        f(torch.ones(2))
    except te_passes.TePassesOptionError as e:
        assert str(e) == NORM_MSG and not isinstance(e, BackendCompilerFailed)
    else:
        pytest.fail("a bad TE_PASSES_UNTOUCHED_NORM was accepted")


@pytest.mark.te
def test_bad_untouched_norm_read_while_dynamo_traces_a_te_module_is_unwrapped(monkeypatch):
    """The polyfill of an untouched te.LayerNormLinear reads the options (TE_PASSES_UNTOUCHED_NORM) while Dynamo traces
    (before te_inductor runs): ``except te_passes.TePassesOptionError`` catches it (it was an
    InternalTorchDynamoError with Dynamo's "report to PyTorch" hint)."""
    te = pytest.importorskip("transformer_engine.pytorch")
    from torch._dynamo.exc import InternalTorchDynamoError
    from torch._subclasses.fake_tensor import FakeTensorMode

    from te_passes.compat.install import install
    from te_passes.testing.fake_gpu import constructing, fake_gpu, quiet

    assert install()
    monkeypatch.setenv("TE_PASSES_UNTOUCHED_NORM", "bogus")
    seen = []
    with quiet(), fake_gpu("bf16"):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode, constructing():
            model = te.LayerNormLinear(64, 128, params_dtype=torch.bfloat16, device="cuda")
            x = torch.randn(32, 64, dtype=torch.bfloat16, device="cuda")
        f = torch.compile(model, backend="te_inductor")
        with mode:
            try:
                f(x)
            except te_passes.TePassesOptionError as e:
                seen.append(e)
    (e,) = seen
    assert str(e) == NORM_MSG and not isinstance(e, InternalTorchDynamoError)
    import traceback

    # raised by the polyfill while Dynamo traced (not by te_inductor's option check after the trace)
    assert "frame_untouched_options" in [f.name for f in traceback.extract_tb(e.__traceback__)]


def test_unknown_te_passes_variable_is_warned_about_once_with_the_closest_name(monkeypatch):
    import te_passes.config as config

    config._warn_unknown_env.cache_clear()  # once per process: forget earlier warnings
    monkeypatch.setenv("TE_PASSES_DISABLED", "insert_early_frees")
    with pytest.warns(RuntimeWarning) as rec:
        te_passes.te_inductor_backend()
    msgs = [str(w.message) for w in rec if "TE_PASSES_DISABLED" in str(w.message)]
    assert msgs == ["te_passes: unknown environment variable TE_PASSES_DISABLED is ignored; did you mean "
                    "TE_PASSES_DISABLE?"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        te_passes.te_inductor_backend()  # once per process
    monkeypatch.setenv("TE_PASSES_ZZZ", "1")
    with pytest.warns(RuntimeWarning, match=r"unknown environment variable TE_PASSES_ZZZ is ignored; "
                                            r"te_passes reads TE_PASSES_COMMIT, .*TE_PASSES_UNTOUCHED_NORM"):
        te_passes.te_inductor_backend()


def test_readme_and_usage_name_the_same_error_classes():
    import pathlib
    import re

    from te_passes.backend import DOCUMENTED_ERRORS

    root = pathlib.Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    para = readme[readme.index("Errors come as"):].split("\n\n")[0]
    usage = (root / "docs" / "usage.md").read_text()
    table = usage[usage.index("## Errors: what you meet"):usage.index("Dynamo wraps an exception")]
    want = {e.__name__ for e in DOCUMENTED_ERRORS}
    assert set(re.findall(r"te_passes\.(\w+Error)", para)) == want
    assert set(re.findall(r"^\| `te_passes\.(\w+Error)`", table, re.M)) == want



def test_every_te_passes_variable_the_sources_read_is_known():
    """The unknown-name warning never fires for a variable te_passes, its tests, benchmarks or scripts read."""
    import pathlib
    import re

    from te_passes.config import known_env_vars

    root = pathlib.Path(__file__).resolve().parents[1]
    files = [p for d in ("te_passes", "tests", "benchmarks", "scripts") for p in (root / d).rglob("*")
             if p.suffix in (".py", ".sh") and p.is_file()] + [root / "Makefile"]
    used = {m for p in files for m in re.findall(r"\bTE_PASSES_[A-Z][A-Z0-9_]*[A-Z0-9]\b", p.read_text())}
    used -= {"TE_PASSES_DISABLED", "TE_PASSES_ZZZ"}  # this file's unknown names
    assert used and used <= set(known_env_vars()), sorted(used - set(known_env_vars()))


# --------------------------------------------------------------------------- session 22's user trial
@pytest.mark.parametrize("via", ["option", "env"])
def test_disabling_a_required_pass_is_refused_when_the_backend_is_built(via, monkeypatch):
    """find_autocast_state's fact is what te_inductor sets around the compiled call: refused by
    ``te_inductor_backend`` at once (was: accepted, refused at the first call)."""
    options = {"te_passes.disable": ["find_autocast_state"]} if via == "option" else None
    if via == "env":
        monkeypatch.setenv("TE_PASSES_DISABLE", "find_autocast_state")
    with pytest.raises(te_passes.TePassesOptionError, match="names find_autocast_state: te_inductor sets the "
                                                            "te.autocast state it finds around the compiled call"):
        te_passes.te_inductor_backend(options=options)


def test_an_option_name_that_is_not_a_string_is_an_option_error():
    with pytest.raises(te_passes.TePassesOptionError) as ei:
        te_passes.te_inductor_backend(options={1: True})
    assert str(ei.value) == "option names are strings ('te_passes.strict', 'triton.cudagraphs', ...); got 1 (int)"
