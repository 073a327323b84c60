"""Generic ``torch.fx`` helpers that know nothing about Transformer Engine (bottom of the pipeline layers)."""
