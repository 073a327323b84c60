"""widen_quantized_inputs: a te.Linear quantizes the values TE eager's fused norm / activation kernels
quantize under its recipe (``te.norm_act.FUSED_QUANTIZE``). DelayedScaling: the norm's output rebuilt
in fp32 from its statistics, LayerNormMLP's activation and its gradient from TE's kernels on fp32
copies; MXFP8: the activation and its gradient in fp32; Float8CurrentScaling: the bf16 activation
with the amax of its fp32 values; Float8BlockScaling: nothing (TE eager quantizes the bf16 values).

Real AOT forward / backward graphs of untouched te.LayerNormLinear / te.LayerNormMLP (CPU capture,
fake GPU: tests/runtime/test_delayed_linear.py's ``_capture``, ``testing.aot_capture.capture_aot``
for the other recipes), through the pass manager path the backend uses (``run_pipeline``): the exact
rewritten nodes, their fake values (a fresh fake propagation, TE's op fakes included), the nodes
left alone with their reason, the switch off. The numerics against TE eager (TE's kernels) are the
GPU tests': ``tests/gpu/test_llama_numerics_gpu.py`` and
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
LINEAR_BWD = "te_passes.delayed_linear_bwd.default"
ACT, ACT_BWD = "te_passes.te_act_fwd.default", "te_passes.te_act_bwd.default"
CONVERT = torch.ops.prims.convert_element_type.default
A = torch.ops.aten


def _aot(name, recipe=None, training=True):
    from tests.runtime.test_delayed_linear import BUILDS, _capture, _te

    if name == "stack-gelu":  # two te.Linears with torch's GELU between (the user's, not TE's)
        return _capture(("HYBRID", 16, "max"), 2)["aot"]
    if name.startswith("LayerNormMLP-"):  # another activation: "LayerNormMLP-swiglu"
        act = name.split("-", 1)[1]
        return _capture(("HYBRID", 16, "max"), 0, prepare=False, recipe=recipe, build=lambda: _te().LayerNormMLP(
            64, 256, params_dtype=torch.bfloat16, device="cuda", activation=act))["aot"]
    if name.startswith("LayerNormLinear-"):  # "LayerNormLinear-RMSNorm", "LayerNormLinear-LayerNorm-zcg"
        _, normalization, *zcg = name.split("-")
        return _capture(("HYBRID", 16, "max"), 0, prepare=False, recipe=recipe, training=training,
                        build=lambda: _te().LayerNormLinear(64, 64, params_dtype=torch.bfloat16, device="cuda",
                                                            normalization=normalization,
                                                            zero_centered_gamma=bool(zcg)))["aot"]
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
    return rep.gm, next(r for r in rep.runs if r.name == "widen_quantized_inputs")


def outs_of(gm):
    return [a for a in gm.graph.output_node().args[0] if isinstance(a, torch.fx.Node)]


def _named(gm, name):
    return [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) == name]



def _getitem(node, k):
    return next(u for u in node.users if u.target is operator.getitem and u.args[1] == k)


def _ev(node, env):
    """Evaluate the nodes behind ``node`` on CPU tensors (``env``: node -> value at the leaves)."""
    if node in env:
        return env[node]
    if not isinstance(node, torch.fx.Node):
        return node
    return node.target(*torch.fx.map_arg(node.args, lambda a: _ev(a, env)))


def _check_rebuilt(gm, norm, y32, rms=False, zcg=False):
    """``y32`` is TE's norm formula over the norm node's own input, weight, bias and statistics,
    node for node, fp32; evaluated on CPU it equals torch's fp32 norm of the same input."""
    x, w, b = norm.args[:3]
    mu, rs = None if rms else _getitem(norm, 1), _getitem(norm, 2)
    f32 = lambda n: n.target is CONVERT and n.args[1] == torch.float32  # noqa: E731
    if not rms:
        assert y32.target is A.add.Tensor and f32(y32.args[1]) and y32.args[1].args[0] is b
        prod = y32.args[0]
    else:
        prod = y32
    assert prod.target is A.mul.Tensor
    g, yn = prod.args
    if zcg:
        assert g.target is A.add.Tensor and g.args[1] == 1.0
        g = g.args[0]
    assert f32(g) and g.args[0] is w
    assert yn.target is A.mul.Tensor and yn.args[0].target is A.unsqueeze.default and yn.args[0].args == (rs, -1)
    centred = yn.args[1]
    if rms:
        assert f32(centred) and centred.args[0] is x
    else:
        assert centred.target is A.sub.Tensor and f32(centred.args[0]) and centred.args[0].args[0] is x
        assert centred.args[1].target is A.unsqueeze.default and centred.args[1].args == (mu, -1)
    assert y32.meta["val"].dtype == y32.meta["tensor_meta"].dtype == torch.float32
    assert y32.meta["val"].shape == x.meta["val"].shape
    gen = torch.Generator().manual_seed(0)
    shape = tuple(x.meta["val"].shape)
    xv = (torch.randn(shape, generator=gen) * 3 + 0.5).bfloat16()
    wv = (torch.rand(shape[-1], generator=gen) + 0.5).bfloat16()
    bv = (torch.randn(shape[-1], generator=gen) * 0.1).bfloat16()
    xf = xv.float()
    eps = norm.args[3]
    var = xf.square().mean(-1) if rms else xf.var(-1, unbiased=False)
    env = {x: xv, w: wv, b: bv, mu: xf.mean(-1), rs: torch.rsqrt(var + eps)}
    want = (torch.nn.functional.rms_norm(xf, shape[-1:], wv.float() + zcg, eps) if rms else
            torch.nn.functional.layer_norm(xf, shape[-1:], wv.float() + zcg, bv.float(), eps))
    torch.testing.assert_close(_ev(y32, env), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["LayerNormLinear", "LayerNormMLP"])
