"""Process-level integration, installed once by the backend (:func:`te_passes.runtime.install.install`):
TE hooks (UB guard, amax groups), our free op and its Inductor lowering, named TE constants.

Imports nothing itself (submodules are imported where they are used)."""
