"""Issue 42 on CPU (fake GPU): the small Llama of te_passes/examples/llama.py compiled as users run it.

``capture_llama`` compiles ``torch.compile(model)`` with a backend that records each Dynamo graph and runs
it on fake cuda tensors (TE's fake impls), standing in for te_inductor (it takes te_passes' polyfills and
its activation-checkpointing scope) or for any other backend; forward + loss only (the backward needs a
CUDA device guard: tests/gpu/test_training_loop_gpu.py runs the whole loop, numerics included).
"""

from __future__ import annotations

import re

import pytest
import torch

te = pytest.importorskip("transformer_engine.pytorch")

from te_passes.examples import EXAMPLES, run_example  # noqa: E402
from te_passes.examples.llama import LlamaConfig, capture_llama  # noqa: E402
from te_passes.compat import gate, table  # noqa: E402
from te_passes.compat.dynamo import callbacks as dynamo_callbacks  # noqa: E402
from te_passes.compat.dynamo.rows import CHECKPOINT_FLAG  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

#: TE GEMMs of the small Llama: 4 per TransformerLayer (qkv, proj, fc1, fc2) and the LM head.
LAYERS = 2
GEMMS = 4 * LAYERS + 1


def _cfg(**kw):
    return LlamaConfig(**{"layers": LAYERS, **kw})


def _one_graph(cap, layers=LAYERS):
    assert cap.stopped is None, cap.stopped
    assert cap.graph_breaks == {}, list(cap.graph_breaks)
    assert len(cap.graphs) == 1, cap.summary()
    assert cap.gemms == [4 * layers + 1], cap.summary()  # every TE GEMM inside the graph
    assert cap.attention == [layers], cap.summary()
    assert cap.islands == [], cap.islands
    assert cap.recompiles == [], cap.recompiles


# --------------------------------------------------------------------------- the model and accumulation
@pytest.mark.parametrize("precision", ["bf16", "fp8-cs"])
def test_llama_with_accumulation_is_one_graph_without_recompiles(precision):
    """Embedding, 2 TransformerLayers (RMSNorm, SwiGLU, GQA, causal), RMSNorm, te.Linear head, cross-entropy:
    one graph with all 9 GEMMs and both attention ops; 2 steps x 4 micro-batches (``loss / 4``): nothing
    compiles after step 1."""
    _one_graph(capture_llama(_cfg(rope=False, te_norm=False), precision, steps=2, micro_batches=4))


def test_bf16_eval_between_steps_is_one_more_graph():
    """``model.eval()`` + ``torch.no_grad()`` evaluation after each step: one inference graph beside the
    training graph, compiled in step 1; steps 2-3 reuse both."""
    cap = capture_llama(_cfg(rope=False, te_norm=False, layers=1), "bf16", steps=3, eval_between=True)
    assert cap.graph_breaks == {} and cap.stopped is None, cap.summary()
    assert len(cap.graphs) == 2 and cap.gemms == [5, 5], cap.summary()
    assert cap.recompiles == [], cap.recompiles


@pytest.mark.parametrize("precision", ["fp8-cs", "mxfp8"])
def test_fp8_eval_between_steps_does_not_recompile(precision):
    """``model.eval()`` + ``torch.no_grad()`` evaluation after each fp8 step: one training and one inference graph,
    both compiled in step 1 and reused in steps 2-3 (was: a recompile at every switch, TE's trace setting the
    module's quantizer usage flags by grad mode: row ``autocast.traced_quantizer_copies``,
    tests/runtime/test_traced_quantizer_copies.py)."""
    cap = capture_llama(_cfg(rope=False, te_norm=False, layers=1), precision, steps=3, eval_between=True)
    assert cap.graph_breaks == {} and cap.stopped is None, cap.summary()
    assert len(cap.graphs) == 2 and cap.gemms == [5, 5], cap.summary()
    assert cap.recompiles == [], cap.recompiles


@pytest.mark.parametrize("precision", ["bf16", "fp8-cs"])
def test_rope_final_te_rmsnorm_and_checkpointing_are_one_graph(precision):
    """The small Llama as users write it — RoPE through ``rotary_pos_emb`` (TE's fused RoPE, the
    ``untouched.apply_rotary_pos_emb`` row), the final ``te.RMSNorm`` (``untouched.rmsnorm_forward``), every
    layer under ``torch.utils.checkpoint`` and 2 micro-batches: one graph with every TE GEMM and attention op,
    no break, no recompile after step 1 (was: a break at each of TE's two pybind kernels)."""
    cap = capture_llama(_cfg(checkpoint=True), precision, steps=2, micro_batches=2)
    _one_graph(cap)


def test_megatron_is_first_microbatch():
    """``is_first_microbatch=(i == 0)`` per micro-batch (Megatron-style): in bf16 the flag is inert in TE (no
    FP8 weight workspace) and te_inductor compiles one graph per value in step 1, nothing after; under fp8
    TE's own te.Linear falls back to eager, each break naming TE's reason (docs/usage.md "Training loop":
    the fix is is_first_microbatch=None)."""
    cap = capture_llama(_cfg(rope=False, te_norm=False, layers=1), "bf16", steps=2, micro_batches=2,
                        first_microbatch_flag=True)
    assert cap.graph_breaks == {} and cap.stopped is None, cap.summary()
    assert cap.gemms == [5, 5] and cap.recompiles == [], cap.summary()
    cap = capture_llama(_cfg(rope=False, te_norm=False, layers=1), "fp8-cs", steps=1, micro_batches=1,
                        first_microbatch_flag=True)
    assert cap.graph_breaks, cap.summary()
    assert all("FP8 weight caching (is_first_microbatch)" in r for r in cap.graph_breaks), list(cap.graph_breaks)


