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
    from tests.runtime.test_delayed_linear import BUILDS, _capture, _te

    if name == "stack-gelu":  # two te.Linears with torch's GELU between (the user's, not TE's)
        return _capture(("HYBRID", 16, "max"), 2)["aot"]
    if name.startswith("LayerNormMLP-"):  # another activation: "LayerNormMLP-swiglu"
        act = name.split("-", 1)[1]
        return _capture(("HYBRID", 16, "max"), 0, prepare=False, recipe=recipe, build=lambda: _te().LayerNormMLP(
            64, 256, params_dtype=torch.bfloat16, device="cuda", activation=act))["aot"]
    build, _ = BUILDS[name]
    return _capture(("HYBRID", 16, "max"), 0, prepare=False, build=build, recipe=recipe)["aot"]


def _run(aot, stage="post_grad_fwd", **opts):
    from te_passes.config import TePassesOptions
    from te_passes.passes.order import configured_passes, pass_names
    from te_passes.pipeline.base import Stage
    from te_passes.testing.capture import run_pipeline

    options = TePassesOptions.parse(opts or None, known_passes=set(pass_names()))[0]
    (rep,) = run_pipeline(aot, stages=[Stage(stage)], options=options,
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
    # no other user of y: the backward op keeps a stand-in of its input, not the input
    # (runtime/delayed/linear.py), so no bf16 copy is made
    assert set(y.users) == set(takers), y.users
    if name == "LayerNormMLP":  # fc2's input: the fp32 activation; the bf16 convert is left without users
        (fc2,) = [n for n in lin if n is not takers[0]]
        act = fc2.args[1]
        assert act.meta["val"].dtype == torch.float32 and act.target is not CONVERT
        (skipped,) = [u for u in act.users if u.target is CONVERT]
        assert skipped.args == (act, torch.bfloat16) and not skipped.users  # Inductor drops it
        rec = next(r for r in run.records if r.kind == "fed_fp32")
        assert (rec.node, rec.data) == (fc2.name, {"value": act.name, "skipped": skipped.name, "argument": "inp"})
    # the graph's outputs keep their dtypes, so the backward graph is unchanged; y is no output
    outs = gm.graph.output_node().args[0]
    assert y not in outs
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


def test_fc1_grad_output_is_the_fp32_activation_gradient():
    """The third rule, on LayerNormMLP's real AOT backward graph: fc1's backward op takes the fp32
    gradient of the activation (TE eager's fused ``dbias_dgelu`` quantizes it from fp32), not its
    bf16 rounding; fc2's backward op (its grad output is the graph's bf16 tangent) is untouched;
    the op's outputs keep their fake dtypes (bias gradient bf16: ``grads_in_fake_dtypes``)."""
    aot = _aot("LayerNormMLP")
    before = aot.copy()
    bwd0 = _named(before.backward, "te_passes.delayed_linear_bwd.default")
    assert [b.args[0].target is CONVERT for b in bwd0] == [False, True]
    conv0 = bwd0[1].args[0]
    assert conv0.args[1] == torch.bfloat16 and conv0.args[0].meta["val"].dtype == torch.float32
    gm, run = _run(aot, "post_grad_bwd")
    assert run.status == "ok" and run.changed, run
    fc2_bwd, fc1_bwd = _named(gm, "te_passes.delayed_linear_bwd.default")
    assert fc2_bwd.args[0].op == "placeholder" and fc2_bwd.args[0].name == bwd0[0].args[0].name
    g32 = fc1_bwd.args[0]
    assert g32.name == conv0.args[0].name and g32.meta["val"].dtype == torch.float32
    assert g32.meta["val"].shape == conv0.meta["val"].shape
    assert fc1_bwd.args[1:] == tuple(torch.fx.map_arg(bwd0[1].args[1:], lambda a: next(
        n for n in gm.graph.nodes if n.name == a.name)))
    assert [(r.kind, r.node, r.data) for r in run.records] == [
        ("fed_fp32", fc1_bwd.name, {"value": g32.name, "skipped": conv0.name, "argument": "grad_output"})]
    assert [v.dtype for v in fc1_bwd.meta["val"][:3]] == [torch.bfloat16] * 3
    gm.graph.lint()
    # a second run: the fp32 gradient is no convert, nothing to do
    from te_passes.passes.widen_delayed_inputs import WidenDelayedInputs
    from te_passes.testing.harness import run_passes

    again = run_passes(gm, WidenDelayedInputs(), "post_grad_bwd")
    assert again.report.runs[0].records == [] and again.after_code == again.before_code


@pytest.mark.parametrize("stage", ["post_grad_fwd", "post_grad_bwd"])
def test_a_users_torch_activation_keeps_its_rounding(stage):
    """te.Linear -> torch GELU (bf16) -> te.Linear: Inductor's GELU also computes in fp32 and
    rounds, but TE eager quantizes that bf16 rounding (the user's GELU is no TE kernel): the
    linear keeps it, and the record says why."""
    aot = _aot("stack-gelu")
    graph = aot.forward if stage == "post_grad_fwd" else aot.backward
    op = "te_passes.delayed_linear_fwd.default" if stage == "post_grad_fwd" else "te_passes.delayed_linear_bwd.default"
    i = 1 if stage == "post_grad_fwd" else 0
    rounded = [n for n in _named(graph, op) if n.args[i].target is CONVERT]
    assert len(rounded) == 1 and rounded[0].args[i].args[0].meta["val"].dtype == torch.float32
    gm, run = _run(aot, stage)
    assert not run.changed, run
    argument = "inp" if i else "grad_output"
    assert [(r.kind, r.node, r.data["reason"]) for r in run.records] == [
        ("kept", rounded[0].name, f"its {argument} is rounded from fp32 outside te_passes' LayerNormMLP activation: "
         "TE eager quantizes the rounded value too")]
    assert all(n.args[i].target is CONVERT for n in _named(gm, op) if n.name == rounded[0].name)


def test_bias_gradient_comes_back_in_the_activation_dtype():
    """``grads_in_fake_dtypes``: TE's ``bgrad_quantize`` on an fp32 grad output returns an fp32
    bias gradient, the fake says the activation dtype: cast; a wgrad / dgrad in a third dtype is
    refused with the names."""
    from te_passes.runtime.delayed.linear import grads_in_fake_dtypes

    cfg = {"simple": {"activation_dtype": torch.bfloat16}}
    w, d = torch.ones(4, 4, dtype=torch.bfloat16), torch.ones(2, 4, dtype=torch.bfloat16)
    b = torch.tensor([1.0, 2.0 ** -9 + 1.0, 3.0, 4.0])
    wg, dg, bg = grads_in_fake_dtypes((w, d, b), cfg)
    assert wg is w and dg is d and bg.dtype == torch.bfloat16 and bg.tolist() == [1.0, 1.0, 3.0, 4.0]
    assert grads_in_fake_dtypes((w, d, None), cfg)[2] is None
    with pytest.raises(RuntimeError, match="TE's dgrad is torch.float16, its fake torch.bfloat16"):
        grads_in_fake_dtypes((w, d.half(), b), cfg)
    with pytest.raises(RuntimeError, match="TE's wgrad is torch.float32, its fake torch.bfloat16"):
        grads_in_fake_dtypes((w.float(), d, b), cfg)  # both GEMMs write the activation dtype


def test_another_user_of_the_norm_output_gets_the_bf16_copy():
    """A user of the norm output besides the linear (here the graph returns it too, as a module
    returning its norm output would; the untouched polyfill keeps ``return_layernorm_output`` an
    island): it gets ``y`` converted back to bf16 (one convert, after ``y``); the linear keeps the
    fp32 ``y``; the graph's outputs keep their dtypes."""
    aot = _aot("LayerNormLinear")
    fw = aot.forward
    (norm0,) = _named(fw, NORM)
    y0 = next(u for u in norm0.users if u.target is operator.getitem and u.args[1] == 0)
    out = fw.graph.output_node()
    out.args = ((*out.args[0], y0),)
    fw.recompile()
    before = [a.meta["val"].dtype for a in outs_of(fw)]
    gm, run = _run(aot)
    assert [r.kind for r in run.records] == ["widened"], run.records
    (norm,) = _named(gm, NORM)
    y = next(u for u in norm.users if u.target is operator.getitem and u.args[1] == 0)
    (lin,) = _named(gm, LINEAR)
    narrow = [u for u in y.users if u.target is CONVERT]
    assert len(narrow) == 1 and narrow[0].args == (y, torch.bfloat16) and set(y.users) == {lin, narrow[0]}
    assert lin.args[1] is y and outs_of(gm)[-1] is narrow[0] and y not in outs_of(gm)
    assert [a.meta["val"].dtype for a in outs_of(gm)] == before
    gm.graph.lint()


@pytest.mark.parametrize("act", ["swiglu", "geglu", "silu"])
def test_gated_activation_gradient_keeps_its_rounding(act):
    """TE fuses the activation's backward with fc1's grad cast only where it has a ``dbias_d*``
    kernel (not for gated activations under DelayedScaling: TE eager computes their gradient in bf16
    and quantizes that, ``module/layernorm_mlp.py``). A gated activation: fc2 still takes the fp32
    activation (TE's forward fuses every activation with fc2's cast), fc1's backward keeps the bf16
    gradient, recorded; silu (fused): both rules fire."""
    aot = _aot(f"LayerNormMLP-{act}")
    _, fwd = _run(aot, "post_grad_fwd")
    assert [r.kind for r in fwd.records] == ["fed_fp32", "widened"], fwd.records
    gm, bwd = _run(aot, "post_grad_bwd")
    fc2_bwd, fc1_bwd = _named(gm, "te_passes.delayed_linear_bwd.default")
    if act == "silu":
        assert [(r.kind, r.node, r.data["argument"]) for r in bwd.records] == [("fed_fp32", fc1_bwd.name, "grad_output")]
        assert fc1_bwd.args[0].meta["val"].dtype == torch.float32
        return
    assert [(r.kind, r.node, r.data["reason"]) for r in bwd.records] == [
        ("kept", fc1_bwd.name, "its grad_output is a gated activation's gradient, which TE eager computes in bf16 "
         "and then quantizes (no fused dbias kernel under DelayedScaling)")]
    assert fc1_bwd.args[0].target is CONVERT and not bwd.changed


def test_a_graph_without_stack_traces_is_left_alone_and_says_so():
    """No ``meta["stack_trace"]`` (a graph rebuilt by a rewrite that dropped it): the pass cannot
    tell whose rounding it is, leaves it and records that, rather than a wrong reason."""
    aot = _aot("LayerNormMLP")
    for n in aot.backward.graph.nodes:
        n.meta.pop("stack_trace", None)
    gm, run = _run(aot, "post_grad_bwd")
    (fc2_bwd, fc1_bwd) = _named(gm, "te_passes.delayed_linear_bwd.default")
    assert [(r.kind, r.node, r.data["reason"]) for r in run.records] == [
        ("kept", fc1_bwd.name, "its grad_output is rounded from fp32 where the graph has no stack trace: "
         "cannot tell by whom")]
    assert not run.changed
