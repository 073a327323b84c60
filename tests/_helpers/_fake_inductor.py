"""``backend="te_inductor"`` without a GPU: Inductor's ``compile_fx`` replaced by a recorder (for
the fake-GPU tests of tests/runtime/ and tests/benchmarks/)."""

from __future__ import annotations

import contextlib
from unittest import mock


class _NeverRun(Exception):
    pass


@contextlib.contextmanager
def te_inductor_without_gpu():
    """``backend="te_inductor"`` up to Inductor: passes run on the Dynamo graph, then a recorder
    stands in for ``compile_fx`` (Inductor cannot compile fake CUDA graphs without a GPU)."""
    seen = []

    def fake_compile_fx(gm, example_inputs, **kwargs):
        seen.append(gm)

        def never_run(*args):
            raise _NeverRun()
        return never_run
    with mock.patch("torch._inductor.compile_fx.compile_fx", fake_compile_fx):
        yield seen
