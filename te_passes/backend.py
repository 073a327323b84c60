"""The ``te_inductor`` torch.compile backend: options parsed once, the ordered passes and the observers
handed to one :class:`~te_passes.pipeline.compilation.Compilation`, then ``compile_fx(config_patches=...)``.
docs/design.md "Stages and the driver", docs/usage.md.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch
import torch.fx

from te_passes.config import TePassesOptionError, TePassesOptions, unwrapped
from te_passes.debug.dump import DumpWriter, tracing_enabled
from te_passes.debug.dump_files import DumpDirError
from te_passes.passes.order import configured_passes, pass_names
from te_passes.pipeline.compilation import Compilation, CompileSettings
from te_passes.pipeline.manager import PassManager, PassObserver, TePassError
from te_passes.compat.dynamo import hooks as dynamo_hooks
from te_passes.compat.dynamo.callbacks import warn_capture_state
from te_passes.cudagraphs.stable_grads import protect_grads
from te_passes.compat import gate as frame_gate
from te_passes.compat.api import RecipeStateError, capture_te_state
from te_passes.te.ub import UbConfigError

#: The errors that reach a ``torch.compile``'d call's caller as themselves (:func:`te_passes.config.unwrapped`).
DOCUMENTED_ERRORS: tuple[type[Exception], ...] = (TePassesOptionError, TePassError, UbConfigError,
                                                   RecipeStateError)


def te_inductor_backend(*, mode: str | None = None, options: dict[str, Any] | None = None):
    """``functools.partial(te_inductor, mode=mode, options=options)`` with every option checked now
    (``torch.compile`` hands them over only at the first call). Raises as :func:`te_inductor`."""
    configured_passes(CompileSettings.parse(mode, options, set(pass_names())).options.pass_config)
    return functools.partial(te_inductor, mode=mode, options=options)


def te_inductor(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None,
                options: dict[str, Any] | None = None):
    """Compile a Dynamo graph with te_passes' passes, then Inductor. ``mode``: as for
    ``backend="inductor"``; ``options``: Inductor config plus ``te_passes.*`` keys (a user's
    ``joint_custom_pre_pass`` / ``post_grad_custom_pre_pass`` runs before ours). Returns Inductor's
    callable in ``Compilation.finish``'s one wrapper (the te.autocast state TE's impls read set around
    the call, the UB guard) when it needs either, else Inductor's callable itself.

    Raises (the te_passes errors reach a ``torch.compile``'d function's caller unwrapped):
        te_passes.config.TePassesOptionError: a bad ``te_passes.*`` key/value, pass_config, pass
            name, ``ub_snapshot``, or an Inductor configuration te_inductor refuses.
        te_passes.pipeline.manager.TePassError: a pass failed under ``te_passes.strict``.
        te_passes.te.ub.UbConfigError: a TE op's UB configuration the UB state cannot satisfy.
        te_passes.compat.api.RecipeStateError: the te.autocast state TE's impls read cannot be set
            around the call (``Compilation.begin``).
        RuntimeError: unknown mode or Inductor option (Inductor's message).
    """
    try:
        return compile_graph(gm, example_inputs, CompileSettings.parse(mode, options, set(pass_names())))
    except DOCUMENTED_ERRORS as e:
        raise unwrapped(e) from e.__cause__


def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], settings: CompileSettings):
    """:func:`te_inductor` on parsed settings (also the UB guard's recompile path)."""
    from torch._inductor.compile_fx import compile_fx

    warn_capture_state("te_inductor")
    manager = PassManager(configured_passes(settings.options.pass_config), observers=_observers(settings.options))
    comp = Compilation(manager, settings, capture_te_state(ub_snapshot=settings.ub_snapshot),
                       recompile=lambda g, args: compile_graph(g, args, comp.settings))  # as begin left them
    comp.begin(gm, example_inputs)  # the Dynamo stage and its facts: autocast state, cudagraph hazard, UB reads
    if comp.settings.config_patches.get("triton.cudagraphs"):
        protect_grads(example_inputs)  # .grad outside the graph pool: accumulation across replays
    return comp.finish(compile_fx(gm, example_inputs, config_patches=comp.inductor_hooks()))


def _observers(opts: TePassesOptions) -> list[PassObserver]:
    """The dump writer when ``te_passes.dump_dir`` / ``TE_PASSES_DUMP_DIR`` or ``TORCH_TRACE`` is on.
    Raises ``TePassesOptionError``: the dump directory cannot be written (names option or variable)."""
    if not (opts.dump_dir or tracing_enabled()):
        return []
    source = "env" if "dump_dir" in opts.from_env else "option"
    try:
        return [DumpWriter.for_backend(opts.dump_dir, source)]
    except DumpDirError as e:
        where = "option te_passes.dump_dir" if source == "option" else "environment variable TE_PASSES_DUMP_DIR"
        raise TePassesOptionError(f"{where}: {e}") from None


frame_gate.register_backend(te_inductor)
dynamo_hooks.register()
