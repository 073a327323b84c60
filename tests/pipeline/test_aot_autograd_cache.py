"""AOTAutograd's cache with constants hoisted by ``hoist_te_constants`` (CPU, real TE graphs).

The situation (TE 2.20.2, torch 2.14.1): te_inductor's compiled forward of an fp8 te.Linear
returns the module's quantizers, and they are the wrapper's hoisted globals (``_te_const_N``).
Dynamo stores them back into ``module.quantizers``; TE's second trace of the frame (its guarded
recompile after the first call, docs/passes/fold_recipe_lookups.md "Recipe identity and recompiles") then bakes those very
objects into the Dynamo graph as constants. Before the fix they rendered there as their wrapper
names, so ``autograd_cache_key`` formatted a quantizer object as an import
(``AOTAutogradCachePickler._format_global_for_cache_key``): "Failed to pickle cache key ...
'Float8CurrentScalingQuantizer' object has no attribute '__name__'" and a bypass
(``counters["aot_autograd"]["autograd_cache_bypass"]``), plus an FX-graph-cache bypass.
Now a hoisted constant renders as its name only in its own graph's Inductor lowering.

Frame 0 runs through a stand-in for te_inductor's compiled forward (no GPU here): the Dynamo
graph with its output constants hoisted by the pass, run by ``torch.fx.Interpreter`` so that,
like Inductor's wrapper, it returns the named objects themselves. Frame 1 is compiled by the
real ``te_inductor`` backend; the key is the one torch computes inside ``compile_fx``
(``autograd_cache.autograd_cache_key``, recorded by a pass-through spy). Training compiles stop
on CPU after the cache lookup (the joint trace needs a CUDA device: ``hasPrimaryContext``);
inference compiles run to the end (Inductor's wrapper is generated and loaded, never run).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import pickle
import re
import subprocess
import sys
import types
from unittest import mock

import pytest

torch = pytest.importorskip("torch")
te_recipe = pytest.importorskip("transformer_engine.common.recipe")
te = pytest.importorskip("transformer_engine.pytorch")

import torch.fx  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from torch._inductor.virtualized import V  # noqa: E402

from te_passes.passes.hoist_te_constants import HoistTEConstants  # noqa: E402
from te_passes.ops.constants import (  # noqa: E402
    NamedConstants, hoisted_name, name_constant, named_constants, rebuild_constant, rendered_in_full)
from te_passes.compat.install import install  # noqa: E402
from te_passes.te.graph_constants import bundle_dict  # noqa: E402

_NAME = re.compile(r"_te_const_\d+")
_INLINE = re.compile(r"_rebuild_quantizer\(|OpaqueValueBundle\(")


def _recipe(variant: str):
    """Float8CurrentScaling variants: ``"default"`` (HYBRID: grad_output E5M2), ``"e4m3"``
    (grad_output quantizer dtype E4M3), ``"pow2-input"`` (``fp8_quant_fwd_inp.power_2_scale``,
    the field TE's module customisation writes into the input quantizer's ``force_pow_2_scales``,
    a ``__setattr__`` the pass folds)."""
    if variant == "default":
        return te_recipe.Float8CurrentScaling()
    if variant == "e4m3":
        return te_recipe.Float8CurrentScaling(fp8_format=te_recipe.Format.E4M3)
    if variant == "pow2-input":
        r = te_recipe.Float8CurrentScaling()
        r.fp8_quant_fwd_inp = te_recipe.QParams(power_2_scale=True, amax_epsilon=0.0)
        return r
    raise ValueError(f"unknown recipe variant {variant!r}")


def _standin_compiled_forward(gm, example_inputs):
    """Backend for frame 0: what te_inductor's forward wrapper returns, without a GPU — the
    graph's TE constants hoisted by the pass (``post_grad_fwd`` rewrite) and the graph run by
    ``torch.fx.Interpreter``, so the quantizers it returns are the named objects themselves.
    The graphs it hoisted into are kept in :data:`_PRIMED` (names are kept per graph)."""
    from te_passes.fx.graph import copy_graph_module
    from te_passes.pipeline.base import Stage
    from te_passes.compat.api import capture_te_state
    from te_passes.testing.harness import run_passes

    g = torch.fx.GraphModule(gm, copy_graph_module(gm).graph)
    run = run_passes(g, HoistTEConstants(), Stage.POST_GRAD_FWD, example_inputs=example_inputs,
                     te_state=capture_te_state(), graph_id="primer")
    assert run.report.graph_id == "primer.fwd"
    assert run.report.runs[0].status == "ok" and run.report.runs[0].changed
    assert run.records("hoisted_constant") and run.diff() == {}
    assert _NAME.search(_lowered_code(g)) and not _NAME.search(g.code)  # names only in g's own lowering
    _PRIMED.append(g)
    return lambda *args: torch.fx.Interpreter(g).run(*args)


#: The post-grad stand-in graphs of the last :func:`_primed_linear` (the owners of the names).
_PRIMED: list[torch.fx.GraphModule] = []


def _lowered_code(gm) -> str:
    """``gm``'s code as its own Inductor lowering renders its constants (``V.graph.module is gm``)."""
    with V.set_graph_handler(types.SimpleNamespace(module=gm)):
        return gm.graph.python_code("self").src


