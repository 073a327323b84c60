"""Userbuffers (UB) at run time: the guards of graphs specialised on TE's UB state (``guard``, ``graph_guard``) and
re-initialising UB under ``te_inductor`` (``reinit``). See docs/passes/fold_ub_predicates.md."""
