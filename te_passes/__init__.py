"""te_passes: a torch.compile backend for Transformer Engine graphs.

``torch.compile(model, backend="te_inductor")`` (no import needed: the backend is a
``torch_dynamo_backends`` entry point) runs TE-aware FX passes on the traced graphs, then
Inductor. Layout, in pipeline order:

* :mod:`te_passes.backend` — the entry: ``te_inductor`` and its Inductor hooks;
* :mod:`te_passes.te` — TE knowledge: the TE graph model, TE state (UB, recipes), version;
* :mod:`te_passes.passes` — the pass interface, registry, manager and the passes;
* :mod:`te_passes.analyses` — liveness, memory estimate and other graph analyses;
* :mod:`te_passes.debug` — TE-aware printing, dumps and the ``te-passes`` CLI;
* :mod:`te_passes.testing` — real TE graph capture without a GPU, test backends.
"""

__version__ = "0.1.0"

__all__ = ["__version__", "te_inductor", "te_inductor_backend", "TePassesOptionError", "TePassError",
           "UbConfigError"]

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
    "TePassError": "te_passes.passes.manager",
    "UbConfigError": "te_passes.te.ub",
}


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'te_passes' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod), name)
