"""Capture the Dynamo graph of a TE model without a GPU (:func:`capture_dynamo`): the graph
``torch.compile`` hands a backend for ``te.Linear`` layers, traced on fake ``cuda`` tensors under
:func:`te_passes.testing.fake_gpu.fake_gpu` (step 1 of :mod:`te_passes.testing.capture`).
"""

from __future__ import annotations

import contextlib
import itertools
import types
from typing import Any, Callable

import torch
import torch.fx

from te_passes.compat.dynamo.hooks import mark_untouched_backend
from te_passes.te.version import te_version
from te_passes.testing.captured import CapturedGraph
from te_passes.testing.fake_gpu import (CaptureError, capture_lock, constructing, fake_gpu, import_te, make_recipe,
                                        quiet)

#: What :func:`capture_dynamo` builds; the last four are untouched TE modules, traced through
#: te_passes' polyfills (:mod:`te_passes.compat.untouched.polyfills`).
MODELS: tuple[str, ...] = ("linear", "stack", "layernorm_linear", "layernorm_mlp", "multihead_attention",
                           "transformer_layer")
UNTOUCHED_MODELS: tuple[str, ...] = MODELS[2:]

#: ``te.Linear`` keyword arguments that turn on Userbuffers overlap (a capture then installs
#: fake UB communicators by default).
UB_OVERLAP_FLAGS = ("ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad")

_counter = itertools.count()


