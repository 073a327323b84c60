"""Every ``te_passes.*`` option value goes through one validator (issue 16, item 8): bools are
bools, paths are non-empty, pass_config values have the types the pass's constructor declares,
unknown pass names in TE_PASSES_DISABLE are refused the same way by the backend and replay."""

from __future__ import annotations

import pytest
import torch

from te_passes.config import TePassesOptionError, TePassesOptions
from te_passes.passes.order import configured_passes, pass_names


@pytest.mark.parametrize("value", ["yes", "false", "no", "1", 0, 1, None, "True"])
def test_strict_takes_only_bools(value):
    with pytest.raises(TePassesOptionError) as ei:
        TePassesOptions.parse({"te_passes.strict": value}, environ={})
    msg = str(ei.value)
    assert "te_passes.strict" in msg and repr(value) in msg and "must be a bool (True or False)" in msg, msg


@pytest.mark.parametrize("value, expect", [(True, True), (False, False)])
def test_strict_bools(value, expect):
    assert TePassesOptions.parse({"te_passes.strict": value}, environ={})[0].strict is expect


@pytest.mark.parametrize("env, expect", [("1", True), ("0", False), ("true", True), ("false", False)])
def test_strict_env_spellings(env, expect):
    assert TePassesOptions.parse({}, environ={"TE_PASSES_STRICT": env})[0].strict is expect


@pytest.mark.parametrize("value", ["", 3, b"dir"])
def test_dump_dir_must_be_a_non_empty_path(value):
    with pytest.raises(TePassesOptionError, match=r"te_passes.dump_dir must be a non-empty path"):
        TePassesOptions.parse({"te_passes.dump_dir": value}, environ={})


@pytest.mark.parametrize("value", ["no", "false", 0, None, [True]])
def test_pass_config_values_are_type_checked(value):
    with pytest.raises(TePassesOptionError) as ei:
        configured_passes({"hoist_te_constants": {"hoist_constants": value}})
    msg = str(ei.value)
    assert "te_passes.pass_config['hoist_te_constants']['hoist_constants']" in msg and repr(value) in msg, msg
    assert "must be bool" in msg


def test_pass_config_right_types_are_taken():
    passes = {p.name: p for p in configured_passes({"hoist_te_constants": {"hoist_constants": False},
                                                    "insert_early_frees": {"policy": "opaque"}})}
    assert passes["hoist_te_constants"].config()["hoist_constants"] is False
    with pytest.raises(TePassesOptionError, match=r"\['insert_early_frees'\]\['policy'\] must be str, got 3"):
        configured_passes({"insert_early_frees": {"policy": 3}})


def test_backend_refuses_bad_option_values_before_compiling():
    from te_passes.backend import te_inductor

    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    for opts, what in (({"te_passes.strict": "yes"}, "te_passes.strict"),
                       ({"te_passes.dump_dir": ""}, "te_passes.dump_dir"),
                       ({"te_passes.pass_config": {"hoist_te_constants": {"hoist_constants": "no"}}},
                        "hoist_constants")):
        with pytest.raises(TePassesOptionError, match=what):
            te_inductor(gm, [torch.ones(2)], options=opts)


def test_unknown_te_passes_disable_is_refused_by_backend_and_replay(monkeypatch, tmp_path):
    from te_passes.backend import te_inductor
    from te_passes.debug.offline import ReplayError, replay, run_stages
    from te_passes.pipeline.base import Stage

    monkeypatch.setenv("TE_PASSES_DISABLE", "nope_pass")
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    with pytest.raises(TePassesOptionError, match="nope_pass"):
        te_inductor(gm, [torch.ones(2)])
    monkeypatch.delenv("TE_PASSES_DISABLE")
    run_stages([(Stage.DYNAMO, gm, [torch.ones(2)])], configured_passes(), dump_dir=str(tmp_path / "d"),
               graph_id="g0")
    monkeypatch.setenv("TE_PASSES_DISABLE", "nope_pass")
    with pytest.raises(ReplayError, match=r"unknown pass name\(s\) in TE_PASSES_DISABLE: \['nope_pass'\]"):
        replay(str(tmp_path / "d"), configured_passes())
    # a known name is applied by replay too (as by the backend)
    monkeypatch.setenv("TE_PASSES_DISABLE", pass_names()[0])
    ((report, _saved),) = replay(str(tmp_path / "d"), configured_passes())
    assert [r.status for s in report.stages for r in s.runs if r.name == pass_names()[0]] == ["disabled"]
