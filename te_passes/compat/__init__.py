"""The only code that changes how Transformer Engine and torch behave, in capability folders: ``dynamo/``
(compile-start callbacks, the Dynamo config scope of te_inductor compiles), ``ub/`` (TE's UB registry
functions), ``autocast/`` (te.autocast state, amax groups, quantizer usage), ``delayed_scaling/``,
``untouched/`` (polyfills of TE's Dynamo-disabled forwards and the opt-in ``compile_friendly`` rewrite).
``api.py`` is the one entry for the pipeline and the passes; ``compiled_call.py`` the one wrapper of a
compiled callable; ``live_state.py`` the reads of a live TE (UB registry, te.autocast state).
docs/design.md "The compat fence"."""
