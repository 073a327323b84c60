"""Inductor's CUDA wrapper generated (and loaded, not run) on a GPU-less machine, for tests that
read what Inductor emits for TE graphs (tests/passes/test_hoist_te_constants.py,
tests/pipeline/test_aot_autograd_cache.py)."""

from __future__ import annotations

import contextlib
from unittest import mock


@contextlib.contextmanager
def _inductor_codegen_on_cpu(precision="fp8-cs"):
    """Let Inductor generate (and load, not run) its CUDA wrapper on this GPU-less machine: the
    TE graphs hold only extern calls, so no Triton kernel is compiled. Yields the list of
    ``(source, module attrs)`` of every wrapper module Inductor loads."""
    import torch._inductor.compile_fx as cfx
    import torch._inductor.scheduler as sch
    from torch._inductor.codecache import PyCodeCache

    from te_passes.testing.fake_gpu import fake_gpu

    loaded = []
    orig = PyCodeCache.load_by_key_path.__func__

    def load(cls, key, path, linemap=None, attrs=None):
        with open(path) as f:
            loaded.append((f.read(), dict(attrs or {})))
        return orig(cls, key, path, linemap, attrs)

    with contextlib.ExitStack() as st:
        st.enter_context(mock.patch.object(PyCodeCache, "load_by_key_path", classmethod(load)))
        st.enter_context(mock.patch.object(cfx, "_check_triton_bf16_support", lambda g: None))
        st.enter_context(mock.patch.object(sch, "has_triton", lambda: True))
        st.enter_context(fake_gpu(precision))
        yield loaded