# --------------------------------------------------------------------------- activation checkpointing
def _checkpoint_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and "tag_activation_checkpoint" in str(n.target)]


@pytest.mark.parametrize("precision", ["bf16", "fp8-cs"])
def test_checkpointed_layers_compile_into_one_graph(precision):
    """``torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)`` per TransformerLayer: one graph,
    one checkpoint op per layer with the layer's 4 GEMMs and its attention op in its body; the flag te_inductor
    sets for its compiles is back to the user's value afterwards."""
    cap = capture_llama(_cfg(rope=False, te_norm=False, checkpoint=True), precision, steps=2, micro_batches=2)
    _one_graph(cap)
    gm = cap.graphs[0][0]
    ckpts = _checkpoint_nodes(gm)
    assert len(ckpts) == LAYERS, gm.graph
    for node in ckpts:
        body = getattr(gm, node.args[0].target)
        assert sum(str(n.target).startswith("transformer_engine_compile.linear") for n in body.graph.nodes) == 4
    assert torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint is False


def test_checkpoint_without_the_scope_runs_the_model_eagerly(monkeypatch):
    """What users get without te_passes' scope (``backend="inductor"`` alike): Dynamo's checkpoint op stops at
    TE's ``fast_setattr`` ("HOP: Unsafe side effect"), the whole forward is skipped (a graph break in a loop):
    no graph at all."""
    monkeypatch.setattr(table, "apply_toggles", lambda *scope: (lambda: None))  # no Dynamo config scope
    cap = capture_llama(_cfg(rope=False, te_norm=False, layers=1, checkpoint=True), "bf16", steps=1)
    assert cap.graphs == []
    assert any("HOP: Unsafe side effect" in r and "DunderDictVariable" in r for r in cap.graph_breaks), cap.graph_breaks


class _Holder:
    calls = 0


def _body(x):
    _Holder.calls = _Holder.calls + 1  # a side effect inside the checkpointed region, as TE's prepare_forward
    return torch.sin(x) * 2


def _checkpointed(x):
    return torch.utils.checkpoint.checkpoint(_body, x, use_reentrant=False)


def _compile_count(backend_mark):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    if backend_mark:
        gate.register_backend(backend)
    torch._dynamo.reset()
    fn = torch.compile(_checkpointed, backend=backend)
    fn(torch.randn(4, requires_grad=True))
    return graphs


@pytest.mark.parametrize("user_value", [False, True])
def test_scope_is_te_inductor_compiles_only(user_value):
    """The flag is on while a te_inductor frame compiles (checkpoint op traced: one graph, no break) and not
    for another backend (the side effect breaks the checkpoint op: no graph with it); the user's own value
    is what remains after each compile."""
    import te_passes.backend  # noqa: F401 - registers te_passes' Dynamo callbacks, as the backend's lookup does

    with torch._dynamo.config.patch({CHECKPOINT_FLAG: user_value}):
        ours = _compile_count(True)
        assert getattr(torch._dynamo.config, CHECKPOINT_FLAG) is user_value
        assert len(ours) == 1 and _checkpoint_nodes(ours[0])
        theirs = _compile_count(False)
        assert getattr(torch._dynamo.config, CHECKPOINT_FLAG) is user_value
        assert bool(theirs and _checkpoint_nodes(theirs[0])) is user_value


def test_scope_restores_after_a_failed_compile():
    """The end callback runs in Dynamo's ``finally``: a compile that raises leaves the flag as it was."""
    import te_passes.backend  # noqa: F401

    def backend(gm, example_inputs):
        raise RuntimeError("backend failed")
    gate.register_backend(backend)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="backend failed"):
        torch.compile(_checkpointed, backend=backend)(torch.randn(4, requires_grad=True))
    assert getattr(torch._dynamo.config, CHECKPOINT_FLAG) is False


# --------------------------------------------------------------------------- te-passes dump --example
def test_llama_examples_are_listed_and_run_offline(tmp_path):
    """``te-passes dump --example llama-bf16``: the model as shipped (RoPE and te.RMSNorm on), captured on fake
    CUDA and every captured graph run through the Dynamo-stage passes; the note carries the counts."""
    assert {"llama-bf16", "llama-fp8"} <= set(EXAMPLES)
    result = run_example("llama-bf16", dump_dir=str(tmp_path / "dump"))
    assert result.reports and "graph(s)" in result.note and "graph break(s)" in result.note, result.note
    counts = re.search(r"(\d+) graph\(s\), (\d+) graph break\(s\), (\d+) island\(s\)", result.note)
    assert counts, result.note
    assert len(result.reports) == int(counts.group(1)) >= 1


def test_scope_recognises_te_inductor_however_wrapped():
    """``backend="te_inductor"`` (torch.compile's wrapper, with or without options), ``te_inductor_backend()``
    (a ``functools.partial``): ours; ``"eager"`` / ``"inductor"``: not."""
    import te_passes.backend as backend
    from torch._dynamo.backends.registry import lookup_backend

    assert dynamo_callbacks.is_te_inductor(torch._TorchCompileWrapper("te_inductor", None, None, None))
    assert dynamo_callbacks.is_te_inductor(torch._TorchCompileWrapper("te_inductor", "reduce-overhead", None, None))
    assert dynamo_callbacks.is_te_inductor(backend.te_inductor_backend(mode="reduce-overhead"))
    assert not dynamo_callbacks.is_te_inductor(torch._TorchCompileWrapper("eager", None, None, None))
    assert not dynamo_callbacks.is_te_inductor(lookup_backend("inductor"))
    assert not dynamo_callbacks.is_te_inductor(None)
    assert gate.tracing_backend() is None  # outside a Dynamo compile
