"""A small Llama built from TE modules as users write it, its training loop, and its capture on a CPU
(fake GPU): ``te-passes dump --example llama-bf16`` / ``llama-fp8``. docs/usage.md "Training loop".

The model mirrors TE's Llama tutorial layout (``docs/examples/te_llama``: ``te.TransformerLayer`` with
RMSNorm, SwiGLU, GQA, causal self-attention, no biases, RoPE through ``rotary_pos_emb``) around a
``torch.nn.Embedding``, a final ``te.RMSNorm``, a ``te.Linear`` LM head and cross-entropy."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Sequence

import torch

from te_passes.compat.dynamo.hooks import mark_untouched_backend
from te_passes.compat.install import install as install_runtime
from te_passes.compat.untouched.gate import clear_island_records, island_records
from te_passes.testing.dynamo_capture import first_line
from te_passes.testing.fake_gpu import capture_lock, constructing, fake_gpu, import_te, make_recipe, quiet


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Sizes and switches of :class:`TinyLlama` (defaults: tiny, for CPU captures and quick GPU runs).

    ``rope``: rotary position embedding through TE's ``rotary_pos_emb`` argument (TE's
    ``RotaryPositionEmbedding``); ``te_norm``: the final norm is ``te.RMSNorm`` (else
    ``torch.nn.RMSNorm``, same formula); ``checkpoint``: every layer under
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``; ``kv_groups`` < ``heads``: GQA.
    """

    vocab: int = 256
    hidden: int = 64
    ffn: int = 128
    heads: int = 4
    kv_groups: int = 2
    layers: int = 2
    rope: bool = True
    te_norm: bool = True
    checkpoint: bool = False
    eps: float = 1e-5
    dtype: torch.dtype = torch.bfloat16


