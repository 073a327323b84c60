"""Pass ``insert_early_frees``: free each quantized buffer right after its last use.

See docs/passes/insert_early_frees.md."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch
import torch.fx

from te_passes.analyses.alias_rules import is_opaque_call
from te_passes.analyses.buffers import Buffer, BufferOrigin, Liveness
from te_passes.analyses.liveness import analyze, analyze_shared, gc_paused
from te_passes.analyses.memory import MemoryEstimate, estimate
from te_passes.pipeline.base import PassConfig, PassContext, PassRecord, PassSkipped, Stage, TEPass, TEPassResult
from te_passes.ops import free as free_op
from te_passes.te import quantized


class InsertEarlyFrees(TEPass):
    """Insert ``te_passes.free_storage(buf)`` after the last use of quantized buffers.

    Records: ``"free"`` (node = the freed value: ``role``, ``bytes``, ``after``, ``source``, ``field``,
    ``op``); ``"kept"`` (``role``, ``bytes``, ``reason``, ``source``); ``"memory"`` (graph level,
    :func:`memory_record`); at the joint stage ``"saved_roles"`` (``count``, ``roles``).

    Raises:
        PassSkipped: ``free_storage``'s Inductor lowering is not registered (``runtime.install()``).
        AssertionError: the rewritten graph has a free before a use (the manager restores the graph).
    """

    name = "insert_early_frees"
    stages = frozenset({Stage.JOINT, Stage.POST_GRAD_FWD, Stage.POST_GRAD_BWD})
    description = "free quantized buffers (FP8/MXFP8 data, transposes, scales) right after their last use"

    source_modules = (free_op,)  # its Inductor lowering shapes the output code

    @dataclasses.dataclass(frozen=True)
    class Config(PassConfig):
        policy: Literal["opaque", "all"] = "opaque"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> TEPassResult:
        why = free_op.lowering_reason()
        if why is not None:
            raise PassSkipped(f"{why}; without it Inductor could reuse a freed buffer")
        with gc_paused():
            return self._run(gm, ctx)

    def _run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> TEPassResult:
        graph = gm.graph
        if ctx.stage is Stage.JOINT:
            roles = quantized.joint_saved_roles(graph)
            return TEPassResult(gm, False, [PassRecord("saved_roles", None, {
                "count": len(roles),
                "roles": {k: {"role": v.role, "field": v.field, "inner_name": v.inner_name,
                              "storage_cls": v.storage_cls} for k, v in sorted(roles.items())}})])
        lv = analyze_shared(graph, ctx.stage, getattr(ctx, "analyses", None))
        before = estimate(lv)
        plan, records = self.plan(lv, ctx.stage)
        last_inserted: dict[torch.fx.Node, torch.fx.Node] = {}  # insert-after node -> its last free
        for buf, after in plan:
            if lv.opaque_uses.get(buf) and _may_lower_unrealized(buf.handle):
                # the opaque reader must get the very buffer the free empties, not a stride-fixing copy
                free_op.mark_realize(buf.handle, ctx.journal)
            free = ctx.journal.call_function(free_op.free_storage, (buf.handle,), after=last_inserted.get(after, after),
                                             meta={"val": None, "te_passes": {
                                                 "pass": self.name,
                                                 "role": buf.quantized.role if buf.quantized else None}})
            last_inserted[after] = free
        after_est = before
        if last_inserted:
            lv_after = analyze(graph, stage=ctx.stage.value)
            self._verify(lv_after)
            after_est = estimate(lv_after)
        records.append(PassRecord("memory", None, memory_record(before, after_est)))
        return TEPassResult(gm, bool(last_inserted), records)

    def plan(self, lv: Liveness, stage: Stage) -> tuple[list[tuple[Buffer, torch.fx.Node]], list[PassRecord]]:
        """Decide what to free: ``([(buffer, insert-after node)], records)``; no mutation."""
        plan: list[tuple[Buffer, torch.fx.Node]] = []
        records: list[PassRecord] = []
        freed = frozenset(b for n in lv.order if free_op.is_free_node(n) and n.args for b in lv.buffers_of(n.args[0]))
        for buf in lv.quantized_buffers():
            reason = self._refusal(lv, buf, stage, freed)
            info = buf.quantized
            nbytes = buf.nbytes()
            if reason is not None:
                records.append(PassRecord("kept", buf.name, {
                    "role": info.role, "bytes": nbytes, "reason": reason, "source": info.source}))
                continue
            last = lv.last_use[buf]
            plan.append((buf, last))
            records.append(PassRecord("free", buf.handle.name, {
                "role": info.role, "bytes": nbytes, "after": last.name, "source": info.source,
                "field": info.field, "op": info.op}))
        return plan, records

    def _refusal(self, lv: Liveness, buf: Buffer, stage: Stage, freed: frozenset[Buffer]) -> str | None:
        if buf.origin is BufferOrigin.INPUT:
            if buf.node in lv.saved_inputs:
                return ("saved tensor (backward graph input): AOTAutograd passes it with steal_args and "
                        "Inductor drops it at its last use; under retain_graph=True the autograd graph "
                        "still holds it, so the graph must not free it")
            return "graph input: owned by the caller"
        if buf.origin is BufferOrigin.CONSTANT:
            return "constant: owned by the GraphModule"
        if lv.is_output(buf):
            saved = stage is Stage.POST_GRAD_FWD and buf.quantized is not None and \
                buf.quantized.source in ("te_forward_output", "paired_backward")
            return "graph output (saved for backward)" if saved else "graph output"
        esc = lv.escaped(buf)
        if esc:
            return f"escapes the graph at {esc[0].node.name}: {esc[0].how}"
        holders = sorted(h.name for h in lv.holders.get(buf, ()))
        if holders:
            return f"its storage is shared with {', '.join(holders)} (set_); left to reference counting"
        if buf.handle is None:
            return "no node extracts this output of a multi-output op; it dies with the op's result tuple"
        last = lv.last_use[buf]
        if buf in freed:
            return "already freed by a free_storage node"
        if last.op == "output":
            return "graph output"
        if self.cfg.policy == "opaque" and not lv.opaque_uses.get(buf):
            return (f"only ATen/Inductor kernels use it: Inductor's wrapper releases it after its last "
                    f"use ({last.name}) without a free")
        return None

    @staticmethod
    def _verify(lv: Liveness) -> None:
        """Raises ``AssertionError`` unless every free in ``lv``'s graph is its buffer's last use."""
        for node in lv.order:
            if not free_op.is_free_node(node):
                continue
            for b in lv.buffers_of(node.args[0]):
                if lv.last_use[b] is not node:
                    raise AssertionError(f"insert_early_frees: {node.name} frees {b.name} but "
                                         f"{lv.last_use[b].name} uses it later")


def _may_lower_unrealized(node: torch.fx.Node) -> bool:
    """Whether Inductor may lower ``node`` to a value without a buffer: a call of an ATen/prims op."""
    return (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and not is_opaque_call(node))


def memory_record(before: MemoryEstimate, after: MemoryEstimate) -> dict[str, Any]:
    """The ``"memory"`` record's data: peaks before/after (symbolic and concrete), peak nodes, input bytes."""
    b, a = before.to_json(), after.to_json()
    return {"peak_before": b["peak"], "peak_after": a["peak"],
            "peak_before_concrete": b["peak_concrete"], "peak_after_concrete": a["peak_concrete"],
            "peak_node_before": b["peak_node"], "peak_node_after": a["peak_node"],
            "input_bytes": b["input_bytes"], "symbolic": before.symbolic, "symbols": b["symbols"],
            "unknown_size": b["unknown_size"]}
