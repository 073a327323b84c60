"""Issue 42: ``torch.no_grad()`` evaluation between fp8 training steps compiles once per grad mode (row
``autocast.traced_quantizer_copies``, te_passes/compat/autocast/traced_quantizers.py).

TE 2.20.2's compiled te.Linear path sets the usage flags of the module's value-opaque quantizers by grad mode while
Dynamo traces (``_linear_forward_fake``), on the real objects, and Dynamo guards on them: without the row every
train <-> no_grad switch recompiles. With it the op gets per-call copies; these tests check that the graphs' TE op
calls are TE's own (the quantizers' values in each op call equal those TE's path builds), that the module's
quantizers keep their values, and that the graph constants are not changed by a later trace.

No GPU: a te.Linear on fake CUDA tensors (te_passes.testing.fake_gpu), compiled with a recording backend marked as
te_inductor (its polyfills and rows: ``mark_untouched_backend``) that snapshots each graph's TE op calls when it
is compiled and runs the graph on the fake tensors (TE's fake impls). tests/gpu/test_training_loop_gpu.py checks the
inference graph's values against TE eager under ``no_grad`` on a GPU.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

pytest.importorskip("transformer_engine.pytorch")

from te_passes.compat import table  # noqa: E402
from te_passes.compat.autocast import traced_quantizers  # noqa: E402
from te_passes.te.graph_constants import TEConstKind, bundle_dict, quantizer_fields, te_const_kind  # noqa: E402

import _rows  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

LINEAR_OP = "transformer_engine_compile.linear"


def _value(v: Any) -> Any:
    """A comparable snapshot of an op argument: tensors by shape / dtype, TE quantizers and bundles by value."""
    if isinstance(v, torch.fx.Node):
        ev = v.meta.get("example_value")
        return ("tensor", tuple(ev.shape), ev.dtype) if isinstance(ev, torch.Tensor) else ("node", v.name)
    if isinstance(v, (list, tuple)):
        return tuple(_value(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _value(x)) for k, x in v.items()))
    kind = te_const_kind(v)
    if kind is TEConstKind.QUANTIZER:
        return (type(v).__qualname__, tuple(sorted((k, repr(x)) for k, x in quantizer_fields(v).items())))
    if kind is TEConstKind.BUNDLE:
        return ("bundle", _value(bundle_dict(v)))
    return v if isinstance(v, (bool, int, float, str, type(None))) else repr(v)


def op_calls(gm: torch.fx.GraphModule) -> list[Any]:
    """The TE linear op calls of ``gm``, their arguments as :func:`_value` snapshots."""
    return [_value((n.args, n.kwargs)) for n in gm.graph.nodes
            if n.op == "call_function" and str(n.target).startswith(LINEAR_OP)]


def flags(lin: Any) -> dict[str, tuple[bool, bool]]:
    """The usage flags of ``lin``'s quantizers, per slot."""
    return {f"{k}[{i}]": (q.rowwise_usage, q.columnwise_usage)
            for k, slot in (lin.quantizers or {}).items() for i, q in enumerate(slot) if q is not None}


@contextlib.contextmanager
def linear(precision: str = "fp8-cs", *, marked: bool = True, row: bool = True):
    """A te.Linear on fake CUDA and ``run(grad)``: one compiled call under ``te.autocast``, with grad (a
    training forward) or under ``torch.no_grad()`` after ``lin.eval()``. Yields ``(lin, run, compiled)``:
    ``compiled`` lists ``(gm, op_calls(gm) when compiled)``. ``marked``: the backend is te_inductor's stand-in;
    ``row``: row ``autocast.traced_quantizer_copies`` applied (else reverted: TE's own ``_get_quantizers``, applied
    again on exit)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from te_passes.compat.dynamo.hooks import mark_untouched_backend
    from te_passes.compat.install import install
    from te_passes.testing.fake_gpu import capture_lock, constructing, fake_gpu, import_te, make_recipe, quiet

    te = import_te()
    compiled: list[tuple[torch.fx.GraphModule, list[Any]]] = []

    def backend(gm, example_inputs):
        compiled.append((gm, op_calls(gm)))
        return gm.forward
    if marked:
        mark_untouched_backend(backend)
    with capture_lock, quiet(), fake_gpu(precision):
        torch._dynamo.reset()
        install()
        stack = contextlib.ExitStack()
        if not row:
            stack.enter_context(without_copies())
        recipe = make_recipe(precision)
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode, constructing():
            lin = te.Linear(64, 64, bias=False, params_dtype=torch.bfloat16, device="cuda")
            x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        fn = torch.compile(lin, backend=backend, dynamic=False)

        def run(grad: bool) -> None:
            lin.train(grad)
            with mode, (contextlib.nullcontext() if grad else torch.no_grad()), \
                    te.autocast(enabled=True, recipe=recipe):
                fn(x)
        with stack:
            yield lin, run, compiled


@contextlib.contextmanager
def without_copies():
    """TE's own ``_linear_op`` call while inside: row ``autocast.traced_quantizer_copies`` reverted (its wrapper, when
    ``delayed_scaling.linear_op`` wraps it, stays in the chain and passes TE's call through), applied again after."""
    _rows.off(traced_quantizers.ROW)
    try:
        yield
    finally:
        assert _rows.on(traced_quantizers.ROW), table.refusal(traced_quantizers.ROW)