@contextlib.contextmanager
def _primed_linear(variant: str = "default"):
    """A fp8 te.Linear(64, 64) on fake CUDA tensors after one compiled step whose forward
    returned hoisted quantizers; yields ``(f, x, mode, lin)``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from te_passes.testing import dynamo_capture as DC
    from te_passes.testing import fake_gpu as FG

    with FG.quiet(), FG.fake_gpu("fp8-cs"):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode, FG.constructing():
            lin = te.Linear(64, 64, params_dtype=torch.bfloat16, device="cuda")
            x = torch.randn(32, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        recipe = _recipe(variant)

        def f(inp):
            with te.autocast(enabled=True, recipe=recipe):
                return lin(inp)

        torch._dynamo.reset()
        _PRIMED.clear()
        primed = torch.compile(DC.fresh_function(f), backend=_standin_compiled_forward, fullgraph=True)
        with mode:
            for _ in range(3):
                primed(x)
        yield f, x, mode, lin


def _primed_name(q) -> str | None:
    """``q``'s name in the stand-in graph that hoisted it (``None``: none did)."""
    return next((n for n in (hoisted_name(q, g) for g in _PRIMED) if n is not None), None)


def _module_quantizer_names(lin) -> list[str | None]:
    return [_primed_name(q) for qs in lin.quantizers.values() for q in qs]


def _te_inductor_frame(f, x, mode, *, training: bool):
    """Compile ``f`` with te_inductor (fresh Dynamo state); returns ``(keys, dynamo_codes,
    wrapper sources+globals, error)``: the AOTAutograd keys torch computed, the code of the graph
    te_inductor handed to compile_fx, what Inductor loaded, and the CPU-only failure if any."""
    from torch._functorch._aot_autograd import autograd_cache

    from te_passes.backend import te_inductor
    from te_passes.testing import dynamo_capture as DC

    from _inductor_cpu import _inductor_codegen_on_cpu

    keys, codes = [], []
    real_key = autograd_cache.autograd_cache_key

    def spy(*args, **kwargs):
        key, lines = real_key(*args, **kwargs)  # raises what torch would turn into a bypass
        keys.append(key)
        return key, lines

    class NeverRun(Exception):
        pass

    def never_run(*args):
        raise NeverRun()

    def backend(gm, example_inputs):
        try:
            te_inductor(gm, example_inputs)  # Dynamo-stage passes rewrite gm in place, then compile_fx
        finally:
            codes.append(gm.code)
        return never_run  # Inductor's CUDA wrapper cannot run here

    torch._dynamo.reset()
    error = None
    with _inductor_codegen_on_cpu() as loaded, mock.patch.object(autograd_cache, "autograd_cache_key", spy):
        fn = torch.compile(DC.fresh_function(f), backend=backend, fullgraph=True)
        try:
            with mode, (contextlib.nullcontext() if training else torch.no_grad()):
                fn(x)
        except NeverRun:
            pass
        except torch._dynamo.exc.BackendCompilerFailed as e:  # training on CPU: after the cache lookup
            error = e
    return keys, codes, loaded, error


