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


def _per_layer(layers: int, rounds: int, precision: str = "bf16",
               alike: bool = False) -> list[tuple[list[str], list[str]]]:
    """Compile each of ``layers`` Llama layers separately, run 2 steps per round (``torch._dynamo.reset()`` between
    rounds; the modules keep their state): per round, the compile ids and the recompile reasons in order.
    ``precision``: ``"bf16"`` or ``"fp8-cs"`` (one Float8CurrentScaling recipe object, te.autocast around each
    step); ``alike``: before compiling, give every layer the same TE module names and ``layer_number`` (what
    a fix would have to stop the trace from specialising on)."""
    import contextlib
    import re

    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformer_engine.common.recipe import Float8CurrentScaling

    from te_passes.compat.dynamo.hooks import mark_untouched_backend
    from te_passes.compat.install import install
    from te_passes.examples.llama import LlamaConfig, TinyLlama
    from te_passes.testing.compile_watch import CompileWatch
    from te_passes.testing.fake_gpu import capture_lock, constructing, fake_gpu, quiet

    def backend(gm, example_inputs):
        return gm.forward
    mark_untouched_backend(backend)
    out = []
    recipe = Float8CurrentScaling() if precision == "fp8-cs" else None
    with capture_lock, quiet(), fake_gpu(precision), torch._dynamo.config.patch(recompile_limit=64):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        cfg = LlamaConfig(layers=layers, rope=False, te_norm=False)
        with mode, constructing():
            model = TinyLlama(cfg, device="cuda")
            data = [torch.randn(16, 2, cfg.hidden, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        if alike:
            for m in model.modules():
                if isinstance(getattr(m, "name", None), str):
                    m.name = re.sub(r"Layer_\d+", "Layer_0", m.name)
                if isinstance(getattr(m, "layer_number", None), int):
                    m.layer_number = 1
        for _ in range(rounds):
            torch._dynamo.reset()
            install()
            compiled = [torch.compile(layer, backend=backend) for layer in model.layers]
            with CompileWatch() as watch:  # Dynamo keeps its last 64 compilation metrics: read them in the region
                for x in data:
                    with mode, (te.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext()):
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


@pytest.mark.parametrize("precision", ["bf16", "fp8-cs"])
def test_names_layer_number_and_first_trace_state_are_all_that_tell_layers_apart(precision):
    """The groundwork for one shared graph: with the layers' TE names and ``layer_number`` made equal, the only
    per-layer difference left is te_passes' per-module state, built at each module's first trace (round 1: the
    layers' cache entries are missing it, so each still compiles); once every module has it (round 2), the layers
    run two graphs, whatever their number: the first layer's (its input needs no grad) and one for all the others
    (bf16 and Float8CurrentScaling alike). A new per-layer value in TE or te_passes fails this."""
    (ids, first), (ids_again, again) = _per_layer(4, rounds=2, precision=precision, alike=True)
    assert ids == ["0/0", "0/1", "0/2", "0/3"], (ids, first)
    assert "requires_grad mismatch" in first[0] and all("_te_passes_untouched_state" in r for r in first[1:]), first
    assert ids_again == ["0/0", "0/1"], (ids_again, again)
    assert len(again) == 1 and "requires_grad mismatch" in again[0], again
