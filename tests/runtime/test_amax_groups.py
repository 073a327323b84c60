"""Issue 8: fp8 sequence-parallel te.Linear compiles on the first call under te_inductor.

No GPU: a ``fake`` torch.distributed process group of size 2 (``FakeStore``), TE on fake CUDA
tensors (te_passes.testing.fake_gpu.fake_gpu). The eager step is TE's real eager Linear forward:
it runs ``_linear_forward_impl`` up to its first CUDA kernel (no GPU here), i.e. past
``set_quantizer_amax_reduction_group(input_quantizer, tp_group)`` (linear.py:448) — exactly the
state an eager step leaves on a GPU. The row-parallel group is set by TE's backward impl
(linear.py:1150), which cannot run here; those tests apply TE's setter as that line does.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

from te_passes.compat import table
from te_passes.testing.capture import capture_skip_reason

import _rows  # noqa: E402

pytestmark = pytest.mark.skipif(capture_skip_reason() is not None, reason=str(capture_skip_reason()))

GROUP_ERROR = "'amax_reduction_group' holds a torch.distributed.ProcessGroup"


@pytest.fixture(scope="module")
def fake_pg(fake_tp_group):
    return fake_tp_group


@pytest.fixture
def hooks():
    """The amax-group hooks module, restored to 'installed' after the test."""
    from te_passes.compat.autocast import amax_groups

    yield amax_groups
    _rows.on(amax_groups.ROW)


class _SP:
    """A sequence-parallel fp8 te.Linear on fake CUDA tensors, with TE's eager step."""

    def __init__(self, parallel_mode: str, group) -> None:
        import transformer_engine.pytorch as te
        from torch._subclasses.fake_tensor import FakeTensorMode

        from te_passes.testing import dynamo_capture as DC
        from te_passes.testing import fake_gpu as FG

        self.DC, self.te, self.group = DC, te, group
        self.recipe = FG.make_recipe("fp8-cs")
        self.stack = contextlib.ExitStack()
        self.stack.enter_context(FG.quiet())
        self.stack.enter_context(FG.fake_gpu("fp8-cs"))
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        with self.mode, FG.constructing():
            self.lin = te.Linear(64, 128, params_dtype=torch.bfloat16, device="cuda",
                                 parallel_mode=parallel_mode, sequence_parallel=True, tp_group=group)
            self.x = torch.randn(32, int(self.lin.weight.shape[1]), dtype=torch.bfloat16, device="cuda",
                                 requires_grad=True)

    def close(self) -> None:
        self.stack.close()

    def run_eager(self) -> None:
        """TE's eager forward under te.autocast; it stops at the first CUDA kernel (no GPU), the
        error kept in ``eager_error``."""
        with self.mode, self.te.autocast(enabled=True, recipe=self.recipe), \
                mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: False):
            try:
                self.lin(self.x)
            except Exception as e:  # noqa: BLE001 - no GPU: the first kernel launch fails
                self.eager_error = e
            else:  # pragma: no cover - only with a GPU
                self.eager_error = None

    def eager_step(self) -> None:
        """TE's eager forward; it stops at the first CUDA kernel (after linear.py:448)."""
        self.run_eager()
        assert self.lin.quantizers["scaling_fwd"], "the eager step did not build the quantizers"

    def quantizer(self, role: str):
        from transformer_engine.pytorch.constants import FP8BwdTensorIdx, FP8FwdTensorIdx

        if role == "input":
            return self.lin.quantizers["scaling_fwd"][FP8FwdTensorIdx.GEMM1_INPUT]
        if role == "weight":
            return self.lin.quantizers["scaling_fwd"][FP8FwdTensorIdx.GEMM1_WEIGHT]
        return self.lin.quantizers["scaling_bwd"][FP8BwdTensorIdx.GRAD_OUTPUT1]

    def backward_leftover(self) -> None:
        """What TE's ``_linear_backward_impl`` leaves for row parallel (linear.py:1150)."""
        from transformer_engine.pytorch.module._common import set_quantizer_amax_reduction_group

        set_quantizer_amax_reduction_group(self.quantizer("grad_output"), self.group)

    def compile(self, backend):
        te, lin, recipe = self.te, self.lin, self.recipe

        def step(inp):
            with te.autocast(enabled=True, recipe=recipe):
                return lin(inp)
        return torch.compile(self.DC.fresh_function(step), backend=backend, fullgraph=True)

    def call(self, fn):
        with self.mode:
            return fn(self.x)


