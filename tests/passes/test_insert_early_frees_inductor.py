"""insert_early_frees through Inductor on CPU: the free reaches the buffer the opaque op got.

The defect these tests pin down (found on an H200 with cudagraph trees, reproduced on CPU):
an ATen FP8 cast lowers to an *unrealized* Inductor ``Pointwise``. A custom op's default
layout constraint (``needs_exact_strides``: ``constrain_to_fake_tensors`` ->
``ExternKernel.require_exact_strides``, torch 2.14 ``torch/_inductor/ir.py``) copies an
unrealized input into a fresh buffer (``copy_input``) — the op received *that* buffer — and
the free's lowering then realized the original ``Pointwise`` into a second buffer: the fused
kernel computed the cast twice, the free emptied the duplicate, and the tensor the opaque op
kept stayed full (``kept numel 4096``; cudagraph trees: "tensor(s) in the cudagraph pool not
tracked as outputs").

Each test compiles with ``backend="te_inductor"`` and reads Inductor's output code
(``torch._inductor.utils.run_and_get_code``).
"""

from __future__ import annotations

import re

import pytest
import torch

from te_passes.report import clear_compile_reports, compile_reports

F8 = torch.float8_e4m3fn
_KEPT: list[torch.Tensor] = []


@torch.library.custom_op("tpq_efi::keep_and_gemm", mutates_args=())
def keep_and_gemm(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """An opaque callee that keeps a reference to its FP8 argument (as TE keeps tensors in
    autograd ``ctx`` / quantized-storage objects); ``q``: float8 ``[M, K]``, ``w``: ``[K, N]``."""
    _KEPT.clear()
    _KEPT.append(q)
    return q.to(w.dtype) @ w


@keep_and_gemm.register_fake
def _(q, w):
    return q.new_empty((q.shape[0], w.shape[1]), dtype=w.dtype)


def _compile_and_code(fn, *args, dynamic=None, **options):
    """``(output, output code, free records, tensors the opaque op kept)`` of one fresh
    ``te_inductor`` compile and call of ``fn`` (FX graph cache off so the passes and the
    lowering really run). The kept tensors are taken right after the compiled call, before
    any eager reference run replaces them."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    clear_compile_reports()
    _KEPT.clear()
    compiled = torch.compile(fn, backend="te_inductor", dynamic=dynamic,
                             options={"fx_graph_cache": False, **options})
    out, codes = run_and_get_code(compiled, *args)
    torch._dynamo.reset()
    kept = list(_KEPT)
    (code,) = codes
    recs = [r for rep in compile_reports() for r in rep.records("free")]
    return out, code, recs, kept


def _fp8_allocations(code: str) -> list[str]:
    """Names of the float8 buffers the wrapper allocates, e.g. ``['buf0']``."""
    return re.findall(r"^\s*(buf\d+) = empty_strided_\w+\([^\n]*torch\.float8_e4m3fn\)", code, re.M)


def _call_args(code: str, op: str) -> list[str]:
    """First argument of every wrapper call to ``op`` (e.g. ``'te_passes.free_storage'``)."""
    return re.findall(rf"torch\.ops\.{re.escape(op)}\.default\((\w+)", code)


def _f(x, w):
    q = x.to(F8)
    return torch.relu(keep_and_gemm(q, w))


def test_free_empties_the_tensor_the_opaque_op_kept():
    """/tmp/ef.py as a test: one FP8 buffer, computed once, given to the opaque op and then
    to the free; the kept tensor object is empty after the call; results equal eager."""
    x, w = torch.randn(64, 64, dtype=torch.bfloat16), torch.randn(64, 64, dtype=torch.bfloat16)
    out, code, frees, kept = _compile_and_code(_f, x, w)
    assert torch.equal(out, _f(x, w))
    assert [(r.data["role"], r.data["after"].startswith("keep_and_gemm")) for r in frees] == \
        [("rowwise_data", True)]
    # (a) the tensor object the opaque op kept was emptied by the free (TE clear_tensor_data)
    assert len(kept) == 1 and kept[0].dtype == F8 and kept[0].numel() == 0
    # (b) exactly one buffer for the cast, and it is the one both calls receive
    (buf,) = _fp8_allocations(code)
    assert _call_args(code, "tpq_efi.keep_and_gemm") == [buf]
    assert _call_args(code, "te_passes.free_storage") == [buf]
    assert f"= {buf}; del {buf}  # reuse" not in code  # never-reuse protection kept


def test_symbolic_shapes_one_buffer_and_the_kept_tensor_emptied():
    """``dynamic=True`` (symbolic sizes and strides: ``run_node`` realizes but skips the
    stride-order check): still one FP8 buffer given to the op and to the free."""
    x, w = torch.randn(48, 64, dtype=torch.bfloat16), torch.randn(64, 8, dtype=torch.bfloat16)
    out, code, frees, kept = _compile_and_code(_f, x, w, dynamic=True)
    assert torch.equal(out, _f(x, w))
    assert len(frees) == 1 and kept[0].numel() == 0
    (buf,) = _fp8_allocations(code)
    assert _call_args(code, "tpq_efi.keep_and_gemm") == [buf]
    assert _call_args(code, "te_passes.free_storage") == [buf]


def test_free_of_a_non_contiguous_cast_reaches_the_same_buffer():
    """A cast of a transposed input keeps its strides (``_to_copy`` preserves them); the
    custom op needs those exact strides. Still one FP8 buffer, passed to both calls."""
    def f(x, w):
        q = x.t().to(F8)
        return keep_and_gemm(q, w) * 2

    x, w = torch.randn(32, 64, dtype=torch.bfloat16), torch.randn(32, 16, dtype=torch.bfloat16)
    out, code, frees, kept = _compile_and_code(f, x, w)
    assert torch.equal(out, f(x, w))
    assert len(frees) == 1
    assert kept[0].numel() == 0
    (buf,) = _fp8_allocations(code)
    assert _call_args(code, "tpq_efi.keep_and_gemm") == [buf]
    assert _call_args(code, "te_passes.free_storage") == [buf]


def test_free_of_a_cast_read_through_a_view_computes_it_once():
    """The opaque op reads the cast through a transpose view: the free still targets the one
    buffer the view aliases (the kept *view* object keeps its own reference to the storage —
    ``set_`` on the base cannot empty another tensor object; see the pass's docs)."""
    def f(x, w):
        q = x.to(F8)
        return keep_and_gemm(q.t(), w) + 1

    x, w = torch.randn(32, 64, dtype=torch.bfloat16), torch.randn(32, 16, dtype=torch.bfloat16)
    out, code, frees, kept = _compile_and_code(f, x, w)
    assert torch.equal(out, f(x, w))
    assert len(frees) == 1
    (buf,) = _fp8_allocations(code)
    assert _call_args(code, "te_passes.free_storage") == [buf]
    (gemm_arg,) = re.findall(r"tpq_efi\.keep_and_gemm\.default\((\w+\(\w+|\w+)", code)
    assert buf in gemm_arg  # reinterpret_tensor(buf0, ...) or buf0 itself, never a copy


def test_policy_all_does_not_materialize_a_fused_cast_just_to_free_it():
    """Policy ``"all"`` frees a cast that only Inductor kernels read. Inductor fuses it into
    its consumer, so there is no buffer: the lowering must not realize one for the free (the
    defect's second face: one more buffer and one more write per step)."""
    def f(x):
        q = x.to(F8)
        return q.to(torch.float32) * 2

    x = torch.randn(64, 64)
    out, code, frees, kept = _compile_and_code(
        f, x, **{"te_passes.pass_config": {"insert_early_frees": {"policy": "all"}}})
    assert torch.equal(out, f(x))
    assert len(frees) == 1  # the pass planned it ...
    assert _fp8_allocations(code) == []  # ... but nothing is materialized for it
    assert "free_storage" not in code


@pytest.mark.parametrize("disable", [False, True])
def test_numerics_equal_eager_with_and_without_the_pass(disable):
    x, w = torch.randn(16, 64, dtype=torch.bfloat16), torch.randn(64, 8, dtype=torch.bfloat16)
    opts = {"te_passes.disable": ["insert_early_frees"]} if disable else {}
    out, code, frees, kept = _compile_and_code(_f, x, w, **opts)
    assert torch.equal(out, _f(x, w))
    assert len(_fp8_allocations(code)) == 1
    assert len(frees) == (0 if disable else 1)
    assert kept[0].numel() == (16 * 64 if disable else 0)


# --------------------------------------------------------------------------- FX level
def _cast_graph():
    """ATen FP8 cast read by the keeping opaque op, a getitem of an opaque op's output read by
    a second opaque op (already a buffer: not marked), and an ATen-only cast."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from _qgraphs import QGEMM, QUANTIZE2, record_vals

    aten = torch.ops.aten

    def f(x, w):
        q = aten._to_copy.default(x, dtype=F8)
        y = torch.ops.tpq_efi.keep_and_gemm.default(q, w)
        data, sinv = QUANTIZE2(x)
        y2 = QGEMM(data, sinv, w)
        z = aten._to_copy.default(aten._to_copy.default(x, dtype=F8), dtype=torch.float32)
        return (y.float() + y2 + z,)

    x, w = torch.randn(4, 4), torch.randn(4, 4)
    gm = make_fx(f)(x, w)
    record_vals(gm, x, w)
    return gm


@pytest.mark.parametrize("policy", ["opaque", "all"])
def test_pass_marks_only_aten_values_an_opaque_op_reads(policy):
    from te_passes.passes.insert_early_frees import InsertEarlyFrees
    from te_passes.pipeline.base import Stage
    from te_passes.testing.harness import run_passes

    gm = _cast_graph()
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    want = gm(x, w)
    run = run_passes(gm, InsertEarlyFrees(policy=policy), Stage.POST_GRAD_FWD, graph_id="t0")
    freed = sorted(r.node for r in run.records("free"))
    assert freed == (["_to_copy", "_to_copy_1", "getitem"] if policy == "all" else ["_to_copy", "getitem"])
    assert run.diff() == {"te_passes.free_storage.default": len(freed)}
    frees = [n for n in gm.graph.nodes if n.target is torch.ops.te_passes.free_storage.default]
    assert sorted(n.args[0].name for n in frees) == freed
    marked = [n.name for n in gm.graph.nodes if n.meta.get("inductor_realize_to_strides")]
    assert marked == ["_to_copy"]  # the cast keep_and_gemm reads; not getitem, not the ATen-only cast
    torch.testing.assert_close(gm(x, w), want)


def test_undo_removes_the_frees_and_the_realize_flag(monkeypatch):
    """A failure after the rewrite (a later pass of the stage): the manager rolls back through
    the edit journal, which erases the frees and the realize flag."""
    from te_passes.passes.insert_early_frees import InsertEarlyFrees
    from te_passes.pipeline.base import Stage, TEPass
    from te_passes.testing.harness import run_passes

    seen = []

    class FailAfter(TEPass):
        name, stages, description = "fail_after", frozenset({Stage.POST_GRAD_FWD}), "test"

        def run(self, gm, ctx):
            assert InsertEarlyFrees().run(gm, ctx).modified
            seen.append(gm.graph.python_code("self").src)
            raise RuntimeError("boom after rewriting")

    gm = _cast_graph()
    before = gm.graph.python_code("self").src
    with pytest.warns(RuntimeWarning, match="boom after rewriting"):
        run = run_passes(gm, FailAfter(), Stage.POST_GRAD_FWD, graph_id="t0")
    assert run.report.runs[0].status == "failed"
    (rewritten,) = seen
    assert rewritten != before and "free_storage" in rewritten
    assert gm.graph.python_code("self").src == before and run.diff() == {}
    assert not any("inductor_realize_to_strides" in n.meta for n in gm.graph.nodes)


def test_lowering_warns_when_an_opaque_reader_got_a_copy(monkeypatch, caplog):
    """If the realize mark is lost (simulated: ``free_op.mark_realize`` does nothing), the
    custom op gets Inductor's copy; the lowering then emits no free (it would only compute a
    duplicate) and warns, naming the value and the opaque op."""
    import logging

    from te_passes._logging import get_logger
    from te_passes.ops import free as free_op

    monkeypatch.setattr(free_op, "mark_realize", lambda node, journal: None)
    get_logger()  # registered with torch._logging
    caplog.set_level(logging.DEBUG, logger="te_passes")
    x, w = torch.randn(64, 64, dtype=torch.bfloat16), torch.randn(64, 64, dtype=torch.bfloat16)
    out, code, frees, kept = _compile_and_code(_f, x, w)
    assert torch.equal(out, _f(x, w))
    assert len(frees) == 1 and kept[0].numel() == 64 * 64
    assert "free_storage" not in code and len(_fp8_allocations(code)) == 1
    (warn,) = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "te_passes"]
    assert "is read by opaque op(s) keep_and_gemm" in warn.getMessage()