def fresh_function(fn: Callable) -> Callable:
    """``fn`` with a new code object, so Dynamo's per-code cache starts empty for every capture
    (no recompiles against earlier captures' guards, no recompile limit, nothing kept alive)."""
    code = fn.__code__.replace(co_name=f"te_capture_{next(_counter)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


class _NeverRun(Exception):
    """Raised by the recording backend's compiled callable: the captured graph is never run."""


def _resolve_model(model: str | None, layers: int) -> str:
    if layers < 1:
        raise CaptureError(f"layers must be >= 1, got {layers}")
    if model is None:
        return "linear" if layers == 1 else "stack"
    if model not in MODELS:
        raise CaptureError(f"unknown model {model!r}; expected one of {MODELS}")
    if model == "linear" and layers != 1:
        return "stack"
    return model


def _untouched_modules(te: Any, model: str, layers: int, hidden: int, kwargs: dict[str, Any]) -> list[Any]:
    """``layers`` untouched TE modules ``model`` of width ``hidden`` (4 heads, ffn 4 * hidden,
    dropout 0 unless ``kwargs`` say otherwise)."""
    kw = dict(kwargs)
    if model == "layernorm_linear":
        return [te.LayerNormLinear(hidden, hidden, **kw) for _ in range(layers)]
    if model == "layernorm_mlp":
        return [te.LayerNormMLP(hidden, 4 * hidden, **kw) for _ in range(layers)]
    kw.setdefault("attention_dropout", 0.0)
    if model == "multihead_attention":
        return [te.MultiheadAttention(hidden, 4, **kw) for _ in range(layers)]
    kw.setdefault("hidden_dropout", 0.0)
    return [te.TransformerLayer(hidden, 4 * hidden, 4, **kw) for _ in range(layers)]


def capture_dynamo(model: str | None = "linear", precision: str = "fp8-cs", layers: int = 1,
                   tokens: int = 32, hidden: int = 64, out_features: int | None = None, *,
                   training: bool = True, fake_ub: bool | None = None, ub_fp8: Any = None,
                   **linear_kwargs: Any) -> CapturedGraph:
    """Capture the Dynamo graph of a TE model without a GPU (docs/internals.md#capture_dynamo).

    Args:
        model: one of :data:`MODELS` — ``"linear"``: ``te.Linear(hidden, out_features)``;
            ``"stack"``: ``layers`` ``te.Linear`` (``hidden -> hidden``, the last ``hidden ->
            out_features``) with ``gelu`` between; ``None``: ``"linear"`` for one layer, else
            ``"stack"`` (as is ``"linear"`` with ``layers > 1``); untouched:
            ``te.LayerNormLinear(hidden, hidden)``, ``te.LayerNormMLP(hidden, 4 * hidden)``,
            ``te.MultiheadAttention(hidden, 4)`` and ``te.TransformerLayer(hidden, 4 * hidden, 4)``
            (dropout 0; the attention models take input [tokens, 2, hidden]), ``layers`` in sequence.
        precision: one of :data:`te_passes.testing.fake_gpu.PRECISIONS`.
        tokens, hidden: the input is bf16[tokens, hidden], ``requires_grad=True`` (row-parallel:
            [tokens, hidden / tp_size], the first layer's weight width).
        out_features: the last layer's output width; default ``2 * hidden`` for ``"linear"``,
            ``hidden`` otherwise.
        training: ``False`` traces under ``torch.no_grad()`` (inference graph).
        fake_ub: install fake Userbuffers communicators (:func:`~te_passes.testing.fake_gpu.fake_gpu`);
            default: when ``linear_kwargs`` sets any of :data:`UB_OVERLAP_FLAGS`.
        ub_fp8: the fake communicators' ``is_fp8_ubuf()`` in FP8 mode: ``None`` —
            :data:`~te_passes.testing.fake_gpu.DEFAULT_UB_FP8`; a bool; or ``{"qkv_fprop": bool, ...}``.
        **linear_kwargs: passed to every module (``bias``, ``parallel_mode``, ``tp_size``,
            ``ub_overlap_*``, ...; params ``bfloat16`` on ``cuda`` unless given). ``tp_size > 1``
            without ``tp_group`` calls ``set_tensor_parallel_group(None)``: the config bundles
            carry ``tp_group=None`` (TP collectives are inside the TE ops either way).

    Raises:
        CaptureError: TE not importable, unknown precision/model, or TE fell back to eager
            (``fullgraph`` graph break; the message carries TE's reason).
    """
    model = _resolve_model(model, layers)
    te = import_te()
    from torch._subclasses.fake_tensor import FakeTensorMode

    if out_features is None:
        out_features = 2 * hidden if model == "linear" else hidden
    if fake_ub is None:
        fake_ub = any(bool(linear_kwargs.get(k)) for k in UB_OVERLAP_FLAGS)
    recipe = make_recipe(precision)
    kwargs = dict(linear_kwargs)
    kwargs.setdefault("params_dtype", torch.bfloat16)
    kwargs["device"] = "cuda"

    with capture_lock, quiet(), fake_gpu(precision, fake_ub=fake_ub, ub_fp8=ub_fp8):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode, constructing():
            if model in UNTOUCHED_MODELS:
                mods = torch.nn.ModuleList(_untouched_modules(te, model, layers, hidden, kwargs))
                out_features = hidden
                # attention models take [s, b, h] (TE's default sbhd), the others [tokens, h]
                shape = (tokens, 2, hidden) if model in ("multihead_attention", "transformer_layer") else (tokens, hidden)
                x = torch.randn(*shape, dtype=torch.bfloat16, device="cuda", requires_grad=True)
            else:
                dims = [hidden] * layers + [out_features]
                mods = torch.nn.ModuleList(te.Linear(dims[i], dims[i + 1], **kwargs) for i in range(layers))
                for lin in mods:
                    if lin.tp_size > 1 and not getattr(lin, "tp_group_initialized", False):
                        lin.set_tensor_parallel_group(kwargs.get("tp_group"))
                # Row-parallel layers take their input's shard: [tokens, in_features / tp_size].
                in_width = int(mods[0].weight.shape[-1])
                x = torch.randn(tokens, in_width, dtype=torch.bfloat16, device="cuda", requires_grad=True)

        gelu = torch.nn.functional.gelu
        between = gelu if model == "stack" else (lambda t: t)

        def step(inp):
            with (te.autocast(enabled=True, recipe=recipe) if recipe is not None else contextlib.nullcontext()):
                for i, lin in enumerate(mods):
                    if i:
                        inp = between(inp)
                    inp = lin(inp)
                    if isinstance(inp, tuple):  # return_bias
                        inp = inp[0]
            return inp

        recorded: list[tuple[torch.fx.GraphModule, list[Any]]] = []

        def backend(gm, example_inputs):
            recorded.append((gm, list(example_inputs)))

            def never_run(*args, **kwargs):
                raise _NeverRun()
            return never_run
        # te_passes' frame gate and every hook loading the backend installs (the patch table, GQA's SplitAlongDim,
        # the Dynamo start callback's TE lazy init): the same graph in a fresh process as after te_inductor
        # was loaded, for every model
        mark_untouched_backend(backend)

        fn = torch.compile(fresh_function(step), backend=backend, fullgraph=True, dynamic=False)
        try:
            with mode, (contextlib.nullcontext() if training else torch.no_grad()):
                fn(x)
        except _NeverRun:
            pass
        except Exception as e:  # noqa: BLE001 - re-raised with context
            raise CaptureError(f"capturing {model} x{layers} {precision} failed: {type(e).__name__}: "
                               f"{first_line(e)}") from e
    if len(recorded) != 1:
        raise CaptureError(f"expected one Dynamo graph, got {len(recorded)}")
    gm, example_inputs = recorded[0]
    return CapturedGraph(gm=gm, example_inputs=example_inputs, precision=precision, model=model,
                         layers=layers, tokens=tokens, hidden=hidden, out_features=out_features,
                         linear_kwargs=dict(linear_kwargs), training=training, te_version=te_version())


def first_line(e: BaseException) -> str:
    """The informative part of a (Dynamo) exception message: TE's eager-fallback reason, the
    exception Dynamo observed, or the first line."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    for ln in lines:
        if "falling back to eager" in ln:
            return ln[ln.index("te.") if "te." in ln else 0:]
    for ln in lines:
        if ln.startswith("Developer debug context:"):
            return ln.removeprefix("Developer debug context:").strip()
    return lines[0] if lines else type(e).__name__
