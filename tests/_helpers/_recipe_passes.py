"""Shared by the recipe-pass tests (tests/passes/test_fold_recipe_lookups.py,
test_remove_quantizer_setattrs.py, test_hoist_te_constants.py): stand-in ops for hand-built FX
graphs, the passes run in pipeline order on the compilation's TE snapshot, and the runtime install
the backend does first (autouse fixture ``_runtime``: import it into the test module)."""

from __future__ import annotations

import collections
import contextlib

import pytest

torch = pytest.importorskip("torch")
te_recipe = pytest.importorskip("transformer_engine.common.recipe")
te = pytest.importorskip("transformer_engine.pytorch")

import torch.fx  # noqa: E402

from te_passes.pipeline.base import Stage  # noqa: E402
from te_passes.passes.fold_recipe_lookups import FoldRecipeLookups  # noqa: E402
from te_passes.passes.hoist_te_constants import HoistTEConstants  # noqa: E402
from te_passes.passes.remove_quantizer_setattrs import RemoveQuantizerSetattrs  # noqa: E402
from te_passes.pipeline.base import TEPassResult  # noqa: E402
from te_passes.compat.install import install  # noqa: E402
from te_passes.compat.api import capture_te_state
from te_passes.testing.harness import pass_context  # noqa: E402


# --------------------------------------------------------------------------- helpers
def gemm(x, split):
    """Stand-in GEMM whose result shows which flag it got."""
    return x * (2.0 if split is True else 3.0 if split is False else 5.0)


def consume(x, obj):
    """A consumer that takes an object itself (must never be given a folded constant)."""
    return x + (1.0 if obj is not None else 0.0)


def scale_by(x, value):
    return x * float(value if not isinstance(value, str) else len(value))


def use_quantizer(x, q):
    """Reads quantizer fields in-memory (an op observing its quantizer)."""
    return x * (2.0 if q.columnwise_usage else 3.0) + (1.0 if q.internal else 0.0)


def ctx(stage=Stage.DYNAMO):
    """The pass reads TE's autocast state from the compilation's TE snapshot, taken here (as
    ``te_inductor`` takes it when a compilation begins)."""
    return pass_context(stage, te_state=capture_te_state(), strict=True)


@pytest.fixture(autouse=True)
def _runtime():
    """``compat.install()``, as the backend does before any pass runs (it wraps TE's constant
    classes' ``__fx_repr__``, which ``hoist_te_constants`` needs and never patches itself)."""
    install()


def run_pass(gm, fp8_state=None, stage=Stage.DYNAMO, **kw):
    """The passes of ``stage`` in pipeline order (Dynamo: fold_recipe_lookups, then
    remove_quantizer_setattrs; post-grad: hoist_te_constants), their records concatenated."""
    if stage is Stage.DYNAMO:
        passes = [FoldRecipeLookups(fp8_state=fp8_state, **kw), RemoveQuantizerSetattrs()]
    else:
        passes = [HoistTEConstants(**kw)]
    results = [p.run(gm, ctx(stage)) for p in passes]
    gm.graph.lint()
    gm.recompile()
    return TEPassResult(gm, any(r.modified for r in results), [x for r in results for x in r.records])


def kinds(res):
    return collections.Counter(r.kind for r in res.records)


@contextlib.contextmanager
def autocast_cpu(recipe):
    """``te.autocast`` on this GPU-less machine (TE's device-support answers preset)."""
    from te_passes.testing.fake_gpu import fake_gpu

    with fake_gpu("fp8-cs"), te.autocast(enabled=True, recipe=recipe):
        yield


def new_graph():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    return g, x


def gm_of(g, root=None):
    return torch.fx.GraphModule(root if root is not None else torch.nn.Module(), g)


def ops(gm):
    return [(n.op, getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes]


X = torch.arange(4.0)