@pytest.fixture
def aot_cache(tmp_path, monkeypatch):
    """Fresh, local Inductor + AOTAutograd caches (both on, as torch's defaults)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    counters.clear()
    with torch._inductor.config.patch(fx_graph_cache=True, fx_graph_remote_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=True):
        yield
    torch._dynamo.reset()


def _training_key(variant: str) -> tuple[str, list[str | None], str]:
    install()  # outside any trace, as the backend's import does (inside one, rows other than lowerings wait)
    with _primed_linear(variant) as (f, x, mode, lin):
        names = _module_quantizer_names(lin)
        keys, codes, _, error = _te_inductor_frame(f, x, mode, training=True)
    assert len(keys) == 1 and len(codes) == 1, (keys, error)
    # Without a GPU the compile stops after the cache lookup, in AOTAutograd's joint trace.
    assert error is None or "hasPrimaryContext" in str(error), error
    return keys[0], names, codes[0]


# --------------------------------------------------------------------------- real graphs
def test_recompiled_fp8_training_frame_has_a_reproducible_aot_autograd_cache_key(aot_cache):
    """The Dynamo graph of a te.Linear whose module quantizers came out of a compiled forward
    gets an AOTAutograd cache key (a lookup: miss, no bypass), the same for an independent
    module and recipe object, a different one when a hoisted quantizer field differs."""
    key, names, code = _training_key("default")
    # The scenario is real: the module holds the objects the compiled forward returned, named.
    assert sum(n is not None and _NAME.fullmatch(n) is not None for n in names) == 5
    assert key.startswith("a") and len(key) > 40
    assert counters["aot_autograd"]["autograd_cache_bypass"] == 0
    assert counters["aot_autograd"]["autograd_cache_miss"] == 1
    # They are in the graph as TE's own content-derived rebuild expressions, not as names.
    assert not _NAME.search(code) and code.count("_rebuild_quantizer(Float8CurrentScalingQuantizer") >= 3

    again, _, code_again = _training_key("default")
    assert again == key and code_again == code
    e4m3, _, code_e4m3 = _training_key("e4m3")
    pow2, _, code_pow2 = _training_key("pow2-input")
    assert len({key, e4m3, pow2}) == 3
    assert "('dtype', 8)" in code and "('dtype', 8)" not in code_e4m3  # grad_output E5M2 -> E4M3
    assert "('force_pow_2_scales', True)" in code_pow2 and "('force_pow_2_scales', True)" not in code
    assert counters["aot_autograd"]["autograd_cache_bypass"] == 0


def test_aot_autograd_cache_key_is_the_same_in_another_process(aot_cache):
    """Content-derived: a fresh interpreter (another hash seed) computes the same key."""
    key, _, _ = _training_key("default")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    helpers = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_helpers")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(__file__), helpers, env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, __file__, "default"], env=env, capture_output=True, text=True,
                         timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr[-3000:]
    other = json.loads(out.stdout.strip().splitlines()[-1])
    assert other["key"] == key
    assert other["bypass"] == 0


def test_fake_gpu_keeps_inductor_system_info_apart_from_plain_cpu():
    """Why the key above was order-dependent: Inductor caches ``CacheBase.get_system()`` (the
    device name, part of every cache key) once per process, and ``fake_gpu`` patches the device
    properties it reads. A value computed on plain CPU by an earlier test was reused under the
    fake GPU, so this process's key differed from a fresh one's. ``fake_gpu`` now clears it on
    entry and exit."""
    from torch._inductor.codecache import CacheBase

    from te_passes.testing.capture import fake_gpu

    outside = CacheBase.get_system()  # as an earlier plain-CPU compile in this process left it
    with fake_gpu("fp8-cs"):
        inside = CacheBase.get_system()
        CacheBase.get_system.cache_clear()
        assert CacheBase.get_system() == inside  # what a fresh process computes under the fake GPU
    assert inside != outside
    assert CacheBase.get_system() == outside  # and plain CPU gets its own back


def test_recompiled_fp8_inference_frame_hits_the_aot_autograd_cache(aot_cache):
    """End to end on CPU (inference: AOTAutograd traces no joint graph): the first compile of the
    recompiled frame misses and saves an AOTAutograd entry, the second one hits it (and the FX
    graph cache). Both loaded wrappers pass every TE constant as a module global, and the
    quantizers inside those bundles are the wrapper's own, not the module's named objects."""
    with _primed_linear() as (f, x, mode, lin):
        module_qs = [q for qs in lin.quantizers.values() for q in qs]
        assert all(_NAME.fullmatch(_primed_name(q) or "") for q in module_qs)
        first = _te_inductor_frame(f, x, mode, training=False)
        assert counters["aot_autograd"]["autograd_cache_miss"] == 1
        assert counters["aot_autograd"]["autograd_cache_saved"] == 1
        assert counters["inductor"]["fxgraph_cache_miss"] == 1
        second = _te_inductor_frame(f, x, mode, training=False)
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1
    assert counters["aot_autograd"]["autograd_cache_bypass"] == 0
    assert counters["inductor"]["fxgraph_cache_bypass"] == 0 and counters["inductor"]["fxgraph_cache_hit"] == 1
    assert first[0] == second[0] and len(first[0]) == 1
    assert first[3] is None and second[3] is None
    for _, codes, loaded, _ in (first, second):
        assert not _NAME.search(codes[0])
        (src, attrs), = loaded  # a hit loads the wrapper from the FX graph cache
        body = src[src.index("def call("):]
        used = sorted(set(_NAME.findall(body)))
        # Inference: the config bundle and the two tensor-or-quantized meta bundles; no quantizer
        # is returned (the module keeps its own).
        assert not _INLINE.search(body) and len(used) == 3 and set(used) <= set(attrs)
        assert [type(attrs[n]).__name__ for n in used] == ["OpaqueValueBundle"] * 3
        inner = [v for n in used for v in bundle_dict(attrs[n]).values() if type(v) in {type(q) for q in module_qs}]
        assert len(inner) == 2  # input and weight quantizers (no grad_output quantizer in inference)
        assert all(any(v == q for q in module_qs) and all(v is not q for q in module_qs) for v in inner)


# --------------------------------------------------------------------------- names, in isolation
def _quantizer(dtype_name: str = "kFloat8E4M3"):
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    # The kind of object graphs hold: rebuilt from TE's own __fx_repr__ (no device state).
    return rebuild_constant(Float8CurrentScalingQuantizer(getattr(tex.DType, dtype_name), device=torch.device("cpu")))


def _owner() -> torch.fx.GraphModule:
    install()  # wraps TE's constant classes' __fx_repr__ (name_constant never patches a class)
    return torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())


def _lowering(gm):
    """Inductor's lowering context for ``gm`` as the hook sees it (``V.graph.module``)."""
    return V.set_graph_handler(types.SimpleNamespace(module=gm))


