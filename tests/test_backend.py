"""te_inductor backend: entry point, modes, options, stages, config hygiene."""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap

import pytest
import torch
import torch._dynamo
from torch._inductor import config as inductor_config
from torch._inductor.utils import fresh_cache

from te_passes.backend import te_inductor
from te_passes.config import TePassesOptionError
from te_passes.passes import PassRecord, Stage, TEPass, TEPassResult
from te_passes.passes.find_autocast_state import FindAutocastState  # te_inductor needs its fact in any pass list
from te_passes.report import clear_compile_reports, compile_reports


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    clear_compile_reports()
    with fresh_cache():  # an FX-graph-cache hit would skip the post-grad stages
        yield
    torch._dynamo.reset()


FRESH = textwrap.dedent("""
    import sys, torch
    assert "te_passes" not in sys.modules
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    for mode in (None, "reduce-overhead", "max-autotune-no-cudagraphs"):
        torch._dynamo.reset()
        y = torch.compile(m, backend="te_inductor", mode=mode)(x)
        torch.testing.assert_close(y, m(x), rtol=0, atol=1e-6)
        print("ok", mode)
    assert "te_passes" in sys.modules  # loaded through the entry point, not by us
""")


def test_fresh_interpreter_no_import_all_modes():
    """The backend name resolves through the torch_dynamo_backends entry point alone."""
    proc = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:3] == ["ok None", "ok reduce-overhead", "ok max-autotune-no-cudagraphs"]


@pytest.mark.parametrize("mode", [None, "default", "reduce-overhead", "max-autotune-no-cudagraphs"])
def test_training_numerics_and_stages(mode):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    ref.load_state_dict(m.state_dict())
    x = torch.randn(3, 8)
    y = torch.compile(m, backend="te_inductor", mode=mode)(x)
    torch.testing.assert_close(y, ref(x))
    y.sum().backward()
    ref(x).sum().backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    (rep,) = compile_reports()
    assert rep.mode == (mode or "default")  # torch.compile drops "default"; the report says it
    assert [s.stage for s in rep.stages] == ["dynamo", "joint", "post_grad_fwd", "post_grad_bwd"]
    assert [s.graph_id for s in rep.stages] == [rep.graph_id, f"{rep.graph_id}.joint",
                                                f"{rep.graph_id}.fwd", f"{rep.graph_id}.bwd"]


def test_inference_graph_has_no_backward_stage():
    m = torch.nn.Linear(4, 4)
    with torch.no_grad():
        y = torch.compile(m, backend="te_inductor")(torch.ones(2, 4))
        torch.testing.assert_close(y, m(torch.ones(2, 4)))
    (rep,) = compile_reports()
    assert [s.stage for s in rep.stages] == ["dynamo", "joint", "post_grad_fwd"]


def test_unknown_te_passes_option_lists_valid_keys():
    with pytest.raises(TePassesOptionError) as ei:
        te_inductor(torch.fx.symbolic_trace(torch.nn.ReLU()), [torch.ones(2)], options={"te_passes.nope": 1})
    msg = str(ei.value)
    assert "'te_passes.nope'" in msg and "te_passes.disable" in msg and "te_passes.strict" in msg


def test_unknown_pass_name_in_disable():
    with pytest.raises(TePassesOptionError, match="unknown pass name.*no_such_pass"):
        te_inductor(torch.fx.symbolic_trace(torch.nn.ReLU()), [torch.ones(2)],
                    options={"te_passes.disable": ["no_such_pass"]})


def test_bad_option_value():
    with pytest.raises(TePassesOptionError, match="te_passes.strict must be a bool"):
        te_inductor(torch.fx.symbolic_trace(torch.nn.ReLU()), [torch.ones(2)], options={"te_passes.strict": 3})


def test_unknown_mode_and_inductor_option_are_inductors_errors():
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    with pytest.raises(RuntimeError, match="Unrecognized mode"):
        te_inductor(gm, [torch.ones(2)], mode="warp-speed")
    with pytest.raises(RuntimeError, match="Unexpected optimization option"):
        te_inductor(gm, [torch.ones(2)], options={"not_an_inductor_knob": True})


def test_inductor_options_pass_through_without_mutating_global_config():
    before = inductor_config.get_config_copy()
    seen = {}

    def spy(graph):
        seen["max_autotune"] = inductor_config.max_autotune
        seen["cudagraphs"] = inductor_config.triton.cudagraphs

    m = torch.nn.Linear(4, 4)
    # torch.compile rejects mode= together with options= (for every backend); te_inductor
    # takes both when called directly, e.g. through functools.partial.
    backend = functools.partial(te_inductor, mode="reduce-overhead",
                                options={"max_autotune": True, "post_grad_custom_post_pass": spy})
    with torch.no_grad():
        torch.compile(m, backend=backend)(torch.ones(1, 4))
    assert seen == {"max_autotune": True, "cudagraphs": True}
    after = inductor_config.get_config_copy()
    assert {k: v for k, v in after.items() if before.get(k) != v} == {}


