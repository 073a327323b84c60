"""Issue 42 on one GPU: the small Llama (te_passes/examples/llama.py) under FSDP2 with a world-size-1 process group,
compiled with ``backend="te_inductor"`` (default mode), against the same model run eagerly under FSDP2.

Run (one GPU, about 2-3 min, most of it compiles)::

    source .gpu/s/env.sh; python3 -m pytest tests/gpu/test_fsdp2_gpu.py -m gpu -s

Process group: NCCL, rank 0 of 1, a ``FileStore`` in a temporary directory (created for the module, destroyed
after it). Cases (:data:`CASES`): bf16 and ``Float8CurrentScaling``, each in two orders:

* ``per_layer`` (the brief's torchtitan order): ``fully_shard`` on every ``te.TransformerLayer`` and on the root,
  then every layer replaced by ``torch.compile(layer, backend="te_inductor")`` (embedding, final norm, LM head and
  loss eager);
* ``whole``: the same sharding, then ``torch.compile(model, backend="te_inductor")``.

Each runs :data:`STEPS` AdamW steps of :func:`te_passes.examples.llama.train_step` (2 micro-batches, ``loss / 2``,
``te.autocast`` around forward and backward). Asserted: finite losses; every step's loss and every parameter
(``DTensor.full_tensor()``) after the last step within ``REL_TOL`` (bf16 1e-2, fp8 5e-2) of FSDP2 eager's; no
recompile after step 1. Printed: a row per variant with graphs, breaks, recompiles, median step ms, peak MiB, the
errors and whether the losses are bit-identical. The CPU capture of the whole-model order (graph and GEMM counts):
tests/runtime/test_fsdp2_capture.py.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from te_passes.testing.gpu import REL_TOL, CompileWatch, copy_params, rel_err

pytestmark = pytest.mark.gpu

STEPS = 3
MICRO_BATCHES = 2
SEQ, BATCH = 128, 4
PRECISIONS = ["bf16", "fp8-cs"]
ORDERS = ["per_layer", "whole"]
CASES = [(p, o) for p in PRECISIONS for o in ORDERS]
_TOL = {"bf16": REL_TOL["bf16"], "fp8-cs": REL_TOL["fp8"]}
_ROWS: list[str] = []


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory):
    """The default process group: NCCL, rank 0 of 1 on GPU 0, a FileStore; destroyed after the module."""
    import torch.distributed as dist

    from te_passes.testing.gpu import gpu_skip_reason

    reason = gpu_skip_reason()  # module scope: set up before the suite's autouse skip
    if reason is not None:
        pytest.skip(reason)
    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process")
    torch.cuda.set_device(0)
    store = dist.FileStore(str(tmp_path_factory.mktemp("fsdp2") / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _config():
    from te_passes.examples.llama import LlamaConfig

    return LlamaConfig(vocab=1024, hidden=256, ffn=512, heads=4, kv_groups=2, layers=2)


def _recipe(precision):
    from transformer_engine.common import recipe as R

    return {"bf16": None, "fp8-cs": R.Float8CurrentScaling()}[precision]


def _data(cfg):
    from te_passes.examples.llama import random_batch

    gen = torch.Generator().manual_seed(11)
    return [[random_batch(cfg, SEQ, BATCH, generator=gen) for _ in range(MICRO_BATCHES)] for _ in range(STEPS)]


def _full(p):
    from torch.distributed.tensor import DTensor

    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()


def _run(precision, order, compiled, init):
    """:data:`STEPS` steps of one variant from parameters ``init``; returns (losses, params, stats, ms, MiB)."""
    from torch.distributed.fsdp import fully_shard
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    from te_passes.compat.install import install
    from te_passes.examples.llama import TinyLlama, train_step

    FP8GlobalStateManager.reset()
    torch._dynamo.reset()
    install()
    cfg = _config()
    model = TinyLlama(cfg, device="cuda")
    copy_params(init, model)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    fn = model
    if compiled and order == "per_layer":
        for i, layer in enumerate(model.layers):
            model.layers[i] = torch.compile(layer, backend="te_inductor")
    elif compiled:
        fn = torch.compile(model, backend="te_inductor")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    recipe = _recipe(precision)
    data = _data(cfg)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    with CompileWatch() as watch:
        for step, batches in enumerate(data):
            t0 = time.perf_counter()
            losses.append(train_step(fn, opt, batches, recipe=recipe))
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
            if step == 0:
                first = watch.snapshot()
    peak = torch.cuda.max_memory_allocated() / 2**20
    params = {n: _full(p) for n, p in model.named_parameters()}
    return torch.stack(losses).float().cpu(), params, (first, watch.stats), statistics.median(times[1:]), peak


@pytest.fixture(scope="module")
def table():
    yield _ROWS
    print(f"\nFSDP2, world size 1 (small Llama: 2 layers, hidden 256, GQA 4/2, RoPE, seq {SEQ} x batch {BATCH}, "
          f"{MICRO_BATCHES} micro-batches, {STEPS} AdamW steps)")
    print(f"{'precision':9} {'order':9} {'mode':12} {'graphs':>6} {'breaks':>6} {'recomp':>6} {'step ms':>8} "
          f"{'peak MiB':>8} {'loss err':>9} {'param err':>9} identical")
    for row in _ROWS:
        print(row)


@pytest.mark.parametrize("precision, order", CASES, ids=[f"{p}-{o}" for p, o in CASES])
def test_fsdp2_training_matches_fsdp2_eager(world_of_one, precision, order, table):
    from te_passes.examples.llama import TinyLlama

    torch.manual_seed(0)
    init = TinyLlama(_config(), device="cuda")
    results = {"eager": _run(precision, order, False, init), "te_inductor": _run(precision, order, True, init)}
    ref_losses, ref_params = results["eager"][0], results["eager"][1]
    failures = []
    for mode, (losses, params, (first, st), ms, peak) in results.items():
        loss_err = max(rel_err(losses[i:i + 1], ref_losses[i:i + 1]) for i in range(STEPS))
        param_err = max(rel_err(params[n], ref_params[n]) for n in ref_params)
        same = bool(torch.equal(losses, ref_losses))
        table.append(f"{precision:9} {order:9} {mode:12} {st.graphs:6d} {st.graph_breaks:6d} {st.recompiles:6d} "
                     f"{ms:8.2f} {peak:8.0f} {loss_err:9.2e} {param_err:9.2e} {same}")
        if mode == "eager":
            continue
        if st.graphs == 0:
            failures.append(f"{mode}: nothing compiled ({st.break_reasons})")
        if not torch.isfinite(losses).all():
            failures.append(f"{mode}: non-finite loss {losses.tolist()}")
        if loss_err > _TOL[precision] or param_err > _TOL[precision]:
            failures.append(f"{mode}: loss err {loss_err:.2e}, param err {param_err:.2e} > {_TOL[precision]:.0e}")
        if st.recompiles != first.recompiles:
            failures.append(f"{mode}: recompiles after step 1: {st.recompile_reasons}")
    assert not failures, failures
