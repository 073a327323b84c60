"""Hand-built FX graphs that do / do not read Userbuffers state (shared by the UB guard and the
UB-uuid tests). Needs Transformer Engine importable (callers ``importorskip`` it first)."""

from __future__ import annotations

import contextlib

import torch
import torch.fx
import transformer_engine.pytorch.module.base as te_base
from torch._dynamo.utils import counters

from te_passes.report import clear_compile_reports
from te_passes.testing.ub import StandInCommunicator as C, ub_registry

#: UB registries: ``proj_fprop``'s reduce-scatter buffer in fp8, and in bf16.
FP8_RS = {("proj_fprop", "fp8"): C(fp8_ubuf=True), ("proj_fprop", "none"): C()}
BF16_RS = {("proj_fprop", "fp8"): C(fp8_ubuf=False), ("proj_fprop", "none"): C()}


@contextlib.contextmanager
def fresh_ub_compiles(registry=FP8_RS):
    """Fresh Dynamo state, compile counters and compile reports, with ``registry`` as TE's UB
    registry, for one test (and Dynamo reset again after it)."""
    torch._dynamo.reset()
    counters.clear()
    clear_compile_reports()
    with ub_registry(registry):
        yield
    torch._dynamo.reset()


def consume(x, v):
    """``3 * x`` when the UB predicate ``v`` is true, else ``0.5 * x``."""
    return x * (3.0 if v else 0.5)


def ub_graph() -> torch.fx.GraphModule:
    """x -> consume(x, get_ub('proj_fprop', True).is_fp8_ubuf()) (a graph with a UB query node)."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    q = g.call_method("is_fp8_ubuf", (g.call_function(te_base.get_ub, ("proj_fprop", True)),))
    g.output((g.call_function(consume, (x, q)),))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def plain_graph() -> torch.fx.GraphModule:
    """x -> relu(x): reads no UB state."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output((g.call_function(torch.relu, (x,)),))
    return torch.fx.GraphModule(torch.nn.Module(), g)


class UbModel(torch.nn.Module):
    """Branches on TE's get_ub_is_fp8 (the query te.Linear.forward makes for RS overlap; Dynamo
    folds it under te_passes' guard while tracing)."""

    def forward(self, x):
        if te_base.get_ub_is_fp8("proj_fprop", True):
            return torch.sin(x) * 2
        return torch.cos(x) - 1


class Plain(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) + 1