def test_delayed_linears_take_fp32_inputs(name):
    """The first linear takes the norm output rebuilt in fp32 from the norm's statistics (the norm
    and its bf16 output stay for the graph's outputs); LayerNormMLP's fc2 takes TE's activation
    kernel run on an fp32 copy of fc1's output."""
    aot = _aot(name)
    before = aot.copy()
    gm, run = _run(aot)
    assert run.status == "ok" and run.changed, run
    (norm,) = _named(gm, NORM)
    assert [a.name if isinstance(a, torch.fx.Node) else a for a in norm.args] == [
        a.name if isinstance(a, torch.fx.Node) else a for a in _named(before.forward, NORM)[0].args]  # untouched
    y = _getitem(norm, 0)
    assert y.meta["val"].dtype == torch.bfloat16
    lins = _named(gm, LINEAR)
    fc1 = lins[0]
    y32 = fc1.args[1]
    _check_rebuilt(gm, norm, y32)
    want = [("fed_fp32", fc1.name, {"value": y32.name, "skipped": y.name, "argument": "inp",
                                    "source": "te_passes::te_norm_fwd", "quantizer": "Float8Quantizer"})]
    if name == "LayerNormMLP":
        fc2 = lins[1]
        (act,) = _named(gm, ACT)
        assert fc2.args[1] is act and act.meta["val"].dtype == torch.float32
        h = act.args[0]
        assert h.target is CONVERT and h.args == (fc1_out := h.args[0], torch.float32)
        assert fc1_out.meta["val"].dtype == torch.bfloat16 and act.args[1:] == _named(before.forward, ACT)[0].args[1:]
        assert set(act.users) == {fc2}  # no other user: no bf16 copy
        want += [("widened", act.name, {"dtype": "bfloat16"}),
                 ("fed_fp32", fc2.name, {"value": act.name, "argument": "inp", "source": "te_passes::te_act_fwd",
                                         "quantizer": "Float8Quantizer"})]
    assert [(r.kind, r.node, r.data) for r in run.records] == want
    # the graph's outputs keep their dtypes, so the backward graph is unchanged
    assert [a.meta["val"].dtype for a in outs_of(gm)] == [a.meta["val"].dtype for a in outs_of(before.forward)]
    gm.graph.lint()


@pytest.mark.parametrize("normalization,zcg", [("RMSNorm", False), ("LayerNorm", True), ("RMSNorm", True)])
def test_rmsnorm_and_zero_centered_gamma(normalization, zcg):
    aot = _aot("LayerNormLinear-" + normalization + ("-zcg" if zcg else ""))
    gm, run = _run(aot)
    (norm,) = _named(gm, NORM)
    (lin,) = _named(gm, LINEAR)
    assert norm.args[4] is (normalization == "RMSNorm") and norm.args[5] is zcg
    _check_rebuilt(gm, norm, lin.args[1], rms=normalization == "RMSNorm", zcg=zcg)
    assert [r.kind for r in run.records] == ["fed_fp32"]


def test_switched_off():
    aot = _aot("LayerNormMLP")
    gm, run = _run(aot, **{"te_passes.disable": ["widen_quantized_inputs"]})
    assert run.status == "disabled", run
    assert all(lin.args[1].target in (operator.getitem, torch.ops.te_passes.te_act_fwd.default)
               for lin in _named(gm, LINEAR)) and not [n for n in gm.graph.nodes if n.target is CONVERT]


