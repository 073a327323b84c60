"""``hoist_recipe_lookups`` after its split (issue 12, item 5): the old name is a deprecated alias
for one release. In ``te_passes.disable`` / ``TE_PASSES_DISABLE`` / ``--disable`` it disables
``fold_recipe_lookups``, ``remove_quantizer_setattrs`` and ``hoist_te_constants``; in
``te_passes.pass_config`` its parameters go to the pass they belong to now. Both warn
``DeprecationWarning``. Checked on the real fp8 te.Linear graphs through the pass manager."""

from __future__ import annotations

import warnings

import pytest
import torch  # noqa: F401  (before transformer_engine)

from te_passes.config import TePassesOptionError, TePassesOptions
from te_passes.pipeline.registry import PASS_ALIASES, configured_passes, pass_classes, pass_names

NEW = ("fold_recipe_lookups", "remove_quantizer_setattrs", "hoist_te_constants")


def _parse(options, environ=None):
    return TePassesOptions.parse(options, known_passes=set(pass_names()), environ=environ or {},
                                 aliases=PASS_ALIASES)[0]


def test_the_split_passes_take_the_old_place_in_the_pipeline():
    names = pass_names()
    assert "hoist_recipe_lookups" not in names
    i = names.index("fold_recipe_lookups")
    assert names[i - 1] == "fold_ub_predicates" and tuple(names[i:i + 3]) == NEW
    assert names[i + 3] == "call_te_impl_directly"
    stages = {c.name: {s.value for s in c.stages} for c in pass_classes()}
    assert stages["fold_recipe_lookups"] == stages["remove_quantizer_setattrs"] == {"dynamo"}
    assert stages["hoist_te_constants"] == {"post_grad_fwd", "post_grad_bwd"}
    assert PASS_ALIASES == {"hoist_recipe_lookups": NEW}


def test_old_name_in_disable_disables_all_three_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match=r"'hoist_recipe_lookups'.*fold_recipe_lookups, "
                                                r"remove_quantizer_setattrs, hoist_te_constants"):
        opts = _parse({"te_passes.disable": ["insert_early_frees", "hoist_recipe_lookups", "hoist_te_constants"]})
    assert opts.disable == ("insert_early_frees",) + NEW  # order kept, no duplicates
    with pytest.warns(DeprecationWarning):
        env = _parse({}, environ={"TE_PASSES_DISABLE": "hoist_recipe_lookups"})
    assert env.disable == NEW
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _parse({"te_passes.disable": list(NEW)}).disable == NEW  # the new names: no warning
    with pytest.raises(TePassesOptionError, match="unknown pass name"):
        _parse({"te_passes.disable": ["hoist_recipe_lookup"]})
    with pytest.raises(TePassesOptionError, match="unknown pass name"):  # without the alias table: refused
        TePassesOptions.parse({"te_passes.disable": ["hoist_recipe_lookups"]}, known_passes=set(pass_names()),
                              environ={})


def test_old_name_accepted_by_the_backend_factory():
    import te_passes

    with pytest.warns(DeprecationWarning, match="hoist_recipe_lookups"):
        te_passes.te_inductor_backend(options={"te_passes.disable": ["hoist_recipe_lookups"]})


@pytest.mark.te
def test_disable_alias_through_the_manager_on_real_graphs(te_dynamo_graph, te_aot_graphs):
    pytest.importorskip("transformer_engine.pytorch")
    from te_passes.testing.capture import run_pipeline

    with pytest.warns(DeprecationWarning):
        opts = _parse({"te_passes.disable": ["hoist_recipe_lookups"]})
    cap = te_dynamo_graph("fp8-cs", 1)
    code = cap.gm.code
    (rep,) = run_pipeline(cap, options=opts, copy=False)
    runs = {r.name: r for r in rep.runs}
    assert runs["fold_recipe_lookups"].status == runs["remove_quantizer_setattrs"].status == "disabled"
    assert cap.gm.code == code and code.count("__setattr__") == 23  # the residue stays
    aot = te_aot_graphs("fp8-cs", 1)
    reps = run_pipeline(aot, ["post_grad_fwd", "post_grad_bwd"], options=opts)
    assert [r.status for rep in reps for r in rep.runs if r.name == "hoist_te_constants"] == ["disabled"] * 2
    # the same graphs with the passes on: what the alias switched off
    (on,) = run_pipeline(te_dynamo_graph("fp8-cs", 1), options=TePassesOptions())
    assert [(r.name, r.status, len(r.records)) for r in on.runs if r.name in NEW] == [
        ("fold_recipe_lookups", "ok", 0), ("remove_quantizer_setattrs", "ok", 23)]


def test_pass_config_of_the_old_name_is_routed_to_the_new_passes():
    from te_passes.te import recipes

    state = recipes.Fp8State(fp8_enabled=False)
    with pytest.warns(DeprecationWarning, match=r"pass_config\['hoist_recipe_lookups'\].*fp8_state -> "
                                                r"fold_recipe_lookups, hoist_constants -> hoist_te_constants"):
        passes = {p.name: p for p in configured_passes({"hoist_recipe_lookups": {"hoist_constants": False,
                                                                                 "fp8_state": state}})}
    assert passes["hoist_te_constants"].config() == {"hoist_constants": False}
    assert passes["fold_recipe_lookups"].config()["fp8_state"]["fp8_enabled"] is False
    assert passes["remove_quantizer_setattrs"].config() == {}
    # same results as the new names, other passes untouched
    direct = {p.name: p for p in configured_passes({"hoist_te_constants": {"hoist_constants": False},
                                                    "fold_recipe_lookups": {"fp8_state": state}})}
    assert {n: p.uuid() for n, p in passes.items()} == {n: p.uuid() for n, p in direct.items()}


def test_pass_config_of_the_old_name_is_checked_under_the_name_given():
    with pytest.warns(DeprecationWarning), pytest.raises(TePassesOptionError) as ei:
        configured_passes({"hoist_recipe_lookups": {"hoist_constants": "no"}})
    assert "te_passes.pass_config['hoist_recipe_lookups']['hoist_constants'] must be bool, got 'no'" in str(ei.value)
    with pytest.warns(DeprecationWarning), pytest.raises(TePassesOptionError,
                                                         match=r"\['hoist_recipe_lookups'\]\['fp8_state'\] must be"):
        configured_passes({"hoist_recipe_lookups": {"fp8_state": {"recipe": None}}})
    with pytest.warns(DeprecationWarning), pytest.raises(TePassesOptionError,
                                                         match=r"unknown parameter\(s\) \['policy'\]"):
        configured_passes({"hoist_recipe_lookups": {"policy": "all"}})
    with pytest.warns(DeprecationWarning), pytest.raises(TePassesOptionError, match="both under"):
        configured_passes({"hoist_recipe_lookups": {"hoist_constants": False},
                           "hoist_te_constants": {"hoist_constants": True}})


def test_te_passes_list_prints_the_deprecation_note(capsys, monkeypatch):
    from te_passes import cli

    monkeypatch.setenv("TE_PASSES_DISABLE", "hoist_recipe_lookups")
    assert cli.main(["list", "--plain"]) == 0
    out = capsys.readouterr().out
    assert "deprecated: hoist_recipe_lookups" in out and "fold_recipe_lookups, remove_quantizer_setattrs, " \
        "hoist_te_constants" in out
    assert "unknown passes" not in out
    rows = [ln for ln in out.splitlines() if ln.split()[:1] and ln.split()[0] in NEW]
    assert len(rows) == 3 and all("no (TE_PASSES_DISABLE)" in ln for ln in rows)
