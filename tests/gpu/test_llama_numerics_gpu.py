"""Issue 38 items 6 and 7 on the GPU: a Llama-style untouched te.TransformerLayer compiled with
``te_inductor`` against TE eager, first training step, every recipe rule of ``widen_quantized_inputs``
and TE's attention-backend selection.

Run on an H100 / H200 (~1-2 min, most of it Inductor compiles)::

    source .gpu/s/env.sh; python3 -m pytest tests/gpu/test_llama_numerics_gpu.py -m gpu -s

The layer: ``te.TransformerLayer(256, 1024, 8, num_gqa_groups=2, normalization="RMSNorm",
activation="swiglu", bias=False, self_attn_mask_type="causal")``, bf16 parameters, input
[128, 2, 256] (sbhd); ``x4``: four such layers in a ``torch.nn.Sequential``. Two twins with equal
parameters, one run by TE eager, one by ``torch.compile(model, backend="te_inductor")``, the same
input and output gradient, ``te.autocast`` around both calls. Printed per case: every tensor's
(output, input gradient, each parameter gradient) max relative element difference
``max|a - b| / max|b|`` and relative Frobenius error, and TE eager against itself (a rerun: its
determinism on this data).

* ``test_first_step[current-x1 / current-x4 / delayed-x1]``: Float8CurrentScaling (the activation
  quantized with its fp32 amax, rule ``amax``) and DelayedScaling (rule ``fp32``): asserted
  **bit-identical** to TE eager (every tensor), as the rules are written to make it; a failure prints
  the measured differences (report them). ``current-x4`` is the configuration of the open failure
  ``test_untouched_transformer_layer[x4-fp8-*]`` (4 layers, Float8CurrentScaling) in this layer's
  Llama form.
* ``test_rope_two_sequence_lengths[current / delayed / bf16]``: the layer with RoPE (``rotary_pos_emb`` from TE's
  ``RotaryPositionEmbedding``) at sequence length 128, then 200, each step against TE eager's same step:
  bit-identical for both fp8 recipes, TE's bf16 tolerances for bf16.
* ``test_unfused_attention_backend``: ``NVTE_FUSED_ATTN=0 NVTE_FLASH_ATTN=0`` (TE selects
  ``UnfusedDotProductAttention``), bf16: the compiled graph holds no ``fused_attn`` op (TE's torch-ops
  attention traced into it, compiled by Inductor) and matches TE eager within TE's own bf16 attention
  tolerances (atol = rtol = 2.5e-2, ``tests/pytorch/attention`` in TE); at most the one known recompile
  on step 2 (docs/untouched.md "Attention backend"), no graph break; with TE's softmax kernel (the
  default at this length: TE's ``te_softmax`` op) and with ``NVTE_MASKED_SOFTMAX_FUSION=0`` (torch's).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from te_passes.testing.gpu import CompileWatch, copy_params, fwd_bwd, rel_err

pytestmark = pytest.mark.gpu

HIDDEN, FFN, HEADS, GROUPS, SEQ, BATCH = 256, 1024, 8, 2, 128, 2


def _layer(layer_number=1):
    import transformer_engine.pytorch as te

    return te.TransformerLayer(HIDDEN, FFN, HEADS, num_gqa_groups=GROUPS, normalization="RMSNorm",
                               activation="swiglu", bias=False, self_attn_mask_type="causal",
                               hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.bfloat16,
                               device="cuda", layer_number=layer_number)


class _RopeLayers(torch.nn.Module):
    """``layers`` Llama layers called with TE's ``RotaryPositionEmbedding`` for the input's sequence length
    (``rotary_pos_emb``), as users write it: x [s, b, HIDDEN] bf16 -> [s, b, HIDDEN]."""

    def __init__(self, layers):
        super().__init__()
        from transformer_engine.pytorch.attention.rope import RotaryPositionEmbedding

        self.layers = torch.nn.ModuleList([_layer(i + 1) for i in range(layers)])
        self.rope = RotaryPositionEmbedding(HIDDEN // HEADS)

    def forward(self, x):
        freqs = self.rope(x.shape[0])
        for layer in self.layers:
            x = layer(x, rotary_pos_emb=freqs)
        return x


def _build(layers, rope=False):
    torch.manual_seed(0)
    if rope:
        return _RopeLayers(layers)
    return _layer() if layers == 1 else torch.nn.Sequential(*[_layer(i + 1) for i in range(layers)])


def _recipe(name):
    from transformer_engine.common import recipe as R

    return {"current": R.Float8CurrentScaling, "delayed": R.DelayedScaling, "bf16": lambda: None}[name]()


def _step(fn, model, recipe, x, dy):
    import transformer_engine.pytorch as te

    with te.autocast(enabled=True, recipe=recipe) if recipe is not None else contextlib.nullcontext():
        y, g = fwd_bwd(fn, model, x, dy)
    torch.cuda.synchronize()
    return {"out": y, **g}


def _diffs(got: dict, ref: dict) -> dict[str, tuple[float, float]]:
    """``{name: (max relative element difference, relative Frobenius error)}``."""
    out = {}
    for k, e in ref.items():
        a, b = got[k].float(), e.float()
        out[k] = (((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item(), rel_err(a, b))
    return out


def _print(tag, diffs):
    print(f"{tag}:")
    for k, (mx, fro) in sorted(diffs.items(), key=lambda kv: -kv[1][0]):
        print(f"    {k:60s} max rel {mx:.3e}  fro {fro:.3e}")


def _compare_steps(layers, recipe_name, seqs, *, rope=False, backend="te_inductor"):
    """One step per sequence length of ``seqs``, TE eager, its rerun and ``backend`` each from fresh TE global
    state: (per step: compiled tensors, eager tensors, eager rerun tensors; compile stats)."""
    from te_passes.compat.install import install
    from transformer_engine.pytorch import quantization as Q

    recipe = _recipe(recipe_name)
    ref, again, cand = (_build(layers, rope=rope) for _ in range(3))
    copy_params(ref, cand)
    copy_params(ref, again)
    torch._dynamo.reset()
    install()
    fn = torch.compile(cand, backend=backend)
    gen = torch.Generator(device="cuda").manual_seed(7)
    xs = [torch.randn(s, BATCH, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
          for s in seqs]
    dys = [torch.randn(s, BATCH, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen) for s in seqs]
    eager = []
    for model in (ref, again):
        Q.FP8GlobalStateManager.reset()  # each run's first step on fresh TE global state (DelayedScaling's buffers)
        eager.append([_step(model, model, recipe, x, dy) for x, dy in zip(xs, dys)])
    Q.FP8GlobalStateManager.reset()
    with CompileWatch() as watch:
        c = [_step(fn, cand, recipe, x, dy) for x, dy in zip(xs, dys)]
        st = watch.snapshot()
    return list(zip(c, *eager)), st


def _compare(layers, recipe_name, steps=2, backend="te_inductor"):
    """(compiled step-0 tensors, eager step-0 tensors, eager rerun, compile stats) over ``steps`` steps at ``SEQ``."""
    per_step, st = _compare_steps(layers, recipe_name, (SEQ,) * steps, backend=backend)
    return (*per_step[0], st)


@pytest.mark.parametrize("recipe_name,layers", [("current", 1), ("current", 4), ("delayed", 1)],
                         ids=["current-x1", "current-x4", "delayed-x1"])
def test_first_step(recipe_name, layers):
    c, r, r2, st = _compare(layers, recipe_name)
    det = _diffs(r2, r)
    diffs = _diffs(c, r)
    _print(f"llama x{layers} {recipe_name}: te_inductor vs TE eager, step 0 ({st.to_json()})", diffs)
    _print(f"llama x{layers} {recipe_name}: TE eager rerun vs TE eager", det)
    assert st.graphs == 1 and st.graph_breaks == 0 and st.recompiles == 0, st.to_json()
    assert all(v == (0.0, 0.0) for v in det.values()), "TE eager is not deterministic on this data"
    differing = {k: v for k, v in diffs.items() if v != (0.0, 0.0)}
    assert not differing, f"not bit-identical to TE eager: {differing}"


@pytest.mark.parametrize("recipe_name", ["current", "delayed", "bf16"])
def test_rope_two_sequence_lengths(recipe_name):
    """Issue 38's GPU item: the Llama layer with RoPE (``rotary_pos_emb``) at two sequence lengths (128, then 200: a
    new length, so Dynamo's automatic dynamic shapes retrace and the attention op specialises the length), each
    step against TE eager on the same step: bit-identical for Float8CurrentScaling and DelayedScaling (whose second
    step quantizes with the scales the first step's amax gave), within TE's bf16 tolerances for bf16. 0 graph
    breaks; at most one graph per length."""
    seqs = (SEQ, 200)
    steps, st = _compare_steps(1, recipe_name, seqs, rope=True)
    print(f"\nllama x1 rope {recipe_name}, lengths {seqs}: {st.to_json()}")
    for s, (c, r, r2) in zip(seqs, steps):
        _print(f"llama x1 rope {recipe_name} seq {s}: te_inductor vs TE eager", _diffs(c, r))
        assert all(v == (0.0, 0.0) for v in _diffs(r2, r).values()), f"TE eager is not deterministic at {s}"
        if recipe_name == "bf16":
            for k in r:
                torch.testing.assert_close(c[k], r[k], atol=2.5e-2, rtol=2.5e-2, msg=lambda m, k=k: f"{s} {k}: {m}")
        else:
            differing = {k: v for k, v in _diffs(c, r).items() if v != (0.0, 0.0)}
            assert not differing, f"seq {s}: not bit-identical to TE eager: {differing}"
    assert st.graph_breaks == 0 and st.graphs <= len(seqs), st.to_json()


@pytest.mark.parametrize("softmax_fusion", ["1", "0"], ids=["te-softmax-kernel", "torch-softmax"])
def test_unfused_attention_backend(softmax_fusion, monkeypatch):
    from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as dpa

    from te_passes.backend import te_inductor
    from te_passes.fx.graph import op_qualname
    from te_passes.compat.dynamo.hooks import mark_untouched_backend

    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
    # read when the modules are built: "1" lets TE's unfused softmax take its own CUDA kernel (16 < s_kv <
    # 16384, s_kv % 8 == 0; TE's te_softmax custom op, in the graph on CPU), "0" torch's softmax
    monkeypatch.setenv("NVTE_MASKED_SOFTMAX_FUSION", softmax_fusion)
    dpa._attention_backends["backend_selection_requires_update"] = True  # TE's own cache of the selection
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return te_inductor(gm, example_inputs)

    mark_untouched_backend(recording)  # te_inductor's polyfills, as under backend="te_inductor"
    try:
        c, r, _, st = _compare(1, "bf16", backend=recording)
    finally:
        dpa._attention_backends["backend_selection_requires_update"] = True
    _print(f"llama x1 bf16, unfused attention: te_inductor vs TE eager ({st.to_json()})", _diffs(c, r))
    ops = {op_qualname(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert "transformer_engine_compile::fused_attn" not in ops, sorted(o for o in ops if o)
    for k in r:
        torch.testing.assert_close(c[k], r[k], atol=2.5e-2, rtol=2.5e-2, msg=lambda m, k=k: f"{k}: {m}")
    # one recompile on step 2 is known (docs/untouched.md "Attention backend": TE's forward fills its
    # _attention_backends and _default_causal_mask caches on its first call)
    assert st.graph_breaks == 0 and st.recompiles <= 1, st.to_json()
