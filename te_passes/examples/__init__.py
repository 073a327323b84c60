"""Built-in examples for ``te-passes dump --example NAME``: real TE graphs through the pipeline.

See docs/internals.md#te_passesexamples__init__py."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import torch

from te_passes._logging import get_logger
from te_passes.backend import te_inductor
from te_passes.config import TePassesOptions
from te_passes.debug.offline import run_stages
from te_passes.examples.llama import LlamaConfig, TinyLlama, capture_llama, random_batch, train_step
from te_passes.pipeline.compilation import inductor_config_patches as _inductor_config_patches
from te_passes.passes.order import configured_passes, pass_names
from te_passes.pipeline.base import Stage
from te_passes.report import compile_reports
from te_passes.testing.capture import capture_aot, capture_dynamo
from te_passes.testing.dynamo_capture import UNTOUCHED_MODELS
from te_passes.testing.fake_gpu import PRECISIONS, CaptureError, fake_gpu, make_recipe

log = get_logger()


@dataclasses.dataclass(frozen=True)
class Example:
    """A built-in example: ``model`` (``"linear"``/``"stack"``/``"transformer_layer"``/``"llama"``: the
    small Llama of :mod:`te_passes.examples.llama`, ``layers`` TransformerLayers), default ``precision``
    (``"bf16"``/``"fp8-cs"``/``"mxfp8"``), ``layers``, ``tokens``, ``hidden``, one-line
    ``description``."""

    name: str
    model: str
    precision: str
    layers: int
    description: str
    tokens: int = 32
    hidden: int = 64


EXAMPLES: dict[str, Example] = {e.name: e for e in (
    Example("linear-fp8", "linear", "fp8-cs", 1,
            "te.Linear(64, 128), Float8CurrentScaling, forward + backward"),
    Example("linear-bf16", "linear", "bf16", 1, "te.Linear(64, 128) in bf16, forward + backward"),
    Example("linear-mxfp8", "linear", "mxfp8", 1, "te.Linear(64, 128), MXFP8BlockScaling, forward + backward"),
    Example("stack-fp8", "stack", "fp8-cs", 2,
            "2 x te.Linear(64, 64) with GELU between, Float8CurrentScaling, forward + backward"),
    # untouched TE modules, traced through te_passes' polyfills (docs/untouched.md)
    Example("transformer-layer-bf16", "transformer_layer", "bf16", 1,
            "untouched te.TransformerLayer(64, 256, 4) in bf16, forward + backward (without a GPU: the forward's "
            "Dynamo graph)", tokens=16),
    Example("transformer-layer-fp8", "transformer_layer", "fp8-cs", 1,
            "untouched te.TransformerLayer(64, 256, 4), Float8CurrentScaling, forward + backward (without a GPU: "
            "the forward's Dynamo graph)", tokens=16),
    # a training loop's model (issue 42): docs/usage.md "Training loop"
    Example("llama-bf16", "llama", "bf16", 2,
            "small Llama (Embedding, 2 x te.TransformerLayer with RMSNorm, SwiGLU, GQA, RoPE, causal; te.RMSNorm, "
            "te.Linear head, cross-entropy) in bf16, 2 training steps", tokens=16),
    Example("llama-fp8", "llama", "fp8-cs", 2,
            "small Llama (Embedding, 2 x te.TransformerLayer with RMSNorm, SwiGLU, GQA, RoPE, causal; te.RMSNorm, "
            "te.Linear head, cross-entropy), Float8CurrentScaling, 2 training steps", tokens=16),
)}

#: How each precision reads in an example's description (after the module: TE recipe class, or bf16).
PRECISION_TEXT: dict[str, str] = {"bf16": " in bf16", "fp8-cs": ", Float8CurrentScaling",
                                  "mxfp8": ", MXFP8BlockScaling"}


def describe(name: str, precision: str | None = None) -> str:
    """Example ``name``'s one-line description with its precision replaced by ``precision``
    (``describe("linear-fp8", "mxfp8")``: ``"te.Linear(64, 128), MXFP8BlockScaling, forward +
    backward"``)."""
    ex = EXAMPLES[name]
    if precision is None or precision == ex.precision:
        return ex.description
    return ex.description.replace(PRECISION_TEXT[ex.precision], PRECISION_TEXT[precision], 1)


@dataclasses.dataclass
class ExampleResult:
    """What :func:`run_example` did: ``compile_path`` (one line), ``note`` (why offline, or
    ``None``), ``reports`` (the :class:`~te_passes.report.CompileReport`\\ s produced)."""

    compile_path: str
    note: str | None
    reports: list[Any]


def run_example(name: str, *, precision: str | None = None, mode: str | None = None,
                dump_dir: str | None = None, disable: Sequence[str] = (),
                status: Callable[[str], None] | None = None) -> ExampleResult:
    """Run example ``name`` (see :data:`EXAMPLES`), writing a dump to ``dump_dir``.

    Args:
        precision: overrides the example's precision (:data:`PRECISIONS`).
        mode: a ``torch.compile`` mode; offline it sets the Inductor config the passes see
            (e.g. ``"reduce-overhead"`` turns on ``triton.cudagraphs``).
        disable: pass names to switch off (``te_passes.disable``).
        status: called with a short progress message before each long step.

    Raises:
        KeyError: unknown example name.
        ValueError: unknown precision.
        te_passes.testing.capture.CaptureError: the graphs could not be captured.
    """
    ex = EXAMPLES[name]
    precision = precision or ex.precision
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {list(PRECISIONS)}")
    say = status or (lambda msg: None)
    if ex.model == "llama":
        return _run_llama(ex, precision, mode, dump_dir, disable, say)
    if torch.cuda.is_available():
        return _run_on_gpu(ex, precision, mode, dump_dir, disable, say)
    return _run_offline(ex, precision, mode, dump_dir, disable, say)


def _run_offline(ex: Example, precision: str, mode: str | None, dump_dir: str | None,
                 disable: Sequence[str], say: Callable[[str], None]) -> ExampleResult:
    opts, _ = TePassesOptions.parse({"te_passes.disable": list(disable)}, known_passes=set(pass_names()))
    patches = _inductor_config_patches(mode, {})
    untouched = ex.model in UNTOUCHED_MODELS
    say(f"capturing the {'Dynamo graph' if untouched else 'Dynamo and AOTAutograd graphs'} of {ex.name} "
        f"({precision}) on fake CUDA tensors" + (" (an untouched model: its AOTAutograd graphs need a GPU)"
                                                   if untouched else ""))
    aot_error = None
    try:
        captured = capture_aot(ex.model, precision, ex.layers, ex.tokens, ex.hidden)
    except CaptureError as e:
        if not untouched:
            raise
        aot_error = str(e)  # the untouched models' AOT trace on fake tensors: the Dynamo stage only
        log.debug("te-passes dump --example %s: AOTAutograd capture failed: %s", ex.name, aot_error)
        captured = capture_dynamo(ex.model, precision, ex.layers, ex.tokens, ex.hidden)
    jobs = captured.stage_jobs()
    stages = ", ".join(job[0].value for job in jobs)
    say(f"running the Dynamo-stage passes on 1 graph ({stages})" if aot_error is not None else
        f"running the pass pipeline on {len(jobs)} graphs ({stages})")
    with fake_gpu(precision), torch._inductor.config.patch(
            {k: v for k, v in patches.items() if not k.endswith("_custom_pre_pass")}):
        report = run_stages(jobs, configured_passes(), options=opts, mode=mode, dump_dir=dump_dir)
    note = ("No GPU here: te_passes ran its full pass pipeline at every stage on the real Dynamo, joint, "
            "forward and backward graphs captured on fake CUDA tensors (te_passes.testing.capture); "
            "Inductor's code generation needs a GPU and was not run. The forward/backward graphs were "
            "partitioned from the joint graph before the joint-stage passes ran.")
    if aot_error is not None:
        note = ("No GPU here: te_passes ran its Dynamo-stage passes on the real Dynamo graph of the untouched "
                "model's forward (one graph, traced through te_passes' polyfills) captured on fake CUDA tensors; "
                "its AOTAutograd graphs (joint, forward, backward) need a GPU: on fake CUDA tensors the joint "
                "trace stops at a device mismatch inside TE's ops (docs/untouched.md \"Known gaps\"); Inductor "
                "was not run.")
        return ExampleResult("offline pass pipeline on the captured Dynamo graph (untouched model)", note, [report])
    return ExampleResult("offline pass pipeline on captured graphs (Dynamo, joint, post-grad fwd/bwd)", note,
                         [report])


def _run_on_gpu(ex: Example, precision: str, mode: str | None, dump_dir: str | None,
                disable: Sequence[str], say: Callable[[str], None]) -> ExampleResult:
    import transformer_engine.pytorch as te

    say(f"building {ex.name} on {torch.cuda.get_device_name()}")
    torch.manual_seed(0)
    out_features = ex.hidden if ex.model == "stack" else 2 * ex.hidden
    if ex.model == "transformer_layer":  # untouched: no compile_friendly, no prepare_te_state
        layers = [te.TransformerLayer(ex.hidden, 4 * ex.hidden, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                      params_dtype=torch.bfloat16, device="cuda") for _ in range(ex.layers)]
        x = torch.randn(ex.tokens, 2, ex.hidden, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    else:
        layers = [te.Linear(ex.hidden, out_features, params_dtype=torch.bfloat16, device="cuda")
                  for _ in range(ex.layers)]
        x = torch.randn(ex.tokens, ex.hidden, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    recipe = make_recipe(precision)

    def step(inp):
        ctx = te.autocast(enabled=True, recipe=recipe) if recipe is not None else torch.autocast("cuda", enabled=False)
        with ctx:
            y = inp
            for i, layer in enumerate(layers):
                y = layer(y)
                if i + 1 < len(layers) and ex.model == "stack":
                    y = torch.nn.functional.gelu(y)
        return y

    options: dict[str, Any] = {"te_passes.disable": list(disable)}
    if dump_dir is not None:
        options["te_passes.dump_dir"] = dump_dir
    # torch.compile refuses mode= together with options= (docs/usage.md): pass both to the backend.

    compiled = torch.compile(step, backend=functools.partial(te_inductor, mode=mode, options=options))
    n0 = len(compile_reports())
    say("compiling and running 2 forward+backward steps under torch.compile(backend='te_inductor')")
    for _ in range(2):
        compiled(x).float().sum().backward()
    torch.cuda.synchronize()
    return ExampleResult(f"torch.compile(backend='te_inductor') on {torch.cuda.get_device_name()}", None,
                         compile_reports()[n0:])


def _run_llama(ex: Example, precision: str, mode: str | None, dump_dir: str | None, disable: Sequence[str],
               say: Callable[[str], None]) -> ExampleResult:
    """The small Llama: on a GPU 2 AdamW training steps under te_inductor; else its forward + loss
    captured on fake CUDA tensors (2 steps) and te_passes' Dynamo-stage passes run on every graph."""
    config = LlamaConfig(layers=ex.layers, hidden=ex.hidden)
    recipe = make_recipe(precision)
    if torch.cuda.is_available():
        say(f"building the small Llama on {torch.cuda.get_device_name()}; 2 training steps under te_inductor")
        torch.manual_seed(0)
        model = TinyLlama(config, device="cuda")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        options: dict[str, Any] = {"te_passes.disable": list(disable)}
        if dump_dir is not None:
            options["te_passes.dump_dir"] = dump_dir
        compiled = torch.compile(model, backend=functools.partial(te_inductor, mode=mode, options=options))
        n0 = len(compile_reports())
        for _ in range(2):
            train_step(compiled, opt, [random_batch(config, ex.tokens)], recipe=recipe)
        torch.cuda.synchronize()
        return ExampleResult(f"torch.compile(model, backend='te_inductor') on {torch.cuda.get_device_name()}", None,
                             compile_reports()[n0:])
    opts, _ = TePassesOptions.parse({"te_passes.disable": list(disable)}, known_passes=set(pass_names()))
    patches = _inductor_config_patches(mode, {})
    say(f"capturing the Dynamo graphs of the small Llama ({precision}, 2 steps) on fake CUDA tensors")
    cap = capture_llama(config, precision, steps=2, seq=ex.tokens)
    say(f"running the pass pipeline on {len(cap.graphs)} graph(s)")
    reports = []
    with fake_gpu(precision), torch._inductor.config.patch(
            {k: v for k, v in patches.items() if not k.endswith("_custom_pre_pass")}):
        for gm, inputs in cap.graphs:
            reports.append(run_stages([(Stage.DYNAMO, gm, inputs)], configured_passes(), options=opts, mode=mode,
                                      dump_dir=dump_dir))
    islands = "; ".join(cap.islands) or "none"
    note = (f"No GPU here: the small Llama's forward + loss was compiled as users write it on fake CUDA tensors, "
            f"2 training steps (forward only: the backward needs a CUDA device): {cap.summary()}; islands: "
            f"{islands}. te_passes ran its Dynamo-stage passes on each graph; the AOTAutograd graphs of untouched "
            f"TE models are not captured without a GPU and Inductor was not run.")
    return ExampleResult("offline pass pipeline on the captured Dynamo graphs (small Llama)", note, reports)
