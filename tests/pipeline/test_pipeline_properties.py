"""Property tests of the whole pass pipeline (issue 16): random FX graphs with fp8 casts, opaque
ops and aliases, and mutated real TE graphs, through every stage via the PassManager (the path
the backend uses: ``te_passes.testing.harness.run_passes``, i.e. ``Compilation.run_stage``; registry passes built from a
``pass_config`` as ``te_passes.pass_config`` would).

Properties, for every graph and stage:

* no pass fails (``status == "failed"``: an exception the manager caught) and nothing escapes
  ``PassManager.run``;
* the graph is lint-clean (``Graph.lint``) and recompiles;
* every skipped pass says why (a non-empty reason record);
* idempotent: a second run over the output changes nothing (every run ``changed=False``);
* no use after a free: no node after a ``te_passes.free_storage(t)`` reads ``t`` or an alias of
  it (aliases found from the real storages of the values);
* random graphs on CPU: the rewritten graph's outputs equal the original's, bit for bit.

Size: ``HYPOTHESIS_PROFILE=ci`` (default) runs a few dozen examples per test; the long run is
one command (docs/testing-real-graphs.md records its result)::

    HYPOTHESIS_PROFILE=long make test PYTEST_ARGS="tests/pipeline/test_pipeline_properties.py"

which runs :data:`LONG_EXAMPLES` examples in total (12,000) and prints how many passed.
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import torch  # noqa: E402
import torch.fx  # noqa: E402

from _qgraphs import F8, QGEMM, QUANTIZE2, record_vals, te_available  # noqa: E402
from te_passes.pipeline.base import Stage  # noqa: E402
from te_passes.pipeline.manager import PassManager  # noqa: E402
from te_passes.passes.order import configured_passes  # noqa: E402
from te_passes.ops import free as free_op  # noqa: E402
from te_passes.te.state import TEState  # noqa: E402
from te_passes.compat.api import capture_te_state
from te_passes.testing.harness import run_passes  # noqa: E402

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
#: Examples per test in each profile: random graphs (the bulk: cheap, checked numerically) and
#: mutated real TE graphs. The long profile's total is >= 10,000.
EXAMPLES = {"ci": {"random": 40, "te": 12}, "long": {"random": 9000, "te": 3000}}[PROFILE]
LONG_EXAMPLES = 9000 + 3000
_SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), derandomize=PROFILE == "ci",
                 database=None)
COUNTS = {"random": 0, "te": 0, "frees": 0, "changed": 0}

aten = torch.ops.aten
STAGES = (Stage.DYNAMO, Stage.JOINT, Stage.POST_GRAD_FWD, Stage.POST_GRAD_BWD)
N = 4  # every f32 value is [N, N]; fp8 values [N, N]; scales [1]


# --------------------------------------------------------------------------- random graphs
@st.composite
def programs(draw):
    """A straight-line program over f32 [4, 4] / fp8 [4, 4] / f32 [1] (scale) values: pointwise
    ops, aliases (view, t, alias, views of views), fp8 casts (ATen ``_to_copy`` and the opaque
    multi-output ``tpq::quantize2``), fp8 readers (ATen cast back, opaque ``tpq::qgemm``); a
    random subset of values (f32 and fp8) is returned."""
    n_ops = draw(st.integers(1, 14))
    ops = []
    kinds = ["f32", "f32", "scale"]  # placeholders x0, x1, s0
    for _ in range(n_ops):
        f32 = [i for i, k in enumerate(kinds) if k == "f32"]
        f8 = [i for i, k in enumerate(kinds) if k == "f8"]
        scales = [i for i, k in enumerate(kinds) if k == "scale"]
        choices = ["add", "mul", "relu", "neg", "t", "view2", "alias", "cast8", "quantize2", "quantize2"]
        if f8:  # quantized values mostly feed opaque consumers (the case frees are for)
            choices += ["cast32", "qgemm", "qgemm", "qgemm", "qgemm", "view8", "alias8"]
        op = draw(st.sampled_from(choices))
        pick = lambda pool: draw(st.sampled_from(pool))  # noqa: E731
        if op in ("add", "mul"):
            ops.append((op, (pick(f32), pick(f32))))
            kinds.append("f32")
        elif op in ("relu", "neg", "t", "view2", "alias"):
            ops.append((op, (pick(f32),)))
            kinds.append("f32")
        elif op == "cast8":
            ops.append((op, (pick(f32),)))
            kinds.append("f8")
        elif op == "quantize2":
            ops.append((op, (pick(f32),)))
            kinds += ["f8", "scale"]  # getitem 0, getitem 1
        elif op == "cast32":
            ops.append((op, (pick(f8),)))
            kinds.append("f32")
        elif op == "qgemm":
            ops.append((op, (pick(f8), pick(scales), pick(f32))))
            kinds.append("f32")
        else:  # view8 / alias8
            ops.append((op, (pick(f8),)))
            kinds.append("f8")
    # mostly f32 results (the quantized values then die inside the graph: what frees target);
    # sometimes an fp8 value or an intermediate escapes as an output too
    f32_out = [i for i in range(3, len(kinds)) if kinds[i] == "f32"] or [0]
    outs = draw(st.lists(st.sampled_from(f32_out), min_size=1, max_size=2, unique=True))
    if draw(st.integers(0, 5)) == 0 and len(kinds) > 3:
        outs.append(draw(st.sampled_from(range(3, len(kinds)))))
    outs = list(dict.fromkeys(outs))
    if not any(kinds[i] == "f32" for i in outs):
        outs.append(next(i for i in range(len(kinds) - 1, -1, -1) if kinds[i] == "f32"))
    policy = draw(st.sampled_from(["opaque", "all"]))
    return ops, outs, policy


def build(program) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    ops, outs, _ = program
    g = torch.fx.Graph()
    vals = [g.placeholder("x0"), g.placeholder("x1"), g.placeholder("s0")]
    for op, a in ops:
        x = [vals[i] for i in a]
        if op == "add":
            vals.append(g.call_function(aten.add.Tensor, (x[0], x[1])))
        elif op == "mul":
            vals.append(g.call_function(aten.mul.Tensor, (x[0], x[1])))
        elif op == "relu":
            vals.append(g.call_function(aten.relu.default, (x[0],)))
        elif op == "neg":
            vals.append(g.call_function(aten.neg.default, (x[0],)))
        elif op == "t":
            vals.append(g.call_function(aten.t.default, (x[0],)))
        elif op in ("view2", "view8"):
            up = g.call_function(aten.view.default, (x[0], [1, N, N]))  # valid for any strides (t() results)
            vals.append(g.call_function(aten.view.default, (up, [N, N])))
        elif op in ("alias", "alias8"):
            vals.append(g.call_function(aten.alias.default, (x[0],)))
        elif op == "cast8":
            vals.append(g.call_function(aten._to_copy.default, (x[0],), {"dtype": F8}))
        elif op == "cast32":
            vals.append(g.call_function(aten._to_copy.default, (x[0],), {"dtype": torch.float32}))
        elif op == "quantize2":
            q = g.call_function(QUANTIZE2, (x[0],))
            vals += [g.call_function(__import__("operator").getitem, (q, 0)),
                     g.call_function(__import__("operator").getitem, (q, 1))]
        elif op == "qgemm":
            vals.append(g.call_function(QGEMM, (x[0], x[1], x[2])))
    g.output(tuple(vals[i] for i in outs))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    gen = torch.Generator().manual_seed(len(ops) * 7919 + sum(outs))
    inputs = [torch.randn(N, N, generator=gen), torch.randn(N, N, generator=gen), torch.rand(1, generator=gen) + 0.5]
    record_vals(gm, *[t.clone() for t in inputs])
    return gm, inputs


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    from te_passes.fx.graph import copy_graph_module

    return copy_graph_module(gm)


def _run(gm, stage, inputs, policy, te=None):
    passes = configured_passes({"insert_early_frees": {"policy": policy}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_passes(gm, passes, stage, example_inputs=inputs, te_state=te or TEState()).report


def check_report(report, where: str) -> None:
    for r in report.runs:
        assert r.status != "failed", f"{where}: {r.name} failed: {r.error}"
        if r.status == "skipped":
            reasons = [rec.data.get("reason") for rec in r.records if rec.kind == "skipped"]
            assert reasons and all(isinstance(x, str) and x.strip() for x in reasons), f"{where}: {r.name} {r}"


def check_no_use_after_free(gm: torch.fx.GraphModule, where: str) -> None:
    from torch.multiprocessing.reductions import StorageWeakRef

    def storage(n):
        v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
        if isinstance(v, torch.Tensor):
            try:
                return StorageWeakRef(v.untyped_storage())
            except Exception:  # noqa: BLE001 - a tensor without storage (sparse, ...)
                return None
        return None

    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for f in gm.graph.nodes:
        if not free_op.is_free_node(f):
            continue
        t = f.args[0]
        freed = storage(t)
        for n in gm.graph.nodes:
            if order[n] <= order[f]:
                continue
            for a in n.all_input_nodes:
                assert a is not t, f"{where}: {n.name} reads {t.name} after its free {f.name}"
                if freed is not None and n.op != "output":
                    s = storage(a)
                    assert s is None or s != freed, f"{where}: {n.name} reads {a.name}, an alias of freed {t.name}"
            if n.op == "output":
                flat = torch.fx.node.map_arg(n.args, lambda x: x)
                for a in torch.utils._pytree.tree_leaves(flat):
                    if isinstance(a, torch.fx.Node):
                        s = storage(a)
                        assert a is not t and (freed is None or s is None or s != freed), \
                            f"{where}: graph output {a.name} is freed {t.name} or an alias of it"


def _outputs(gm, inputs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = gm(*[t.clone() for t in inputs])
    return [o.to(torch.float32) if o.dtype == F8 else o for o in out]


def check_equal(ref, new, where):
    assert len(ref) == len(new), where
    for a, b in zip(ref, new):
        assert a.shape == b.shape and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)), \
            f"{where}: outputs differ"


@settings(max_examples=EXAMPLES["random"], **_SETTINGS)
@given(programs(), st.sampled_from(STAGES))
def test_random_graphs_through_every_stage(program, stage):
    gm, inputs = build(program)
    ref = _outputs(_copy(gm), inputs)
    where = f"{stage.value}: {program}"
    report = _run(gm, stage, inputs, program[2])
    check_report(report, where)
    gm.graph.lint()
    gm.recompile()
    check_no_use_after_free(gm, where)
    COUNTS["frees"] += sum(1 for n in gm.graph.nodes if free_op.is_free_node(n))
    COUNTS["changed"] += any(r.changed for r in report.runs)
    check_equal(ref, _outputs(gm, inputs), where)
    code = gm.code
    again = _run(gm, stage, inputs, program[2])
    check_report(again, where + " (second run)")
    assert not any(r.changed for r in again.runs), f"{where}: not idempotent: {[r for r in again.runs if r.changed]}"
    gm.graph.lint()
    gm.recompile()
    assert gm.code == code, where
    check_equal(ref, _outputs(gm, inputs), where + " (second run)")
    COUNTS["random"] += 1  # this example passed every property


def test_the_checks_can_fail():
    """The use-after-free and equality checks reject a free placed before a use of an alias."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    q = g.call_function(aten._to_copy.default, (x,), {"dtype": F8})
    v = g.call_function(aten.alias.default, (q,))
    c = g.call_function(aten._to_copy.default, (v,), {"dtype": torch.float32})
    g.output((c,))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    inputs = [torch.randn(N, N)]
    record_vals(gm, *[t.clone() for t in inputs])  # values of the graph without the free (as in build)
    with g.inserting_after(v):
        g.call_function(torch.ops.te_passes.free_storage.default, (q,))
    gm.recompile()
    with pytest.raises(AssertionError, match="alias of freed"):
        check_no_use_after_free(gm, "crafted")
    # a direct read of the freed value: the structural check and the numerics both see it
    g2 = torch.fx.Graph()
    x = g2.placeholder("x")
    q = g2.call_function(aten._to_copy.default, (x,), {"dtype": F8})
    c = g2.call_function(aten._to_copy.default, (q,), {"dtype": torch.float32})
    g2.output((c,))
    gm2 = torch.fx.GraphModule(torch.nn.Module(), g2)
    record_vals(gm2, *[t.clone() for t in inputs])
    ref = _outputs(gm2, inputs)
    with g2.inserting_before(c):
        g2.call_function(torch.ops.te_passes.free_storage.default, (q,))
    gm2.recompile()
    with pytest.raises(AssertionError, match="after its free"):
        check_no_use_after_free(gm2, "crafted")
    with pytest.raises((AssertionError, RuntimeError)):
        check_equal(ref, _outputs(gm2, inputs), "crafted")


