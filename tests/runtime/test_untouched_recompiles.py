"""Recompiles of untouched TE models under te_inductor (issue 38, items 4, 5, 8 and the sliding window of 3), on
CPU with a fake GPU: each case compiles a real TE model as a user writes it with a backend carrying te_inductor's
mark (tests/runtime/test_untouched.py ``_run``), calls it 4 times and counts Dynamo graphs, graph breaks and
recompiles (``torch._dynamo.utils.get_compilation_metrics``). The GPU check of the bf16
``te.autocast(enabled=False)`` case: tests/gpu/test_recompiles_gpu.py (when lent).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

te = pytest.importorskip("transformer_engine.pytorch")

from te_passes.compat.dynamo.hooks import mark_untouched_backend  # noqa: E402
from te_passes.compat.untouched import gate, polyfills as untouched  # noqa: E402
from tests.runtime.test_untouched import install_polyfills  # noqa: E402
from te_passes.testing.fake_gpu import constructing, fake_gpu, make_recipe, quiet  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _polyfills():
    install_polyfills()
    untouched.clear_island_records()
    yield


def _backend(graphs):
    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    return mark_untouched_backend(backend)


def _layer(**kw):
    args = dict(hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.bfloat16, device="cuda")
    args.update(kw)
    return te.TransformerLayer(64, 256, 4, **args)


def _llama(**kw):
    """A Llama-style layer: RMSNorm, SwiGLU, GQA, causal, no bias."""
    return _layer(normalization="RMSNorm", activation="swiglu", num_gqa_groups=2, self_attn_mask_type="causal",
                  bias=False, **kw)


def _run(build, step_body, outer, precision="fp8-cs", calls=4, shape=(16, 2, 64)):
    """Compile ``step_body(model, recipe, x)`` over ``build()`` on fake cuda, call it ``calls`` times, each inside
    ``outer(recipe)`` (a context manager built per call); ``precision`` ``"fp8-ds"``: TE's ``DelayedScaling()``
    (on the fake Hopper). Returns dict(graphs, breaks, recompiles, restarts (Dynamo's restart reasons), warnings)."""
    from torch._dynamo.utils import counters, get_compilation_metrics
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch._dynamo.reset()
    install_polyfills()
    counters.clear()
    graphs: list = []
    with quiet(), fake_gpu("fp8-cs" if precision == "fp8-ds" else precision), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if precision == "fp8-ds":
            from transformer_engine.common.recipe import DelayedScaling

            recipe = DelayedScaling()
        else:
            recipe = make_recipe(precision) if precision != "bf16" else None
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode, constructing():
            model = build()

        def step(x):
            out = step_body(model, recipe, x)
            return out[0] if isinstance(out, tuple) else out

        step.__code__ = step.__code__.replace(co_name=f"recompiles_step_{id(step_body)}_{precision}")
        fn = torch.compile(step, backend=_backend(graphs), dynamic=False)
        seen = {id(m) for m in get_compilation_metrics()}
        for _ in range(calls):
            with mode, constructing():
                x = torch.randn(*shape, dtype=torch.bfloat16, device="cuda", requires_grad=True)
            with mode, outer(recipe):
                fn(x)
        new = [m for m in get_compilation_metrics() if id(m) not in seen]
        reasons = [m.recompile_reason for m in new if m.recompile_reason]
        restarts = [r for m in new for r in (m.restart_reasons or ())]
    ours = [str(w.message) for w in caught if str(w.message).startswith("te_passes:")]
    return dict(graphs=len(graphs), breaks=dict(counters["graph_break"]), recompiles=reasons, restarts=restarts,
                warnings=ours)


def _plain(model, recipe, x):
    return model(x)


def _no_recompile(r, graphs=1):
    assert r["breaks"] == {}, r["breaks"]
    assert r["recompiles"] == [], r["recompiles"]
    assert r["graphs"] == graphs, r


# --------------------------------------------------------------------------- item 8: te.autocast, same state
@pytest.mark.parametrize("build", [_layer, _llama], ids=["layer", "llama"])
def test_bf16_under_te_autocast_disabled_never_recompiles(build):
    """te.autocast(enabled=False) without a recipe builds a new default recipe per call (TE's autocast_enter):
    was a recompile per step (the recipe's identity was guarded though no TE op reads it with fp8 off)."""
    _no_recompile(_run(build, _plain, lambda r: te.autocast(enabled=False), precision="bf16"))


def test_te_autocast_disabled_with_a_new_recipe_per_step_never_recompiles():
    _no_recompile(_run(_layer, _plain, lambda r: te.autocast(enabled=False, recipe=type(r)()), precision="fp8-cs"))


def test_te_autocast_disabled_inside_the_compiled_function():
    def body(model, recipe, x):
        with te.autocast(enabled=False):
            return model(x)
    _no_recompile(_run(_layer, body, lambda r: contextlib.nullcontext(), precision="bf16"))


@pytest.mark.parametrize("build", [_layer, _llama], ids=["layer", "llama"])
def test_fp8_te_autocast_inside_the_compiled_function_never_recompiles(build):
    """Was one recompile on step 2 (TE's MultiheadAttention reads proj's state, prepared with fp8 off at compile
    start): TE's prepare_forward prepares proj with the traced state first and restarts the analysis
    (compat/untouched/forward_state.py)."""
    def body(model, recipe, x):
        with te.autocast(enabled=True, recipe=recipe):
            return model(x)
    _no_recompile(_run(build, body, lambda r: contextlib.nullcontext()))


class _WithHead(torch.nn.Module):
    """A layer in fp8 and an LM head (te.Linear) kept in bf16 under a nested te.autocast(enabled=False)."""

    def __init__(self):
        super().__init__()
        self.layer = _layer()
        self.head = te.Linear(64, 128, params_dtype=torch.bfloat16, device="cuda")

    def forward(self, x):
        h = self.layer(x)
        with te.autocast(enabled=False):
            return self.head(h)


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_nested_te_autocast_disabled_lm_head_never_recompiles(where):
    """Was one recompile on step 2: the compile-start callback prepared the head with the outer fp8 state (now
    prepared again with fp8 off in the trace, compat/untouched/forward_state.py)."""
    if where == "outside":
        r = _run(_WithHead, _plain, lambda recipe: te.autocast(enabled=True, recipe=recipe))
    else:
        def body(model, recipe, x):
            with te.autocast(enabled=True, recipe=recipe):
                return model(x)
        r = _run(_WithHead, body, lambda recipe: contextlib.nullcontext())
    _no_recompile(r)


def _alternating(bf16):
    """``outer`` for :func:`_run`: fp8 (``te.autocast(recipe=...)``) on even calls, bf16 on odd ones (``bf16``:
    ``"disabled"`` te.autocast(enabled=False), ``"disabled-recipe"`` the same with the fp8 recipe, ``"none"`` no
    te.autocast)."""
    calls = iter(range(10**6))

    def outer(recipe):
        if next(calls) % 2 == 0:
            return te.autocast(enabled=True, recipe=recipe)
        if bf16 == "none":
            return contextlib.nullcontext()
        return te.autocast(enabled=False, recipe=recipe if bf16 == "disabled-recipe" else None)
    return outer


def _linear():
    return te.Linear(64, 64, params_dtype=torch.bfloat16, device="cuda")


@pytest.mark.parametrize("bf16", ["disabled", "disabled-recipe", "none"])
@pytest.mark.parametrize("build", [_linear, _layer, _llama], ids=["linear", "layer", "llama"])
def test_fp8_and_bf16_calls_alternating_compile_two_graphs(build, bf16):
    """A bf16 evaluation between fp8 training steps (user trial, session 22): every call recompiled until Dynamo's
    recompile limit, then the frame ran eagerly. TE's prepare_forward reads the fp8 flag the previous call left, and
    a call without fp8 resets fp8_initialized, which the fp8 graph guards on (compat/untouched/forward_state.py).
    Now: one graph per state, both reused; the one recompile is the state change."""
    r = _run(build, _plain, _alternating(bf16), calls=6)
    assert r["breaks"] == {}, r["breaks"]
    assert r["graphs"] == 2 and len(r["recompiles"]) == 1, r


@pytest.mark.usefixtures("reset_te_fp8_state")  # DelayedScaling registers the modules in TE's global buffers
@pytest.mark.parametrize("precision", ["fp8-cs", "fp8-ds"])
def test_te_autocast_inside_switching_fp8_on_and_off_compiles_two_graphs(precision):
    """The same with te.autocast inside the compiled function, its ``enabled`` read from a flag the loop flips
    (DelayedScaling needs te.autocast inside on the fake GPU: its exit's amax update runs in the graph)."""
    flag = {"fp8": True}

    def body(model, recipe, x):
        with te.autocast(enabled=flag["fp8"], recipe=recipe):
            return model(x)

    @contextlib.contextmanager
    def flip(recipe):
        yield
        flag["fp8"] = not flag["fp8"]
    r = _run(_llama, body, flip, precision=precision, calls=6)
    assert r["breaks"] == {}, r["breaks"]
    assert r["graphs"] == 2 and len(r["recompiles"]) == 1, r


# --------------------------------------------------------------------------- item 4: a new recipe per step
def test_new_recipe_object_per_step_warns_once_naming_the_fix():
    """A new (equal) recipe object per step: Dynamo's guard on the recipe object recompiles each step (te_passes
    keeps the identity guard: the compiled graph runs under the recipe object it traced); one warning."""
    r = _run(_layer, _plain, lambda recipe: te.autocast(enabled=True, recipe=type(recipe)()))
    assert len(r["recompiles"]) == 3 and all("fp8_recipe" in x for x in r["recompiles"]), r["recompiles"]
    assert len(r["warnings"]) == 1, r["warnings"]
    w = r["warnings"][0]
    assert "new Float8CurrentScaling object" in w and "recompile_limit" in w and gate.NEW_RECIPE_FIX in w, w


def test_the_same_recipe_object_each_step_does_not_warn():
    r = _run(_layer, _plain, lambda recipe: te.autocast(enabled=True, recipe=recipe))
    _no_recompile(r)
    assert r["warnings"] == [], r["warnings"]


# --------------------------------------------------------------------------- item 3: sliding window
@pytest.mark.parametrize("kw", [dict(self_attn_mask_type="causal", window_size=(4, 0)),
                                dict(self_attn_mask_type="no_mask", window_size=(4, 4))], ids=["causal", "no_mask"])
@pytest.mark.parametrize("precision", ["bf16", "fp8-cs"])
def test_sliding_window_is_the_fused_op_without_recompile(kw, precision):
    """Was TE's own DotProductAttention.forward, whose global backend cache recompiled on step 2."""
    outer = ((lambda recipe: te.autocast(enabled=True, recipe=recipe)) if precision != "bf16"
             else (lambda recipe: contextlib.nullcontext()))
    _no_recompile(_run(lambda: _layer(**kw), _plain, outer, precision=precision))
    assert untouched.island_records() == []


def test_sliding_window_reaches_the_op_with_te_s_window():
    """The fused_attn node carries the window TE resolves (check_set_window_size) in its args bundle."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch._dynamo.reset()
    install_polyfills()
    graphs: list = []
    with quiet(), fake_gpu("bf16"):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode, constructing():
            model = _layer(self_attn_mask_type="causal", window_size=(4, 0))
            x = torch.randn(16, 2, 64, dtype=torch.bfloat16, device="cuda")
        fn = torch.compile(lambda t: model(t), backend=_backend(graphs), fullgraph=True, dynamic=False)
        with mode:
            fn(x)
    attn = [n for g in graphs for n in g.graph.nodes if n.op == "call_function" and "fused_attn" in str(n.target)]
    assert attn, [str(n.target) for g in graphs for n in g.graph.nodes]
    bundles = [a.as_dict() for n in attn for a in n.args if hasattr(a, "as_dict")]
    windows = {(b.get("window_size"), b.get("attn_mask_type")) for b in bundles if "window_size" in b}
    assert windows == {((4, 0), "causal")}, bundles
    assert untouched.island_records() == []


def test_window_rules():
    from te_passes.compat.te220.untouched_rules import FUSED_OP_PATH, window_problem

    assert window_problem(None, "causal", "SDPA") is None and window_problem((-1, 0), "causal", "SDPA") is None
    assert "SDPA path" in window_problem((4, 0), "causal", "SDPA")
    assert window_problem((4, 0), "causal", FUSED_OP_PATH) is None
    assert window_problem((4, -1), "causal", FUSED_OP_PATH) is None  # TE: (4, 0) for a causal mask
    assert window_problem((4, 4), "no_mask", FUSED_OP_PATH) is None
    assert "(>=0, >=0)" in window_problem((-1, 4), "no_mask", FUSED_OP_PATH)
    assert "(>=0, >=0)" in window_problem((4, -1), "no_mask", FUSED_OP_PATH)


# --------------------------------------------------------------------------- item 5: fresh processes
def _in_fresh_process(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("TE_PASSES_DISABLE", "TE_PASSES_UNTOUCHED", "TORCH_TRACE"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.strip().splitlines()[-1]


_CAPTURE = """
    import re, sys, torch
    {first}
    from te_passes.testing.capture import capture_dynamo
    cg = capture_dynamo("transformer_layer", "bf16", num_gqa_groups=2)
    assert ("te_passes.backend" in sys.modules) == {loaded}, "fresh: the capture must not load the backend"
    print(sorted(re.sub(" at 0x[0-9a-f]+", "", str(n.target)) for n in cg.gm.graph.nodes if n.op == "call_function"))
"""


def test_gqa_capture_in_a_fresh_process_is_the_graph_after_the_backend_loaded():
    fresh = _in_fresh_process(_CAPTURE.format(first="", loaded="False"))
    loaded = _in_fresh_process(_CAPTURE.format(first="import te_passes; te_passes.te_inductor", loaded="True"))
    assert fresh == loaded
    assert fresh.count("transformer_engine_compile.linear") >= 4 and "fused_attn" in fresh, fresh


_MARKED = """
    import torch, transformer_engine.pytorch as te, te_passes
    from te_passes.testing.fake_gpu import constructing, fake_gpu, quiet
    from torch._subclasses.fake_tensor import FakeTensorMode
    graphs = []
    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    te_passes.mark_untouched_backend(backend)
    with quiet(), fake_gpu("bf16"):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode, constructing():
            m = te.TransformerLayer(64, 256, 4, num_gqa_groups=2, hidden_dropout=0.0, attention_dropout=0.0,
                                    params_dtype=torch.bfloat16, device="cuda")
            x = torch.randn(16, 2, 64, dtype=torch.bfloat16, device="cuda")
        with mode:
            torch.compile(m, backend=backend, fullgraph=True, dynamic=False)(x)
    print(len(graphs), sum("transformer_engine_compile.linear" in str(n.target) for g in graphs for n in g.graph.nodes))
"""


def test_mark_untouched_backend_in_a_fresh_process():
    """A backend of one's own, marked with te_passes.mark_untouched_backend in a process that never loaded
    te_inductor: one graph (fullgraph) with the GQA layer's 4 GEMMs (was: TE's disabled forwards)."""
    assert _in_fresh_process(_MARKED) == "1 4"


def test_mark_untouched_backend_refuses_what_it_cannot_mark():
    from te_passes.compat.dynamo.hooks import mark_untouched_backend

    with pytest.raises(TypeError, match="backend callable"):
        mark_untouched_backend(42)
    class NoWeakref:  # a callable that cannot be weakly referenced: the gate holds backends weakly
        __slots__ = ()

        def __call__(self, gm, example_inputs):
            return gm

    with pytest.raises(TypeError, match="cannot register .* as a te_passes backend"):
        mark_untouched_backend(NoWeakref())
