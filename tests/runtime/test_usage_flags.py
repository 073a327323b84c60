"""Issue 17: alternating eager and compiled steps of one fp8 te.Linear does not recompile.

TE 2.20.2's eager ``_linear_forward_impl`` leaves a column-parallel sequence-parallel layer's input
quantizer with ``columnwise_usage=False`` (``module/linear.py:488``/``:502``: fp8 all-gather is
row-wise only); Dynamo's trace of the same module leaves ``True`` on that persistent quantizer
(``_linear_forward_fake``, ``linear.py:835``) and guards ``quantizers['scaling_fwd'][0]
.columnwise_usage == True``. So every eager step recompiled the next compiled call (measured on
2 x H200, docs/benchmarks.md; after 8 recompiles Dynamo runs the frame eagerly for good).
te_passes' wrappers around the impls (:mod:`te_passes.compat.autocast.amax_groups`) put the usage flags back
when the last call in flight on a quantizer returns.

No GPU: ``fake`` process group of size 2 (conftest ``fake_tp_group``), TE on fake CUDA tensors;
the eager step is TE's real eager forward, which runs ``_linear_forward_impl`` up to its first
kernel (the input quantize, after the ``set_usage`` calls that matter); the backward test runs
TE's real ``_linear_backward_impl`` up to its first kernel. Compiles are counted by what reaches
Inductor (``compile_fx`` stands in: no GPU to compile for) and by Dynamo's guard failures.
"""

from __future__ import annotations

import types
from unittest import mock

import pytest
import torch

from te_passes.compat.autocast import quantizer_usage
from te_passes.testing.capture import capture_skip_reason

from _overlap import b_runs_inside_a, stand_in_impls  # noqa: E402
import _rows  # noqa: E402

pytestmark = pytest.mark.skipif(capture_skip_reason() is not None, reason=str(capture_skip_reason()))

ALTERNATIONS = 8


@pytest.fixture(scope="module")
def group(fake_tp_group):
    return fake_tp_group


@pytest.fixture
def hooks():
    from te_passes.compat.autocast import amax_groups

    _rows.on(amax_groups.ROW)
    yield amax_groups
    _rows.off(amax_groups.ROW)
    _rows.on(amax_groups.ROW)


@pytest.fixture
def no_usage_restore(hooks, monkeypatch):
    """The hooks installed as if the usage audit had failed: groups released, flags left as is."""
    _rows.off(hooks.ROW)
    monkeypatch.setattr(hooks, "usage_unsafe_reason", lambda mod: "test: usage restore off")
    assert _rows.on(hooks.ROW)
    assert not hooks.usage_restore_installed()
    yield hooks
    _rows.off(hooks.ROW)
    monkeypatch.undo()
    _rows.on(hooks.ROW)


def _layer(parallel_mode, group, precision="fp8-cs", sequence_parallel=True):
    from test_amax_groups import _SP

    m = _SP.__new__(_SP)
    import contextlib

    import transformer_engine.pytorch as te
    from torch._subclasses.fake_tensor import FakeTensorMode

    from te_passes.testing import dynamo_capture as DC
    from te_passes.testing import fake_gpu as FG

    m.DC, m.te, m.group = DC, te, group
    m.recipe = FG.make_recipe(precision)
    m.stack = contextlib.ExitStack()
    m.stack.enter_context(FG.quiet())
    m.stack.enter_context(FG.fake_gpu(precision))
    m.mode = FakeTensorMode(allow_non_fake_inputs=True)
    kw = {} if parallel_mode is None else dict(parallel_mode=parallel_mode, sequence_parallel=sequence_parallel,
                                               tp_group=group)
    with m.mode, FG.constructing():
        m.lin = te.Linear(64, 128, params_dtype=torch.bfloat16, device="cuda", **kw)
        m.x = torch.randn(32, int(m.lin.weight.shape[1]), dtype=torch.bfloat16, device="cuda", requires_grad=True)
    if precision == "bf16":  # te.autocast(enabled=True, recipe=None) would pick TE's default fp8 recipe
        m.te = types.SimpleNamespace(autocast=lambda **kw: contextlib.nullcontext())
    return m


