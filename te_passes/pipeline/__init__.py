"""The pass framework: the pass interface (:mod:`.base`), the manager (:mod:`.manager`) and the
compilation driver (:mod:`.compilation`). The ordered pass list is ``te_passes.passes.order``."""