# --------------------------------------------------------------------------- mutated TE graphs
TE_CASES = [("fp8-cs", 1), ("mxfp8", 1), ("bf16", 1), ("fp8-cs", 2)]
GRAPHS = {"forward": Stage.POST_GRAD_FWD, "backward": Stage.POST_GRAD_BWD, "joint": Stage.JOINT}


@st.composite
def te_mutations(draw):
    case = draw(st.sampled_from(TE_CASES))
    which = draw(st.sampled_from(sorted(GRAPHS) + ["dynamo"]))
    muts = draw(st.lists(st.tuples(st.sampled_from(["drop_output", "alias_user", "cast_user", "view_output",
                                                    "dup_output"]),
                                   st.integers(0, 10_000)), max_size=4))
    policy = draw(st.sampled_from(["opaque", "all"]))
    return case, which, muts, policy


def _fake_val(target, args, kwargs):
    from torch._guards import detect_fake_mode

    vals = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta.get("val"))
    mode = detect_fake_mode(torch.utils._pytree.tree_leaves(vals))
    with mode:
        return target(*vals[0], **vals[1])


def mutate(gm: torch.fx.GraphModule, muts) -> list[str]:
    """Apply ``muts``: drop an output element, add an ATen alias / cast user of a tensor value
    after its producer (returned as a new output), return a view of a value, return a value
    twice. Every new node gets a fake ``meta['val']``. Returns what was done."""
    done = []
    g = gm.graph
    out = g.output_node()
    for kind, k in muts:
        tensors = [n for n in g.nodes if n.op not in ("output", "placeholder")
                   and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() >= 1]
        outs = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
        if kind == "drop_output" and len(outs) > 1:
            i = k % len(outs)
            done.append(f"drop output {i}")
            outs.pop(i)
        elif kind in ("alias_user", "cast_user", "view_output") and tensors:
            t = tensors[k % len(tensors)]
            with g.inserting_before(out):
                if kind == "alias_user":
                    target, args, kw = aten.alias.default, (t,), {}
                elif kind == "cast_user":
                    target, args, kw = aten._to_copy.default, (t,), {"dtype": torch.float32}
                else:
                    target, args, kw = aten.view.default, (t, [-1]), {}
                try:
                    val = _fake_val(target, args, kw)
                except Exception:  # noqa: BLE001 - an op this value does not support: skip the mutation
                    continue
                n = g.call_function(target, args, kw)
                n.meta["val"] = val
            outs.append(n)
            done.append(f"{kind} of {t.name}")
        elif kind == "dup_output" and outs:
            outs.append(outs[k % len(outs)])
            done.append(f"dup output {k % len(outs)}")
        out.args = (tuple(outs),)
    g.lint()
    gm.recompile()
    return done


