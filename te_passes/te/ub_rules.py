"""TE's Userbuffers (UB) buffer-use rules: which communicators a ``te.Linear`` op fetches for
its config flags, and the check of a TE op config against a UB snapshot.

See docs/internals.md#te_passesteub_rulespy."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from te_passes.te.graph_constants import mro_names
from te_passes.te.graph_model import UB_FLAGS
from te_passes.te.ub import UbBufferState, UbSnapshot, ub_mode

#: Where the buffer-use rules below come from.
LINEAR_SOURCE_FWD = ("transformer_engine/pytorch/module/linear.py:_linear_forward_impl "
                     "('Configure Userbuffers communication'), TE 2.20.2")
LINEAR_SOURCE_BWD = ("transformer_engine/pytorch/module/linear.py:_linear_backward_impl "
                     "('Configure Userbuffers communication' + MXFP8 wgrad all-gather), TE 2.20.2")
LINEAR_SOURCE_SETUP = ("transformer_engine/pytorch/module/linear.py:_linear_setup_backward "
                       "(bwd ub_* flags from fwd flags; all off when backward_override is set), TE 2.20.2")


@dataclasses.dataclass(frozen=True)
class UbBufferUse:
    """One communicator fetch ``get_ub(buffer, use_fp8)`` a TE op will make in ``phase``
    (fprop/dgrad/wgrad), the ``overlap`` kind (``"AG"``, ``"bulk RS"``, ...), the config ``flag``
    requiring it and the TE ``source`` it mirrors."""

    buffer: str
    use_fp8: bool
    phase: str
    overlap: str
    flag: str
    source: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _is_mxfp8_quantizer(q: Any) -> bool:
    return q is not None and "MXFP8Quantizer" in mro_names(q)


def _backward_flags_from_forward(cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    """``LinearBwdArgs`` UB fields as ``_linear_setup_backward`` derives them, or ``None`` when
    no backward op will run (grad disabled / nothing requires grad)."""
    if not cfg.get("is_grad_enabled", True):
        return None
    if not any(cfg.get(k, False) for k in ("input_requires_grad", "weight_requires_grad", "bias_requires_grad")):
        return None
    override = cfg.get("backward_override") is not None
    return {
        "ub_name": cfg.get("ub_name"),
        "ub_overlap_ag": bool(cfg.get("ub_overlap_ag_dgrad")) and not override,
        "ub_overlap_rs_dgrad": bool(cfg.get("ub_overlap_rs_dgrad")) and not override,
        "ub_bulk_dgrad": bool(cfg.get("ub_bulk_dgrad")) and not override,
        "ub_bulk_wgrad": bool(cfg.get("ub_bulk_wgrad")) and not override,
        "fp8": bool(cfg.get("fp8")) and not override,
        "requires_dgrad": bool(cfg.get("input_requires_grad", True)),
        "requires_wgrad": bool(cfg.get("weight_requires_grad", True)),
        "grad_output_quantizer": None if override else cfg.get("grad_output_quantizer"),
        "grad_input_quantizer": None if override else cfg.get("grad_input_quantizer"),
    }


def _backward_uses(bwd: Mapping[str, Any], snapshot: UbSnapshot | None) -> list[UbBufferUse]:
    name, fp8 = bwd.get("ub_name"), bool(bwd.get("fp8"))
    out: list[UbBufferUse] = []
    if not name:
        return out
    src = LINEAR_SOURCE_BWD
    if bwd.get("ub_overlap_ag"):
        out.append(UbBufferUse(f"{name}_dgrad", fp8, "dgrad", "AG", "ub_overlap_ag_dgrad", src))
        # MXFP8 grad_output is gathered again for wgrad unless the dgrad buffer uses cuBLASMp.
        if bwd.get("requires_wgrad") and _is_mxfp8_quantizer(bwd.get("grad_output_quantizer")):
            dg = snapshot.buffer(f"{name}_dgrad", fp8) if snapshot is not None else None
            if dg is None or not dg.with_cublasmp:
                out.append(UbBufferUse(f"{name}_wgrad", fp8, "wgrad", "AG (MXFP8 wgrad)",
                                       "ub_overlap_ag_dgrad", src))
    elif bwd.get("ub_overlap_rs_dgrad"):
        out.append(UbBufferUse(f"{name}_dgrad", fp8, "dgrad", "RS", "ub_overlap_rs_dgrad", src))
    else:
        if bwd.get("ub_bulk_dgrad"):
            out.append(UbBufferUse(f"{name}_dgrad", fp8, "dgrad", "bulk AG", "ub_bulk_dgrad", src))
        if bwd.get("ub_bulk_wgrad"):
            out.append(UbBufferUse(f"{name}_wgrad", fp8, "wgrad", "bulk RS", "ub_bulk_wgrad", src))
    return out


def linear_ub_buffer_uses(op: str, config: Mapping[str, Any],
                          snapshot: UbSnapshot | None = None) -> list[UbBufferUse]:
    """Every ``get_ub(...)`` a ``te.Linear`` op makes for its config bundle, in TE's order
    (``ValueError`` for a non-linear op)."""
    kind = op.removesuffix("_base")
    if kind not in ("linear", "linear_backward"):
        raise ValueError(f"no UB buffer-use rules for TE op {op!r} (known: linear, linear_backward)")
    if kind == "linear_backward":
        return _backward_uses(config, snapshot)
    name, fp8 = config.get("ub_name"), bool(config.get("fp8"))
    out: list[UbBufferUse] = []
    if name:
        if config.get("ub_overlap_rs_fprop"):
            out.append(UbBufferUse(f"{name}_fprop", fp8, "fprop", "RS", "ub_overlap_rs_fprop", LINEAR_SOURCE_FWD))
        elif config.get("ub_overlap_ag_fprop"):
            out.append(UbBufferUse(f"{name}_fprop", fp8, "fprop", "AG", "ub_overlap_ag_fprop", LINEAR_SOURCE_FWD))
    bwd = _backward_flags_from_forward(config)
    if bwd is not None:
        out.extend(_backward_uses(bwd, snapshot))
    return out


def ub_flags_set(op: str, config: Mapping[str, Any]) -> list[str]:
    """The UB overlap flags set (truthy) in a TE op config, in declaration order."""
    return [k for k in UB_FLAGS.get(op.removesuffix("_base"), ()) if config.get(k)]


@dataclasses.dataclass
class UbCheckResult:
    """Outcome of :func:`check_linear_ub_config`: the buffer ``uses``, the snapshot's answers
    (``found``) and the ``problems`` (``(buffer or "", message)``)."""

    ub_name: str | None
    uses: list[UbBufferUse]
    found: dict[str, UbBufferState | None]
    problems: list[tuple[str, str]]

    @property
    def ok(self) -> bool:
        return not self.problems


def check_linear_ub_config(op: str, config: Mapping[str, Any], snapshot: UbSnapshot) -> UbCheckResult:
    """Check a ``te.Linear`` op's UB configuration against a UB snapshot (``problems`` empty: consistent)."""
    kind = op.removesuffix("_base")
    flags = ub_flags_set(kind, config)
    name = config.get("ub_name")
    uses = linear_ub_buffer_uses(kind, config, snapshot) if flags else []
    found: dict[str, UbBufferState | None] = {}
    problems: list[tuple[str, str]] = []
    result = UbCheckResult(name, uses, found, problems)
    who = f"TE {kind} op with ub_name={name!r}"
    if flags and not name:
        problems.append(("", f"{who}: UB overlap flags {flags} are set but ub_name is None"))
    elif flags and not snapshot.initialized:
        problems.append(("", f"{who} uses UB overlap ({', '.join(flags)}) but UB is not initialised "
                             "in the UB state compiled against (call initialize_ub() before compiling)"))
    if not flags or problems:
        return result
    tp_size = config.get("tp_size")
    for use in uses:
        b = snapshot.buffer(use.buffer, use.use_fp8)
        found[f"{use.buffer}[{ub_mode(use.use_fp8)}]"] = b
        if b is None:
            problems.append((use.buffer, (
                f"{who}: {use.flag} needs UB buffer {use.buffer!r} in mode {ub_mode(use.use_fp8)!r} "
                f"({use.phase} {use.overlap}) but it is not registered; registered: {snapshot.names()}")))
            continue
        if isinstance(tp_size, int) and b.tp_size is not None and b.tp_size != tp_size:
            problems.append((use.buffer, (
                f"{who}: UB buffer {use.buffer!r} was initialised for tp_size={b.tp_size} but the "
                f"op runs with tp_size={tp_size}")))
    if snapshot.with_cublasmp:
        bulk = [f for f in flags if f.startswith("ub_bulk_")]
        if bulk:
            problems.append((f"{name}_dgrad" if "ub_bulk_dgrad" in bulk else f"{name}_wgrad", (
                f"{who}: {bulk} set but UB uses the cuBLASMp backend, which has no bulk overlap "
                "(the module was built before UB was re-initialised with with_cublasmp=True; rebuild it)")))
    fp8 = bool(config.get("fp8"))
    if fp8 and kind == "linear" and config.get("ub_overlap_rs_fprop"):
        b = snapshot.buffer(f"{name}_fprop", True)
        if b is not None and b.is_fp8_ubuf and not (config.get("fp8_output") and config.get("output_quantizer") is not None):
            problems.append((f"{name}_fprop", (
                f"{who}: UB buffer {name + '_fprop'!r} is an FP8 reduce-scatter buffer (is_fp8_ubuf()=True), "
                f"so TE's Linear.forward sets fp8_output=True, but the op was traced with "
                f"fp8_output={config.get('fp8_output')!r} and output_quantizer="
                f"{'set' if config.get('output_quantizer') is not None else 'None'} (traced against another UB state)")))
    rs_dgrad = config.get("ub_overlap_rs_dgrad") and not config.get("ub_overlap_ag" if kind == "linear_backward" else "ub_overlap_ag_dgrad")
    needs_dgrad = (config.get("requires_dgrad", True) if kind == "linear_backward"
                   else (config.get("is_grad_enabled", True) and config.get("input_requires_grad", True)
                         and config.get("backward_override") is None))
    if fp8 and rs_dgrad and needs_dgrad:
        b = snapshot.buffer(f"{name}_dgrad", True)
        if b is not None and b.is_fp8_ubuf and config.get("grad_input_quantizer") is None:
            problems.append((f"{name}_dgrad", (
                f"{who}: UB buffer {name + '_dgrad'!r} is an FP8 reduce-scatter buffer (is_fp8_ubuf()=True), "
                "so TE's Linear.forward sets fp8_grad=True, but the op has no grad_input_quantizer "
                "(traced against another UB state)")))
    return result
