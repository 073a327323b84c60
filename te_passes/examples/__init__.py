"""te_passes.examples."""
