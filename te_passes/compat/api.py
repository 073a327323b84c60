"""The one entry into the compat fence for the pass pipeline and the passes: the scans of a Dynamo graph
that need the runtime's knowledge, the live TE state (UB registry, te.autocast state), the typed facts the
passes return, the UB queries' folds and the one wrapper around a compiled callable. ``te_passes.pipeline`` and
``te_passes.passes`` import compat only from here (pyproject.toml ``[tool.importlinter]``). docs/design.md
"The compat fence".
"""

from __future__ import annotations

from te_passes.compat.autocast.recipe_state import RecipeStateError, TracedAutocast, autocast_for_graph
from te_passes.compat.compiled_call import wrap_compiled
from te_passes.compat.delayed_scaling.linear import cudagraph_hazard
from te_passes.compat.live_state import capture_fp8, capture_te_state, capture_ub
from te_passes.compat.table import refusal as row_refusal
from te_passes.compat.ub.graph_guard import (UbCheckSpec, UbDependence, UbMismatch, pristine_copy, raise_ub_mismatches,
                                              te_state_guard, ub_dependence_of, ub_state_reads)
from te_passes.compat.ub.guard import UbFold, dynamo_stage_inputs
from te_passes.compat.untouched.polyfills import NORM_ENV as UNTOUCHED_NORM_ENV

__all__ = [
    # te.autocast state (compat.autocast.recipe_state)
    "RecipeStateError", "TracedAutocast", "autocast_for_graph",
    # DelayedScaling (compat.delayed_scaling.linear)
    "cudagraph_hazard",
    # Userbuffers (compat.ub)
    "UbCheckSpec", "UbDependence", "UbFold", "UbMismatch", "dynamo_stage_inputs", "pristine_copy",
    "raise_ub_mismatches", "te_state_guard", "ub_dependence_of", "ub_state_reads",
    # the live TE state a compilation runs against (compat.live_state)
    "capture_fp8", "capture_te_state", "capture_ub",
    # the compiled callable's one wrapper (compat.compiled_call)
    "wrap_compiled",
    # the patch table's status (compat.table), the untouched polyfills' norm switch
    "row_refusal", "UNTOUCHED_NORM_ENV",
]
