"""Untouched TE models (issue 38) on CPU with a fake GPU: any sequence length (Dynamo's automatic
dynamic shapes, ``dynamic=True``, ``mark_dynamic``) and the parameters the module holds *now*
(``torch.func.functional_call``, ``load_state_dict(assign=True)``, attribute assignment).

The sequence-length tests count graphs and recompiles over the lengths 16 -> 24 -> 40 (TE's fused
attention op holds ``max_seqlen`` as a constant: one graph per sequence length, batch dynamic). The
parameter tests record the tensors each compiled graph is called with: after a swap, the new
``Parameter`` object must be among them and the old one must not (the hidden ``te.Linear`` of
LayerNormLinear / LayerNormMLP kept the Parameter of its first trace before; numerics on the GPU:
tests/gpu/test_swapped_params_gpu.py, not yet run).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

te = pytest.importorskip("transformer_engine.pytorch")

from te_passes.compat.untouched import polyfills as untouched  # noqa: E402
from tests.runtime.test_untouched import install_polyfills  # noqa: E402
from te_passes.compat.dynamo.hooks import mark_untouched_backend  # noqa: E402
from te_passes.testing.fake_gpu import constructing, fake_gpu, make_recipe, quiet  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(autouse=True)
def _polyfills():
    install_polyfills()
    untouched.clear_island_records()
    yield


class _Recorder:
    """A backend taking the polyfills (as te_inductor): records each graph and the tensors every
    call of a compiled graph receives; runs the graph as is (TE's fake impls on fake cuda)."""

    def __init__(self):
        self.graphs: list = []
        self.calls: list[list[torch.Tensor]] = []
        mark_untouched_backend(self)  # as te_inductor: the polyfills and the runtime hooks (Dynamo scope)

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)

        def run(*args):
            self.calls.append([a for a in args if isinstance(a, torch.Tensor)])
            return gm.forward(*args)
        return run


@contextlib.contextmanager
def _session(precision):
    from torch._dynamo.utils import counters
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch._dynamo.reset()
    install_polyfills()
    counters.clear()
    with quiet(), fake_gpu(precision):
        yield FakeTensorMode(allow_non_fake_inputs=True)


def _cuda(mode, *shape, grad=False):
    with mode, constructing():
        return torch.randn(*shape, dtype=torch.bfloat16, device="cuda", requires_grad=grad)


def _recompiles(seen):
    from torch._dynamo.utils import get_compilation_metrics

    return [m.recompile_reason for m in get_compilation_metrics() if id(m) not in seen and m.recompile_reason]


def _layer(**kw):
    args = dict(hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.bfloat16, device="cuda")
    args.update(kw)
    return te.TransformerLayer(64, 256, 4, **args)


def _llama(**kw):
    """A Llama-style layer: RMSNorm, SwiGLU, GQA, causal, no bias."""
    return _layer(normalization="RMSNorm", activation="swiglu", num_gqa_groups=2, self_attn_mask_type="causal",
                  bias=False, **kw)


# --------------------------------------------------------------------------- sequence lengths
SEQ_LENS = (16, 24, 40)


def _run_lengths(build, dynamic, precision="bf16", lengths=SEQ_LENS, batch=2):
    from torch._dynamo.utils import counters, get_compilation_metrics

    rec = _Recorder()
    with _session(precision) as mode:
        recipe = make_recipe(precision)
        with mode, constructing():
            model = build()
        fn = torch.compile(model, backend=rec, dynamic=None if dynamic == "mark" else dynamic)
        seen = {id(m) for m in get_compilation_metrics()}
        outer = te.autocast(enabled=True, recipe=recipe) if recipe is not None else contextlib.nullcontext()
        shapes = []
        for s in lengths:
            x = _cuda(mode, s, batch, 64)
            if dynamic == "mark":
                torch._dynamo.mark_dynamic(x, 0)
            with mode, outer:
                out = fn(x)
            shapes.append(tuple(out.shape))
        return dict(graphs=len(rec.graphs), breaks=dict(counters["graph_break"]), recompiles=_recompiles(seen),
                    shapes=shapes, rec=rec)


