"""Follow-on graph breaks inside TE frames are attributed (te.DotProductAttention, TE 2.20.2).

Measured on an H200 (tests/gpu/test_te_inductor_gpu.py::test_transformer_layer_numerics_and_eager_islands):
te.TransformerLayer's DotProductAttention.forward breaks with reason ``step_unsupported`` at
``dot_product_attention.py:2318 (forward)`` — the ``with self.prepare_forward_ctx(...)`` around
the eager FusedAttention call — and the report left it unattributed. These tests feed that exact
shape of break record to the report.
"""

from __future__ import annotations

import collections
import traceback

from te_passes.debug.graph_breaks import CompileEvents, graph_break_entry
from te_passes.compat.te220.fallbacks import classify_graph_break

DPA = "/root/tek/site/transformer_engine/pytorch/attention/dot_product_attention/dot_product_attention.py"
Break = collections.namedtuple("Break", "reason user_stack")


def _stack(*frames):
    return [traceback.FrameSummary(f, line, name, lookup_line=False) for f, line, name in frames]


def test_cannot_resume_break_in_dpa_forward_is_a_follow_on_island():
    stack = _stack(("/work/model.py", 10, "step"), (DPA, 2318, "forward"))
    e = graph_break_entry("step_unsupported", stack)
    assert e["te"] == {"module": "te.DotProductAttention", "kind": "follow_on",
                       "reason": e["te"]["reason"]}
    assert "prepare_forward_ctx" in e["te"]["reason"]
    assert e["location"] == "/work/model.py:10 (step)"


def test_the_same_reason_elsewhere_or_another_te_function_is_not_attributed():
    assert classify_graph_break("step_unsupported", ("/work/model.py", "forward")) is None
    assert classify_graph_break("step_unsupported", (DPA, "_unpack")) is None
    assert classify_graph_break("step_unsupported") is None  # no frame given: text alone is not enough
    # a different break at the same place is not a follow-on
    assert classify_graph_break("Unsupported: call_function BuiltinVariable(print)", (DPA, "forward")) is None


def test_dynamo_cannot_resume_text_is_recognised():
    reason = ("Encountered graph break that we cannot resume from. Compiling up to the previous "
              "resumable state, then skipping the rest of the function. Graph break encountered:\n\n...")
    assert classify_graph_break(reason, (DPA, "forward")).module == "te.DotProductAttention"


def test_compile_events_report_lists_the_follow_on_island():
    ev = CompileEvents(record_warnings=False)
    disabled = ("Skip inlining function <function FusedAttention.forward at 0x7f00> since it was "
                "wrapped with `torch.compiler.disable`")
    ev._fill([Break(disabled, _stack((DPA, 2330, "forward"))),
              Break("step_unsupported", _stack((DPA, 2318, "forward")))], [])
    assert [b["te"]["module"] if b["te"] else None for b in ev.graph_breaks] == ["te.FusedAttention",
                                                                                 "te.DotProductAttention"]
    assert [(f["module"], f["kind"]) for f in ev.eager_fallbacks] == [("te.FusedAttention", "disabled_forward"),
                                                                      ("te.DotProductAttention", "follow_on")]
