"""GPU harness: real TE modules on a CUDA device, compiled against TE eager.

See docs/internals.md#te_passestestinggpupy."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from te_passes.testing.compile_watch import (  # noqa: F401 - re-exported (torch-only harness parts)
    CompileStats, CompileWatch, cudagraph_tree_nodes, fresh_compile_state, te_inductor_backend_listed)

#: The precisions the suite and the benchmark run: ``"bf16"`` (bf16 params and activations, no
#: quantization) and ``"fp8"`` (``transformer_engine.common.recipe.Float8CurrentScaling``).
PRECISIONS: tuple[str, ...] = ("bf16", "fp8")

#: Relative Frobenius-norm error ``||a - b|| / ||b||`` allowed between compiled and eager tensors:
#: a few ulps of bf16 (2^-8) for Inductor's elementwise code; for fp8 (E4M3) one flipped rounding
#: before a cast (2^-4). A wrong scale, stale quantizer or missing transpose gives errors of order 1.
REL_TOL: dict[str, float] = {"bf16": 1e-2, "fp8": 5e-2}


def te_compile_skip_reason() -> str | None:
    """Why TE's torch.compile path is unusable here (TE does not import, or its custom-op path is
    off: ``transformer_engine.pytorch.utils._compile_disabled_reason``), or ``None``."""
    try:
        import transformer_engine.pytorch  # noqa: F401
        import transformer_engine.pytorch.utils as te_utils
    except Exception as exc:  # noqa: BLE001 - ImportError, or TE's own load errors (missing libs)
        return f"transformer_engine.pytorch does not import: {type(exc).__name__}: {exc}"
    reason = getattr(te_utils, "_compile_disabled_reason", "TE has no _compile_disabled_reason (not TE 2.20?)")
    return None if reason is None else f"TE's torch.compile custom-op path is off: {reason}"


def gpu_skip_reason() -> str | None:
    """Why real TE cannot be compiled on a GPU in this process (for ``pytest.skip``), or ``None``."""
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return te_compile_skip_reason()


def make_recipe(precision: str):
    """The TE recipe for ``precision``: ``None`` for ``"bf16"``, ``Float8CurrentScaling()`` for ``"fp8"``.

    Raises:
        ValueError: ``precision`` is not one of :data:`PRECISIONS`.
    """
    if precision == "bf16":
        return None
    if precision == "fp8":
        from transformer_engine.common.recipe import Float8CurrentScaling

        return Float8CurrentScaling()
    raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def build_linear(hidden: int, *, out_features: int | None = None, bias: bool = True, seed: int = 0,
                 device: str = "cuda") -> torch.nn.Module:
    """``te.Linear(hidden, out_features or hidden)``, bf16 parameters on ``device``, TE's init under
    ``torch.manual_seed(seed)``."""
    import transformer_engine.pytorch as te

    torch.manual_seed(seed)
    return te.Linear(hidden, out_features or hidden, bias=bias, params_dtype=torch.bfloat16, device=device)


def build_stack(layers: int, hidden: int, *, bias: bool = True, seed: int = 0,
                device: str = "cuda") -> torch.nn.Sequential:
    """``layers`` × ``te.Linear(hidden, hidden)`` (bf16 params) with ``torch.nn.GELU()`` between.

    Raises:
        ValueError: ``layers < 1``.
    """
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    import transformer_engine.pytorch as te

    torch.manual_seed(seed)
    mods: list[torch.nn.Module] = []
    for i in range(layers):
        if i:
            mods.append(torch.nn.GELU())
        mods.append(te.Linear(hidden, hidden, bias=bias, params_dtype=torch.bfloat16, device=device))
    return torch.nn.Sequential(*mods)


def copy_params(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Copy every parameter of ``src`` into ``dst`` (same architecture), in place, no autograd.

    Raises:
        ValueError: the two modules' parameter names or shapes differ.
    """
    s, d = dict(src.named_parameters()), dict(dst.named_parameters())
    if s.keys() != d.keys() or any(s[k].shape != d[k].shape for k in s):
        raise ValueError("copy_params: modules differ in parameter names or shapes")
    with torch.no_grad():
        for k, p in s.items():
            d[k].copy_(p)