def test_fp32_values_kept_with_the_reason():
    """An fp32 model has nothing to widen: the record says why, the graph is unchanged."""
    aot = _aot("LayerNormLinear")
    (norm,) = _named(aot.forward, NORM)
    for n in (norm.args[0], _getitem(norm, 0)):
        n.meta["val"] = n.meta["val"].to(torch.float32)
    gm, run = _run(aot)
    (lin,) = _named(gm, LINEAR)
    assert [(r.kind, r.node, r.data["reason"]) for r in run.records] == [
        ("kept", lin.name, "its inp is torch.float32: nothing to widen")]
    assert not run.changed and lin.args[1] is _getitem(_named(gm, NORM)[0], 0)


@pytest.mark.parametrize("stage", ["post_grad_fwd", "post_grad_bwd"])
def test_second_run_changes_nothing(stage):
    """Run twice (a re-lowering, a replay): the rebuilt / widened values are recognised, no edit,
    no record."""
    from te_passes.passes.widen_quantized_inputs import WidenQuantizedInputs
    from te_passes.testing.harness import run_passes

    gm, run = _run(_aot("LayerNormMLP"), stage)
    assert run.changed
    again = run_passes(gm, WidenQuantizedInputs(), stage)
    (rerun,) = again.report.runs
    assert rerun.status == "ok" and not rerun.changed and rerun.records == []
    assert again.after_code == again.before_code


def test_fc1_grad_output_is_the_fp32_activation_gradient():
    """The backward rule, on LayerNormMLP's real AOT backward graph: the activation's backward op
    (TE's dgelu) runs on fp32 copies of fc2's dgrad and fc1's output, and fc1's backward op takes
    its fp32 gradient (TE eager's fused ``dbias_dgelu`` quantizes it from fp32); fc2's backward op
    (its grad output is the graph's bf16 tangent) is untouched; the op's outputs keep their fake
    dtypes (bias gradient bf16: ``grads_in_fake_dtypes``)."""
    aot = _aot("LayerNormMLP")
    before = aot.copy()
    (dact0,) = _named(before.backward, ACT_BWD)
    bwd0 = _named(before.backward, LINEAR_BWD)
    assert bwd0[1].args[0] is dact0 and dact0.meta["val"].dtype == torch.bfloat16
    gm, run = _run(aot, "post_grad_bwd")
    assert run.status == "ok" and run.changed, run
    fc2_bwd, fc1_bwd = _named(gm, LINEAR_BWD)
    (dact,) = _named(gm, ACT_BWD)
    assert fc2_bwd.args[0].op == "placeholder" and fc2_bwd.args[0].name == bwd0[0].args[0].name
    assert fc1_bwd.args[0] is dact and dact.meta["val"].dtype == torch.float32
    for a, old in zip(dact.args[:2], dact0.args[:2]):
        assert a.target is CONVERT and a.args[1] == torch.float32 and a.args[0].name == old.name
    assert dact.args[2:] == dact0.args[2:] == ("gelu", 7.0, 1.702, 1.0)
    assert [(r.kind, r.node, r.data) for r in run.records] == [
        ("widened", dact.name, {"dtype": "bfloat16"}),
        ("fed_fp32", fc1_bwd.name, {"value": dact.name, "argument": "grad_output", "source": "te_passes::te_act_bwd",
                                    "quantizer": "Float8Quantizer"})]
    gm.graph.lint()


@pytest.mark.parametrize("stage", ["post_grad_fwd", "post_grad_bwd"])
def test_a_users_torch_activation_keeps_its_rounding(stage):
    """te.Linear -> torch GELU (bf16) -> te.Linear: Inductor's GELU also computes in fp32 and
    rounds, but TE eager quantizes that bf16 rounding (the user's GELU is no TE kernel): the
    linear keeps it, and the record says why."""
    aot = _aot("stack-gelu")
    graph = aot.forward if stage == "post_grad_fwd" else aot.backward
    op = LINEAR if stage == "post_grad_fwd" else LINEAR_BWD
    i = 1 if stage == "post_grad_fwd" else 0
    rounded = [n for n in _named(graph, op) if n.args[i].target is CONVERT]
    assert len(rounded) == 1 and rounded[0].args[i].args[0].meta["val"].dtype == torch.float32
    gm, run = _run(aot, stage)
    assert not run.changed, run
    argument = "inp" if i else "grad_output"
    assert [(r.kind, r.node, r.data["reason"]) for r in run.records] == [
        ("kept", rounded[0].name, f"its {argument} is rounded from fp32 by torch ops, not by one of TE's kernels "
         "(te_norm_fwd / te_act_fwd / te_act_bwd): a user's torch activation, whose rounded value TE eager "
         "quantizes too, or the torch-ops polyfills (TE_PASSES_UNTOUCHED_NORM=torch; te gives TE eager's numerics)")]


