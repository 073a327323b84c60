"""te_passes: a torch.compile backend for Transformer Engine graphs.

See docs/internals.md#te_passes__init__py and docs/design.md."""

__version__ = "0.1.0"

__all__ = ["__version__", "te_inductor", "te_inductor_backend", "TePassesOptionError", "TePassError",
           "UbConfigError", "compile_friendly", "prepare_te_state", "prepare_delayed_scaling",
           "RecipeStateError", "compile_step", "make_graphed", "StepCaptureError", "reinitialize_ub",
           "mark_untouched_backend"]

#: Public names and the module each lives in, imported on first access (``import te_passes`` stays
#: light). The errors reach a ``torch.compile``'d function's caller unwrapped (docs/usage.md "Errors").
_LAZY = {
    "te_inductor": "te_passes.backend",
    "te_inductor_backend": "te_passes.backend",
    "TePassesOptionError": "te_passes.config",
    "TePassError": "te_passes.pipeline.manager",
    "UbConfigError": "te_passes.te.ub",
    "compile_friendly": "te_passes.compat.untouched.rewrite.compile_friendly",  # opt-in model rewrite
    "prepare_te_state": "te_passes.compat.untouched.rewrite.te_state",  # TE's first-forward lazy state, before compiling
    # DelayedScaling: TE's amax buffers registered, state static, before compiling
    "prepare_delayed_scaling": "te_passes.compat.delayed_scaling.linear",
    "RecipeStateError": "te_passes.compat.autocast.recipe_state",  # raised by te_inductor, unwrapped
    # small batches (whole-step capture; TE's CUDA-graph capture over te_inductor)
    "compile_step": "te_passes.step_capture",
    "make_graphed": "te_passes.step_capture",
    "StepCaptureError": "te_passes.step_capture",
    "reinitialize_ub": "te_passes.compat.ub.reinit",  # instead of TE's destroy_ub() + initialize_ub()
    "mark_untouched_backend": "te_passes.compat.dynamo.hooks",  # a backend of your own takes the polyfills
}


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'te_passes' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod), name)
