"""Where te_passes changes TE's own behaviour at run time: per-call amax-reduction groups (``amax_groups``) and the
user's ``te.autocast`` state delivered to TE's impls in compiled code (``recipe_state``)."""