@pytest.fixture
def layer(group):
    made = []

    def make(*args, **kw):
        made.append(_layer(args[0], group, *args[1:], **kw))
        return made[-1]
    yield make
    for m in made:
        m.stack.close()


def _flags(m) -> dict[str, tuple[bool, bool]]:
    return {f"{k}[{i}]": (q.rowwise_usage, q.columnwise_usage)
            for k, slot in (m.lin.quantizers or {}).items() for i, q in enumerate(slot) if q is not None}


def _eager(m) -> None:
    """TE's eager forward (stops at its first kernel here); bf16 builds no quantizers."""
    m.run_eager()


def _alternate(m, n: int, backend="te_inductor"):
    """An eager step, the compile and first compiled call, then ``n`` x (eager step, compiled
    call). Returns (graphs that reached Inductor, recompile reasons, the flags before and after
    each of the ``n`` eager steps)."""
    from test_amax_groups import _call_expect_trace, te_inductor_without_gpu

    _eager(m)
    fn = m.compile(backend)
    torch._dynamo.utils.guard_failures.clear()
    torch._dynamo.utils.counters.clear()
    around = []
    with te_inductor_without_gpu() as seen:
        _call_expect_trace(m, fn)
        for _ in range(n):
            before = _flags(m)
            _eager(m)
            around.append((before, _flags(m)))
            _call_expect_trace(m, fn)
    reasons = [r.split("  #")[0] for rs in torch._dynamo.utils.guard_failures.values() for r in rs]
    # Dynamo's own count of the graphs it compiled agrees with what reached the backend
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == len(seen), reasons
    return seen, reasons, around


def test_column_sp_fp8_alternation_compiles_once_and_eager_leaves_flags_as_found(layer, hooks):
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    assert hooks.usage_restore_installed(), hooks.hook_stats()
    m = layer("column")
    seen_in_call = []
    orig = Float8CurrentScalingQuantizer.quantize

    def spy(self, *a, **kw):  # the first kernel of TE's eager forward: what TE set for it
        seen_in_call.append((self.rowwise_usage, self.columnwise_usage))
        return orig(self, *a, **kw)

    restored = hooks.hook_stats()["usage_restored_after_calls"]
    with mock.patch.object(Float8CurrentScalingQuantizer, "quantize", spy):
        seen, reasons, around = _alternate(m, ALTERNATIONS)
    assert len(seen) == 1, f"{len(seen)} compiles for {ALTERNATIONS} alternations; reasons {reasons}"
    assert reasons == []
    assert all(before == after for before, after in around), around
    # TE's impl did change the flag during each eager call (488: fp8 all-gather is row-wise only),
    # and the wrapper put it back: the test is not vacuous.
    assert seen_in_call and all(s == (True, False) for s in seen_in_call), seen_in_call
    assert around[0][0]["scaling_fwd[0]"] == (True, True)
    assert hooks.hook_stats()["usage_restored_after_calls"] >= restored + 1 + ALTERNATIONS


def test_without_usage_restore_each_alternation_recompiles_on_the_usage_guard(layer, no_usage_restore):
    """The failure the restore removes (what the 2-GPU run measured: one recompile per alternation), with TE's own
    trace (row ``autocast.traced_quantizer_copies`` off: the trace sets the module's flag back to ``True``)."""
    from test_traced_quantizer_copies import without_copies

    m = layer("column")
    with without_copies():
        seen, reasons, around = _alternate(m, 3)
    assert len(seen) == 1 + 3, reasons
    assert reasons and all("['scaling_fwd'][0].columnwise_usage == True" in r for r in reasons), reasons
    assert all(before["scaling_fwd[0]"] == (True, True) and after["scaling_fwd[0]"] == (True, False)
               for before, after in around), around


def test_traced_copies_alone_keep_the_alternation_at_one_graph(layer, no_usage_restore):
    """Without the restore but with row ``autocast.traced_quantizer_copies``: the trace no longer writes the module's
    flag, so the value each eager step leaves is the one the graph guarded on: one graph."""
    m = layer("column")
    seen, reasons, around = _alternate(m, 3)
    assert len(seen) == 1 and reasons == [], reasons
    assert all(after["scaling_fwd[0]"] == (True, False) for _, after in around), around