class TinyLlama(torch.nn.Module):
    """Embedding, ``config.layers`` x ``te.TransformerLayer``, ``te.RMSNorm`` (or ``torch.nn.RMSNorm``),
    ``te.Linear`` LM head.

    ``forward(tokens, targets=None, is_first_microbatch=None)``: ``tokens`` int64 ``[seq, batch]`` (TE's
    default ``sbhd`` layout); returns the logits ``[seq, batch, vocab]`` in ``config.dtype``, or with
    ``targets`` (int64 ``[seq, batch]``) the mean cross-entropy, fp32 scalar. ``is_first_microbatch`` is
    passed to every TE module (Megatron-style FP8 weight caching; docs/usage.md "Training loop").

    Raises:
        ValueError: ``hidden`` not divisible by ``heads`` or ``heads`` by ``kv_groups``.
    """

    def __init__(self, config: LlamaConfig | None = None, *, device: str | torch.device = "cuda") -> None:
        import transformer_engine.pytorch as te

        super().__init__()
        c = self.config = config or LlamaConfig()
        if c.hidden % c.heads or c.heads % c.kv_groups:
            raise ValueError(f"hidden ({c.hidden}) must divide by heads ({c.heads}) and heads by kv_groups "
                             f"({c.kv_groups})")
        self.embed = torch.nn.Embedding(c.vocab, c.hidden, device=device, dtype=c.dtype)
        self.layers = torch.nn.ModuleList(
            te.TransformerLayer(c.hidden, c.ffn, c.heads, num_gqa_groups=c.kv_groups, layernorm_epsilon=c.eps,
                                hidden_dropout=0.0, attention_dropout=0.0, self_attn_mask_type="causal",
                                normalization="RMSNorm", activation="swiglu", bias=False, layer_number=i + 1,
                                params_dtype=c.dtype, device=device)
            for i in range(c.layers))
        self.norm = (te.RMSNorm(c.hidden, eps=c.eps, params_dtype=c.dtype, device=device) if c.te_norm
                     else torch.nn.RMSNorm(c.hidden, eps=c.eps, device=device, dtype=c.dtype))
        self.head = te.Linear(c.hidden, c.vocab, bias=False, params_dtype=c.dtype, device=device)
        self.rope = te.RotaryPositionEmbedding(c.hidden // c.heads) if c.rope else None

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                is_first_microbatch: bool | None = None) -> torch.Tensor:
        x = self.embed(tokens)
        rope = self.rope(tokens.shape[0]) if self.rope is not None else None
        kw = {"rotary_pos_emb": rope, "is_first_microbatch": is_first_microbatch}
        for layer in self.layers:
            if self.config.checkpoint:
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False, **kw)
            else:
                x = layer(x, **kw)
        logits = self.head(self.norm(x), is_first_microbatch=is_first_microbatch)
        if targets is None:
            return logits
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def random_batch(config: LlamaConfig, seq: int = 16, batch: int = 2, *, device: str | torch.device = "cuda",
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, targets)``, int64 ``[seq, batch]`` each, uniform over the vocabulary (targets: the
    tokens shifted by one, the last position wrapping)."""
    seqs = torch.randint(0, config.vocab, (seq + 1, batch), generator=generator, device="cpu")
    return seqs[:-1].to(device), seqs[1:].to(device)


def train_step(model: Callable[..., torch.Tensor], optimizer: torch.optim.Optimizer,
               batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *, recipe: Any = None,
               set_to_none: bool = True) -> torch.Tensor:
    """One optimizer step as users write it: for each of the ``k = len(batches)`` micro-batches, the
    model's loss divided by ``k`` and ``backward()`` (``.grad`` accumulates), both under
    ``te.autocast(recipe=recipe)`` when ``recipe`` is given (so a checkpointed layer's recompute in the
    backward runs under the forward's recipe in eager TE too), then ``optimizer.step()`` and
    ``optimizer.zero_grad(set_to_none=set_to_none)`` outside the compiled model. Returns the step's
    loss (fp32 scalar, detached: safe to hold across steps, also under CUDA graphs)."""
    import transformer_engine.pytorch as te

    k = len(batches)
    total = torch.zeros((), dtype=torch.float32, device=batches[0][0].device)
    for tokens, targets in batches:
        with (te.autocast(enabled=True, recipe=recipe) if recipe is not None else contextlib.nullcontext()):
            loss = model(tokens, targets) / k
            loss.backward()
        total += loss.detach()
    optimizer.step()
    optimizer.zero_grad(set_to_none=set_to_none)
    return total


# --------------------------------------------------------------------------- CPU capture (fake GPU)
#: Op name prefixes of the TE GEMMs / attention in a Dynamo graph (TE's compiled te.Linear op, te_passes'
#: DelayedScaling te.Linear op, TE's fused attention op as te_passes registers it).
GEMM_OPS = ("transformer_engine_compile.linear", "te_passes.delayed_linear_fwd")
ATTENTION_OPS = ("transformer_engine_compile.fused_attn",)


def _count(gm: torch.fx.GraphModule, prefixes: tuple[str, ...]) -> int:
    """Forward op nodes named ``prefixes`` in ``gm`` and its subgraphs (a checkpoint op's body)."""
    return sum(1 for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes
               if n.op == "call_function" and "backward" not in str(n.target) and str(n.target).startswith(prefixes))


@dataclasses.dataclass
class LlamaCapture:
    """What :func:`capture_llama` saw: ``graphs`` (``(gm, example_inputs)`` per Dynamo graph, in
    compile order), ``graph_breaks`` (Dynamo's reason -> count: graph breaks and frames Dynamo gave up
    on), ``islands`` (te_passes' named eager
    islands, ``str(Island)``), ``recompiles`` (the reasons of every compile after the first step:
    a recompile or a new frame), ``config``, ``precision``; ``stopped``: why the capture ended early (an
    eager island after a graph break ran TE's CUDA kernels, which need a GPU), else ``None``."""

    graphs: list[tuple[torch.fx.GraphModule, list[Any]]]
    graph_breaks: dict[str, int]
    islands: list[str]
    recompiles: list[str]
    config: LlamaConfig
    precision: str
    stopped: str | None = None

    @property
    def gemms(self) -> list[int]:
        """TE GEMM op nodes (forward ops) per graph."""
        return [_count(gm, GEMM_OPS) for gm, _ in self.graphs]

    @property
    def attention(self) -> list[int]:
        """TE fused-attention op nodes per graph."""
        return [_count(gm, ATTENTION_OPS) for gm, _ in self.graphs]

    def summary(self) -> str:
        """One line: graphs, breaks, islands, recompiles, GEMMs and attention ops per graph."""
        text = (f"{len(self.graphs)} graph(s), {sum(self.graph_breaks.values())} graph break(s), "
                f"{len(self.islands)} island(s), {len(self.recompiles)} compile(s) after step 1; TE GEMMs per "
                f"graph {self.gemms}, attention ops per graph {self.attention}")
        if self.stopped:
            text += (f"; the capture stopped at the first eager island (TE's CUDA kernels need a GPU): "
                     f"{self.stopped}")
        return text


def capture_llama(config: LlamaConfig | None = None, precision: str = "bf16", *, steps: int = 2,
                  micro_batches: int = 1, seq: int = 16, batch: int = 2, eval_between: bool = False,
                  first_microbatch_flag: bool = False, backend_mark: bool = True) -> LlamaCapture:
    """Compile :class:`TinyLlama`'s loss as users do (``torch.compile(model)``, ``te.autocast`` outside)
    on fake cuda tensors and call it for ``steps`` steps of ``micro_batches`` micro-batches each (with
    ``eval_between``: a ``model.eval()`` + ``torch.no_grad()`` forward after each step, under the same
    ``te.autocast``; with ``first_microbatch_flag``: ``is_first_microbatch=(i == 0)`` for micro-batch
    ``i``, Megatron-style). The backend records each graph and runs it on the fake tensors (TE's fake impls); it stands in for te_inductor
    (``backend_mark``: it takes te_passes' polyfills and checkpoint scope) or for any other backend.

    Forward only: the backward (and so ``.grad`` accumulation) needs a CUDA device (the autograd
    engine's device guard); tests/gpu/test_training_loop_gpu.py runs the whole loop.

    Raises:
        te_passes.testing.fake_gpu.CaptureError: TE not importable, unknown precision.
    """
    import_te()
    from torch._dynamo.utils import counters, get_compilation_metrics
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg = config or LlamaConfig()
    graphs: list[tuple[torch.fx.GraphModule, list[Any]]] = []

    def backend(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward
    if backend_mark:
        mark_untouched_backend(backend)  # the polyfills (and the Dynamo scope), as te_inductor
    with capture_lock, quiet(), fake_gpu(precision):
        torch._dynamo.reset()  # the model's code objects are shared by every capture in the process
        install_runtime()
        clear_island_records()
        counters.clear()
        recipe = make_recipe(precision)
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode, constructing():
            model = TinyLlama(cfg, device="cuda")
            data = [[random_batch(cfg, seq, batch) for _ in range(micro_batches)] for _ in range(steps)]
        compiled = torch.compile(model, backend=backend, dynamic=False)
        import transformer_engine.pytorch as te

        def autocast() -> Any:
            return te.autocast(enabled=True, recipe=recipe) if recipe is not None else contextlib.nullcontext()

        seen: set[int] | None = None
        stopped = None
        try:
            for batches in data:
                for i, (tokens, targets) in enumerate(batches):
                    with mode, autocast():
                        flag = {"is_first_microbatch": i == 0} if first_microbatch_flag else {}
                        compiled(tokens, targets, **flag) / len(batches)
                if eval_between:
                    model.eval()
                    with mode, torch.no_grad(), autocast():
                        compiled(batches[0][0])
                    model.train()
                if seen is None:
                    seen = {id(m) for m in get_compilation_metrics()}
        except Exception as e:  # noqa: BLE001 - eager code reached a CUDA kernel: reported, not raised
            if "CUDA" not in str(e):
                raise
            stopped = f"{type(e).__name__}: {first_line(e)}"
        later = [m for m in get_compilation_metrics() if seen is not None and id(m) not in seen]
        recompiles = [m.recompile_reason or f"new frame {m.co_name}" for m in later]
        # graph breaks, and what made Dynamo skip a frame (e.g. a failed checkpoint op: "unimplemented")
        breaks = {**dict(counters["unimplemented"]), **dict(counters["graph_break"])}
    return LlamaCapture(graphs, breaks, [str(i) for i in island_records()], recompiles, cfg, precision, stopped)