@pytest.fixture
def sp(fake_pg):
    made = []

    def make(parallel_mode: str) -> _SP:
        made.append(_SP(parallel_mode, fake_pg))
        return made[-1]
    yield make
    for m in made:
        m.close()


from _fake_inductor import _NeverRun, te_inductor_without_gpu  # noqa: E402 - test_usage_flags imports them from here


def _call_expect_trace(sp: _SP, fn) -> None:
    try:
        sp.call(fn)
    except _NeverRun:
        pass


def test_sweep_without_torch_distributed_is_a_no_op(hooks):
    import torch.distributed as dist

    assert not dist.is_initialized()  # runs before the module-scoped fake process group
    assert hooks.sweep_live_linear_modules() == 0


# ------------------------------------------------------------------------- the reproduction
@pytest.mark.parametrize("backend", ["inductor", "eager"])
def test_first_trace_after_eager_step_fails_without_te_passes_hooks(sp, hooks, backend):
    _rows.off(hooks.ROW)
    m = sp("column")
    m.eager_step()
    assert hooks.holds_process_group(m.quantizer("input")), "TE's eager forward left no group"
    with pytest.raises(torch._dynamo.exc.InternalTorchDynamoError, match=GROUP_ERROR):
        m.call(m.compile(backend))


def test_row_parallel_first_trace_fails_on_the_group_guard_without_hooks(sp, hooks):
    _rows.off(hooks.ROW)
    m = sp("row")
    m.eager_step()
    m.backward_leftover()
    # backend="eager": the failure is in Dynamo's guard building, after the backend returns
    # (Inductor itself cannot compile fake CUDA graphs here).
    with pytest.raises(torch._dynamo.exc.InternalTorchDynamoError, match="group_name"):
        m.call(m.compile("eager"))


# ------------------------------------------------------------------------- the fix
def _process_groups_in_graph(gm: torch.fx.GraphModule) -> list[str]:
    """Every quantizer constant (incl. inside bundles) that holds a ProcessGroup."""
    from te_passes.compat.autocast import amax_groups
    from te_passes.te import graph_constants

    return [f"{node.name}: {type(obj).__name__}" for node, obj, _ in graph_constants.iter_te_constants(gm.graph)
            if amax_groups.holds_process_group(obj)]


@pytest.mark.parametrize("parallel_mode", ["column", "row"])
def test_te_inductor_first_call_compiles_after_eager_step_before_te_passes_loaded(sp, hooks, parallel_mode):
    """Eager steps ran before te_passes was loaded; looking up te_inductor installs the hooks,
    whose sweep releases the leftover group, and the first trace compiles."""
    from te_passes.te import graph_model

    _rows.off(hooks.ROW)
    m = sp(parallel_mode)
    m.eager_step()
    if parallel_mode == "row":
        m.backward_leftover()
    sticky = m.quantizer("input" if parallel_mode == "column" else "grad_output")
    assert hooks.holds_process_group(sticky)

    assert _rows.on(hooks.ROW)  # what importing te_passes.backend does
    assert hooks.hook_stats()["released_at_install"] == 1
    assert not hooks.holds_process_group(sticky)

    with te_inductor_without_gpu() as seen:
        _call_expect_trace(m, m.compile("te_inductor"))
    assert len(seen) == 1
    gm = seen[0]
    assert _process_groups_in_graph(gm) == []
    # The reduction group still reaches the op: the config bundle carries the TP group by name
    # (custom_op.py PROCESS_GROUP kind) and TE's impl re-applies it to the quantizer per call.
    [call] = [graph_model.decode(n) for n in gm.graph.nodes if graph_model.is_te_op_node(n)]
    assert call.config["sequence_parallel"] is True
    assert call.config["parallel_mode"] == parallel_mode
    assert call.config["tp_group"] == m.group.group_name


def test_hooks_release_the_group_after_each_eager_call_and_guards_never_see_it(sp, hooks):
    """Hooks installed: TE's eager impl sets the group for its call and it is released on return;
    alternating eager steps and compiled calls never fails a guard on the group.

    (The usage flags TE's eager impl leaves are put back by the same wrappers: issue 17,
    tests/runtime/test_usage_flags.py; on the GPU benchmarks/sp_fp8_tp2.py's alternation check.)"""
    assert _rows.on(hooks.ROW)
    m = sp("column")
    before = hooks.hook_stats()["released_after_calls"]
    m.eager_step()
    assert hooks.hook_stats()["released_after_calls"] == before + 1  # TE's impl did set it
    assert not hooks.holds_process_group(m.quantizer("input"))

    fn = m.compile("te_inductor")
    torch._dynamo.utils.guard_failures.clear()
    with te_inductor_without_gpu() as seen:
        for _ in range(3):
            _call_expect_trace(m, fn)  # a TypeError from a recompile would propagate here
            m.eager_step()
    assert seen, "te_inductor never compiled"
    reasons = [r for rs in torch._dynamo.utils.guard_failures.values() for r in rs]
    assert not [r for r in reasons if "amax_reduction" in r], reasons
    assert _process_groups_in_graph(seen[-1]) == []
    assert hooks.hook_stats()["released_after_calls"] == before + 4