def forward_fn(model: torch.nn.Module, precision: str, recipe: Any = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> model(x)``; for ``"fp8"`` inside ``te.autocast(enabled=True, recipe=recipe)``.

    Raises:
        ValueError: ``precision`` is ``"fp8"`` and ``recipe`` is ``None``, or an unknown precision.
    """
    if precision == "bf16":
        def fwd(x):
            return model(x)
        return fwd
    if precision != "fp8":
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if recipe is None:
        raise ValueError("forward_fn: precision 'fp8' needs a recipe (make_recipe('fp8'))")
    import transformer_engine.pytorch as te

    def fwd_fp8(x):
        with te.autocast(enabled=True, recipe=recipe):
            return model(x)
    return fwd_fp8


def train_step(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, dy: torch.Tensor,
               params: Sequence[torch.nn.Parameter], *, mark_step: bool = False) -> torch.Tensor:
    """One forward + backward: ``p.grad = None`` for ``params`` and ``x``, ``y = fn(x)``,
    ``y.backward(dy)`` (``dy``: same shape/dtype as ``y``); returns ``y``. ``mark_step``: call
    ``torch.compiler.cudagraph_mark_step_begin()`` first (reduce-overhead; ``y`` then lives in
    the cudagraph pool until the next step: clone it to keep it)."""
    if mark_step:
        torch.compiler.cudagraph_mark_step_begin()
    for p in params:
        p.grad = None
    x.grad = None
    y = fn(x)
    y.backward(dy)
    return y


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected||_F / max(||expected||_F, tiny)`` in fp32 (a float).

    Raises:
        ValueError: shapes differ.
    """
    if actual.shape != expected.shape:
        raise ValueError(f"rel_err: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    a, e = actual.detach().float(), expected.detach().float()
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item()


def symmetry_reference(name: str) -> str | None:
    """For a gradient that is 0 in exact arithmetic, the gradient whose norm its error is measured
    against: an attention key bias (``...key_bias``; softmax is invariant to adding ``q·b_k`` to every
    logit of a query, so eager's value is rounding noise) -> the same layer's ``...query_bias``."""
    return name[: -len("key_bias")] + "query_bias" if name.endswith("key_bias") else None


def grad_rel_err(name: str, actual: torch.Tensor, expected: torch.Tensor,
                 grads: dict[str, torch.Tensor]) -> float:
    """:func:`rel_err`, except for a gradient with a :func:`symmetry_reference` in ``grads`` (the
    reference run's gradients by name): ``||actual - expected||_F / ||grads[reference]||_F``."""
    ref = symmetry_reference(name)
    if ref is None or ref not in grads:
        return rel_err(actual, expected)
    a, e = actual.detach().float(), expected.detach().float()
    return ((a - e).norm() / grads[ref].detach().float().norm().clamp_min(1e-30)).item()


def grads_of(x: torch.Tensor, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{"x": x.grad, "<param name>": p.grad, ...}`` cloned (``None`` grads are left out)."""
    out = {"x": x.grad.detach().clone()} if x.grad is not None else {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            out[name] = p.grad.detach().clone()
    return out


def fwd_bwd(fn: Callable, model: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """One forward (``fn(x)``; a tuple's first item) and ``backward(dy)`` from cleared grads of
    ``x`` and ``model``: ``(output copy, grads_of(x, model))``."""
    for p in model.parameters():
        p.grad = None
    x.grad = None
    y = fn(x)
    y = y[0] if isinstance(y, tuple) else y
    y.backward(dy)
    return y.detach().clone(), grads_of(x, model)


def transformer_layer_pair(hidden: int, ffn: int, heads: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Two ``te.TransformerLayer(hidden, ffn, heads)`` (bf16 on cuda, no dropout, seed 0) with
    equal parameters: ``(reference, candidate)``."""
    import transformer_engine.pytorch as te

    def build():
        torch.manual_seed(0)
        return te.TransformerLayer(hidden, ffn, heads, hidden_dropout=0.0, attention_dropout=0.0,
                                   params_dtype=torch.bfloat16, device="cuda")

    ref, cand = build(), build()
    copy_params(ref, cand)
    return ref, cand


def ensure_te_inductor_backend() -> str:
    """Make ``backend="te_inductor"`` resolvable; return how it resolves."""
    if te_inductor_backend_listed():
        return "entry point"
    # Function-level on purpose: importing te_passes.backend installs te_passes' TE hooks (its
    # module-level runtime.install()); the GPU suite imports this module at collection, and its
    # plain-inductor tests (and benchmarks/sp_fp8_tp2.py's inductor scenario) must run without them.
    from te_passes.backend import te_inductor

    torch._dynamo.register_backend(te_inductor, name="te_inductor")
    return "registered"
