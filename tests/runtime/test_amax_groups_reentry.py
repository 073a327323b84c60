"""Review of the issue-8 hooks (:mod:`te_passes.compat.autocast.amax_groups`): re-entrant / concurrent calls and
the per-call cost of the wrappers around TE's ``_linear_forward_impl`` / ``_linear_backward_impl``.

TE 2.20.2 only *sets* the group at the start of each impl call (``module/linear.py:448``,
``:1142``/``:1150``), so overlapping calls on the same quantizer all write the same value and none
of them can lose it. The wrapper adds a *release* when a call returns; that release must not strip
the group from under a call of the same quantizer that is still running (a nested call, or a second
thread — e.g. the autograd engine's device thread running a backward while another thread runs a
forward of the same module), or that call's current-scaling quantize would skip the TP amax
reduction and the ranks would use different scales (silently wrong numerics).

The impls here are stand-ins installed in TE's real ``module.linear`` (so the real install path,
layout check and wrapper are exercised); the quantizer is TE's real
``Float8CurrentScalingQuantizer`` and the group a real ``ProcessGroup`` (``fake`` backend, size 2).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from te_passes.testing.capture import capture_skip_reason

from _overlap import b_runs_inside_a, stand_in_impls  # noqa: E402
import _rows  # noqa: E402

pytestmark = pytest.mark.skipif(capture_skip_reason() is not None, reason=str(capture_skip_reason()))


@pytest.fixture(scope="module")
def group(fake_tp_group):
    return fake_tp_group


def _quantizer():
    import transformer_engine.pytorch  # noqa: F401  (registers the extension)
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    return Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, device=torch.device("cpu"))


def set_quantizer_amax_reduction_group(quantizer, group):  # the stand-ins call TE's by this name
    from transformer_engine.pytorch.module._common import set_quantizer_amax_reduction_group as te_set

    te_set(quantizer, group)


@pytest.fixture
def stub_impls(monkeypatch):
    """Install the hooks over stand-in impls in TE's ``module.linear``; yields a setter for the
    forward stand-in's body. TE's real impls and hooks are restored afterwards."""
    from te_passes.compat.autocast import amax_groups

    linear = sys.modules.get(amax_groups.TE_LINEAR_MODULE)
    if linear is None:
        import transformer_engine.pytorch.module.linear as linear  # noqa: F811
    _rows.off(amax_groups.ROW)
    body = {}

    def _linear_forward_impl(args):  # stands in for TE's: sets the group first, like linear.py:448
        set_quantizer_amax_reduction_group(args.input_quantizer, args.tp_group)
        return body["fwd"](args)

    def _linear_backward_impl(args):  # like linear.py:1142/1150
        set_quantizer_amax_reduction_group(args.input_quantizer, None)
        set_quantizer_amax_reduction_group(args.grad_output_quantizer, args.tp_group)
        return args

    with stand_in_impls(monkeypatch, linear, _linear_forward_impl, _linear_backward_impl):
        assert getattr(linear._linear_forward_impl, "_te_passes_amax_hook", False)
        yield linear, body


def test_nested_call_keeps_the_group_until_the_outermost_call_returns(group, stub_impls):
    from te_passes.compat.autocast.amax_groups import holds_process_group

    linear, body = stub_impls
    q = _quantizer()
    seen = []

    def fwd(args):
        if args.depth == 0:
            linear._linear_forward_impl(types.SimpleNamespace(input_quantizer=q, tp_group=group, depth=1))
            seen.append(holds_process_group(q))  # the outer call goes on to quantize with it
        return args
    body["fwd"] = fwd
    linear._linear_forward_impl(types.SimpleNamespace(input_quantizer=q, tp_group=group, depth=0))
    assert seen == [True], "the nested call's release stripped the group from the running outer call"
    assert not holds_process_group(q), "not released after the outermost call"


def test_concurrent_call_on_another_thread_does_not_strip_the_group(group, stub_impls):
    from te_passes.compat.autocast.amax_groups import holds_process_group

    linear, body = stub_impls
    q = _quantizer()
    seen = b_runs_inside_a(body, lambda who: linear._linear_forward_impl(
        types.SimpleNamespace(input_quantizer=q, tp_group=group, who=who)), lambda: holds_process_group(q))
    assert seen is True, "thread b's release stripped the group from thread a's running call"
    assert not holds_process_group(q)


def test_backward_wrapper_releases_both_quantizers_and_counts_them(group, stub_impls):
    from te_passes.compat.autocast import amax_groups

    linear, _ = stub_impls
    qi, qg = _quantizer(), _quantizer()
    before = amax_groups.hook_stats()["released_after_calls"]
    linear._linear_backward_impl(types.SimpleNamespace(input_quantizer=qi, grad_output_quantizer=qg,
                                                       tp_group=group))
    assert not amax_groups.holds_process_group(qg)
    assert amax_groups.hook_stats()["released_after_calls"] == before + 1  # qi was set to None


def test_call_never_drops_a_group_the_quantizer_had_before_it(group, stub_impls):
    """If a group was set outside the impls (a TE that stops re-applying it per call, which
    ``unsafe_reason``'s name check cannot see, or user code), a wrapped call puts it back rather
    than dropping it: dropping it would silently skip the amax reduction from the next call on.
    Here the stand-in sets it again (so the check passes) but the group was there first."""
    from te_passes.compat.autocast.amax_groups import holds_process_group

    linear, body = stub_impls
    q = _quantizer()
    body["fwd"] = lambda args: args
    set_quantizer_amax_reduction_group(q, group)
    linear._linear_forward_impl(types.SimpleNamespace(input_quantizer=q, tp_group=None))
    assert holds_process_group(q) and q.amax_reduction_group is group and q.with_amax_reduction
    linear._linear_forward_impl(types.SimpleNamespace(input_quantizer=q, tp_group=group))
    assert q.amax_reduction_group is group


def test_sweep_skips_a_quantizer_a_running_call_holds(group, stub_impls):
    """The install-time sweep can run on the compiling thread while another thread is inside an
    eager impl: it must leave that call's group alone."""
    from transformer_engine.pytorch.constants import FP8BwdTensorIdx, FP8FwdTensorIdx

    from te_passes.compat.autocast.amax_groups import holds_process_group, sweep_live_linear_modules

    linear, body = stub_impls
    q = _quantizer()
    slots = {"scaling_fwd": [None] * (FP8FwdTensorIdx.GEMM1_INPUT + 1),
             "scaling_bwd": [None] * (FP8BwdTensorIdx.GRAD_OUTPUT1 + 1)}
    slots["scaling_fwd"][FP8FwdTensorIdx.GEMM1_INPUT] = q
    module = types.SimpleNamespace(quantizers=slots)  # a te.Linear as the sweep reads it
    seen = []

    def fwd(args):
        seen.append((sweep_live_linear_modules([module]), holds_process_group(q)))
        return args
    body["fwd"] = fwd
    linear._linear_forward_impl(types.SimpleNamespace(input_quantizer=q, tp_group=group))
    assert seen == [(0, True)]
    assert not holds_process_group(q)
    set_quantizer_amax_reduction_group(q, group)  # a leftover from an unwrapped eager call
    assert sweep_live_linear_modules([module]) == 1 and not holds_process_group(q)


def test_debug_quantizers_of_one_parent_share_the_in_flight_count(group, stub_impls):
    """TE builds ``DebugQuantizer`` wrappers per call (``_get_debug_quantizers``) around the
    module's persistent quantizers, and TE's setter writes to ``parent_quantizer``
    (``module/_common.py``): calls with *different* wrappers of one parent are counted together."""
    from te_passes.compat.autocast.amax_groups import holds_process_group

    linear, body = stub_impls
    parent = _quantizer()
    outer, inner = (types.SimpleNamespace(parent_quantizer=parent) for _ in range(2))  # DebugQuantizer's shape
    seen = []

    def fwd(args):
        if args.input_quantizer is outer:
            linear._linear_forward_impl(types.SimpleNamespace(input_quantizer=inner, tp_group=group))
            seen.append(holds_process_group(parent))
        return args
    body["fwd"] = fwd
    linear._linear_forward_impl(types.SimpleNamespace(input_quantizer=outer, tp_group=group))
    assert seen == [True]
    assert not holds_process_group(parent) and not holds_process_group(outer)


def test_group_left_before_te_passes_loads_is_released_when_the_backend_installs():
    """TE loaded and an unwrapped eager call left a group before te_passes; loading the backend (the one
    install moment: it imports TE and applies the rows) wraps the impls and the row's sweep releases the
    leftover before any frame is traced."""
    import subprocess
    import textwrap

    code = textwrap.dedent("""
        import sys, torch, torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        import transformer_engine.pytorch as te
        from transformer_engine.pytorch.module import linear
        from transformer_engine.pytorch.module._common import set_quantizer_amax_reduction_group
        lin = linear.Linear.__new__(linear.Linear)   # a live te.Linear as the sweep sees it (no GPU
        torch.nn.Module.__init__(lin)                # here to build one); the slot is the input's
        lin.quantizers = {"scaling_fwd": [linear.Float8CurrentScalingQuantizer(
            te.constants.TE_DType[torch.float8_e4m3fn], device=torch.device("cpu"))], "scaling_bwd": []}
        q = lin.quantizers["scaling_fwd"][0]
        set_quantizer_amax_reduction_group(q, dist.group.WORLD)   # what linear.py:448 leaves
        assert not getattr(linear._linear_forward_impl, "_te_passes_amax_hook", False)
        import te_passes.backend
        from te_passes.compat import table
        from te_passes.compat.autocast import amax_groups as ag
        assert table.refusal(ag.ROW) is None
        assert getattr(linear._linear_forward_impl, "_te_passes_amax_hook", False)
        assert not ag.holds_process_group(q)
        assert ag.hook_stats()["released_at_install"] == 1, ag.hook_stats()
        print("OK")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-2000:] + r.stderr[-4000:]