def test_bias_gradient_comes_back_in_the_activation_dtype():
    """``grads_in_fake_dtypes``: TE's ``bgrad_quantize`` on an fp32 grad output returns an fp32
    bias gradient, the fake says the activation dtype: cast; a wgrad / dgrad in a third dtype is
    refused with the names."""
    from te_passes.compat.delayed_scaling.linear import grads_in_fake_dtypes

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


def test_other_users_keep_the_bf16_values():
    """Users besides the linears (here the graph returns the norm output and the activation, as a
    module returning them would): the norm's bf16 output stays theirs; the widened activation gives
    them one bf16 copy right after it; the linears take the fp32 values; outputs keep their dtypes."""
    aot = _aot("LayerNormMLP")
    fw = aot.forward
    (norm0,) = _named(fw, NORM)
    (act0,) = _named(fw, ACT)
    out = fw.graph.output_node()
    out.args = ((*out.args[0], _getitem(norm0, 0), act0),)
    fw.recompile()
    before = [a.meta["val"].dtype for a in outs_of(fw)]
    gm, run = _run(aot)
    assert [r.kind for r in run.records] == ["fed_fp32", "widened", "fed_fp32"], run.records
    (norm,) = _named(gm, NORM)
    (act,) = _named(gm, ACT)
    fc1, fc2 = _named(gm, LINEAR)
    narrow = [u for u in act.users if u.target is CONVERT]
    assert len(narrow) == 1 and narrow[0].args == (act, torch.bfloat16) and set(act.users) == {fc2, narrow[0]}
    assert narrow[0].prev is act
    assert outs_of(gm)[-2:] == [_getitem(norm, 0), narrow[0]] and fc2.args[1] is act
    assert fc1.args[1] is not _getitem(norm, 0)
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
    assert [r.kind for r in fwd.records] == ["fed_fp32", "widened", "fed_fp32"], fwd.records
    gm, bwd = _run(aot, "post_grad_bwd")
    fc2_bwd, fc1_bwd = _named(gm, LINEAR_BWD)
    if act == "silu":
        assert [(r.kind, r.data.get("argument")) for r in bwd.records] == [("widened", None),
                                                                            ("fed_fp32", "grad_output")]
        assert fc1_bwd.args[0].meta["val"].dtype == torch.float32
        return
    assert [(r.kind, r.node, r.data["reason"]) for r in bwd.records] == [
        ("kept", fc1_bwd.name, f"its grad_output is the gradient of {act!r}, which TE eager computes in bfloat16 "
         "and then quantizes (no fused dbias kernel under DelayedScaling)")]
    assert op_name(fc1_bwd.args[0]) == ACT_BWD and not bwd.changed


def test_torch_ops_polyfills_are_kept_and_say_how_to_match_te(monkeypatch):
    """``TE_PASSES_UNTOUCHED_NORM=torch``: the norm and activation in torch ops; the pass cannot
    tell a polyfill's rounding from a user's, keeps both, and the reason names the switch."""
    monkeypatch.setenv("TE_PASSES_UNTOUCHED_NORM", "torch")
    gm, run = _run(_aot("LayerNormMLP"))
    assert not _named(gm, NORM) and not _named(gm, ACT) and not run.changed
    assert [r.kind for r in run.records] == ["kept", "kept"]
    assert all("TE_PASSES_UNTOUCHED_NORM=torch" in r.data["reason"] for r in run.records)


def op_name(node):
    return str(node.target)


@pytest.mark.parametrize("act,stage", [("gelu", "post_grad_fwd"), ("swiglu", "post_grad_fwd"),
                                       ("gelu", "post_grad_bwd"), ("silu", "post_grad_bwd")])