def test_without_hooks_each_eager_step_rearms_the_failure_after_a_good_compile(sp, hooks, monkeypatch):
    """Why releasing after the call matters: with a clean first trace but no hooks, the next
    eager step fails the guard on the group and the recompile hits the same TypeError."""
    import te_passes.backend  # noqa: F401 - the install moment; te_inductor does not install again per call
    _rows.off(hooks.ROW)
    m = sp("column")
    m.eager_step()
    hooks.release_group(m.quantizer("input"))
    fn = m.compile("te_inductor")
    with te_inductor_without_gpu() as seen:
        _call_expect_trace(m, fn)
        assert len(seen) == 1
        m.eager_step()
        assert hooks.holds_process_group(m.quantizer("input"))
        with pytest.raises(torch._dynamo.exc.InternalTorchDynamoError, match=GROUP_ERROR):
            m.call(fn)


def test_sweep_leaves_groups_te_does_not_reapply_per_call(sp, hooks):
    """FSDP2 weight quantizers get their group once, at init (module/base.py:1862): never touched."""
    from transformer_engine.pytorch.module._common import set_quantizer_amax_reduction_group

    m = sp("column")
    m.eager_step()
    set_quantizer_amax_reduction_group(m.quantizer("weight"), m.group)
    set_quantizer_amax_reduction_group(m.quantizer("input"), m.group)
    assert hooks.sweep_live_linear_modules([m.lin]) == 1
    assert hooks.holds_process_group(m.quantizer("weight"))
    assert not hooks.holds_process_group(m.quantizer("input"))


# ------------------------------------------------------------------------- refusing
def set_quantizer_amax_reduction_group(q, g):  # stands in for TE's, for the layout check
    pass


def reapplies(args):
    set_quantizer_amax_reduction_group(args.input_quantizer, None)


def does_not(args):
    return args


def test_unsafe_reason_refuses_impls_that_do_not_reapply_the_group(hooks):
    import types

    from te_passes.compat.autocast import amax_groups

    mod = types.ModuleType("fake_te_linear")
    mod.set_quantizer_amax_reduction_group = set_quantizer_amax_reduction_group
    mod._linear_forward_impl = reapplies
    mod._linear_backward_impl = does_not
    reason = amax_groups.unsafe_reason(mod)
    assert reason is not None and "_linear_backward_impl no longer calls" in reason
    mod._linear_backward_impl = reapplies
    assert amax_groups.unsafe_reason(mod) is None
    del mod._linear_forward_impl
    assert "_linear_forward_impl is missing" in amax_groups.unsafe_reason(mod)


def test_install_refuses_and_says_why_when_te_layout_changed(hooks, monkeypatch, caplog):
    import sys

    _rows.off(hooks.ROW)
    linear = sys.modules[hooks.TE_LINEAR_MODULE]
    monkeypatch.setattr(linear, "_linear_backward_impl", lambda args: None)
    with caplog.at_level("WARNING", logger="te_passes"):
        assert not _rows.on(hooks.ROW)
    assert "no longer calls set_quantizer_amax_reduction_group" in table.refusal(hooks.ROW)
    assert any("not wrapping TE's Linear impls" in r.getMessage() for r in caplog.records)
    assert linear._linear_forward_impl is not None and not getattr(linear._linear_forward_impl, "_te_passes_amax_hook",
                                                                   False)
    monkeypatch.undo()
    assert _rows.on(hooks.ROW) and table.refusal(hooks.ROW) is None


def test_backend_installs_the_hooks_on_import_and_wraps_te_impls(hooks):
    import sys

    import te_passes.backend  # noqa: F401

    linear = sys.modules[hooks.TE_LINEAR_MODULE]
    assert table.refusal(hooks.ROW) is None
    assert getattr(linear._linear_forward_impl, "_te_passes_amax_hook", False)
    assert getattr(linear._linear_backward_impl, "_te_passes_amax_hook", False)
    _rows.off(hooks.ROW)
    assert not getattr(linear._linear_forward_impl, "_te_passes_amax_hook", False)
