"""The pass framework: the pass interface (:mod:`.base`), the manager (:mod:`.manager`), the
ordered registry (:mod:`.registry`) and the compilation driver's shared pieces
(:mod:`.compilation`)."""
