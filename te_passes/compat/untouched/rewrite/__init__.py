"""Opt-in model rewrites, applied to modules before ``torch.compile`` (:mod:`.compile_friendly`)."""
