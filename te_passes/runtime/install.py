"""The one entry that installs te_passes' process-level integration (called by the backend).

:func:`install` puts in place, idempotently and process-wide:

* :func:`te_passes.runtime.ub_guard.install_te_ub_hooks` — guarded ``get_ub_is_fp8``,
  generation bump on ``initialize_ub`` / ``destroy_ub``;
* :func:`te_passes.runtime.amax_groups.install_amax_group_hooks` — TE Linear's per-call amax
  reduction groups released after each eager call, and a one-time sweep of live modules (issue 8).

Both need TE imported; until then they are no-ops and :func:`install` returns ``False``.
"""

from __future__ import annotations

from te_passes.runtime.amax_groups import install_amax_group_hooks
from te_passes.runtime.ub_guard import install_te_ub_hooks


def install() -> bool:
    """Install every runtime hook (idempotent). Returns whether all are in place (``False``
    while Transformer Engine is not imported yet)."""
    return install_te_ub_hooks() & install_amax_group_hooks()
