"""widen_delayed_inputs: under DelayedScaling a te.Linear quantizes the fp32 values TE's fused kernels
quantize: the norm feeding it runs in fp32, an activation computed in fp32 is not rounded first.

Real AOT forward graphs of untouched te.LayerNormLinear / te.LayerNormMLP under DelayedScaling
(CPU capture, fake GPU: tests/runtime/test_delayed_linear.py's ``_capture``), through the pass
manager path the backend uses (``run_pipeline``): the exact rewritten nodes, their fake values,
the nodes left alone with their reason, the switch off, and Float8CurrentScaling untouched. The
numerics against TE eager (TE's norm and quantize kernels) are the GPU test's:
``tests/gpu/test_delayed_scaling_gpu.py::test_transformer_layer_trajectory``.
"""

from __future__ import annotations

import operator

import pytest
import torch

from te_passes.testing.capture import capture_skip_reason

pytestmark = [pytest.mark.skipif(capture_skip_reason() is not None, reason=str(capture_skip_reason())),
              pytest.mark.usefixtures("reset_te_fp8_state")]

NORM, LINEAR = "te_passes.te_norm_fwd.default", "te_passes.delayed_linear_fwd.default"
CONVERT = torch.ops.prims.convert_element_type.default


def _aot(name, recipe=None):
    from tests.runtime.test_delayed_linear import BUILDS, _capture

    build, _ = BUILDS[name]
    return _capture(("HYBRID", 16, "max"), 0, prepare=False, build=build, recipe=recipe)["aot"]


def _run(aot, **opts):
    from te_passes.config import TePassesOptions
    from te_passes.passes.order import configured_passes, pass_names
    from te_passes.pipeline.base import Stage
    from te_passes.testing.capture import run_pipeline

    options = TePassesOptions.parse(opts or None, known_passes=set(pass_names()))[0]
    (rep,) = run_pipeline(aot, stages=[Stage.POST_GRAD_FWD], options=options,
                          passes=configured_passes(options.pass_config))
    return rep.gm, next(r for r in rep.runs if r.name == "widen_delayed_inputs")


def outs_of(gm):
    return [a for a in gm.graph.output_node().args[0] if isinstance(a, torch.fx.Node)]


def _named(gm, name):
    return [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) == name]


