"""te_passes.te."""