_TE_SKIP = None if te_available() else "transformer_engine not installed"


@pytest.mark.skipif(_TE_SKIP is not None, reason=str(_TE_SKIP))
@settings(max_examples=EXAMPLES["te"], **_SETTINGS)
@given(te_mutations())
def test_mutated_real_te_graphs_through_their_stage(m):
    from te_passes.testing.capture import cached_aot
    from te_passes.testing.fake_gpu import fake_gpu

    (precision, layers), which, muts, policy = m
    aot = cached_aot(precision, layers)
    if which == "dynamo":
        gm, inputs, stage = aot.dynamo.gm, aot.dynamo.example_inputs, Stage.DYNAMO
    else:
        gm = getattr(aot, which)
        inputs, stage = getattr(aot, f"{which}_inputs"), GRAPHS[which]
    with fake_gpu(precision):
        done = mutate(gm, muts)
        where = f"{precision} x{layers} {which} {done} policy={policy}"
        report = _run(gm, stage, inputs, policy, te=capture_te_state())
        check_report(report, where)
        gm.graph.lint()
        gm.recompile()
        check_no_use_after_free(gm, where)
        code = gm.code
        again = _run(gm, stage, inputs, policy, te=capture_te_state())
        check_report(again, where + " (second run)")
        assert not any(r.changed for r in again.runs), \
            f"{where}: not idempotent: {[(r.name, r.records[:3]) for r in again.runs if r.changed]}"
        gm.recompile()
        assert gm.code == code, where
    COUNTS["te"] += 1  # this example passed every property


@pytest.fixture(scope="module", autouse=True)
def _report_counts(request):
    """Print the example count once pytest has stopped capturing output (at unconfigure)."""
    def report():
        total = COUNTS["random"] + COUNTS["te"]
        if total:
            sys.stdout.write(f"\ntest_properties ({PROFILE} profile): {total} examples ({COUNTS['random']} random "
                             f"graphs, {COUNTS['te']} mutated TE graphs) passed every property; random graphs changed "
                             f"by a pass: {COUNTS['changed']}, frees inserted: {COUNTS['frees']}\n")
            sys.stdout.flush()
    request.config.add_cleanup(report)
    yield
