"""Inductor's FX graph cache with te_passes: hits when nothing changed, misses when a pass, its
config or the TE state the passes read changed (the post-grad passes' ``uuid()``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config
from torch._inductor.utils import fresh_cache

from te_passes.passes import PassRecord, Stage, TEPass, TEPassResult
from te_passes.passes.find_autocast_state import FindAutocastState  # te_inductor needs its fact in any pass list
from te_passes.pipeline.base import PassConfig
from te_passes.report import clear_compile_reports, compile_reports
from te_passes.te.state import TEState


class Tagger(TEPass):
    """Post-grad analysis pass whose config is part of its uuid."""

    name = "tagger"
    stages = frozenset({Stage.POST_GRAD_FWD})
    description = "records the config it ran with"
    analysis_only = True

    @dataclasses.dataclass(frozen=True)
    class Config(PassConfig):
        level: int = 0

    def run(self, gm, ctx):
        return TEPassResult(gm, False, [PassRecord("tag", None, self.config())])


def _compile_once(monkeypatch, **cfg):
    monkeypatch.setattr("te_passes.passes.order.default_passes", lambda: [FindAutocastState(), Tagger(**cfg)])
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(lambda x: torch.sin(x) * 3, backend="te_inductor")(torch.arange(4.0))
    torch.testing.assert_close(out, torch.sin(torch.arange(4.0)) * 3)


def _hits_misses():
    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


@pytest.fixture
def cache():
    counters.clear()
    clear_compile_reports()
    with fresh_cache(), inductor_config.patch(fx_graph_cache=True, fx_graph_remote_cache=False):
        yield
    torch._dynamo.reset()


def test_cache_hits_when_unchanged_misses_on_pass_config(monkeypatch, cache):
    _compile_once(monkeypatch, level=1)
    assert _hits_misses() == (0, 1)
    _compile_once(monkeypatch, level=1)
    assert _hits_misses() == (1, 1)
    reps = compile_reports()
    # The hit reused the compiled artifact: the post-grad pass did not run again.
    def tagged(rep):
        return [s.stage for s in rep.stages if any(r.name == Tagger.name for r in s.runs)]

    assert tagged(reps[0]) == ["post_grad_fwd"]
    assert tagged(reps[1]) == []
    _compile_once(monkeypatch, level=2)
    assert _hits_misses() == (1, 2)
    assert compile_reports()[2].records("tag")[0].data == {"level": 2}


def test_cache_misses_when_te_state_changes(monkeypatch, cache):
    _compile_once(monkeypatch)
    _compile_once(monkeypatch)
    assert _hits_misses() == (1, 1)
    changed = TEState(te_version="9.99.0")
    monkeypatch.setattr("te_passes.backend.capture_te_state", lambda **kw: changed)
    _compile_once(monkeypatch)
    assert _hits_misses() == (1, 2)
    assert compile_reports()[2].uuid["te_state"] == changed.fingerprint()
