"""No pass changes process-global state while it runs (issue 12).

The process-level integration — TE's UB and amax-group hooks, the Inductor lowering of our free
op, the ``__fx_repr__`` wrappers of TE's value-opaque constant classes — is installed once by
:func:`te_passes.runtime.install.install` (the backend calls it). Then every registered pass runs
through the manager on real captured TE graphs (fp8 te.Linear, every stage, and a UB te.Linear
whose TE op checks and trace-time folds make ``fold_ub_predicates`` return a dependence), and the
process state that passes used to write is compared before/after: the UB guard's registries and
token, TE module functions, TE constant classes' ``__fx_repr__``, Inductor's lowering table.

Known remaining global (not checked here): :data:`te_passes.runtime.constants._NAMED`, the weak
registry of the names ``hoist_te_constants`` gives the constants it hoists (it holds no object
and no graph alive; an entry goes with its object).
"""

from __future__ import annotations

import sys

import pytest
import torch

te = pytest.importorskip("transformer_engine.pytorch")

from te_passes.config import TePassesOptions  # noqa: E402
from te_passes.pipeline.base import Stage  # noqa: E402
from te_passes.pipeline.registry import pass_names  # noqa: E402
from te_passes.runtime import constants, ub_guard  # noqa: E402
from te_passes.runtime import ub_graph_guard  # noqa: E402
from te_passes.runtime.install import install  # noqa: E402
from te_passes.testing.capture import capture_aot, run_pipeline  # noqa: E402
from te_passes.testing.fake_gpu import fake_gpu  # noqa: E402

TE_FUNCTIONS = (("transformer_engine.pytorch.module.base", ("initialize_ub", "destroy_ub", "get_ub_is_fp8")),
                ("transformer_engine.pytorch.module.linear", ("_linear_forward_impl", "_linear_backward_impl",
                                                              "get_ub_is_fp8")))


def _process_state() -> dict:
    from torch._inductor import lowering

    st = ub_guard._STATE
    return {
        "ub_token": ub_guard.UB_STATE_TOKEN,
        "ub_generation": st.generation,
        "ub_hooks": (st.hooks_installed, dict(st.originals), dict(st.replacements)),
        "ub_frame_tokens": dict(st.frame_tokens),
        "ub_pending_trace_folds": {k: list(v) for k, v in ub_guard._PENDING_TRACE_FOLDS.items()},
        "ub_guard_stats": dict(ub_guard.guard_stats),
        "te_functions": {(m, n): getattr(sys.modules.get(m), n, None) for m, ns in TE_FUNCTIONS for n in ns},
        "fx_repr": {c: c.__dict__.get("__fx_repr__") for c in constants.te_constant_classes()},
        "inductor_lowerings": (len(lowering.lowerings), set(lowering.lowerings)),
    }


def _diff(a: dict, b: dict) -> list[str]:
    return [k for k in a if a[k] != b[k]]


def test_every_pass_through_the_manager_leaves_process_state_alone():
    assert install()  # as the backend does on import / on every te_inductor call
    with fake_gpu("fp8-cs"):
        aot = capture_aot("linear", "fp8-cs", layers=2)
        before = _process_state()
        reps = run_pipeline(aot, [Stage.DYNAMO, Stage.JOINT, Stage.POST_GRAD_FWD, Stage.POST_GRAD_BWD],
                            options=TePassesOptions(strict=True), graph_id="gpure")
        after = _process_state()
    ran = {(r.name, s.stage) for s in reps for r in s.runs if r.status == "ok"}
    assert {n for n, _ in ran} == set(pass_names())  # every registered pass ran at least once
    assert any(r.changed for s in reps for r in s.runs)  # and rewrote something
    assert _diff(before, after) == []


def test_fold_ub_predicates_returns_its_dependence_instead_of_registering_it():
    from te_passes.testing.ub import StandInCommunicator as C, ub_registry

    assert install()
    row_ub = dict(ub_name="proj", parallel_mode="row", sequence_parallel=True, tp_size=2, ub_overlap_rs=True,
                  ub_overlap_ag=True)
    with ub_registry({("proj_fprop", "none"): C(), ("proj_dgrad", "none"): C()}):
        aot = capture_aot("linear", "bf16", **row_ub)
        before = _process_state()
        reps = run_pipeline(aot, [Stage.DYNAMO, Stage.POST_GRAD_FWD, Stage.POST_GRAD_BWD],
                            options=TePassesOptions(), graph_id="gpure_ub")
        after = _process_state()
    deps = [f for s in reps for r in s.runs for f in r.facts if isinstance(f, ub_graph_guard.UbDependence)]
    assert deps and all(d.checks for d in deps)  # the TE ops' UB configurations, as facts
    assert _diff(before, after) == []
