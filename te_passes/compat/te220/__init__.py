"""What te_passes knows about TE 2.20's Python internals, read from a live TE: the run-time state its op impls
read (``runtime_reads``: the inventory with TE 2.20.2 line numbers and the bytecode check), TE's capture flags
(``capture_state``), what module forwards initialise (``module_init``), the DelayedScaling layout audit
(``delayed_scaling``), TE's attention-backend selection (``attention_backend``), which module configurations the
untouched polyfills express (``untouched_rules``) and where TE runs eagerly (``fallbacks``). ``te/`` keeps the
tables and pure functions about the graph model. docs/design.md "The compat fence"."""