class _CountAdds(TEPass):
    name = "count_adds"
    stages = frozenset({Stage.DYNAMO, Stage.POST_GRAD_FWD})
    description = "test pass: records how many add nodes each graph has"
    analysis_only = True

    def run(self, gm, ctx):
        adds = [n.name for n in gm.graph.nodes if n.op == "call_function" and "add" in str(n.target)]
        return TEPassResult(gm, False, [PassRecord("adds", None, {"nodes": adds})])


def test_user_post_grad_pass_runs_before_ours(monkeypatch):
    order = []
    monkeypatch.setattr("te_passes.passes.order.default_passes", lambda: [FindAutocastState(), _Spy(order)])

    def user_pass(graph):
        order.append("user")

    with torch.no_grad():
        torch.compile(lambda x: x + 1, backend="te_inductor",
                      options={"post_grad_custom_pre_pass": user_pass})(torch.ones(2))
    assert order == ["ours:dynamo", "ours:joint", "user", "ours:post_grad_fwd"]


class _Spy(TEPass):
    name = "spy"
    stages = frozenset(Stage)
    description = "test pass: logs the stages it saw"
    analysis_only = True

    def __init__(self, order):
        super().__init__()
        self.order = order

    def run(self, gm, ctx):
        self.order.append(f"ours:{ctx.stage.value}")
        return TEPassResult(gm, False)


def test_dynamo_and_post_grad_passes_see_their_graphs(monkeypatch):
    monkeypatch.setattr("te_passes.passes.order.default_passes", lambda: [FindAutocastState(), _CountAdds()])
    with torch.no_grad():
        torch.compile(lambda x, y: (x + y) * 2 + 1, backend="te_inductor")(torch.ones(2), torch.ones(2))
    (rep,) = compile_reports()
    dyn, _joint, fwd = rep.stages
    assert [r.name for r in dyn.runs] == ["find_autocast_state", "count_adds"]
    assert dyn.runs[1].records[0].data["nodes"] == ["add", "add_1"]
    assert fwd.runs[0].records[0].data["nodes"] == ["add", "add_1"]  # aten.add.Tensor nodes
    assert rep.uuid["passes"] == {"find_autocast_state": FindAutocastState().uuid(), "count_adds": _CountAdds().uuid()}


def test_bad_environment_variables_are_named(monkeypatch):
    from te_passes.config import TePassesOptions

    monkeypatch.setenv("TE_PASSES_DISABLE", "bogus")
    with pytest.raises(TePassesOptionError, match=r"unknown pass name\(s\) in TE_PASSES_DISABLE: \['bogus'\]"):
        TePassesOptions.parse({}, known_passes={"a"})
    with pytest.raises(TePassesOptionError, match=r"in te_passes.disable / TE_PASSES_DISABLE: \['x', 'bogus'\]"):
        TePassesOptions.parse({"te_passes.disable": ["x"]}, known_passes={"a"})
    monkeypatch.delenv("TE_PASSES_DISABLE")
    monkeypatch.setenv("TE_PASSES_STRICT", "banana")
    with pytest.raises(TePassesOptionError, match=r"environment variable TE_PASSES_STRICT='banana': .*must be a bool"):
        TePassesOptions.parse({})


def test_pass_config_reaches_the_passes_and_their_uuid():
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    with torch.no_grad():
        te_inductor(gm, [torch.ones(2)], options={"te_passes.pass_config": {"insert_early_frees": {"policy": "all"}}})
    (rep,) = compile_reports()
    from te_passes.passes.order import configured_passes
    (frees,) = [p for p in configured_passes({"insert_early_frees": {"policy": "all"}}) if p.name == "insert_early_frees"]
    assert frees.config()["policy"] == "all"
    assert rep.uuid["passes"]["insert_early_frees"] == frees.uuid()
    assert rep.uuid["passes"]["insert_early_frees"] != type(frees)().uuid()


@pytest.mark.parametrize("cfg, msg", [
    ({"no_such_pass": {}}, r"names unknown pass\(es\) \['no_such_pass'\]"),
    ({"insert_early_frees": {"polcy": "all"}}, r"\['polcy'\]; insert_early_frees takes \['policy'\]"),
    ({"insert_early_frees": {"policy": "sometimes"}}, r"\['insert_early_frees'\]\['policy'\] must be one of"),
    ({"insert_early_frees": "all"}, r"must be a dict"),
])
def test_bad_pass_config(cfg, msg):
    with pytest.raises(TePassesOptionError, match=msg):
        te_inductor(torch.fx.symbolic_trace(torch.nn.ReLU()), [torch.ones(2)], options={"te_passes.pass_config": cfg})
