"""te_passes.analyses."""