def test_metadata_is_what_fake_propagation_gives(act, stage):
    """Every node's ``meta["val"]`` after the pass (the new nodes', the widened op's, and the
    delayed ops' own: their fakes now see fp32 arguments) equals a fresh fake propagation of the
    rewritten graph, shape and dtype."""
    import torch.utils._pytree as pytree
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from te_passes.testing.fake_gpu import fake_gpu, quiet

    def sig(v):
        return [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t for t in pytree.tree_leaves(v)]

    gm, run = _run(_aot(f"LayerNormMLP-{act}"), stage)
    assert run.changed
    old = {n: sig(n.meta.get("val")) for n in gm.graph.nodes if n.op == "call_function"}
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with quiet(), fake_gpu("fp8-cs"):
        inputs = [mode.from_tensor(p.meta["val"]) if isinstance(p.meta.get("val"), torch.Tensor) else p.meta.get("val")
                  for p in gm.graph.nodes if p.op == "placeholder"]
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
    assert {n.name: sig(n.meta.get("val")) for n in old} == {n.name: v for n, v in old.items()}


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_inference_graph_without_the_statistics(normalization):
    """A no-grad graph drops the norm's unused mean / rsigma getitems: the pass adds the one it
    needs (rsigma; LayerNorm also mu) with the norm's own fake values."""
    aot = _aot(f"LayerNormLinear-{normalization}", training=False)
    (norm0,) = _named(aot.forward, NORM)
    assert {u.args[1] for u in norm0.users} == {0}
    gm, run = _run(aot)
    assert run.status == "ok" and [r.kind for r in run.records] == ["fed_fp32"], run
    (norm,) = _named(gm, NORM)
    (lin,) = _named(gm, LINEAR)
    rms = normalization == "RMSNorm"
    assert {u.args[1] for u in norm.users} == ({0, 2} if rms else {0, 1, 2})
    _check_rebuilt(gm, norm, lin.args[1], rms=rms)
    gm.graph.lint()


def test_linears_sharing_the_norm_output_in_any_user_order():
    """Two delayed linears take one norm output, the later one first in ``y.users`` (an earlier
    rewrite re-pointed it): one rebuilt value, defined before both."""
    aot = _aot("LayerNormLinear")
    fw = aot.forward
    (lin,) = _named(fw, LINEAR)
    y = lin.args[1]
    with fw.graph.inserting_before(lin):
        tmp = fw.graph.call_function(A.clone.default, (y,))
        tmp.meta = dict(y.meta)
        lin2 = fw.graph.node_copy(lin, lambda n: tmp if n is y else n)
        out2 = fw.graph.call_function(operator.getitem, (lin2, 0))
        out2.meta["val"] = lin2.meta["val"][0]
    out = fw.graph.output_node()
    out.args = ((*out.args[0], out2),)
    lin2.replace_input_with(tmp, y)
    fw.graph.erase_node(tmp)
    fw.recompile()
    assert [u.name for u in y.users][:2] == [lin.name, lin2.name] and lin2.next is not lin
    gm, run = _run(aot)
    assert run.status == "ok", run
    first, second = _named(gm, LINEAR)
    assert first.args[1] is second.args[1] and [r.kind for r in run.records] == ["fed_fp32", "fed_fp32"]
    gm.graph.lint()  # every argument defined before its user


# --------------------------------------------------------------------------- the other recipes
TE_LINEAR, TE_LINEAR_BWD = "transformer_engine_compile.linear.default", "transformer_engine_compile.linear_backward.default"


def _aot_te(module, precision, **kw):
    """AOT graphs of an untouched ``module`` (``layernorm_mlp`` / ``layernorm_linear``, hidden 64) under
    ``precision`` (``fp8-cs``: Float8CurrentScaling on a fake Hopper; ``mxfp8``: MXFP8BlockScaling on a
    fake Blackwell): TE's own te.Linear ops (``transformer_engine_compile::linear``)."""
    from te_passes.testing.aot_capture import capture_aot

    return capture_aot(module, precision, 1, hidden=64, **kw)


def _te_linears(gm, bwd=False):
    ops = {"transformer_engine_compile::linear_backward", "transformer_engine_compile::linear_backward_base"} if bwd \
        else {"transformer_engine_compile::linear", "transformer_engine_compile::linear_base"}
    from te_passes.fx.graph import op_qualname

    return [n for n in gm.graph.nodes if n.op == "call_function" and op_qualname(n.target) in ops]


def _fake_repropagates(gm, precision):
    """Every call node's ``meta["val"]`` equals a fresh fake propagation of ``gm`` (shapes, dtypes)."""
    import torch.utils._pytree as pytree
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from te_passes.testing.fake_gpu import fake_gpu, quiet

    def sig(v):
        return [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t for t in pytree.tree_leaves(v)]

    old = {n: sig(n.meta.get("val")) for n in gm.graph.nodes if n.op == "call_function"}
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with quiet(), fake_gpu(precision):
        inputs = [mode.from_tensor(p.meta["val"]) if isinstance(p.meta.get("val"), torch.Tensor) else p.meta.get("val")
                  for p in gm.graph.nodes if p.op == "placeholder"]
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
    assert {n.name: sig(n.meta.get("val")) for n in old} == {n.name: v for n, v in old.items()}