def test_name_renders_only_in_its_owners_lowering():
    q, owner = _quantizer(), _owner()
    full = q.__fx_repr__()[0]
    name_constant(q, "_te_const_0", owner)
    assert hoisted_name(q, owner) == "_te_const_0" and hoisted_name(q, _owner()) is None
    assert isinstance(owner.meta["te_passes.named_constants"], NamedConstants)  # the graph's own state
    assert q.__fx_repr__()[0] == full and full.startswith("_rebuild_quantizer(")
    with _lowering(owner):
        assert q.__fx_repr__() == ("_te_const_0", {"_te_const_0": q})
        with rendered_in_full():
            assert q.__fx_repr__()[0] == full
    with _lowering(_owner()):
        assert q.__fx_repr__()[0] == full
    copy = pickle.loads(pickle.dumps(q))  # an FX-graph-cache entry's object: equal, not named
    assert copy == q and hoisted_name(copy, owner) is None and "_te_passes" not in "".join(vars(copy))
    with _lowering(owner):
        assert copy.__fx_repr__()[0] == full
    # a pickled / deep-copied name table is empty (names are kept by object identity)
    assert len(pickle.loads(pickle.dumps(named_constants(owner)))) == 0
    import copy as copy_mod

    assert len(named_constants(owner)) == 1 and len(copy_mod.deepcopy(named_constants(owner))) == 0
    with pytest.raises(TypeError, match="owner must be the post-grad torch.fx.GraphModule"):
        name_constant(q, "_te_const_1", owner.graph)


