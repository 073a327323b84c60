"""Pass ``fold_ub_predicates``: Userbuffers (UB) queries become guarded compile-time constants.

See docs/passes/fold_ub_predicates.md."""

from __future__ import annotations

import operator
import warnings
from typing import Any

import torch
import torch.fx
from torch.fx.node import map_arg

from te_passes.fx.journal import GraphJournal
from te_passes.pipeline.base import PassContext, PassRecord, Stage, TEPass, TEPassResult
from te_passes.te import graph_model as gmod
from te_passes.compat.api import (UbCheckSpec, UbDependence, UbFold, UbMismatch, pristine_copy,
                                   row_refusal)
from te_passes.te.ub import UbConfigError, UbSnapshot
from te_passes.te.ub_queries import describe_ub_query, find_ub_queries
from te_passes.te.ub_rules import check_linear_ub_config, ub_flags_set

#: The patch-table row whose absence leaves TE's own (unguarded) get_ub_is_fp8 folds in a Dynamo graph.
UB_FP8_ROW = "ub.get_ub_is_fp8"
#: Pure functions whose call nodes are folded once all their arguments are constants.
_PURE_FOLDABLE = frozenset({
    operator.not_, operator.truth, operator.eq, operator.ne, operator.and_, operator.or_,
    operator.xor, operator.lt, operator.le, operator.gt, operator.ge, operator.is_,
    operator.is_not, operator.getitem, operator.add, operator.sub, operator.mul,
    operator.floordiv, operator.mod, bool, int, float, str, max, min, all, any,
})
#: What a fold may compute: scalars (``int`` <= 64 bits, ``str`` <= 256 chars) or sequences of <= 16 of
#: them, a sequence times an ``int`` <= 256: a replayed graph must not make it build a huge value.
_FOLD_MAX_BITS, _FOLD_MAX_LEN = 64, 256


def _small_fold_value(v: Any, depth: int = 0) -> bool:
    if v is None or isinstance(v, (bool, float)):
        return True
    if isinstance(v, int):
        return v.bit_length() <= _FOLD_MAX_BITS
    if isinstance(v, str):
        return len(v) <= _FOLD_MAX_LEN
    if isinstance(v, (tuple, list)) and depth == 0:
        return len(v) <= 16 and all(_small_fold_value(x, 1) for x in v)
    return False


def _fold_is_bounded(target: Any, args: tuple, kwargs: dict) -> bool:
    vals = (*args, *kwargs.values())
    if not all(_small_fold_value(v) for v in vals):
        return False
    if target is operator.mul and any(isinstance(v, (str, tuple, list)) for v in vals):
        return all(abs(v) <= _FOLD_MAX_LEN for v in vals if isinstance(v, int))
    return True


