"""te_passes: a torch.compile backend for Transformer Engine graphs.

``torch.compile(model, backend="te_inductor")`` (no import needed: the backend is a
``torch_dynamo_backends`` entry point) runs TE-aware FX passes on the traced graphs, then
Inductor. Layout, in pipeline order:

* :mod:`te_passes.backend` — the entry: ``te_inductor`` and its Inductor hooks;
* :mod:`te_passes.te` — TE knowledge: the TE graph model, TE state (UB, recipes), version;
* :mod:`te_passes.passes` — the pass interface, registry, manager and the passes;
* :mod:`te_passes.analyses` — liveness, memory estimate and other graph analyses;
* :mod:`te_passes.debug` — TE-aware printing, dumps and the ``te-passes`` CLI;
* :mod:`te_passes.testing` — real TE graph capture without a GPU, test backends;
* :mod:`te_passes.rewrite` — opt-in model rewrites applied before ``torch.compile``
  (``te_passes.compile_friendly(model)``).
"""

__version__ = "0.1.0"

__all__ = ["__version__", "te_inductor", "compile_friendly", "prepare_te_state"]


def __getattr__(name):
    if name == "te_inductor":
        from te_passes.backend import te_inductor

        return te_inductor
    if name == "compile_friendly":  # issue 15: opt-in model rewrite, imported on first use
        from te_passes.rewrite.compile_friendly import compile_friendly

        return compile_friendly
    if name == "prepare_te_state":  # issue 15: TE's first-forward lazy state, before compiling
        from te_passes.rewrite.te_state import prepare_te_state

        return prepare_te_state
    raise AttributeError(name)
