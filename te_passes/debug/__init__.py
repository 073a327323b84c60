"""te_passes.debug."""