def _attention_ops(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and "fused_attn" in str(n.target)]


@pytest.mark.parametrize("precision", ["bf16", "fp8-cs"])
@pytest.mark.parametrize("dynamic", [None, True, False])
def test_transformer_layer_any_sequence_length(dynamic, precision):
    """Default (automatic dynamic), dynamic=True and dynamic=False: no error; one graph per sequence
    length (the fused-attention op takes max_seqlen as a constant), no graph break; every graph
    holds the attention op and the outputs have the input's length."""
    r = _run_lengths(_llama, dynamic, precision)
    assert r["breaks"] == {}, r["breaks"]
    assert r["shapes"] == [(s, 2, 64) for s in SEQ_LENS]
    assert r["graphs"] == len(SEQ_LENS), (r["graphs"], r["recompiles"])
    assert all(_attention_ops(g) for g in r["rec"].graphs)
    assert untouched.island_records() == [], untouched.island_records()


def test_repeated_sequence_length_reuses_its_graph():
    """A length seen before runs its graph again: 16 -> 24 -> 16 -> 24 compiles two graphs."""
    r = _run_lengths(_llama, None, lengths=(16, 24, 16, 24))
    assert r["graphs"] == 2 and len(r["rec"].calls) == 4, (r["graphs"], r["recompiles"])


def test_batch_dimension_stays_dynamic():
    """Only the sequence length is specialised: batch 2 -> 3 -> 5 at one length is one
    recompile into a batch-dynamic graph (Dynamo's automatic dynamic), not one graph per batch."""
    from torch._dynamo.utils import get_compilation_metrics

    rec = _Recorder()
    with _session("bf16") as mode:
        with mode, constructing():
            model = _llama()
        fn = torch.compile(model, backend=rec)
        seen = {id(m) for m in get_compilation_metrics()}
        for b in (2, 3, 5):
            with mode:
                fn(_cuda(mode, 16, b, 64))
        assert len(rec.graphs) == 2, _recompiles(seen)


@pytest.mark.parametrize("build", [
    lambda: te.MultiheadAttention(64, 4, attention_dropout=0.0, params_dtype=torch.bfloat16, device="cuda",
                                  num_gqa_groups=2, attn_mask_type="causal"),
    lambda: te.DotProductAttention(4, 16, num_gqa_groups=2, attention_dropout=0.0, attn_mask_type="causal"),
], ids=["MultiheadAttention", "DotProductAttention"])
def test_attention_modules_any_sequence_length(build):
    rec = _Recorder()
    with _session("bf16") as mode:
        with mode, constructing():
            model = build()
        fn = torch.compile(model, backend=rec)
        for s in SEQ_LENS:
            if isinstance(model, te.DotProductAttention):
                q, k, v = _cuda(mode, s, 2, 4, 16), _cuda(mode, s, 2, 2, 16), _cuda(mode, s, 2, 2, 16)
                with mode:
                    out = fn(q, k, v)
            else:
                with mode:
                    out = fn(_cuda(mode, s, 2, 64))
            assert out.shape[0] == s
    assert len(rec.graphs) == len(SEQ_LENS) and all(_attention_ops(g) for g in rec.graphs)


def test_mark_dynamic_sequence_length():
    """mark_dynamic on the sequence dimension asks for one graph valid for every length, which TE's op
    cannot give (max_seqlen is a constant of its bundle): te_inductor's compiles take Dynamo's
    ``allow_ignore_mark_dynamic`` (patch-table row ``dynamo.allow_ignore_mark_dynamic``), so the length is specialised under a
    guard like the default's — one graph per length, no ConstraintViolationError, no island."""
    r = _run_lengths(_llama, "mark")
    assert r["shapes"] == [(s, 2, 64) for s in SEQ_LENS]
    assert r["breaks"] == {}, r["breaks"]
    assert r["graphs"] == len(SEQ_LENS), (r["graphs"], r["recompiles"])
    assert untouched.island_records() == [], untouched.island_records()
    assert not torch._dynamo.config.allow_ignore_mark_dynamic  # scoped to te_inductor's compiles


