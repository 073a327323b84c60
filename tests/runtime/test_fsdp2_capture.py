"""Issue 42 on CPU (fake GPU): the small Llama under FSDP2 (``fully_shard`` per TransformerLayer and on the root,
world size 1) compiled whole, as te_inductor traces it.

The process group is torch's ``fake`` backend (``FakeStore``, world size 1); the model and data are fake CUDA
tensors (te_passes.testing.fake_gpu); FSDP2's CUDA streams and events, which its lazy init and hooks create and
wait on, are stubbed (no CUDA device here). The backend records each Dynamo graph and runs it on the fake tensors,
standing in for te_inductor (``mark_untouched_backend``: its polyfills and rows). Forward + loss only, as
tests/runtime/test_training_loop.py (the backward needs a CUDA device guard). The per-layer order (torchtitan:
``torch.compile`` per layer, the head eager) runs TE's eager head kernels and is left to the GPU test:
tests/gpu/test_fsdp2_gpu.py, which also compares losses and parameters with TE eager.
"""

from __future__ import annotations

import contextlib
from typing import Any
from unittest import mock

import pytest
import torch

te = pytest.importorskip("transformer_engine.pytorch")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

LAYERS = 2


class _Stream:
    """Stands in for ``torch.cuda.Stream`` / the current stream: FSDP2 only orders work with it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def wait_event(self, *args: Any) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> "_Event":
        return _Event()

    def synchronize(self) -> None:
        pass


class _Event(_Stream):
    """Stands in for ``torch.cuda.Event``."""

    def record(self, *args: Any) -> None:
        pass

    def wait(self, *args: Any) -> None:
        pass

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def _no_cuda_streams():
    current = _Stream()
    with contextlib.ExitStack() as stack:
        for target, new in (("torch.cuda.Stream", _Stream), ("torch.cuda.Event", _Event),
                            ("torch.cuda.current_stream", lambda *a, **k: current),
                            ("torch.cuda.stream", lambda s: contextlib.nullcontext()),
                            ("torch.Tensor.record_stream", lambda *a, **k: None),
                            ("torch.cuda.is_current_stream_capturing", lambda: False)):
            stack.enter_context(mock.patch(target, new))
        yield


@pytest.fixture(scope="module")
def world_of_one(fake_world_of_one):
    """The default process group on torch's ``fake`` backend, rank 0 of 1 (tests/conftest.py)."""
    return fake_world_of_one


def _capture(precision: str, steps: int = 3, eval_between: bool = False) -> dict[str, Any]:
    """The small Llama (RoPE and the final te.RMSNorm off, as the CPU capture's fp8 tests) under FSDP2, compiled
    whole; ``steps`` forward + loss calls (with ``eval_between``: a ``no_grad`` forward after each). Returns the
    graphs' TE GEMM / attention counts, compiles after step 1, graph breaks, and what TE saw of FSDP2."""
    from torch._dynamo.utils import counters, get_compilation_metrics
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from te_passes.compat.dynamo.hooks import mark_untouched_backend
    from te_passes.compat.install import install
    from te_passes.examples.llama import ATTENTION_OPS, GEMM_OPS, LlamaConfig, TinyLlama, random_batch
    from te_passes.testing.fake_gpu import capture_lock, constructing, fake_gpu, make_recipe, quiet

    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    mark_untouched_backend(backend)
    with capture_lock, quiet(), fake_gpu(precision), _no_cuda_streams():
        torch._dynamo.reset()
        install()
        counters.clear()
        recipe = make_recipe(precision)
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        cfg = LlamaConfig(layers=LAYERS, rope=False, te_norm=False)
        with mode, constructing():
            model = TinyLlama(cfg, device="cuda")
            mesh = DeviceMesh("cuda", [0])
            for layer in model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            data = [random_batch(cfg, 16, 2) for _ in range(steps)]
        sharded = all(isinstance(p, DTensor) for p in model.parameters())
        # torch.compile's default dynamic=None, as users compile: the second layer's recompile makes its differing
        # int attributes (layer_number) symbolic, which the fused-attention op must specialise (GPU run, session 21)
        fn = torch.compile(model, backend=backend)
        seen = None
        for tokens, targets in data:
            with mode, te.autocast(enabled=recipe is not None, recipe=recipe):
                fn(tokens, targets)
            if eval_between:
                model.eval()
                with mode, torch.no_grad(), te.autocast(enabled=recipe is not None, recipe=recipe):
                    fn(tokens)
                model.train()
            if seen is None:
                seen = {id(m) for m in get_compilation_metrics()}
        later = [m.recompile_reason or f"new frame {m.co_name}" for m in get_compilation_metrics()
                 if id(m) not in seen]
        te_modules = [m for m in model.modules() if hasattr(type(m), "is_fsdp2")]

        def count(prefixes):
            return [sum(1 for n in gm.graph.nodes if n.op == "call_function" and "backward" not in str(n.target)
                        and str(n.target).startswith(prefixes)) for gm in graphs]
        return {"gemms": count(GEMM_OPS), "attention": count(ATTENTION_OPS), "recompiles": later,
                "breaks": dict(counters["graph_break"]), "sharded": sharded,
                "is_fsdp2": {type(m).__name__: m.is_fsdp2 for m in te_modules}}


@pytest.mark.parametrize("precision", ["bf16", "fp8-cs"])
def test_fsdp2_whole_model_compiles_every_gemm_without_recompiles(world_of_one, precision):
    """``fully_shard`` per layer and on the root, then ``torch.compile(model)``: Dynamo gives each FSDP-wrapped
    layer its own graph (4 GEMMs and the attention op each; FSDP2's hooks run outside) and the root's rest one
    (the LM head's GEMM); no graph break, nothing compiles after step 1 (the second layer's graph is a recompile
    of the shared TransformerLayer frame inside step 1). The parameters are DTensors and TE sees FSDP2
    (``is_fsdp2``) in every TE module under a sharded layer."""
    cap = _capture(precision)
    assert cap["sharded"], cap
    assert cap["breaks"] == {}, cap["breaks"]
    assert sorted(cap["gemms"]) == [1] + [4] * LAYERS, cap
    assert sorted(cap["attention"]) == [0] + [1] * LAYERS, cap
    assert cap["recompiles"] == [], cap["recompiles"]
    assert cap["is_fsdp2"] and all(cap["is_fsdp2"].values()), cap["is_fsdp2"]


def test_fsdp2_fp8_eval_between_steps_does_not_recompile(world_of_one):
    """The same with a ``no_grad`` evaluation after each fp8 step: one more graph per frame in step 1, none after
    (row ``autocast.traced_quantizer_copies``)."""
    cap = _capture("fp8-cs", eval_between=True)
    assert cap["breaks"] == {} and cap["recompiles"] == [], cap
    assert sorted(cap["gemms"]) == sorted([1, 1] + [4] * 2 * LAYERS), cap
