"""Untouched TE models in one graph: polyfills of TE's ``torch.compiler.disable``\\ d forwards (``polyfills``,
``attention``), the backend gate that switches them on under ``te_inductor`` only (``gate``) and TE's first-forward
lazy state done before the trace (``state``). See docs/untouched.md."""
