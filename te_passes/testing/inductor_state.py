"""Inductor process state that the CPU capture helpers' fake GPU must not leak into (or out of).

Inductor caches ``CacheBase.get_system()`` once per process (``functools.cache``; torch 2.14.1
``torch/_inductor/codecache.py``). It reads the device name from
``torch.cuda.get_device_properties``, which :func:`te_passes.testing.capture.fake_gpu` patches,
and the result is part of every FX-graph-cache and AOTAutograd-cache key. Computed once outside
the fake GPU, every later key computed inside it (and vice versa) differs from the key a fresh
process computes: tests/test_aot_autograd_cache.py's cross-process key check failed whenever an
earlier test in the same process had computed a cache key on plain CPU first.
"""

from __future__ import annotations

import sys

__all__ = ["clear_system_info"]


def clear_system_info() -> None:
    """Forget Inductor's cached ``CacheBase.get_system()`` so the next cache key reads the devices
    as they are now. A no-op while ``torch._inductor.codecache`` is not imported (nothing cached)."""
    codecache = sys.modules.get("torch._inductor.codecache")
    if codecache is not None:
        codecache.CacheBase.get_system.cache_clear()