@pytest.mark.parametrize("case", ["row-sp-fp8", "column-no-sp-fp8", "plain-fp8", "column-sp-bf16", "plain-bf16"])
def test_other_paths_do_not_recompile_even_without_usage_restore(layer, no_usage_restore, case):
    """Which paths have the recompile at all (forward, CPU): only column-parallel sequence-parallel
    fp8, whose all-gather branch narrows the input quantizer (linear.py:488/502). Row-parallel, no
    sequence parallelism and plain te.Linear set the input quantizer as the trace does (524 / 835:
    ``rowwise=True, columnwise=backward_needs_input``); bf16 has no quantizers."""
    mode, sp, precision = {"row-sp-fp8": ("row", True, "fp8-cs"), "column-no-sp-fp8": ("column", False, "fp8-cs"),
                           "plain-fp8": (None, False, "fp8-cs"), "column-sp-bf16": ("column", True, "bf16"),
                           "plain-bf16": (None, False, "bf16")}[case]
    m = layer(mode, precision, sequence_parallel=sp)
    seen, reasons, around = _alternate(m, 3)
    assert len(seen) == 1 and reasons == [], reasons
    if precision == "bf16":
        assert not m.lin.quantizers or not any(m.lin.quantizers.values())


def test_backward_impl_flags_put_back_after_te_backward_runs_to_its_first_kernel(layer, hooks):
    """TE's real ``_linear_backward_impl``: args built by TE's ``_linear_setup_ctx`` from the
    forward's args, as ``_Linear.forward`` does; it sets the grad-output quantizer's usage
    (1243: both), and stops at the first quantize (row-parallel SP: inside
    ``gather_along_first_dim``, which narrows the usage for it, distributed.py:1039). Flags
    before the call are deliberately not TE's, so a missing restore shows."""
    import transformer_engine.pytorch.module.linear as L
    from transformer_engine.pytorch.quantized_tensor import Quantizer

    m = layer("row")
    captured = []
    wrapped_fwd = L._linear_forward_impl

    def record(args, *a, **kw):
        captured.append(args)
        return wrapped_fwd(args, *a, **kw)
    with mock.patch.object(L, "_linear_forward_impl", record):
        _eager(m)
    [fwd] = captured
    bwd = L.LinearBwdArgs()
    saved = L._linear_setup_ctx(bwd, fwd, (None, None),
                                {"fsdp_shapes": [], "saved_tensor_aliases": ("inp", None, "weight", None)},
                                (None, None, None, None))
    bwd.inputmat, bwd.weight_fp8, bwd.saved_weight = saved[0], None, saved[2]
    gq = bwd.grad_output_quantizer
    assert gq is m.quantizer("grad_output")
    gq.set_usage(rowwise=False, columnwise=True)
    set_in_call = []
    orig = Quantizer.set_usage

    def spy(self, *, rowwise=None, columnwise=None):
        if self is gq:
            set_in_call.append((rowwise, columnwise))
        return orig(self, rowwise=rowwise, columnwise=columnwise)
    with m.mode:
        bwd.grad_output = torch.randn(32, 128, dtype=torch.bfloat16, device="cuda")
        with mock.patch.object(Quantizer, "set_usage", spy), pytest.raises(Exception):  # noqa: B017 - no GPU
            L._linear_backward_impl(bwd)
    assert set_in_call[:2] == [(True, True), (True, False)], set_in_call  # 1243, then distributed.py:1039
    assert set_in_call[-1] == (False, True), "the last write is the wrapper's restore"
    assert (gq.rowwise_usage, gq.columnwise_usage) == (False, True)


# ------------------------------------------------------------------------- reentry (stand-in impls)
def _quantizer():
    import transformer_engine.pytorch  # noqa: F401
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    return Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, device=torch.device("cpu"))