@pytest.mark.parametrize("name,linears", [("LayerNormLinear", 1), ("LayerNormMLP", 1)])
def test_delayed_linears_take_fp32_inputs(name, linears):
    aot = _aot(name)
    before = aot.copy()
    (norm0,) = _named(before.forward, NORM)
    x0 = norm0.args[0]
    assert x0.meta["val"].dtype == torch.bfloat16
    gm, run = _run(aot)
    assert run.status == "ok", run
    (norm,) = _named(gm, NORM)
    widened = [r for r in run.records if r.kind == "widened"]
    assert [(r.kind, r.node) for r in widened] == [("widened", norm.name)]
    assert widened[0].data["dtype"] == "bfloat16"
    # LayerNormMLP: fc2 takes the fp32 activation (second rule); LayerNormLinear has no second linear
    assert [r.kind for r in run.records if r.kind != "widened"] == (["fed_fp32"] if name == "LayerNormMLP" else [])
    # the norm's input, weight (and LayerNorm bias) are fp32 copies of the graph's
    for a, old in zip(norm.args[:3], norm0.args[:3]):
        if old is None:
            assert a is None
            continue
        assert a.target is CONVERT and a.args[1] == torch.float32 and a.args[0].name == old.name
        assert a.meta["val"].dtype == torch.float32 and a.meta["val"].shape == old.meta["val"].shape
    assert norm.args[3:] == norm0.args[3:]
    y = next(u for u in norm.users if u.target is operator.getitem and u.args[1] == 0)
    assert norm.meta["val"][0].dtype == y.meta["val"].dtype == torch.float32
    assert [t.dtype for t in norm.meta["val"][1:]] == [torch.float32, torch.float32]  # mu, rsigma: as before
    lin = _named(gm, LINEAR)
    takers = [n for n in lin if n.args[1] is y]
    assert len(takers) == linears  # the linear after the norm quantizes the fp32 output
    narrow = [u for u in y.users if u.target is CONVERT]
    assert len(narrow) == 1 and narrow[0].args == (y, torch.bfloat16)
    assert set(y.users) == set(takers) | set(narrow)
    if name == "LayerNormMLP":  # fc2's input: the fp32 activation, the bf16 convert kept for the backward
        (fc2,) = [n for n in lin if n is not takers[0]]
        act = fc2.args[1]
        assert act.meta["val"].dtype == torch.float32 and act.target is not CONVERT
        (skipped,) = [u for u in act.users if u.target is CONVERT]
        assert skipped.args == (act, torch.bfloat16) and skipped in outs_of(gm)
        rec = next(r for r in run.records if r.kind == "fed_fp32")
        assert (rec.node, rec.data) == (fc2.name, {"value": act.name, "skipped": skipped.name})
    # every other user (the saved input of the backward op) gets the bf16 copy: the graph's outputs
    # keep their dtypes, so the backward graph is unchanged
    outs = gm.graph.output_node().args[0]
    assert narrow[0] in outs and y not in outs
    out_vals = [a.meta["val"].dtype for a in outs if isinstance(a, torch.fx.Node)]
    before_vals = [a.meta["val"].dtype for a in before.forward.graph.output_node().args[0] if isinstance(a, torch.fx.Node)]
    assert out_vals == before_vals
    gm.graph.lint()


def test_switched_off_and_current_scaling_untouched():
    from transformer_engine.common import recipe as R

    aot = _aot("LayerNormLinear")
    gm, run = _run(aot, **{"te_passes.disable": ["widen_delayed_inputs"]})
    assert run.status == "disabled", run
    (norm,) = _named(gm, NORM)
    assert norm.args[0].op == "placeholder" and not [n for n in gm.graph.nodes if n.target is CONVERT]
    # Float8CurrentScaling: no delayed te.Linear after the norm, nothing to widen, nothing recorded
    gm, run = _run(_aot("LayerNormLinear", recipe=R.Float8CurrentScaling()))
    assert run.status == "ok" and run.records == [] and not run.changed, run
    assert not [n for n in gm.graph.nodes if n.target is CONVERT]


def test_fp32_input_kept_with_the_reason():
    """An fp32 model has nothing to widen: the norm is kept and the record says why."""
    aot = _aot("LayerNormLinear")
    (norm,) = _named(aot.forward, NORM)
    x = norm.args[0]
    x.meta["val"] = x.meta["val"].to(torch.float32)
    gm, run = _run(aot)
    assert [(r.kind, r.data["reason"]) for r in run.records] == [("kept", "its input is torch.float32: nothing to widen")]
    assert not [n for n in gm.graph.nodes if n.target is CONVERT]


def test_second_run_changes_nothing_and_metadata_follows():
    """Run twice (a re-lowering, a replay): the widened norm is recognised, no edit, no record; the
    widened output's ``tensor_meta`` says fp32 like its ``val`` (pattern matchers read it)."""
    from te_passes.passes.widen_delayed_inputs import WidenDelayedInputs
    from te_passes.testing.harness import run_passes

    gm, run = _run(_aot("LayerNormLinear"))
    assert [r.kind for r in run.records] == ["widened"]
    (norm,) = _named(gm, NORM)
    y = next(u for u in norm.users if u.args[1] == 0)
    assert y.meta["tensor_meta"].dtype == torch.float32
    again = run_passes(gm, WidenDelayedInputs(), "post_grad_fwd")
    (rerun,) = again.report.runs
    assert rerun.status == "ok" and not rerun.changed and rerun.records == []
    assert again.after_code == again.before_code
