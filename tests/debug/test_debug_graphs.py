"""TE-aware printing, field-level diffs, offline graph files and TE graph-break attribution, on
real TE 2.20.2 graphs (CPU capture, ``tests/conftest.py`` fixtures)."""

from __future__ import annotations

import pickle
import re

import pytest
import torch
import torch.fx

from te_passes.debug.diff import GraphSnapshot, graph_changes, unified_diff
from te_passes.debug.graph_io import GraphFileError, load_graph, save_graph
from te_passes.debug.printer import format_graph, node_fields
from te_passes.te import graph_model as gmod
from te_passes.te import graph_constants as gconst
from te_passes.compat.te220.fallbacks import classify_graph_break, fallback_reason_from_warning


def _te_node(gm):
    return next(n for n in gm.graph.nodes if gmod.is_te_op_node(n))


def test_printer_shows_storages_roles_and_config_fields(te_aot_graphs):
    aot = te_aot_graphs("fp8-cs")
    text = format_graph(aot.backward)
    assert "object at 0x" not in text and "OpaqueValueBundle(" not in text
    call = gmod.decode(_te_node(aot.backward))
    # every quantized buffer appears on its own line with its role and type
    for buf in call.quantized_buffers():
        t = buf.node.meta["val"]
        abbr = {torch.uint8: "u8", torch.float32: "f32"}[t.dtype]
        assert re.search(rf"^\s+{buf.inner_name}={buf.node.name},\s+# {buf.role.value} {abbr}\[", text, re.M), buf
    # every config field appears once as `key=value,` inside config={...}
    for key in call.config:
        assert len(re.findall(rf"^\s+{key}=", text, re.M)) == 1, key
    assert "grad_output_quantizer=Float8CurrentScalingQuantizer(" in text and "dtype=DType.kFloat8E5M2" in text
    # the saved input's quantizer (columnwise only): True flags by name, False ones left out
    q = call.tq_fields["inputmat"].quantizer
    assert (q.rowwise_usage, q.columnwise_usage) == (False, True)
    assert ("quantizer=Float8CurrentScalingQuantizer(columnwise_usage, internal, optimize_for_gemm, "
            "dtype=DType.kFloat8E4M3, amax_epsilon=0.0),") in text