class _Debug:
    """A TE ``DebugQuantizer`` as the wrapper sees it: a per-call object whose ``set_usage``
    also sets its ``parent_quantizer``'s (``debug_quantization.py:557``)."""

    def __init__(self, parent):
        self.parent_quantizer = parent
        self.rowwise_usage = self.columnwise_usage = True

    def set_usage(self, rowwise=None, columnwise=None):
        if rowwise is not None:
            self.rowwise_usage = rowwise
        if columnwise is not None:
            self.columnwise_usage = columnwise
        if self.parent_quantizer is not None:
            self.parent_quantizer.set_usage(rowwise=rowwise, columnwise=columnwise)


@pytest.fixture
def stub_impls(monkeypatch):
    """Stand-in impls in TE's real ``module.linear`` that set usage like TE's (one ``set_usage``
    each, audited as such), wrapped by the real install; ``body`` is the forward's rest."""
    from te_passes.compat.autocast import amax_groups

    import transformer_engine.pytorch.module.linear as linear
    _rows.off(amax_groups.ROW)
    body = {}

    def _linear_forward_impl(args):
        args.input_quantizer.set_usage(rowwise=True, columnwise=False)
        return body["fwd"](args)

    def _linear_backward_impl(args):
        args.grad_output_quantizer.set_usage(rowwise=True, columnwise=False)
        return args

    monkeypatch.setattr(amax_groups, "unsafe_reason", lambda mod: None)  # the stand-ins set no group
    monkeypatch.setattr(quantizer_usage, "AUDITED_USAGE_CALLS", {"_linear_forward_impl": {"set_usage": (1,)},
                                                                 "_linear_backward_impl": {"set_usage": (1,)}})
    with stand_in_impls(monkeypatch, linear, _linear_forward_impl, _linear_backward_impl):
        assert amax_groups.usage_restore_installed(), amax_groups.hook_stats()
        yield linear, body


def _args(q, **kw):
    return types.SimpleNamespace(input_quantizer=q, sequence_parallel=False, **kw)


def test_nested_call_does_not_restore_under_the_running_outer_call(stub_impls):
    linear, body = stub_impls
    q = _quantizer()
    q.set_usage(rowwise=False, columnwise=True)
    seen = []

    def fwd(args):
        if args.depth == 0:
            linear._linear_forward_impl(_args(q, depth=1))
            seen.append((q.rowwise_usage, q.columnwise_usage))  # the outer call goes on with TE's values
        return args
    body["fwd"] = fwd
    linear._linear_forward_impl(_args(q, depth=0))
    assert seen == [(True, False)], "the nested call's restore changed the flags under the running outer call"
    assert (q.rowwise_usage, q.columnwise_usage) == (False, True), "not restored after the outermost call"


def test_restored_when_the_impl_raises(stub_impls):
    linear, body = stub_impls
    q = _quantizer()
    q.set_usage(rowwise=False, columnwise=True)

    def fwd(args):
        raise RuntimeError("first kernel")
    body["fwd"] = fwd
    with pytest.raises(RuntimeError, match="first kernel"):
        linear._linear_forward_impl(_args(q))
    assert (q.rowwise_usage, q.columnwise_usage) == (False, True)


def test_concurrent_call_on_another_thread_does_not_restore_under_it(stub_impls):
    linear, body = stub_impls
    q = _quantizer()
    q.set_usage(rowwise=False, columnwise=True)
    seen = b_runs_inside_a(body, lambda who: linear._linear_forward_impl(_args(q, who=who)),
                           lambda: (q.rowwise_usage, q.columnwise_usage))
    assert seen == (True, False)
    assert (q.rowwise_usage, q.columnwise_usage) == (False, True)


def test_debug_quantizers_of_one_parent_share_the_count_and_the_parent_is_restored(stub_impls):
    linear, body = stub_impls
    parent = _quantizer()
    parent.set_usage(rowwise=False, columnwise=True)
    outer, inner = _Debug(parent), _Debug(parent)
    seen = []

    def fwd(args):
        if args.input_quantizer is outer:
            linear._linear_forward_impl(_args(inner))
            seen.append((parent.rowwise_usage, parent.columnwise_usage))
        return args
    body["fwd"] = fwd
    linear._linear_forward_impl(_args(outer))
    assert seen == [(True, False)]
    assert (parent.rowwise_usage, parent.columnwise_usage) == (False, True)