def test_names_hold_nothing_alive():
    """The owner's table holds its objects weakly (an entry goes with its object), and nothing
    outside the owner holds the table."""
    import weakref

    q, owner = _quantizer(), _owner()
    name_constant(q, "_te_const_0", owner)
    table = named_constants(owner)
    ref_q, ref_owner, ref_table = weakref.ref(q), weakref.ref(owner), weakref.ref(table)
    assert table.names() == {"_te_const_0"}
    del q
    gc.collect()
    assert ref_q() is None and table.names() == set() and len(table._by_id) == 0
    del owner, table
    gc.collect()
    assert ref_owner() is None and ref_table() is None


def test_rebuilding_a_bundle_does_not_alias_a_named_quantizer_inside_it():
    """A config bundle of a recompiled frame holds a module quantizer an earlier wrapper returned
    (named). Rebuilding the bundle (the post-grad hoist) must give it a quantizer of its own —
    TE's ops write to the quantizers they get (usage flags, amax group)."""
    from transformer_engine.pytorch.dynamo.custom_op import OpaqueValueBundle

    q, owner = _quantizer(), _owner()
    name_constant(q, "_te_const_3", owner)
    bundle = OpaqueValueBundle({"input_quantizer": q, "fp8": True})
    for ctx in (contextlib.nullcontext(), _lowering(owner)):
        with ctx:
            fresh = rebuild_constant(bundle)
        inner = bundle_dict(fresh)["input_quantizer"]
        assert fresh == bundle and inner == q and inner is not q


def test_equal_names_from_two_wrappers_stay_two_objects_in_a_third_graph():
    """Every graph numbers its constants from 0, so a later graph can meet two different
    ``_te_const_0`` objects (say quantizers returned by two compiled regions). Each must reach
    its own consumer: they render by value, not by a name one of them would win."""
    qa, qb = _quantizer("kFloat8E4M3"), _quantizer("kFloat8E5M2")
    name_constant(qa, "_te_const_0", _owner())
    name_constant(qb, "_te_const_0", _owner())
    g = torch.fx.Graph()
    out = g.call_function(tuple, ((g.call_function(getattr, (qa, "dtype")), g.call_function(getattr, (qb, "dtype"))),))
    g.output(out)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert not _NAME.search(gm.code)
    import transformer_engine_torch as tex

    assert gm() == (tex.DType.kFloat8E4M3, tex.DType.kFloat8E5M2)


if __name__ == "__main__":  # the other process of test_aot_autograd_cache_key_is_the_same_in_another_process
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp()
    with torch._inductor.config.patch(fx_graph_cache=True, fx_graph_remote_cache=False):
        k, _, _ = _training_key(sys.argv[1])
    print(json.dumps({"key": k, "bypass": counters["aot_autograd"]["autograd_cache_bypass"]}))
