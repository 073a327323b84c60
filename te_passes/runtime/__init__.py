"""Process-level integration, installed once by the backend (:func:`te_passes.runtime.install.install`):
TE hooks (UB guard, amax groups), our free op and its Inductor lowering, named TE constants, the
direct-call lowering of TE's base ops (:mod:`te_passes.runtime.direct_lowering`, calling
:mod:`te_passes.runtime.direct_call` objects), and the lean
CUDA-graph policy for ``mode="reduce-overhead"`` (:mod:`te_passes.runtime.cudagraph_policy`,
``te_passes.cudagraphs="lean"``).

Imports nothing itself (submodules are imported where they are used)."""
