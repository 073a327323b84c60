"""The untouched-model polyfills' patch-table rows (te_passes/compat/untouched/rows.py) on the installed TE and
torch: each row active with the change it names, refused with the reason outside its version range, revert
puts TE's objects back, the compile-start callback is registered once (never from a trace), and the
``te_passes.untouched_norm`` / ``te_passes.fused_attn`` options reach the polyfills through the frame gate
(real TE modules on a fake GPU, compiled for a registered recording backend)."""

from __future__ import annotations

import functools
import sys

import pytest
import torch

te = pytest.importorskip("transformer_engine.pytorch")

from te_passes.compat import table  # noqa: E402
from te_passes.compat.dynamo.hooks import mark_untouched_backend  # noqa: E402
from te_passes.compat.install import install  # noqa: E402
from te_passes.compat.untouched import forward_state, gate, polyfills, rope_norm, split, state  # noqa: E402
from te_passes.compat.untouched.rows import ROWS  # noqa: E402
from te_passes.config import TePassesOptionError, TePassesOptions  # noqa: E402

NAMES = [r.name for r in ROWS]
REBINDS = [r.name for r in ROWS if r.kind in ("rebind", "toggle")]
#: torch 2.14 cannot unregister a substitute_in_graph polyfill (the table keeps those rows).
CAN_UNREGISTER = hasattr(torch._dynamo.decorators, "_unregister_substitute_in_graph")
REVERTIBLE = NAMES if CAN_UNREGISTER else REBINDS


@pytest.fixture(autouse=True)
def _installed():
    install()
    yield
    table.revert(REVERTIBLE)  # a test's refusals do not outlive it
    install()
    assert all(table.refusal(n) is None for n in NAMES), [s for s in table.status() if s.name in NAMES]


def test_every_row_is_active_with_the_change_it_names():
    by = {s.name: s for s in table.status()}
    assert len(NAMES) == len(set(NAMES)) == 13 and all(n.startswith("untouched.") for n in NAMES)
    for row in ROWS:
        assert by[row.name].active, by[row.name]
        assert by[row.name].changes == (0 if row.kind == "toggle" else 1), by[row.name]
    from transformer_engine.pytorch.attention.dot_product_attention.backends import FusedAttention
    from transformer_engine.pytorch.module import _common

    assert torch._dynamo.trace_rules.is_polyfilled_callable(polyfills.closure_layout(FusedAttention.forward)[0])
    assert torch._dynamo.trace_rules.is_polyfilled_callable(_common.noop_cat)
    assert te.RMSNorm.forward is rope_norm.te_ops_norm_forward
    assert sys.modules[split.TE_MHA_MODULE].SplitAlongDim is split.GraphSplitAlongDim
    assert split.TE_SPLIT[0].__name__ == "SplitAlongDim" and issubclass(split.TE_SPLIT[0], torch.autograd.Function)
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    assert TransformerEngineBaseModule.__dict__["prepare_forward"] is forward_state.prepare_forward


def test_revert_puts_tes_objects_back_and_install_makes_them_again():
    from transformer_engine.pytorch.ops.op import BasicOperation

    mha = sys.modules[split.TE_MHA_MODULE]
    table.revert(REVERTIBLE)
    assert te.RMSNorm.forward is BasicOperation.forward and "forward" not in te.RMSNorm.__dict__
    assert mha.SplitAlongDim is split.TE_SPLIT[0]
    assert all(table.refusal(n) == "pending: reverted" for n in REVERTIBLE)
    if CAN_UNREGISTER:
        from transformer_engine.pytorch.attention import rope

        assert not torch._dynamo.trace_rules.is_polyfilled_callable(rope.apply_rotary_pos_emb)
    install()
    assert te.RMSNorm.forward is rope_norm.te_ops_norm_forward and mha.SplitAlongDim is split.GraphSplitAlongDim


def test_rows_outside_their_version_range_are_refused_with_the_reason(monkeypatch):
    monkeypatch.setattr(table, "te_version", lambda: "2.21.0")
    table.revert(REVERTIBLE)
    install()
    for name in REVERTIBLE:
        if name == state.EAGER_ROW:  # touches no TE object
            assert table.refusal(name) is None
            continue
        assert table.refusal(name) == "checked against TE ==2.20.*, installed TE is 2.21.0", name
    assert te.RMSNorm.forward is not rope_norm.te_ops_norm_forward
    monkeypatch.setattr(table, "torch_version_string", lambda: "2.16.0")
    table.revert([state.EAGER_ROW])
    install()
    assert table.refusal(state.EAGER_ROW) == "checked against torch >=2.14,<2.16, installed torch is 2.16.0"
    monkeypatch.undo()
    table.revert(REVERTIBLE)


def test_run_eager_writes_the_flag_only_while_its_row_is_active():
    try:
        with torch.compiler._compile_session_context():
            with state.run_eager():
                assert not torch.compiler.is_compiling()
            assert torch.compiler.is_compiling()
            table.revert([state.EAGER_ROW])
            with state.run_eager():
                assert torch.compiler.is_compiling()  # refused / reverted: no write
        assert not torch.compiler.is_compiling()
    finally:
        install()
    assert table.refusal(state.EAGER_ROW) is None


def test_the_lazy_init_runs_from_the_one_start_callback_registered_once_over_reset():
    from te_passes.compat.dynamo import callbacks
    from te_passes.compat.dynamo.hooks import register

    register()
    register()
    starts = torch._dynamo.callback_handler.start_callbacks
    assert starts.count(callbacks.on_compile_start) == 1 and state.on_compile_start not in starts
    assert callbacks.untouched_compile_start is state.on_compile_start
    torch._dynamo.reset()
    assert torch._dynamo.callback_handler.start_callbacks.count(callbacks.on_compile_start) == 1


