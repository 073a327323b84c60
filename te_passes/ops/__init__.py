"""te_passes' own ops and their Inductor lowerings: the early free, TE's base ops called directly from wrapper code,
TE's fused attention and norm kernels as custom ops, the shared-Parameter ``te.Linear``, named TE constants and the
quantizer usage flags after TE's Linear impls."""
