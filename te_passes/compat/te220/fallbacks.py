"""Where and why Transformer Engine runs eagerly under torch.compile (TE 2.20.2).

See docs/internals.md#te_passescompatte220fallbackspy."""

from __future__ import annotations

import dataclasses
import re

_NO_OP = "is @no_torch_dynamo (torch.compiler.disable) in TE 2.20: no compiled custom op yet"

#: ``qualname`` of a ``@no_torch_dynamo()`` TE function -> (TE module, why it is eager).
DISABLED_FORWARDS: dict[str, tuple[str, str]] = {
    **{f"{m}.forward": (f"te.{m}", f"{m}.forward {_NO_OP}") for m in ("LayerNormLinear", "LayerNormMLP",
                                                                    "GroupedLinear")},
    "FusedAttention.forward": ("te.FusedAttention", "FusedAttention.forward is @no_torch_dynamo "
                               "(torch.compiler.disable) in TE 2.20: fused attention kernels run eagerly"),
    **{q: (f"te.{q.split('.')[0]}", f"{q} is @no_torch_dynamo in TE 2.20")
       for q in ("UnfusedDotProductAttention._forward_eager", "Fp8Padding.forward", "Fp8Unpadding.forward")},
    "_linear_eager": ("te.Linear", "te.Linear's eager implementation (_linear_eager, @no_torch_dynamo) "
                      "ran inside the compiled region"),
}

#: ``@no_torch_dynamo`` bodies TE runs *after* a configuration fallback: qualname -> TE module.
EAGER_BODIES: dict[str, str] = {
    "Linear._forward_eager_fallback": "te.Linear",
}

#: Prefix of te.Linear's own graph-break message (``module/linear.py``).
LINEAR_FALLBACK_PREFIX = "te.Linear falling back to eager: "
#: TE's eager-fallback warning (``utils.warn_compile_eager_fallback`` / ``jit.no_torch_dynamo``).
FALLBACK_WARNING_RE = re.compile(r"Falling back to eager execution under torch\.compile: (?P<reason>.*?) is "
                                 r"unsupported on the compiled path")

#: Dynamo's text for a call to a ``torch.compiler.disable``d function (``<function Qual.name at 0x...>``).
_DISABLED_RE = re.compile(r"<function (?P<qual>[\w.<>]+) at 0x[0-9a-f]+>")
_USER_BREAK_RE = re.compile(r"User-inserted graph break\. Message: (?P<msg>[^\n]*)")
#: The disabled copy of a TE forward the untouched-model polyfills leave a call to, named after it.
_ISLAND_RE = re.compile(r"te_passes_untouched_island\[(?P<target>[\w.]+)\]")
#: Polyfill target -> TE module (the island record, ``untouched.island_records()``, has the reason).
UNTOUCHED_TARGETS: dict[str, str] = {"LayerNormLinear.forward": "te.LayerNormLinear",
                                     "LayerNormMLP.forward": "te.LayerNormMLP",
                                     "FusedAttention.forward": "te.FusedAttention"}


#: Follow-on breaks: a TE function whose frame Dynamo cannot resume after an island inside it,
#: keyed by (path suffix of the file, function name) of the innermost frame -> (TE module, why).
#: ``DotProductAttention.forward`` calls ``FusedAttention.forward`` inside ``with
#: self.prepare_forward_ctx(...)`` (``attention/dot_product_attention/dot_product_attention.py``), a
#: generator context manager Dynamo cannot build a resume function inside.
FOLLOW_ON_BREAKS: dict[tuple[str, str], tuple[str, str]] = {
    ("transformer_engine/pytorch/attention/dot_product_attention/dot_product_attention.py", "forward"): (
        "te.DotProductAttention",
        "the eager attention backend (FusedAttention.forward, @no_torch_dynamo) is called inside "
        "`with self.prepare_forward_ctx(...)`, which Dynamo cannot resume in: the rest of "
        "DotProductAttention.forward runs eagerly"),
}
_SPLIT = ("q/k/v split with SplitAlongDim (GQA, or no packed pass-through), {}reads data_ptr: "
          "one graph break per layer; no fix inside te_passes (num_gqa_groups == heads avoids it)")
