"""te_passes.testing."""