# --------------------------------------------------------------------------- swapped parameters
MODULES = {
    "Linear": (lambda: te.Linear(64, 64, params_dtype=torch.bfloat16, device="cuda"), ["weight", "bias"]),
    "LayerNormLinear": (lambda: te.LayerNormLinear(64, 64, params_dtype=torch.bfloat16, device="cuda"),
                        ["weight", "bias", "layer_norm_weight"]),
    "LayerNormMLP": (lambda: te.LayerNormMLP(64, 256, params_dtype=torch.bfloat16, device="cuda"),
                     ["fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"]),
    "TransformerLayer": (_llama, ["self_attention.layernorm_qkv.query_weight", "self_attention.layernorm_qkv.key_weight",
                                  "layernorm_mlp.fc1_weight", "layernorm_mlp.fc2_weight"]),
}


def _owner_and_attr(model, name):
    *path, attr = name.split(".")
    owner = model
    for p in path:
        owner = getattr(owner, p)
    return owner, attr


def _holds(tensors, t):
    return any(a is t for a in tensors)


@pytest.mark.parametrize("precision", ["bf16", "fp8-cs"])
@pytest.mark.parametrize("how", ["setattr", "load_state_dict_assign"])
@pytest.mark.parametrize("module", list(MODULES))
def test_swapped_parameters_reach_the_graph(module, how, precision):
    """After ``module.weight = nn.Parameter(...)`` or ``load_state_dict(sd, assign=True)`` every
    compiled graph call receives the new Parameter objects, never the old ones (recompiled or not)."""
    build, names = MODULES[module]
    rec = _Recorder()
    with _session(precision) as mode:
        recipe = make_recipe(precision)
        with mode, constructing():
            model = build()
        fn = torch.compile(model, backend=rec, dynamic=False)
        outer = te.autocast(enabled=True, recipe=recipe) if recipe is not None else contextlib.nullcontext()
        x_shape = (16, 2, 64)
        with mode, outer:
            fn(_cuda(mode, *x_shape, grad=True))
        old = {n: getattr(*_owner_and_attr(model, n)) for n in names}
        assert all(_holds(rec.calls[-1], p) for p in old.values()), "the first call does not pass the parameters"
        with mode, constructing():
            new = {n: torch.nn.Parameter(torch.randn_like(p), requires_grad=p.requires_grad) for n, p in old.items()}
            if how == "setattr":
                for n, p in new.items():
                    setattr(*_owner_and_attr(model, n), p)
            else:
                sd = dict(model.state_dict())
                sd.update(new)
                res = model.load_state_dict(sd, assign=True, strict=True)
                assert not res.missing_keys and not res.unexpected_keys
                new = {n: getattr(*_owner_and_attr(model, n)) for n in names}  # assign keeps the Parameter
        with mode, outer:
            fn(_cuda(mode, *x_shape, grad=True))
        last = rec.calls[-1]
        for n in names:
            assert _holds(last, new[n]), f"{module}: the graph did not receive the swapped {n}"
            assert not _holds(last, old[n]), f"{module}: the graph still received the old {n}"


@pytest.mark.parametrize("module", list(MODULES))
def test_functional_call_parameters_reach_the_graph(module):
    """``torch.func.functional_call(model, params, x)`` compiled: the graph receives the tensors in
    ``params`` (EMA evaluation, RL weight sync), for two different dicts in a row."""
    build, names = MODULES[module]
    rec = _Recorder()
    with _session("bf16") as mode:
        with mode, constructing():
            model = build()
        fn = torch.compile(lambda p, x: torch.func.functional_call(model, p, (x,)), backend=rec, dynamic=False)
        for _ in range(2):
            with mode, constructing():
                params = {n: torch.randn_like(t) for n, t in model.named_parameters()}
            with mode:
                fn(params, _cuda(mode, 16, 2, 64))
            for n in names:
                assert _holds(rec.calls[-1], params[n]), f"{module}: the graph did not receive params[{n!r}]"
                assert not _holds(rec.calls[-1], getattr(*_owner_and_attr(model, n))), \
                    f"{module}: the graph received the module's own {n}"
