"""torchtitan's order without FSDP: ``torch.compile`` on every te.TransformerLayer of a model, one after the other
(CPU, fake GPU, te_inductor's polyfills through a recording backend).

All layers run one code object (``TransformerLayer.forward``), so each is a Dynamo cache entry of that frame: with
plain torch layers the entries are shared, with TE layers every layer gets its own. The guards that fail are TE's
and te_passes' per-module values: the modules' ``name`` (``Layer_<n>...``, which TE 2.20.2 reads while tracing:
``MultiheadAttention.forward``'s ``proj_name = self.proj.name or ""``, and under fp8 ``get_quantizer_roles``) and the
polyfills' per-module state (``_te_passes_untouched_state``, built at a module's first trace). Past Dynamo's ``recompile_limit`` (8) the later layers run eagerly: docs/usage.md "Compiling layer by
layer".
"""

from __future__ import annotations

import pytest
import torch

te = pytest.importorskip("transformer_engine.pytorch")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _per_layer(layers: int, rounds: int) -> list[tuple[list[str], list[str]]]:
    """Compile each of ``layers`` Llama layers separately, run 2 steps per round (``torch._dynamo.reset()`` between
    rounds; the modules keep their state): per round, the compile ids and the recompile reasons in order."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from te_passes.compat.dynamo.hooks import mark_untouched_backend
    from te_passes.compat.install import install
    from te_passes.examples.llama import LlamaConfig, TinyLlama
    from te_passes.testing.compile_watch import CompileWatch
    from te_passes.testing.fake_gpu import capture_lock, constructing, fake_gpu, quiet

    def backend(gm, example_inputs):
        return gm.forward
    mark_untouched_backend(backend)
    out = []
    with capture_lock, quiet(), fake_gpu("bf16"), torch._dynamo.config.patch(recompile_limit=64):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        cfg = LlamaConfig(layers=layers, rope=False, te_norm=False)
        with mode, constructing():
            model = TinyLlama(cfg, device="cuda")
            data = [torch.randn(16, 2, cfg.hidden, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        for _ in range(rounds):
            torch._dynamo.reset()
            install()
            compiled = [torch.compile(layer, backend=backend) for layer in model.layers]
            with CompileWatch() as watch:  # Dynamo keeps its last 64 compilation metrics: read them in the region
                for x in data:
                    with mode:
                        for layer in compiled:
                            x = layer(x)
            out.append((watch.stats.compile_ids, watch.stats.recompile_reasons))
        torch._dynamo.reset()
    return out


def test_every_layer_compiles_its_own_graph_for_te_and_te_passes_per_module_values():
    (ids, first), (ids_again, again) = _per_layer(4, rounds=2)
    # step 1: one compile per layer (the first layer's input needs no grad, the others' does), none in step 2
    assert ids == ids_again == ["0/0", "0/1", "0/2", "0/3"], (ids, ids_again)
    assert len(first) == len(again) == 3, (first, again)
    assert "requires_grad mismatch" in first[0], first
    assert all("_te_passes_untouched_state" in r for r in first[1:]), first
    # with every module's state built (a second round), TE's module names still tell the layers apart
    assert all(".name == 'Layer_" in r for r in again[1:]), again