def _check_amax_matched(value, act):
    """``value`` is ``where(|a| == m, a, clamp(r, -m, m))``, ``m = amax(|a|)``, ``r`` the bf16 rounding
    of ``a`` in integer ops (``fx.rounding.rounded_like``), node for
    node, over the widened activation ``act``; every inserted op has an Inductor lowering (a post-grad pass
    inserts after the decompositions ran: Inductor refuses to fall back to an op it decomposes)."""
    assert value.target is A.where.self
    top, a, clamped = value.args
    assert a is act and top.target is A.eq.Tensor
    mag, m = top.args
    assert mag.target is A.abs.default and mag.args == (act,)
    assert m.target is A.amax.default and m.args == (mag,)
    # clamp(x, -m, m) as minimum(maximum(x, -m), m): ops Inductor lowers after its decompositions ran
    assert clamped.target is A.minimum.default and clamped.args[1] is m
    low = clamped.args[0]
    assert low.target is A.maximum.default
    assert low.args[1].target is A.neg.default and low.args[1].args == (m,)
    r32 = low.args[0]  # where(act != act, act, view(bits rounded, fp32)): no convert pair (Inductor elides one)
    assert r32.target is A.where.self and r32.args[1] is act
    assert r32.args[0].target is A.ne.Tensor and r32.args[0].args == (act, act)
    back = r32.args[2]
    assert back.target is A.view.dtype and back.args[1] == torch.float32
    masked = back.args[0]
    assert masked.target is A.bitwise_and.Scalar and masked.args[1] == -(1 << 16)
    up = masked.args[0]
    assert up.target is A.add.Tensor and up.args[0].target is A.add.Tensor and up.args[0].args[1] == 0x7FFF
    bits = up.args[0].args[0]
    assert bits.target is A.view.dtype and bits.args == (act, torch.int32)
    assert not any(n.target is CONVERT and n.args[0] is act for n in act.users)
    assert value.meta["val"].dtype == torch.float32 and value.meta["val"].shape == act.meta["val"].shape
    _assert_inductor_lowers(value, stop=act)


def _assert_inductor_lowers(node, stop):
    """Every aten op from ``node`` back to ``stop`` has an Inductor lowering (the GPU failure of
    aten.clamp.Tensor, H100 2026-12-07: "both a fallback and a decomp for same op")."""
    from torch._inductor import lowering as L

    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n is stop or n in seen or n.op != "call_function":
            continue
        seen.add(n)
        if isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "aten":
            assert n.target in L.lowerings, n.target  # else Inductor falls back, and refuses a decomposed op
        todo += [a for a in n.all_input_nodes]


@pytest.mark.parametrize("act", ["swiglu", "gelu"])
def test_current_scaling_activation_takes_its_fp32_amax(act):
    """Float8CurrentScaling: TE's activation kernel writes bf16 and the amax of its fp32 values, which
    fc2's cast uses (``FUSED_ACTIVATION_AMAX_FP8``). fc2 (TE's ``linear`` op) takes the bf16 values,
    as fp32, whose amax is the fp32 one; the norm output (TE's kernel: amax of the bf16 values) and
    the whole backward (TE computes the gradient in bf16, then quantizes it) stay."""
    aot = _aot_te("layernorm_mlp", "fp8-cs", activation=act, bias=False)
    before = aot.copy()
    gm, run = _run(aot)
    assert run.status == "ok" and run.changed, run
    fc1, fc2 = _te_linears(gm)
    (norm,) = _named(gm, NORM)
    assert fc1.args[3] is _getitem(norm, 0)  # the norm rule does not apply
    (a,) = _named(gm, ACT)
    assert a.meta["val"].dtype == torch.float32 and a.args[0].target is CONVERT
    value = fc2.args[3]
    _check_amax_matched(value, a)
    assert [(r.kind, r.node, r.data) for r in run.records] == [
        ("widened", a.name, {"dtype": "bfloat16"}),
        ("fed_fp32_amax", fc2.name, {"value": value.name, "skipped": a.name, "argument": "inp",
                                     "source": "te_passes::te_act_fwd", "quantizer": "Float8CurrentScalingQuantizer"})]
    assert [o.meta["val"].dtype for o in outs_of(gm)] == [o.meta["val"].dtype for o in outs_of(before.forward)]
    gm.graph.lint()
    _fake_repropagates(gm, "fp8-cs")
    gm_b, run_b = _run(aot, "post_grad_bwd")
    assert run_b.status == "ok" and not run_b.changed and run_b.records == [], run_b