def test_debug_quantizer_around_no_quantizer_is_skipped(stub_impls):
    linear, body = stub_impls
    body["fwd"] = lambda args: args
    d = _Debug(None)
    linear._linear_forward_impl(_args(d))  # nothing persistent to restore; must not fail
    assert (d.rowwise_usage, d.columnwise_usage) == (True, False)


def test_weight_quantizer_left_alone_for_quantized_or_distributed_weights(hooks):
    from te_passes.compat.autocast.quantizer_usage import usage_targets

    wq, iq = object(), object()
    plain = types.SimpleNamespace(weight=torch.zeros(1), weight_quantizer=wq, input_quantizer=iq)
    assert usage_targets(plain, ("input_quantizer", "weight_quantizer"), "weight") == [iq, wq]
    dist_w = torch.zeros(1)
    dist_w.is_distributed_weight = True
    assert usage_targets(types.SimpleNamespace(weight=dist_w, weight_quantizer=wq), ("weight_quantizer",),
                          "weight") is None
    bwd = types.SimpleNamespace(saved_weight=torch.zeros(1), weight_quantizer=wq, is_weight_param_quantized=True)
    assert usage_targets(bwd, ("weight_quantizer",), "saved_weight") is None
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import Float8TensorStorage

    qt = Float8TensorStorage(data=torch.zeros(4, 4, dtype=torch.uint8), fp8_scale_inv=torch.ones(1),
                             fp8_dtype=tex.DType.kFloat8E4M3, quantizer=None)  # a quantized weight
    assert usage_targets(types.SimpleNamespace(weight=qt, weight_quantizer=wq), ("weight_quantizer",),
                          "weight") is None


# ------------------------------------------------------------------------- the audit and refusing
def test_audit_matches_te_2_20_2_impls(hooks):
    """The audited set_usage call sites are exactly those of the installed TE's impls (fails when
    TE's impl changes: then the module docstring's audit must be redone)."""
    import transformer_engine.pytorch.module.linear as linear

    assert quantizer_usage.usage_unsafe_reason(linear) is None
    assert hooks.usage_restore_installed()


def set_usage_stub(q):
    q.set_usage(rowwise=True)


def test_usage_unsafe_reason_names_the_call_sites_that_changed(hooks):
    mod = types.ModuleType("fake_te_linear")
    mod._linear_forward_impl = set_usage_stub
    mod._linear_backward_impl = set_usage_stub
    reason = quantizer_usage.usage_unsafe_reason(mod)
    assert reason is not None and "_linear_forward_impl no longer has the audited usage-setting calls" in reason
    assert "set_usage: 7 call site(s) audited (TE 2.20.2 lines [482, 488, 492, 502, 524, 571, 617]), 1 found" in reason
    del mod._linear_forward_impl
    assert "_linear_forward_impl is missing" in quantizer_usage.usage_unsafe_reason(mod)


def test_install_keeps_the_group_release_but_not_the_usage_restore_when_the_audit_fails(hooks, monkeypatch, caplog):
    import transformer_engine.pytorch.module.linear as linear

    _rows.off(hooks.ROW)
    audited = {k: dict(v) for k, v in quantizer_usage.AUDITED_USAGE_CALLS.items()}
    audited["_linear_backward_impl"]["set_usage"] = (*audited["_linear_backward_impl"]["set_usage"], 9999)
    monkeypatch.setattr(quantizer_usage, "AUDITED_USAGE_CALLS", audited)
    with caplog.at_level("WARNING", logger="te_passes"):
        assert _rows.on(hooks.ROW)
    assert "_linear_backward_impl no longer has the audited usage-setting calls" in hooks.hook_stats()["usage_refused"]
    assert any("not restoring TE quantizer usage flags" in r.getMessage() for r in caplog.records)
    assert getattr(linear._linear_forward_impl, "_te_passes_amax_hook", False)
    assert not hooks.usage_restore_installed()
    _rows.off(hooks.ROW)
    monkeypatch.undo()
    assert _rows.on(hooks.ROW) and hooks.hook_stats()["usage_refused"] is None
    assert hooks.usage_restore_installed()

