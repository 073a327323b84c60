"""DelayedScaling compiled by ``te_inductor``: ``te.Linear`` as a functional op pair (``linear``), the in-graph scale
update and its polyfills (``scaling``) and the modules' DelayedScaling state (``state``). See docs/design.md."""