def test_current_scaling_value_casts_like_te():
    """The rewritten value, evaluated on CPU for an activation whose amax is not a bf16 value: its amax
    is the fp32 amax (TE's kernel's), every other element is the bf16 rounding TE's kernel writes,
    and the FP8 (E4M3, TE's saturating cast) of ``value * scale`` equals that of ``bf16(a) * scale``
    byte for byte (``scale = 448 / amax``: ``compute_scale_from_amax``); TE's quantizer, fed the bf16
    values, would have scaled by their own, other, amax."""
    aot = _aot_te("layernorm_mlp", "fp8-cs", activation="gelu", bias=False)
    gm, _ = _run(aot)
    (a,) = _named(gm, ACT)
    value = _te_linears(gm)[1].args[3]
    gen = torch.Generator().manual_seed(3)
    a32 = (torch.randn(tuple(a.meta["val"].shape), generator=gen) * 2).clamp(-6, 6)
    a32.view(-1)[5] = 7.0234375  # the amax, between the bf16 values 7.0 and 7.03125 (rounds up)
    a32.view(-1)[9] = -7.02  # below the amax, but its bf16 rounding (-7.03125) is above: clamped
    got = _ev(value, {a: a32})
    m = a32.abs().amax()
    a16 = a32.bfloat16().float()
    assert got.abs().amax() == m and a16.abs().amax() != m
    assert torch.equal(got.view(-1)[:5], a16.view(-1)[:5]) and got.view(-1)[5] == m and got.view(-1)[9] == -m

    def fp8(t, amax):
        s = torch.tensor(448.0) / amax
        return (t * s).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)

    assert torch.equal(fp8(got, got.abs().amax()), fp8(a16, m))  # TE eager: bf16 values, fp32 amax
    assert not torch.equal(fp8(a16, a16.abs().amax()), fp8(a16, m))  # the split without the rule


def _subgraph(out, leaf, example):
    """A GraphModule computing ``out`` from one placeholder standing for ``leaf`` (``example``: its value)."""
    g, env = torch.fx.Graph(), {}
    env[leaf] = g.placeholder("a")
    env[leaf].meta["val"] = example

    def copy(n):
        if n not in env:
            for a in n.all_input_nodes:
                copy(a)
            env[n] = g.node_copy(n, lambda a: env[a])
        return env[n]

    g.output(copy(out))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_current_scaling_value_compiled_by_inductor_casts_like_te():
    """The same value compiled by Inductor (CPU): Inductor keeps a bf16 intermediate of a fused kernel in
    fp32, so a ``convert`` pair would be no rounding at all (the GPU failure of session 19: fc2's FP8
    input was the fp32 activation's; fc2_weight's gradient 2.4e-2 from TE eager); the integer rounding
    gives TE eager's FP8 bytes."""
    aot = _aot_te("layernorm_mlp", "fp8-cs", activation="gelu", bias=False)
    gm, _ = _run(aot)
    (a,) = _named(gm, ACT)
    value = _te_linears(gm)[1].args[3]
    gen = torch.Generator().manual_seed(4)
    a32 = torch.randn(tuple(a.meta["val"].shape), generator=gen) * 3
    a32.view(-1)[7] = 9.0234375  # the amax, not a bf16 value
    sub = _subgraph(value, a, a32)
    got = torch.compile(sub, backend="inductor", fullgraph=True)(a32)
    m = a32.abs().amax()
    want = torch.where(a32.abs() == m, a32, a32.bfloat16().float().clamp(-m, m))
    assert torch.equal(got, want), (got != want).sum()
    assert not torch.equal(got, a32)  # rounded (the convert pair compiled to a32 itself)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounded_like_is_a_store_under_inductor(dtype):
    """``rounded_like`` compiled by Inductor equals ``x.to(dtype).float()`` bit for bit: ties to even,
    fp16 subnormals and overflow to infinity, infinities and NaN kept; a convert pair would not."""
    from te_passes.fx.journal import GraphJournal
    from te_passes.fx.rounding import rounded_like

    gen = torch.Generator().manual_seed(5)
    x = torch.cat([torch.randn(4096, generator=gen) * s for s in (1e-6, 1e-3, 1.0, 300.0, 7e4)])
    one = 1.0 + 2.0 ** -8 if dtype is torch.bfloat16 else 1.0 + 2.0 ** -11  # ties: 1 + half an ulp
    x = torch.cat([x, torch.tensor([one, -one, 3 * one - 2, 65519.0, 65520.0, -65520.0, 2.0 ** -25, 3 * 2.0 ** -25,
                                    float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 3.4e38])])
    g = torch.fx.Graph()
    p = g.placeholder("x")
    p.meta["val"] = torch._subclasses.FakeTensorMode().from_tensor(x)
    out = g.output(None)
    r = rounded_like(GraphJournal(), p, dtype, out)
    out.args = (r,)
    got = torch.compile(torch.fx.GraphModule(torch.nn.Module(), g), backend="inductor", fullgraph=True)(x)
    want = x.to(dtype).float()
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~got.isnan()], want[~want.isnan()])
    with pytest.raises(ValueError, match="bf16 / fp16 only"):
        rounded_like(GraphJournal(), p, torch.float32, out)


