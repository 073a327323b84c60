"""Opt-in model rewrites applied to a model *before* ``torch.compile`` (they change modules,
not FX graphs). Importing this package imports nothing heavy; see
:mod:`te_passes.rewrite.compile_friendly`."""
