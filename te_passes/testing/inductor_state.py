"""Inductor process state that the CPU capture helpers' fake GPU must not leak into (or out of).

See docs/internals.md#te_passestestinginductor_statepy."""

from __future__ import annotations

import sys

__all__ = ["clear_system_info"]


def clear_system_info() -> None:
    """Forget Inductor's cached ``CacheBase.get_system()`` so the next cache key reads the devices
    as they are now. A no-op while ``torch._inductor.codecache`` is not imported (nothing cached)."""
    codecache = sys.modules.get("torch._inductor.codecache")
    if codecache is not None:
        codecache.CacheBase.get_system.cache_clear()
