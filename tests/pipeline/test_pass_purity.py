"""No pass changes process-global state while it runs (issue 12).

The process-level integration — TE's UB and amax-group hooks, the Inductor lowering of our free
op, the ``__fx_repr__`` wrappers of TE's value-opaque constant classes — is installed once by
:func:`te_passes.compat.install.install` (the backend calls it). Then every registered pass runs
through the manager on real captured TE graphs (fp8 te.Linear, every stage, and a UB te.Linear
whose TE op checks and trace-time folds make ``fold_ub_predicates`` return a dependence), and the
process state that passes used to write is compared before/after: the UB guard's registries and
token, TE module functions, TE constant classes' ``__fx_repr__``, Inductor's lowering table, and
every module-level container (dict, list, set, ...) of every loaded ``te_passes`` module — which
is what catches a registry like the former ``ops.constants._NAMED`` (the names
``hoist_te_constants`` gives its constants now live in the post-grad graph's own ``gm.meta``).
Memo caches of pure functions are listed in :data:`MEMO_CACHES` with the reason.

Without ``compat.install()``, ``insert_early_frees`` leaves the graph alone with a record saying
why and registers no Inductor lowering (it used to register it while it ran).
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import weakref

import pytest
import torch

te = pytest.importorskip("transformer_engine.pytorch")

from te_passes.config import TePassesOptions  # noqa: E402
from te_passes.pipeline.base import Stage  # noqa: E402
from te_passes.passes.order import pass_names  # noqa: E402
from te_passes.ops import constants  # noqa: E402
from te_passes.compat import table  # noqa: E402
from te_passes.compat.ub import guard as ub_guard
from te_passes.compat.ub import graph_guard as ub_graph_guard  # noqa: E402
from te_passes.compat.install import install  # noqa: E402
from te_passes.testing.capture import capture_aot, run_pipeline  # noqa: E402
from te_passes.testing.fake_gpu import fake_gpu  # noqa: E402

TE_FUNCTIONS = (("transformer_engine.pytorch.module.base", ("initialize_ub", "destroy_ub", "get_ub_is_fp8")),
                ("transformer_engine.pytorch.module.linear", ("_linear_forward_impl", "_linear_backward_impl",
                                                              "get_ub_is_fp8")))


#: Module-level containers passes may fill: memos of pure functions of a class or a source text,
#: holding no pass result. ``(module, name)``. (The memos of ``te/`` and ``ops/constants`` are
#: ``functools.lru_cache``\ s of pure functions, not module containers.)
MEMO_CACHES = {
    ("te_passes.analyses.alias_rules", "_RULES"),  # id(OpOverload) -> its alias rule (from the schema)
}
_CONTAINERS = (dict, list, set, collections.deque, weakref.WeakKeyDictionary, weakref.WeakValueDictionary,
               weakref.WeakSet)


def _module_containers() -> dict:
    """``{(module, name): snapshot}`` of every module-level container of every loaded te_passes
    module (keys and value identities, so an added, removed or replaced entry shows)."""
    out = {}
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name == "te_passes" or mod_name.startswith("te_passes.")):
            continue
        values = list(vars(mod).items())
        for name, v in list(values):  # a module's state object (a dataclass instance): its container fields
            if dataclasses.is_dataclass(v) and not isinstance(v, type):
                values += [(f"{name}.{f.name}", getattr(v, f.name)) for f in dataclasses.fields(v)]
        for name, v in values:
            if not isinstance(v, _CONTAINERS) or (mod_name, name) in MEMO_CACHES:
                continue
            if isinstance(v, (dict, weakref.WeakKeyDictionary, weakref.WeakValueDictionary)):
                out[(mod_name, name)] = {repr(k) if not isinstance(k, (int, str)) else k: id(x)
                                         for k, x in list(v.items())}
            elif isinstance(v, (set, weakref.WeakSet)):
                out[(mod_name, name)] = {id(x) for x in list(v)}
            else:
                out[(mod_name, name)] = [id(x) for x in v]
    return out


def _process_state() -> dict:
    from torch._inductor import lowering

    st = ub_guard._STATE
    return {
        "ub_token": st.token,
        "ub_generation": st.generation,
        "patch_table": [(s.name, s.active, s.changes, s.reason) for s in table.status()],
        "ub_frame_tokens": dict(st.frame_tokens),
        "ub_pending_trace_folds": {k: list(v) for k, v in st.pending_folds.items()},
        "ub_guard_stats": dict(ub_guard.guard_stats),
        "te_functions": {(m, n): getattr(sys.modules.get(m), n, None) for m, ns in TE_FUNCTIONS for n in ns},
        "fx_repr": {c: c.__dict__.get("__fx_repr__") for c in constants.te_constant_classes()},
        "inductor_lowerings": (len(lowering.lowerings), set(lowering.lowerings)),
        **{f"{m}.{n}": v for (m, n), v in _module_containers().items()},
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


def test_insert_early_frees_without_the_runtime_leaves_the_graph_and_inductor_alone():
    """As in a process where ``compat.install()`` never ran: the free op's lowering is not
    registered. Through the harness (no install): the pass is skipped with the reason, the graph
    is unchanged, and the pass did not register the lowering itself."""
    from torch._inductor import lowering
    from torch.fx.experimental.proxy_tensor import make_fx

    from _qgraphs import QGEMM, QUANTIZE2, record_vals
    from te_passes.compat import table
    from te_passes.passes.insert_early_frees import InsertEarlyFrees
    from te_passes.ops import free as free_op
    from te_passes.testing.harness import run_passes

    def f(x, w):
        data, sinv = QUANTIZE2(x)
        return (torch.relu(QGEMM(data, sinv, w)),)

    x, w = torch.randn(4, 4), torch.randn(4, 4)
    gm = make_fx(f)(x, w)
    record_vals(gm, x, w)
    assert install()  # then undo what install() registered for the free op (its patch-table row)
    table.revert(["lowering.free_storage"])
    try:
        before = _process_state()
        run = run_passes(gm, InsertEarlyFrees(), Stage.POST_GRAD_FWD, install=False)
        after = _process_state()
        registered_by_the_pass = free_op.free_storage in lowering.lowerings
    finally:
        install()
    assert free_op.lowering_reason() is None  # install() put it back
    (r,) = run.report.runs
    assert r.status == "skipped" and not r.changed
    (why,) = [rec.data["reason"] for rec in run.records("skipped")]
    assert "not installed" in why and "compat.install.install()" in why and "reuse a freed buffer" in why
    assert run.diff() == {} and run.after_code == run.before_code
    assert not registered_by_the_pass and _diff(before, after) == []
    # installed: the same graph gets its free
    run = run_passes(gm, InsertEarlyFrees(), Stage.POST_GRAD_FWD)
    assert run.diff() == {"te_passes.free_storage.default": 1}