def test_a_row_plan_waits_while_te_is_not_imported(monkeypatch):
    from te_passes.compat.untouched import rows

    monkeypatch.delitem(sys.modules, "transformer_engine.pytorch")
    with pytest.raises(table.Refused, match=r"^pending: transformer_engine.pytorch is not imported yet"):
        rows._te_module("transformer_engine.pytorch.module._common")


# --------------------------------------------------------------------------- the options, through the gate
def test_the_options_parse_with_their_environment_aliases(monkeypatch):
    monkeypatch.delenv("TE_PASSES_UNTOUCHED_NORM", raising=False)
    monkeypatch.delenv("TE_PASSES_FUSED_ATTN", raising=False)
    opts = TePassesOptions.parse(None)[0]
    assert (opts.untouched_norm, opts.fused_attn) == ("te", True) and gate.fused_attn_off(opts) == ""
    opts = TePassesOptions.parse({"te_passes.untouched_norm": "torch", "te_passes.fused_attn": False})[0]
    assert (opts.untouched_norm, opts.fused_attn) == ("torch", False)
    assert gate.fused_attn_off(opts) == "switched off (te_passes.fused_attn=False)"
    monkeypatch.setenv("TE_PASSES_FUSED_ATTN", "0")
    monkeypatch.setenv("TE_PASSES_UNTOUCHED_NORM", "torch")
    opts = TePassesOptions.parse(None)[0]
    assert opts.from_env == {"fused_attn", "untouched_norm"} and opts.untouched_norm == "torch"
    assert gate.fused_attn_off(opts) == "switched off (TE_PASSES_FUSED_ATTN='0')"
    assert TePassesOptions.parse({"te_passes.fused_attn": True})[0].fused_attn  # the option wins
    monkeypatch.setenv("TE_PASSES_FUSED_ATTN", "maybe")
    with pytest.raises(TePassesOptionError, match=r"TE_PASSES_FUSED_ATTN='maybe': option te_passes.fused_attn must "
                                                  r"be a bool"):
        TePassesOptions.parse(None)
    with pytest.raises(TePassesOptionError, match=r"te_passes.untouched_norm must be one of \['te', 'torch'\], "
                                                  r"got 'TE'"):
        TePassesOptions.parse({"te_passes.untouched_norm": "TE"})


def _recording(graphs, options):
    def backend(gm, example_inputs, options=None):
        graphs.append(gm)
        return gm.forward
    mark_untouched_backend(backend)
    return functools.partial(backend, options=options)


def _compile_layer(build, options, fullgraph=False):
    """``build()`` on a fake GPU compiled for a registered recording backend with ``options``; one call.
    Returns (call_function targets, error text or None)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from te_passes.testing.fake_gpu import constructing, fake_gpu, quiet

    torch._dynamo.reset()
    polyfills.clear_island_records()
    graphs: list = []
    with quiet(), fake_gpu("bf16"):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode, constructing():
            model = build()
            x = torch.randn(16, 2, 64, dtype=torch.bfloat16, device="cuda")
        fn = torch.compile(model, backend=_recording(graphs, options), fullgraph=fullgraph, dynamic=False)
        err = None
        try:
            with mode:
                fn(x)
        except Exception as e:  # noqa: BLE001 - the text is the result
            err = str(e)
    return [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"], err


def _layer():
    return te.TransformerLayer(64, 256, 4, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.bfloat16,
                               device="cuda")


def test_untouched_norm_option_picks_the_polyfills_norm():
    lnl = lambda: te.LayerNormLinear(64, 64, params_dtype=torch.bfloat16, device="cuda")  # noqa: E731
    targets, err = _compile_layer(lnl, {"te_passes.untouched_norm": "te"}, fullgraph=True)
    assert err is None and any("te_norm_fwd" in t for t in targets), targets
    targets, err = _compile_layer(lnl, {"te_passes.untouched_norm": "torch"}, fullgraph=True)
    assert err is None and not any("te_norm_fwd" in t for t in targets), targets
    assert any("native_layer_norm" in t or "layer_norm" in t or "rsqrt" in t for t in targets), targets


@pytest.mark.parametrize("how", ["option", "env"])
def test_fused_attn_switched_off_leaves_the_attention_to_te_with_the_reason(how, monkeypatch):
    options = {"te_passes.fused_attn": False} if how == "option" else None
    if how == "env":
        monkeypatch.setenv("TE_PASSES_FUSED_ATTN", "off")
    targets, err = _compile_layer(_layer, options, fullgraph=True)
    assert err is not None and "te_passes_untouched_island[FusedAttention.forward]" in err, err
    want = "switched off (te_passes.fused_attn=False)" if how == "option" else "switched off (TE_PASSES_FUSED_ATTN='off')"
    assert [i.reason for i in polyfills.island_records()] == [f"TE fused-attention op unavailable: {want}"]
    # the fix names the user's own switch (session 22's user trial: it said "none inside te_passes")
    switch = "te_passes.fused_attn=False" if how == "option" else "TE_PASSES_FUSED_ATTN='off'"
    assert [i.fix for i in polyfills.island_records()] == [
        f"drop {switch}: it switches TE's fused-attention op off in te_inductor frames"]
    monkeypatch.delenv("TE_PASSES_FUSED_ATTN", raising=False)
    targets, err = _compile_layer(_layer, None, fullgraph=True)
    assert err is None and any("fused_attn" in t for t in targets), err