def _alternate(run, steps: int = 3) -> None:
    for _ in range(steps):
        run(True)
        run(False)


@pytest.mark.parametrize("precision", ["fp8-cs", "mxfp8"])
def test_train_eval_alternation_compiles_two_graphs_and_leaves_the_quantizers_alone(precision):
    """3 x (training forward, no_grad forward): one graph per grad mode, both reused; the module's quantizers keep
    the values they had after TE's lazy init (the traces wrote to copies)."""
    with linear(precision) as (lin, run, compiled):
        assert table.refusal(traced_quantizers.ROW) is None, table.refusal(traced_quantizers.ROW)
        run(True)
        before = flags(lin)
        assert before and all(f == (True, True) for f in before.values()), before  # TE's defaults
        run(False)
        _alternate(run)
        assert len(compiled) == 2, [c[1] for c in compiled]
        assert flags(lin) == before


def test_without_the_row_each_switch_recompiles():
    """TE's own path (row reverted): the traces set the module's usage flags by grad mode, every switch fails the
    other graph's guards and compiles again."""
    with linear(row=False) as (lin, run, compiled):
        _alternate(run)
        assert len(compiled) == 6
        assert flags(lin)["scaling_fwd[0]"] == (True, False)  # the last (no_grad) trace's value


def _calls_per_mode(row: bool) -> tuple[list[Any], list[Any]]:
    with linear(row=row) as (lin, run, compiled):
        run(True)
        run(False)
        assert len(compiled) == 2
        return compiled[0][1], compiled[1][1]


def test_op_calls_equal_te_own_path_in_each_grad_mode():
    """The training and the inference graph's TE op call (quantizer values, usage flags included, and the config
    bundle) are what TE's own path builds for the first trace in each grad mode: the inference op gets TE's
    no_grad usage (input and weight columnwise off), the training op TE's training usage."""
    te_train, te_eval = _calls_per_mode(row=False)
    train, evaluation = _calls_per_mode(row=True)
    assert train == te_train and evaluation == te_eval
    # the grad mode is in the op call (TE's usage by grad mode, linear.py:832/861), not in a guarded attribute
    assert _usage(train) == {"input_quantizer": (True, True), "weight_quantizer": (True, True)}
    assert _usage(evaluation) == {"input_quantizer": (True, False), "weight_quantizer": (True, False)}


def _usage(calls: list[Any]) -> dict[str, tuple[bool, bool]]:
    """``(rowwise, columnwise)`` usage of the input and weight quantizers in the one op call's config bundle."""
    (call,) = calls
    args, _ = call
    kind, config = args[-1]
    assert kind == "bundle"
    out = {}
    for field in ("input_quantizer", "weight_quantizer"):
        values = dict(dict(config)[field][1])
        out[field] = (values["rowwise_usage"] == "True", values["columnwise_usage"] == "True")
    return out


@pytest.mark.parametrize("row", [True, False])
def test_graph_constants_are_not_changed_by_a_later_trace(row):
    """The quantizers inside a compiled graph's op call are the trace's own copies: the no_grad trace that follows
    leaves the training graph's op call as it was compiled. TE's own path (row reverted) hands the op the module's
    objects, so the no_grad trace rewrites the compiled training graph's constants (its usage flags)."""
    with linear(row=row) as (lin, run, compiled):
        run(True)
        run(False)
        now = [op_calls(gm) for gm, _ in compiled]
        assert (now == [calls for _, calls in compiled]) is row
        assert now[1] == compiled[1][1]  # the last trace's graph: as compiled either way


def test_other_backends_frames_keep_te_behaviour():
    """The row acts only in te_inductor frames: under another backend TE's trace still writes the module's
    quantizers (and recompiles at each switch, TE's behaviour)."""
    with linear(marked=False) as (lin, run, compiled):
        run(True)
        run(False)
        assert flags(lin)["scaling_fwd[0]"] == (True, False)
        run(True)
        assert len(compiled) == 3


def test_row_refuses_a_te_without_copy(monkeypatch):
    """A value-opaque quantizer class without ``copy()`` (a TE change): refused with the class named; the wrapper
    passes TE's call through (``active()``)."""
    with without_copies():
        monkeypatch.setattr(traced_quantizers, "_has_copy", lambda q: q != "Float8CurrentScalingQuantizer")
        assert not _rows.on(traced_quantizers.ROW)
        assert "['Float8CurrentScalingQuantizer'] have no copy()" in table.refusal(traced_quantizers.ROW)
        assert not traced_quantizers.active()
        monkeypatch.undo()
        _rows.off(traced_quantizers.ROW)
    assert traced_quantizers.active()


def test_reapplied_row_does_not_wrap_twice():
    """Reverted and applied again while ``delayed_scaling.linear_op`` wraps it: one wrapper of ours in TE's
    ``_linear_op`` chain, active again."""
    import transformer_engine.pytorch.module.linear as te_linear

    def ours():
        return traced_quantizers.wrappers_in(te_linear._linear_op)
    with without_copies():
        assert ours() == 1 and not traced_quantizers.active()
    assert ours() == 1 and traced_quantizers.active()