def test_current_scaling_layernorm_linear_untouched():
    """Float8CurrentScaling's norm kernel takes the amax of the bf16 values it writes: the split's
    bf16 norm output is what TE eager quantizes; nothing to do, nothing recorded."""
    aot = _aot_te("layernorm_linear", "fp8-cs")
    gm, run = _run(aot)
    assert run.status == "ok" and not run.changed and run.records == [], run


@pytest.mark.parametrize("act", ["gelu", "swiglu"])
def test_mxfp8_activation_and_gradient_in_fp32(act):
    """MXFP8: TE's activation kernel writes MXFP8 from its fp32 values (``FULLY_FUSED``) and its
    ``dbias_d*`` backward (gelu; not the gated swiglu) too; the norm runs unfused (bf16, then
    quantized). fc2 takes the fp32 activation; fc1's backward the fp32 gradient for gelu."""
    aot = _aot_te("layernorm_mlp", "mxfp8", activation=act, bias=False)
    gm, run = _run(aot)
    fc1, fc2 = _te_linears(gm)
    (norm,) = _named(gm, NORM)
    (a,) = _named(gm, ACT)
    assert fc1.args[3] is _getitem(norm, 0) and fc2.args[3] is a and a.meta["val"].dtype == torch.float32
    assert [(r.kind, r.node, r.data) for r in run.records] == [
        ("widened", a.name, {"dtype": "bfloat16"}),
        ("fed_fp32", fc2.name, {"value": a.name, "argument": "inp", "source": "te_passes::te_act_fwd",
                                "quantizer": "MXFP8Quantizer"})]
    _fake_repropagates(gm, "mxfp8")
    gm_b, run_b = _run(aot, "post_grad_bwd")
    fc2_b, fc1_b = _te_linears(gm_b, bwd=True)
    (da,) = _named(gm_b, ACT_BWD)
    if act == "swiglu":
        assert not run_b.changed and [(r.kind, r.node, r.data["reason"]) for r in run_b.records] == [
            ("kept", fc1_b.name, "its grad_output is the gradient of 'swiglu', which TE eager computes in bfloat16 "
             "and then quantizes (no fused dbias kernel under MXFP8BlockScaling)")]
        return
    assert fc1_b.args[0] is da and da.meta["val"].dtype == torch.float32
    assert [(r.kind, r.node) for r in run_b.records] == [("widened", da.name), ("fed_fp32", fc1_b.name)]
    _fake_repropagates(gm_b, "mxfp8")


def test_mxfp8_gradient_with_a_bias_is_kept():
    """With a bias TE's ``linear_backward`` would return fc1's bias gradient in the fp32 grad output's
    dtype (its fake: bf16): the gradient rule is left out, with the reason; the forward rule applies."""
    aot = _aot_te("layernorm_mlp", "mxfp8", activation="gelu", bias=True)
    _, run = _run(aot)
    assert [r.kind for r in run.records] == ["widened", "fed_fp32"]
    gm_b, run_b = _run(aot, "post_grad_bwd")
    assert not run_b.changed
    assert [(r.kind, r.data["reason"]) for r in run_b.records] == [
        ("kept", "its grad_output would be fp32 and TE's linear_backward then returns the bias gradient in fp32 "
         "where its fake says the activation dtype (a bias with a dbias-fused activation)")]


def test_block_scaling_untouched():
    """Float8BlockScaling: TE eager normalizes and activates in bf16 and quantizes that (no fused
    path): nothing to do in either graph, nothing recorded."""
    from transformer_engine.common import recipe as R

    aot = _aot("LayerNormMLP", recipe=R.Float8BlockScaling())
    for stage in ("post_grad_fwd", "post_grad_bwd"):
        gm, run = _run(aot, stage)
        assert run.status == "ok" and not run.changed and run.records == [], run
        assert _te_linears(gm, bwd=stage == "post_grad_bwd")


def test_mxfp8_cudnn_norm_is_named(monkeypatch):
    """``NVTE_NORM_FWD_USE_CUDNN=1``: TE eager's MXFP8 norm may run cuDNN's fused kernel from its own fp32
    values: not expressed, recorded with the reason."""
    monkeypatch.setenv("NVTE_NORM_FWD_USE_CUDNN", "1")
    _, run = _run(_aot_te("layernorm_linear", "mxfp8"))
    assert [(r.kind, r.data["reason"]) for r in run.records] == [
        ("kept", "NVTE_NORM_FWD_USE_CUDNN=1: TE eager's MXFP8 norm may run cuDNN's fused kernel (both dims multiples "
         "of 128), which quantizes its own fp32 values: not expressed")]
