"""Process-level integration, installed once by the backend (:func:`te_passes.runtime.install.install`), in
feature folders: ``ub/`` (UB guards), ``cudagraphs/`` (the lean CUDA-graph policy), ``ops/`` (our ops and lowerings),
``untouched/`` (polyfills of TE's disabled forwards), ``delayed/`` (DelayedScaling) and ``te_patches/`` (changes to
TE's own run-time behaviour). Imports nothing itself (submodules are imported where they are used)."""
