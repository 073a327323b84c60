"""benchmarks/bench_llama.py's CPU check (``--dry-run``): every model the plan builds, checked
without a GPU before the device time is spent.

Per distinct row (model, layers, seq × batch), at the real sizes on fake CUDA tensors
(``te_passes.testing.fake_gpu``): the ``te.TransformerLayer`` stack is built with the benchmark's
arguments (and RoPE), the plain-torch block takes its weights (every name and shape matched), and,
per recipe, Dynamo traces the TE forward as ``te_inductor`` will see it (te_passes' untouched
polyfills, a recording backend, ``fullgraph=True``: a break is reported as a warning, not a failure).
At a tiny size on the CPU, for real: the torch block's forward and backward (and RoPE), and the
torchao float8 conversion of each torchao variant (forward / backward where torchao runs on CPU).
Docs: docs/benchmarks.md "Llama-class sizes (issue 41)".
"""

from __future__ import annotations

import contextlib
import traceback
from typing import Any, Callable

import llama_models as lm
import te_variants as tv

#: bench recipe -> the fake GPU's precision (device capability): Hopper for bf16 / FP8, Blackwell for MXFP8
FAKE_PRECISION = {"bf16": "bf16", "fp8": "fp8-cs", "fp8-delayed": "fp8-cs", "fp8-block": "fp8-cs", "mxfp8": "mxfp8"}


def _run(lines: list[str], what: str, fn: Callable[[], Any], *, fatal: bool = True) -> bool:
    """Run one check; append ``ok`` / ``FAIL`` (fatal) / ``WARN`` with its first line of error."""
    try:
        got = fn()
        lines.append(f"  ok    {what}" + (f": {got}" if got not in (None, "") else ""))
        return True
    except Exception as exc:  # noqa: BLE001 - every check's failure is reported, the others still run
        msg = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
        lines.append(f"  {'FAIL' if fatal else 'WARN'}  {what}: {msg}")
        if fatal:
            lines.append("        " + traceback.format_exc().strip().splitlines()[-3][:200])
        return not fatal


@contextlib.contextmanager
def _fake(precision: str):
    """Fake GPU of ``precision``'s capability, a FakeTensorMode, quiet TE warnings: ``yield (mode, te)``."""
    import torch  # noqa: F401 - before TE
    from torch._subclasses.fake_tensor import FakeTensorMode

    from te_passes.testing.fake_gpu import capture_lock, fake_gpu, import_te, quiet

    te = import_te()
    with capture_lock, quiet(), fake_gpu(FAKE_PRECISION[precision]):
        yield FakeTensorMode(allow_non_fake_inputs=True), te


def _build_pair(model: str, layers: int, seq: int, rope: bool):
    """(TEStack, TorchStack with its weights, rope) at the real size on fake CUDA."""
    from te_passes.testing.fake_gpu import constructing

    shape = lm.SHAPES[model]
    with _fake("bf16") as (mode, _te), mode, constructing():
        freqs = lm.rope_freqs(seq, shape.head_dim, "cuda") if rope else None
        te_model = lm.TEStack(shape, layers, freqs)
        torch_model = lm.TorchStack(shape, layers, freqs)
        lm.load_from_te(torch_model, te_model)
    return te_model, torch_model


