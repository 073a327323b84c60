"""prepare_te_state / prime_recipe on CPU (TE modules built under fake CUDA): which first-forward
state is set on which modules, and that Dynamo then does not recompile on the second call.

The H200 run (docs/benchmarks/h200_2026-12-01_final) showed the untouched te.TransformerLayer
recompiling ``prepare_forward`` after step 1 (``self.activation_dtype is None`` in bf16,
``self.fp8 == False`` in fp8): that frame is ``DotProductAttention``'s ``prepare_forward`` (DPA is
a ``TransformerEngineBaseModule``; its forward graph-breaks inside ``with
self.prepare_forward_ctx(...)`` at the disabled ``FusedAttention.forward``, so Dynamo runs it
eagerly and compiles ``prepare_forward`` as its own frame). ``test_dpa_prepare_forward_*``
reproduces that frame on CPU.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

te = pytest.importorskip("transformer_engine.pytorch")

from transformer_engine.common import recipe as te_recipe  # noqa: E402

from te_passes.compat.untouched.rewrite import compile_friendly as cf  # noqa: E402
from te_passes.compat.untouched.rewrite.te_state import prepare_te_state, prime_recipe, te_modules_to_prepare  # noqa: E402
from te_passes.testing.fake_gpu import constructing as _constructing, fake_gpu, quiet as _quiet  # noqa: E402


def _layer():
    return te.TransformerLayer(64, 256, 4, hidden_dropout=0.0, attention_dropout=0.0,
                               params_dtype=torch.bfloat16, device="cuda")


@contextlib.contextmanager
def _fake(precision):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with _quiet(), fake_gpu(precision):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode, _constructing():
            yield mode


#: TE 2.20.2 forward -> prepare_forward(num_gemms=...): module/linear.py:2407,
#: layernorm_linear.py:1726, layernorm_mlp.py:2320, dot_product_attention.py:2318.
_UNTOUCHED = {"self_attention.layernorm_qkv": ("LayerNormLinear", 1),
              "self_attention.core_attention": ("DotProductAttention", 3),
              "self_attention.proj": ("Linear", 1),
              "layernorm_mlp": ("LayerNormMLP", 2)}


@pytest.mark.parametrize("precision", ["bf16", "fp8-cs"])
def test_untouched_layer_every_te_base_module_is_prepared(precision):
    fp8 = precision == "fp8-cs"
    recipe = te_recipe.Float8CurrentScaling()
    with _fake(precision):
        layer = _layer()
        assert "_cached_repr" not in recipe.__dict__  # what the H200 stack4 guard saw
        assert all(m.activation_dtype is None and m.fp8 is False for m in layer.modules()
                   if hasattr(m, "fp8_meta"))
        done = prepare_te_state(layer, recipe, fp8=fp8)
    prepared, skipped = te_modules_to_prepare(layer)
    assert skipped == []
    got = {name: (type(m).__name__, args[0]) for name, m, args in prepared}
    assert got == _UNTOUCHED, got
    assert "_cached_repr" in recipe.__dict__
    for name, m, (num_gemms, _) in prepared:
        assert m.activation_dtype is torch.bfloat16, name
        assert m.fp8 is fp8 and m.fp8_initialized is fp8, name
        assert "_is_fsdp2" in m.__dict__, name
        if fp8:
            assert m.fp8_meta["num_gemms"] == num_gemms and m.fp8_meta["recipe"] is recipe, name
    assert any("DotProductAttention" in line for line in done), done


@pytest.mark.parametrize("attention", ["sdpa", "te_fused"])
def test_rewritten_layer_prepares_hidden_linears_not_rewritten_modules(attention):
    recipe = te_recipe.Float8CurrentScaling()
    with _fake("fp8-cs"):
        layer = _layer()
        cf.compile_friendly(layer, strict=True, attention=attention)
        prepare_te_state(layer, recipe, fp8=True)
    prepared, skipped = te_modules_to_prepare(layer)
    names = [n for n, _, _ in prepared]
    # layernorm_qkv (1 hidden), core_attention (SDPA / fused op: none), proj (untouched Linear), fc1 + fc2
    assert names == ["self_attention.layernorm_qkv.<hidden te.Linear 0>", "self_attention.proj",
                     "layernorm_mlp.<hidden te.Linear 0>", "layernorm_mlp.<hidden te.Linear 1>"], names
    assert skipped == []
    assert all(m.fp8 and m.activation_dtype is torch.bfloat16 for _, m, _ in prepared)
    for rewritten in (layer.self_attention.layernorm_qkv, layer.layernorm_mlp):
        assert rewritten.activation_dtype is None and rewritten.fp8 is False  # TE's forward no longer runs


def test_unaudited_subclass_is_named_not_prepared():
    class MyLinear(te.Linear):
        pass

    with _fake("bf16"):
        model = torch.nn.Sequential(MyLinear(64, 64, params_dtype=torch.bfloat16, device="cuda"))
        done = prepare_te_state(model, None, fp8=False)
    assert any("0 (" in line and "MyLinear" in line and "not prepared" in line for line in done), done
    assert model[0].activation_dtype is None


def test_prepare_refusals():
    with _fake("bf16"):
        lin = te.Linear(64, 64, params_dtype=torch.float32, device="cuda")
        with pytest.raises(ValueError, match="fp8=True needs the recipe"):
            prepare_te_state(lin, None, fp8=True)
        with pytest.raises(TypeError, match=r"prepare_te_state: <model> \(Linear\) with dtype=torch.bfloat16: "
                                            "Data types for parameters must match"):
            prepare_te_state(lin, None, fp8=False, dtype=torch.bfloat16)
        with pytest.raises(TypeError, match="dtype must be a torch.dtype .*got 'bf16'"):
            prepare_te_state(lin, None, fp8=False, dtype="bf16")
        with pytest.raises(TypeError, match="fp8 must be a bool .*got 'no'"):
            prepare_te_state(lin, None, fp8="no")
    with pytest.raises(TypeError, match="expected a transformer_engine.common.recipe.Recipe"):
        prime_recipe("Float8CurrentScaling")


def test_prime_recipe_fills_repr_cache_and_autocast_arguments():
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    r = te_recipe.Float8CurrentScaling()
    assert "_cached_repr" not in r.__dict__
    prime_recipe(r)
    assert r.__dict__["_cached_repr"] == repr(r)
    key = FP8GlobalStateManager.get_unique_autocast_key(r, None)
    assert FP8GlobalStateManager.quantization_state.autocast_arguments[key][0] is r


@pytest.mark.parametrize("precision,guard", [("bf16", "self.activation_dtype is None"),
                                             ("fp8-cs", "self.fp8 == False")])
def test_dpa_prepare_forward_frame_recompiles_as_on_h200_unless_prepared(precision, guard, monkeypatch):
    """TE's DotProductAttention.forward with TE's backend selection answering FusedAttention and
    FusedAttention.forward (dynamo-disabled in TE) replaced by a disabled shape stand-in: the
    disabled call inside ``with self.prepare_forward_ctx(...)`` makes Dynamo run DPA's forward
    eagerly and compile ``prepare_forward`` as its own frame, which recompiles on call 2 with the
    H200 guard (``module/base.py:1490`` bf16, ``:1601`` fp8) — and not after prepare_te_state."""
    import transformer_engine.pytorch.attention.dot_product_attention.backends as backends
    import transformer_engine.pytorch.attention.dot_product_attention.utils as dpa_utils
    import transformer_engine_torch as tex
    from torch._subclasses.fake_tensor import FakeTensorMode

    def fused_selected(params):  # the H200's choice: FusedAttention, arbitrary-seqlen sub-backend
        return False, None, True, tex.NVTE_Fused_Attn_Backend.NVTE_F16_arbitrary_seqlen, False, None

    @torch.compiler.disable
    def fused_forward(self, q, k, v, *args, **kwargs):  # sbhd in, (s, b, h * d) out
        return q.new_empty(q.shape[0], q.shape[1], q.shape[2] * q.shape[3])

    monkeypatch.setattr(dpa_utils, "get_attention_backend", fused_selected)
    monkeypatch.setattr(backends.FusedAttention, "forward", fused_forward)
    fp8 = precision == "fp8-cs"
    recipe = te_recipe.Float8CurrentScaling()
    for prepare in (False, True):
        torch._dynamo.reset()
        with _quiet(), fake_gpu(precision):
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            with mode, _constructing():  # torch.cuda.is_available patched only while building
                dpa = te.DotProductAttention(4, 16, attention_dropout=0.0, attn_mask_type="causal")
                prime_recipe(recipe)
                if prepare:
                    prepare_te_state(dpa, recipe, fp8=fp8)

            def step(q):
                with te.autocast(enabled=fp8, recipe=recipe):
                    return dpa(q, q, q) * 2

            fn = torch.compile(step, backend=lambda gm, ex: gm.forward, dynamic=False)
            seen = _metrics_seen()
            for _ in range(3):
                with mode, _constructing():
                    q = torch.randn(16, 2, 4, 16, dtype=torch.bfloat16, device="cuda")
                with mode:
                    fn(q)
            metrics = [m for m in torch._dynamo.utils.get_compilation_metrics() if id(m) not in seen]
        frames = {m.co_name for m in metrics}
        assert "prepare_forward" in frames and "forward" in frames, frames  # DPA's forward ran unframed
        reasons = [m.recompile_reason for m in metrics if m.recompile_reason]
        if prepare:
            assert reasons == [], reasons
        else:
            assert len(reasons) == 1 and guard in reasons[0], reasons
            assert [m.co_name for m in metrics if m.recompile_reason] == ["prepare_forward"]


@pytest.mark.parametrize("precision", ["bf16", "fp8-cs"])
def test_unprepared_te_state_names_module_attribute_and_fix(precision):
    from te_passes.compat.untouched.rewrite.te_state import unprepared_te_state

    fp8 = precision == "fp8-cs"
    recipe = te_recipe.Float8CurrentScaling()
    with _fake(precision):
        layer = _layer()
        before = unprepared_te_state(layer, recipe, fp8=fp8)
        assert before[0].startswith("recipe Float8CurrentScaling: repr not cached")
        dpa = [ln for ln in before if ln.startswith("self_attention.core_attention (DotProductAttention): ")]
        assert len(dpa) == 1 and "activation_dtype None (first forward sets torch.bfloat16)" in dpa[0], before
        assert ("fp8 False (first forward sets True)" in dpa[0]) is fp8
        assert all(ln.endswith("before torch.compile") for ln in before)
        assert len(before) == 1 + len(_UNTOUCHED)
        prepare_te_state(layer, recipe, fp8=fp8)
        assert unprepared_te_state(layer, recipe, fp8=fp8) == []
        # prepared for bf16, compiled in fp8: every module is named again
        if not fp8:
            assert len(unprepared_te_state(layer, recipe, fp8=True)) == len(_UNTOUCHED)


@pytest.fixture
def h200_frames(monkeypatch):
    """The untouched layer's H200 frame structure on CPU: TE's backend selection answers
    FusedAttention, and the forwards TE wraps in ``no_torch_dynamo()`` (LayerNormLinear,
    LayerNormMLP, FusedAttention) are replaced by shape stand-ins wrapped the same way (so the
    shared ``jit.py`` ``wrapper`` frame is TE's)."""
    import transformer_engine.pytorch.attention.dot_product_attention.backends as backends
    import transformer_engine.pytorch.attention.dot_product_attention.utils as dpa_utils
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.jit import no_torch_dynamo

    def like(t, *shape):
        return t.new_empty(*shape).requires_grad_(t.requires_grad)

    @no_torch_dynamo()
    def fused_forward(self, q, k, v, *args, **kwargs):  # sbhd in, (s, b, h * d) out
        return like(q, q.shape[0], q.shape[1], q.shape[2] * q.shape[3])

    @no_torch_dynamo()
    def lnl(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False):
        return like(inp, *inp.shape[:-1], self.out_features)

    @no_torch_dynamo()
    def lnmlp(self, inp, is_first_microbatch=None):
        out = like(inp, *inp.shape)
        return (out, self.fc2_bias) if self.return_bias else out

    monkeypatch.setattr(dpa_utils, "get_attention_backend", lambda params: (
        False, None, True, tex.NVTE_Fused_Attn_Backend.NVTE_F16_arbitrary_seqlen, False, None))
    monkeypatch.setattr(backends.FusedAttention, "forward", fused_forward)
    monkeypatch.setattr(te.LayerNormLinear, "forward", lnl)
    monkeypatch.setattr(te.LayerNormMLP, "forward", lnmlp)


def _layer_recompiles(precision, layers, prepare, calls=3):
    """(recompile reasons of call 1, those after it) for ``layers`` untouched TransformerLayers."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fp8 = precision == "fp8-cs"
    recipe = te_recipe.Float8CurrentScaling()
    torch._dynamo.reset()
    with _quiet(), fake_gpu(precision):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode, _constructing():
            model = torch.nn.Sequential(*[_layer() for _ in range(layers)])
            prime_recipe(recipe)  # as the benchmark's eager reference run does
            if prepare:
                prepare_te_state(model, recipe, fp8=fp8)

        def step(x):
            with te.autocast(enabled=fp8, recipe=recipe):
                return model(x)

        per_call = _recompiles_per_call(step, mode, (16, 2, 64), calls)
    return per_call[0], [r for c in per_call[1:] for r in c]


def _metrics_seen():
    """``{id: metric}`` of Dynamo's compilation metrics so far. The objects are held: Dynamo keeps only the
    last 64 (a deque), and an evicted, freed metric's id may be reused by a new one."""
    return {id(m): m for m in torch._dynamo.utils.get_compilation_metrics()}


def _recompiles_per_call(step, mode, shape, calls):
    """Compile ``step`` with a pass-through backend and call it ``calls`` times on fresh fake
    CUDA inputs of ``shape``; per call, the ``"<frame>: <recompile reason>"`` of its new compiles."""
    fn = torch.compile(step, backend=lambda gm, ex: gm.forward, dynamic=False)
    seen = _metrics_seen()
    per_call = []
    for _ in range(calls):
        with mode, _constructing():
            x = torch.randn(*shape, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        with mode:
            fn(x)
        new = [m for m in torch._dynamo.utils.get_compilation_metrics() if id(m) not in seen]
        seen.update((id(m), m) for m in new)
        per_call.append([f"{m.co_name}: {m.recompile_reason}" for m in new if m.recompile_reason])
    return per_call


@pytest.mark.parametrize("precision", ["bf16", "fp8-cs"])
def test_untouched_layer_h200_frames_no_recompile_after_first_call(precision, h200_frames):
    first, later = _layer_recompiles(precision, 1, prepare=False)
    # what the H200 run showed (its prepare_te_state already covered proj), plus proj's own state
    assert any(r.startswith("prepare_forward: ") for r in later), later
    assert all(r.startswith(("prepare_forward: ", "torch_dynamo_resume_in_forward")) for r in later), later
    first, later = _layer_recompiles(precision, 1, prepare=True)
    assert later == [], later
    # within call 1: TE's shared no_torch_dynamo wrapper frame, once per other argument count
    assert [r.split(":")[0] for r in first] == ["wrapper", "wrapper"] and "len(args) ==" in first[0], first


def test_two_untouched_layers_recompile_per_layer_only_in_the_first_call(h200_frames):
    first, later = _layer_recompiles("fp8-cs", 2, prepare=True)
    assert later == [], later
    # MultiheadAttention.forward reads proj.name (multi_head_attention.py:550): one entry per layer
    assert any("self.proj.name" in r or "_modules['proj'].name ==" in r for r in first), first


@pytest.mark.parametrize("setup,expect", [("none", "_cached_repr"), ("prime_recipe", "_is_fsdp2"),
                                          ("prepare_te_state", None)])
def test_stack4_fp8_recompile_of_h200_and_what_removes_it(setup, expect):
    """The benchmark's stack4 (te.Linear / GELU × 4) in fp8 on CPU: untouched, call 2 recompiles
    with the H200 reason (the recipe's repr cached on call 1); priming only the recipe uncovers
    the modules' own lazy state; prepare_te_state removes both."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    recipe = te_recipe.Float8CurrentScaling()
    torch._dynamo.reset()
    with _quiet(), fake_gpu("fp8-cs"):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode, _constructing():
            mods = [te.Linear(64, 64, params_dtype=torch.bfloat16, device="cuda") for _ in range(4)]
            model = torch.nn.Sequential(mods[0], torch.nn.GELU(), mods[1], torch.nn.GELU(), mods[2],
                                        torch.nn.GELU(), mods[3])
            if setup == "prime_recipe":
                prime_recipe(recipe)
            elif setup == "prepare_te_state":
                prepare_te_state(model, recipe, fp8=True)

        def fwd_fp8(x):
            with te.autocast(enabled=True, recipe=recipe):
                return model(x)

        reasons = [r for c in _recompiles_per_call(fwd_fp8, mode, (32, 64), 3) for r in c]
    if expect is None:
        assert reasons == [], reasons
    else:
        assert len(reasons) == 1 and expect in reasons[0], reasons