def test_node_fields_and_diff_find_one_flipped_config_field(te_dynamo_graph):
    cg = te_dynamo_graph("fp8-cs")
    gm = cg.gm
    before = GraphSnapshot.take(gm)
    node = _te_node(gm)
    call = gmod.decode(node)
    cfg = dict(call.config)
    assert cfg["fp8_output"] is False
    cfg["fp8_output"] = True
    bundle_cls = type(call.config_slot.value)
    args = list(node.args)
    args[call.config_slot.index] = bundle_cls(cfg)
    node.args = tuple(args)
    after = GraphSnapshot.take(gm)
    ch = graph_changes(before, after)
    assert ch == {"added": [], "removed": [], "changed": [
        {"node": node.name, "field": "config.fp8_output", "before": "False", "after": "True"}]}
    # a quantizer flag: named down to the field
    mid = after
    q = cfg["input_quantizer"]
    items = dict(q._value_key()[1])
    items["amax_epsilon"] = 0.5
    from transformer_engine.pytorch.dynamo.quantizer_opaque import _rebuild_quantizer

    cfg2 = dict(cfg, input_quantizer=_rebuild_quantizer(type(q), tuple(items.items())))
    args[call.config_slot.index] = bundle_cls(cfg2)
    node.args = tuple(args)
    assert graph_changes(mid, GraphSnapshot.take(gm))["changed"] == [
        {"node": node.name, "field": "config.input_quantizer.amax_epsilon", "before": "0.0", "after": "0.5"}]
    patch = unified_diff(before.text, after.text)
    minus = [ln for ln in patch.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    plus = [ln for ln in patch.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    assert [m.strip() for m in minus] == ["-                fp8_output=False,".strip()]
    assert [p.strip() for p in plus] == ["+                fp8_output=True,".strip()]


@pytest.mark.parametrize("which", ["joint", "forward", "backward"])
def test_tegraph_round_trip_keeps_names_meta_and_te_constants(te_aot_graphs, tmp_path, which):
    aot = te_aot_graphs("fp8-cs")
    gm = aot.graphs()[which]
    path = tmp_path / f"{which}.tegraph"
    save_graph(path, gm, stage="post_grad_fwd", graph_id="g0.fwd", example_inputs=aot.forward_inputs)
    gm2, payload = load_graph(path)
    assert [n.name for n in gm2.graph.nodes] == [n.name for n in gm.graph.nodes]
    assert format_graph(gm2) == format_graph(gm)
    assert {n.name: node_fields(n) for n in gm2.graph.nodes} == {n.name: node_fields(n) for n in gm.graph.nodes}
    for a, b in zip(gm.graph.nodes, gm2.graph.nodes):
        va, vb = a.meta.get("val"), b.meta.get("val")
        if isinstance(va, torch.Tensor):
            assert (vb.shape, vb.dtype, vb.device, vb.stride()) == (va.shape, va.dtype, va.device, va.stride())
    # TE constants come back by value, with a hash valid in this process (TE caches it)
    for (n1, o1, k1), (n2, o2, k2) in zip(gconst.iter_te_constants(gm.graph), gconst.iter_te_constants(gm2.graph)):
        assert (n1.name, k1) == (n2.name, k2)
        if k1 in (gconst.TEConstKind.BUNDLE, gconst.TEConstKind.QUANTIZER):
            assert o2 == o1 and hash(o2) == hash(o1) and o2 is not o1
    assert [tuple(t.shape) for t in payload["example_inputs_fake"]] == [tuple(t.shape) for t in aot.forward_inputs]
    gm2.graph.lint()


def test_graphmodule_pickle_loses_the_meta_replay_needs(te_aot_graphs):
    """Why dumps save .tegraph files: a GraphModule pickles (TE's bundles and quantizers pickle),
    but it comes back re-traced from code, without node.meta (the fake values passes read)."""
    gm = te_aot_graphs("fp8-cs").forward
    gm2 = pickle.loads(pickle.dumps(gm))
    assert any("val" in n.meta for n in gm.graph.nodes)
    assert not any("val" in n.meta for n in gm2.graph.nodes)


def test_bad_graph_files(tmp_path):
    (tmp_path / "x.tegraph").write_bytes(pickle.dumps({"format": "something else"}))
    with pytest.raises(GraphFileError, match="not a te_passes graph file"):
        load_graph(tmp_path / "x.tegraph")
    with pytest.raises(GraphFileError, match="graph file not found"):
        load_graph(tmp_path / "missing.tegraph")


def test_graph_break_texts_name_te_eager_islands():
    # torch 2.14's texts (see tests/cli/test_cli.py for the real ones from Dynamo)
    disabled = ("Skip calling `torch.compiler.disable()`d function\n  Explanation: Skip calling function "
                "`<function LayerNormMLP.forward at 0x7f85d2672f20>` since it was wrapped with "
                "`torch.compiler.disable` (reason: None)")
    fb = classify_graph_break(disabled)
    assert (fb.module, fb.kind) == ("te.LayerNormMLP", "disabled_forward") and "@no_torch_dynamo" in fb.reason
    user = ("Call to `torch._dynamo.graph_break()`\n  Explanation: User-inserted graph break. Message: te.Linear "
            "falling back to eager: DelayedScaling recipe\n  Hint: ...")
    fb = classify_graph_break(user)
    assert (fb.module, fb.kind, fb.reason) == ("te.Linear", "linear_config", "DelayedScaling recipe")
    other = disabled.replace("LayerNormMLP.forward", "my_helper")
    assert classify_graph_break(other) is None
    assert classify_graph_break("Data-dependent branching") is None
    assert fallback_reason_from_warning("Falling back to eager execution under torch.compile: FP8 attention is "
                                        "unsupported on the compiled path (graph-breaks under fullgraph=True).") \
        == "FP8 attention"


def test_tegraph_keeps_symbolic_sizes(tmp_path):
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda x, w: torch.relu(x @ w).sum(0), tracing_mode="symbolic")(torch.randn(8, 4), torch.randn(4, 3))
    text = format_graph(gm)
    assert re.search(r'"f32\[s\d+, s\d+\]"', text), text
    save_graph(tmp_path / "sym.tegraph", gm, stage="dynamo", graph_id="g0")
    gm2, _ = load_graph(tmp_path / "sym.tegraph")
    assert format_graph(gm2) == text
    mm = next(n for n in gm2.graph.nodes if n.name.startswith("mm"))
    assert isinstance(mm.meta["val"].shape[0], torch.SymInt)
    assert mm.meta["val"].shape[0].node.hint == 8