#: Graph breaks inside TE code Dynamo cannot trace, keyed by (path suffix, function) of the
#: innermost frame -> (TE module, why and the fix): ``SplitAlongDim`` (``pytorch/utils.py``), with
#: which TE's ``MultiheadAttention`` splits q/k/v, compares ``untyped_storage().data_ptr()``.
TE_UNTRACEABLE: dict[tuple[str, str], tuple[str, str]] = {
    ("transformer_engine/pytorch/utils.py", "backward"): ("te.MultiheadAttention", _SPLIT.format("whose backward ")),
    ("transformer_engine/pytorch/utils.py", "forward"): ("te.MultiheadAttention", _SPLIT.format("which ")),
}
#: Dynamo's texts for a graph break it cannot resume from (``symbolic_convert``).
_CANNOT_RESUME_RE = re.compile(r"step_unsupported|cannot resume from", re.IGNORECASE)


@dataclasses.dataclass
class TEFallback:
    """A graph break attributed to TE: ``module`` (``"te.LayerNormLinear"``), ``kind``
    (``"disabled_forward"``, ``"linear_config"``, ``"conditional"``, ``"untouched_island"`` — a call
    te_passes' polyfill left to TE's eager forward, ``"untraceable"`` — TE code Dynamo cannot trace, ``"eager_body"`` — the
    eager half of a configuration fallback, ``"follow_on"`` — a TE frame Dynamo could not resume
    after an island inside it), ``reason`` (one line)."""

    module: str
    kind: str
    reason: str


def classify_graph_break(reason: str, innermost_frame: tuple[str, str] | None = None) -> TEFallback | None:
    """The TE eager island a Dynamo graph-break ``reason`` text stands for, or ``None``.

    ``innermost_frame`` — ``(filename, function)`` of the break's innermost user-stack frame —
    lets a "cannot resume" break inside a TE function of :data:`FOLLOW_ON_BREAKS` be attributed
    (kind ``"follow_on"``); without it such a break stays unattributed.
    """
    if innermost_frame is not None:
        norm, func = innermost_frame[0].replace("\\", "/"), innermost_frame[1]
        for kind, table, hit in (("follow_on", FOLLOW_ON_BREAKS, _CANNOT_RESUME_RE.search(reason)),
                                 ("untraceable", TE_UNTRACEABLE, "data_ptr" in reason)):
            for (suffix, fn_name), (mod, why) in table.items() if hit else ():
                if func == fn_name and norm.endswith(suffix):
                    return TEFallback(mod, kind, why)
    m = _USER_BREAK_RE.search(reason)
    if m and m.group("msg").startswith(LINEAR_FALLBACK_PREFIX):
        return TEFallback("te.Linear", "linear_config", m.group("msg")[len(LINEAR_FALLBACK_PREFIX):].strip())
    m = _ISLAND_RE.search(reason) if "torch.compiler.disable" in reason else None
    if m:
        target = m.group("target")
        return TEFallback(UNTOUCHED_TARGETS.get(target, target), "untouched_island",
                          f"te_passes' polyfill of {target} left this call to TE's eager forward "
                          "(te_passes.compat.untouched.polyfills.island_records() names the reason and the fix)")
    m = _DISABLED_RE.search(reason) if "torch.compiler.disable" in reason else None
    if m:
        qual = m.group("qual")
        if qual in DISABLED_FORWARDS:
            mod, why = DISABLED_FORWARDS[qual]
            return TEFallback(mod, "disabled_forward", why)
        if qual in EAGER_BODIES:
            return TEFallback(EAGER_BODIES[qual], "eager_body", f"{qual} (@no_torch_dynamo) runs the fallback eagerly")
        if "report_and_run" in qual:
            return TEFallback("te (no_torch_dynamo(when=...))", "conditional",
                              "conditionally disabled TE forward; see the TE warning for the reason")
    return None


def fallback_reason_from_warning(message: str) -> str | None:
    """The reason inside TE's ``Falling back to eager execution under torch.compile`` warning."""
    m = FALLBACK_WARNING_RE.search(message)
    return m.group("reason") if m else None