class FoldUbPredicates(TEPass):
    """Fold UB predicates to constants against the UB snapshot; check TE ops' UB configs.

    Records: ``"folded"`` (``api``, ``args``, ``value``, ``source`` = ``"fx"`` /
    ``"dynamo_trace"``), ``"const_folded"`` (operator nodes folded after them), ``"removed"``
    (erased nodes), ``"ub_check"`` (per TE op: ``ub_name``, ``flags``, ``buffers``),
    ``"ub_mismatch"`` (``ub_name``, ``buffer``, ``message``), ``"skipped"`` (a query node that
    could not be folded, with the reason)."""

    name = "fold_ub_predicates"
    stages = frozenset({Stage.DYNAMO, Stage.POST_GRAD_FWD, Stage.POST_GRAD_BWD})
    description = "fold Userbuffers queries to guarded constants; check TE ops' UB buffers against the UB state"

    def _check_te_ops(self, gm: torch.fx.GraphModule, snap: UbSnapshot, records: list[PassRecord],
                      checks: list[UbCheckSpec]) -> None:
        unknown: list[str] = []
        for call in gmod.te_op_calls(gm.graph, unknown=unknown):
            if call.module_kind != "linear":
                if any(call.config.get(k) for k in gmod.UB_CONFIG_KEYS):
                    records.append(PassRecord("skipped", call.node.name, {
                        "reason": f"no UB buffer rules for TE op {call.op}; its UB configuration is not checked"}))
                continue
            flags = ub_flags_set(call.op, call.config)
            if not flags:
                continue
            res = check_linear_ub_config(call.op, call.config, snap)
            checks.append(UbCheckSpec(call.op, dict(call.config), call.node.name))
            buffers = []
            for use in res.uses:
                key = f"{use.buffer}[{'fp8' if use.use_fp8 else 'none'}]"
                b = res.found.get(key)
                buffers.append({**use.to_json(), "mode": "fp8" if use.use_fp8 else "none", "registered": b is not None,
                                **{k: getattr(b, k, None) for k in ("is_fp8_ubuf", "with_cublasmp", "tp_size")}})
            records.append(PassRecord("ub_check", call.node.name, {
                "op": call.op, "ub_name": res.ub_name, "flags": flags, "buffers": buffers,
                "status": "ok" if res.ok else "mismatch"}))
            for buf, msg in res.problems:
                records.append(PassRecord("ub_mismatch", call.node.name,
                                          {"ub_name": res.ub_name, "buffer": buf or None, "message": msg}))
        for msg in unknown:
            records.append(PassRecord("skipped", None, {"reason": f"TE op not decoded, UB not checked: {msg}"}))

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> TEPassResult:
        snap = getattr(ctx.te_state, "ub", None) or UbSnapshot(source="absent")
        records: list[PassRecord] = []
        folds: list[UbFold] = []
        checks: list[UbCheckSpec] = []

        # 1. folds Dynamo made while tracing this graph (TE's get_ub_is_fp8 under our hook).
        if ctx.stage is Stage.DYNAMO:
            self._record_trace_folds(snap, ctx, records, folds)

        # 2. query nodes and their values.
        queries, refused = find_ub_queries(gm.graph)
        for node, reason in refused:
            records.append(PassRecord("skipped", node.name, {"reason": f"UB query not folded: {reason}"}))
        values: dict[torch.fx.Node, Any] = {}
        for node, api, args in queries:
            try:
                values[node] = snap.query(api, args)
            except UbConfigError as e:
                records.append(PassRecord("ub_mismatch", node.name, {
                    "ub_name": None, "buffer": args[0] if args else None,
                    "message": f"node {node.name}: {e}"}))

        # 3. TE op UB configurations.
        self._check_te_ops(gm, snap, records, checks)
        if checks and ctx.stage is Stage.DYNAMO and row_refusal(UB_FP8_ROW) is not None:
            reason = (f"TE's UB hooks were not installed when Dynamo traced this graph (patch {UB_FP8_ROW}: "
                      f"{row_refusal(UB_FP8_ROW)}; e.g. transformer_engine was imported after "
                      "torch.compile(backend='te_inductor') was called): get_ub_is_fp8 values folded by TE in "
                      "this frame are not guarded; import transformer_engine first")
            warnings.warn(f"te_passes: graph {ctx.graph_id}: {reason}", RuntimeWarning, stacklevel=2)
            records.append(PassRecord("skipped", None, {"reason": reason}))

        mismatches = [r for r in records if r.kind == "ub_mismatch"]
        if mismatches and ctx.options.strict:
            raise UbConfigError("; ".join(str(r.data["message"]) for r in mismatches))

        # 4. mutate: keep a pre-pass copy for recompiles, then fold.
        pristine = pristine_copy(gm) if (values or checks) and ctx.stage is Stage.DYNAMO else None
        if values:
            self._fold(ctx.journal, values, records, folds)
        facts: list[Any] = [UbDependence(folds, checks, pristine)] if folds or checks else []
        facts += [UbMismatch(r.node, str(r.data["message"])) for r in mismatches]
        return TEPassResult(gm, bool(values), records, facts)

    def _record_trace_folds(self, snap: UbSnapshot, ctx: PassContext, records: list[PassRecord],
                            folds: list[UbFold]) -> None:
        trace_folds = list(ctx.inputs.get("ub_trace_folds", ()))
        for f in trace_folds:
            folds.append(f)
            records.append(PassRecord("folded", None, {"api": f.api, "args": list(f.args), "value": f.value,
                                                       "source": f.source}))
            try:
                now = snap.query(f.api, f.args)
            except UbConfigError as e:
                now = f"<error: {e}>"
            if now != f.value:
                records.append(PassRecord("ub_mismatch", None, {
                    "ub_name": None, "buffer": f.args[0] if f.args else None,
                    "message": (f"{f.api}{f.args!r} was folded to {f.value!r} while Dynamo traced, but the UB "
                                f"state compiled against ({snap.source}) gives {now!r}")}))
        if not trace_folds:
            return
        prev = ctx.inputs.get("ub_prev_token")
        if prev is not None and ctx.options.ub_on_change == "error":
            compile_id, old, new = prev
            records.append(PassRecord("ub_mismatch", None, {
                "ub_name": None, "buffer": None,
                "message": (f"Dynamo frame {compile_id} is being re-traced because the UB state changed "
                            f"(token {old} -> {new}) and te_passes.ub_on_change='error'")}))

    def _fold(self, journal: GraphJournal, values: dict[torch.fx.Node, Any], records: list[PassRecord],
              folds: list[UbFold]) -> None:
        for node, value in values.items():
            api, args = describe_ub_query(node)
            folds.append(UbFold(api, args, value, node.name, "fx"))
            records.append(PassRecord("folded", node.name, {"api": api, "args": list(args), "value": value,
                                                            "source": "fx"}))
        # substitute, then propagate through pure operator nodes; then erase what became dead
        const: dict[torch.fx.Node, Any] = dict(values)
        work = list(values)
        while work:
            node = work.pop(0)
            value = const[node]
            for user in list(node.users):
                journal.set_args(user, map_arg(user.args, lambda n: value if n is node else n),
                                 map_arg(user.kwargs, lambda n: value if n is node else n))
                if (user.op == "call_function" and user.target in _PURE_FOLDABLE and user not in const
                        and not any(isinstance(a, torch.fx.Node) for a in (*user.args, *user.kwargs.values()))):
                    if not _fold_is_bounded(user.target, user.args, user.kwargs):
                        records.append(PassRecord("skipped", user.name, {
                            "reason": "not folded: an operand is not a small constant (ints <= 64 bits, "
                                      "strings and sequences <= 256 long)"}))
                        continue
                    try:
                        const[user] = user.target(*user.args, **user.kwargs)
                    except Exception as e:  # noqa: BLE001 - leave it as a call on constants
                        records.append(PassRecord("skipped", user.name, {"reason": f"not folded: {e}"}))
                        continue
                    if not _small_fold_value(const[user]):
                        del const[user]
                        records.append(PassRecord("skipped", user.name, {
                            "reason": "not folded: the result is not a small constant"}))
                        continue
                    records.append(PassRecord("const_folded", user.name, {
                        "target": getattr(user.target, "__name__", str(user.target)),
                        "args": list(user.args), "value": const[user]}))
                    work.append(user)
        candidates = list(const) + [n.args[0] for n in values if n.op == "call_method"]
        erased: dict[torch.fx.Node, str] = {}  # in erase order
        while any(n not in erased and not n.users for n in candidates):
            for n in candidates:
                if n not in erased and not n.users:
                    erased[n] = n.name
                    journal.erase(n)
        if erased:
            records.append(PassRecord("removed", None, {"nodes": list(erased.values())}))
