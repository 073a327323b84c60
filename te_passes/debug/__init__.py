"""te_passes.debug: what the passes did, made visible (the ``te-passes`` CLI and its pieces).

* :mod:`~te_passes.debug.printer` — TE-aware graph printing (TE op fields, storages with buffer
  roles, config bundles field by field, quantizers by value);
* :mod:`~te_passes.debug.diff` — unified diffs and field-level graph changes;
* :mod:`~te_passes.debug.graph_io` — ``.tegraph`` files: graphs saved with names, fake values
  and TE constants, loadable offline without a GPU (what a file may reference:
  :mod:`~te_passes.debug.graph_safety`);
* :mod:`~te_passes.debug.dump` — :class:`~te_passes.debug.dump.DumpWriter` (the pass-manager
  observer behind ``te_passes.dump_dir`` / ``TE_PASSES_DUMP_DIR`` / ``TORCH_TRACE``), with
  :mod:`~te_passes.debug.dump_summary` (report.json, index.md), :mod:`~te_passes.debug.dump_sessions`
  (per-process sessions, claimed directories) and :mod:`~te_passes.debug.dump_files` (schema
  constants, directory lock, reading dumps back);
* :mod:`~te_passes.debug.graph_breaks` — graph breaks, TE eager islands with reasons, recompiles;
* :mod:`~te_passes.debug.offline` — the pipeline outside torch.compile (examples, replay).

The ``te-passes dump | list | show | replay`` CLI that drives them is :mod:`te_passes.cli`.

See docs/cli.md.
"""