def trace_te(model: str, layers: int, seq: int, batch: int, precision: str, rope: bool) -> str:
    """Dynamo's graph of the TE stack's forward under ``precision`` (fake CUDA, real sizes), as
    te_inductor traces it: ``"1 graph, N nodes"``.

    Raises:
        RuntimeError: not one graph (a break: Dynamo's reason).
    """
    import torch

    from te_passes.compat.dynamo.hooks import mark_untouched_backend
    from te_passes.compat.install import install
    from te_passes.testing.dynamo_capture import first_line
    from te_passes.testing.fake_gpu import constructing

    shape = lm.SHAPES[model]
    recipe = tv.recipe_for(precision)
    graphs: list = []

    class NeverRun(Exception):
        pass

    def backend(gm, example_inputs):
        graphs.append(gm)

        def never_run(*args, **kwargs):  # the graph is only recorded
            raise NeverRun()
        return never_run
    mark_untouched_backend(backend)  # te_passes' polyfills and frame gate, as te_inductor takes them
    with _fake(precision) as (mode, _te):
        install()  # te_inductor's process-level hooks (polyfills, GQA's SplitAlongDim), as the backend installs them
        with mode, constructing():
            freqs = lm.rope_freqs(seq, shape.head_dim, "cuda") if rope else None
            te_model = lm.TEStack(shape, layers, freqs)
            x = torch.randn(seq, batch, shape.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            if precision == "fp8-delayed":  # what te_inductor's compile-start callback does on a GPU
                from transformer_engine.pytorch.quantization import FP8GlobalStateManager

                from te_passes.compat.untouched.rewrite.te_state import prepare_te_state
                from te_passes.compat.delayed_scaling.linear import prepare_delayed_scaling

                FP8GlobalStateManager.reset()
                prepare_te_state(te_model, recipe, fp8=True)
                prepare_delayed_scaling(te_model, recipe, static=False)
        fwd = tv.forward_of(te_model, recipe)
        torch._dynamo.reset()
        try:
            with mode:
                torch.compile(lambda t: fwd(t), backend=backend, fullgraph=True, dynamic=False)(x)
        except NeverRun:
            pass
        except Exception as exc:
            raise RuntimeError(f"not one graph: {first_line(exc)[:300]}") from exc
        finally:
            torch._dynamo.reset()
    return f"1 graph, {len(graphs[0].graph.nodes)} nodes"


def run_torch_tiny(layers: int, seq: int, batch: int, rope: bool, float8: str | None = None) -> str:
    """The torch block at :data:`llama_models.SHAPES` ``["tiny"]`` on the CPU: forward, backward,
    finite output and gradients; ``float8``: converted with torchao first."""
    import torch

    shape = lm.SHAPES["tiny"]
    torch.manual_seed(0)
    model = lm.TorchStack(shape, layers, lm.rope_freqs(seq, shape.head_dim, "cpu") if rope else None, device="cpu")
    note = ""
    if float8:
        note = f"{lm.to_float8(model, float8)} Float8Linear; "
    x = torch.randn(seq, batch, shape.hidden, dtype=torch.bfloat16, requires_grad=True)
    y = model(x)
    y.backward(torch.randn_like(y))
    bad = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    if y.shape != x.shape or not torch.isfinite(y).all() or bad:
        raise RuntimeError(f"output {tuple(y.shape)}, non-finite or missing gradients: {bad[:4]}")
    return note + f"forward + backward {tuple(x.shape)}"


def check(tasks: list[dict], *, rope: bool, parse_row: Callable[[str], tuple[str, int, int, int]]) -> tuple[str, bool]:
    """Every check above for the rows, recipes and competitor variants of ``tasks``
    (``parse_row``: row name -> (model, layers, seq, batch)); returns ``(report, failed)``
    (``failed``: a fatal check failed)."""
    lines = ["CPU check of bench_llama's models (fake CUDA at the real sizes; tiny CPU runs):"]
    ok = True
    rows: dict[str, dict[str, set]] = {}
    for t in tasks:
        rows.setdefault(t["row"], {}).setdefault(t["precision"], set()).add(t["variant"].split("+")[0])
    traced: set = set()
    for row, recipes in rows.items():
        model, layers, seq, batch = parse_row(row)
        lines.append(f"{row} ({model}, {layers} layer(s), {seq} × {batch} tokens, RoPE {'on' if rope else 'off'}):")
        ok &= _run(lines, "TE stack built, torch block takes its weights (names, shapes)",
                   lambda: _build_pair(model, layers, seq, rope) and None)
        for p, variants in recipes.items():
            ok &= _run(lines, f"recipe {p}", lambda: type(tv.recipe_for(p)).__name__)
            compiled = any(v.startswith("te_inductor") or v == "inductor" for v in variants)
            if compiled and (model, layers, p) not in traced:
                traced.add((model, layers, p))
                _run(lines, f"Dynamo trace of the TE forward, {p}",
                     lambda: trace_te(model, layers, seq, batch, p, rope), fatal=False)
            for v in sorted(variants & set(lm.TORCHAO_RECIPES)):
                recipe = lm.TORCHAO_RECIPES[v]
                if recipe and lm.torchao_skip_reason():
                    lines.append(f"  skip  {v}: {lm.torchao_skip_reason()}")
                    continue
                if recipe:
                    ok &= _run(lines, f"{v}: torchao converts every nn.Linear",
                               lambda: _count_float8(layers, recipe))
                    _run(lines, f"{v}: tiny forward + backward on CPU",
                         lambda: run_torch_tiny(layers, 8, 2, rope, recipe), fatal=False)
                else:
                    ok &= _run(lines, f"{v}: tiny forward + backward on CPU",
                               lambda: run_torch_tiny(layers, 8, 2, rope))
    lines.append("CPU check: " + ("passed" if ok else "FAILED"))
    return "\n".join(lines), not ok


def _count_float8(layers: int, recipe: str) -> str:
    model = lm.TorchStack(lm.SHAPES["tiny"], layers, device="cpu")
    n = lm.to_float8(model, recipe)
    if n != 7 * layers:
        raise RuntimeError(f"{n} Float8Linear, want {7 * layers} (7 linears a block)")
    return f"{n} Float8Linear"
