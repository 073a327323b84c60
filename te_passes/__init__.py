"""te_passes: a torch.compile backend for Transformer Engine graphs.

``torch.compile(model, backend="te_inductor")`` (no import needed: the backend is a
``torch_dynamo_backends`` entry point) runs TE-aware FX passes on the traced graphs, then
Inductor. Layers, top to bottom (a module imports only from layers below it; checked by
``lint-imports``, see docs/design.md):

* :mod:`te_passes.cli` — the ``te-passes`` command; :mod:`te_passes.examples` — built-in models;
* :mod:`te_passes.testing` — real TE graph capture without a GPU, test backends;
* :mod:`te_passes.step_capture` — small batches: ``compile_step`` (the whole step, one graph), ``make_graphed``;
* :mod:`te_passes.backend` — the entry: ``te_inductor`` and its Inductor hooks;
* :mod:`te_passes.debug` — TE-aware printing, dumps, graph-break report, offline replay;
* :mod:`te_passes.passes` — one module per pass;
* :mod:`te_passes.pipeline` — the pass interface, manager, registry, compilation driver;
* :mod:`te_passes.runtime` — process-level integration (TE hooks, the free op, named constants);
* :mod:`te_passes.analyses` — liveness, memory estimate and other graph analyses;
* :mod:`te_passes.te` — TE knowledge: the TE graph model, TE state (UB, recipes), version;
* :mod:`te_passes.fx` — generic FX helpers;
* :mod:`te_passes.config`, :mod:`te_passes.report`, ``_logging``, ``_json`` — options, reports.
* :mod:`te_passes.rewrite` — opt-in model rewrites applied before ``torch.compile``
  (``te_passes.compile_friendly(model)``, ``te_passes.prepare_te_state``).
"""

__version__ = "0.1.0"

__all__ = ["__version__", "te_inductor", "te_inductor_backend", "TePassesOptionError", "TePassError",
           "UbConfigError", "compile_friendly", "prepare_te_state", "prepare_delayed_scaling",
           "RecipeStateError", "compile_step", "make_graphed", "StepCaptureError"]

#: Public names and the module each lives in (imported on first access: ``import te_passes``
#: stays light). ``TePassesOptionError``: a ``te_passes.*`` option or an Inductor
#: configuration te_inductor refuses; ``TePassError``: a pass failed under
#: ``te_passes.strict``; ``UbConfigError``: a TE op's Userbuffers configuration the UB state
#: cannot satisfy. All three reach the caller of a function compiled with ``torch.compile`` unwrapped
#: (see docs/usage.md, "Errors").
_LAZY = {
    "te_inductor": "te_passes.backend",
    "te_inductor_backend": "te_passes.backend",
    "TePassesOptionError": "te_passes.config",
    "TePassError": "te_passes.pipeline.manager",
    "UbConfigError": "te_passes.te.ub",
    "compile_friendly": "te_passes.rewrite.compile_friendly",  # opt-in model rewrite (issue 15)
    "prepare_te_state": "te_passes.rewrite.te_state",  # TE's first-forward lazy state, before compiling
    # DelayedScaling (issue 24): TE's amax buffers registered, state static, before compiling
    "prepare_delayed_scaling": "te_passes.runtime.delayed_linear",
    "RecipeStateError": "te_passes.runtime.recipe_state",  # raised by te_inductor, unwrapped
    # issue 22: small batches (whole-step capture; TE's CUDA-graph capture over te_inductor)
    "compile_step": "te_passes.step_capture",
    "make_graphed": "te_passes.step_capture",
    "StepCaptureError": "te_passes.step_capture",
}


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'te_passes' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod), name)
