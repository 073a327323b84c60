"""Process-level integration pieces the backend installs once (Inductor lowerings, TE hooks).

Imports nothing itself: submodules are imported where they are used
(:mod:`te_passes.runtime.direct_call`: the direct-call lowering of TE's base ops)."""
