"""te_passes.debug: what the passes did, made visible (the ``te-passes`` CLI and its pieces).

See docs/internals.md#te_passesdebug__init__py and docs/cli.md.."""
