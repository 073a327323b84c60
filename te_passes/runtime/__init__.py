"""Process-level runtime integration of te_passes (issue 12 layout: below ``pipeline``).

Modules here are imported on demand by the backend; this package imports nothing heavy.

* :mod:`te_passes.runtime.cudagraphs` — the lean CUDA-graph policy for ``mode="reduce-overhead"``
  (``te_passes.cudagraphs="lean"``, issue 14).
"""
