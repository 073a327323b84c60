"""The ordered pass list (``te-passes list`` prints it), one module per pass; the backend, the CLI
and the test harness hand it to the pass manager, which imports no pass."""

from __future__ import annotations

from te_passes.passes.call_te_impl_directly import CallTEImplDirectly
from te_passes.passes.check_cudagraph_hazard import CheckCudagraphHazard
from te_passes.passes.check_cudagraph_pool import CheckCudagraphPool
from te_passes.passes.find_autocast_state import FindAutocastState
from te_passes.passes.find_ub_state_reads import FindUbStateReads
from te_passes.passes.fold_recipe_lookups import FoldRecipeLookups
from te_passes.passes.fold_ub_predicates import FoldUbPredicates
from te_passes.passes.hoist_te_constants import HoistTEConstants
from te_passes.passes.insert_early_frees import InsertEarlyFrees
from te_passes.passes.remove_quantizer_setattrs import RemoveQuantizerSetattrs
from te_passes.passes.widen_quantized_inputs import WidenQuantizedInputs
from te_passes.pipeline.base import TEPass
from te_passes.pipeline.registry import build_passes

#: Every pass class, in pipeline order.
PASSES: tuple[type[TEPass], ...] = (
    FindAutocastState,  # analyses of the Dynamo graph as Dynamo traced it (before any rewrite)
    CheckCudagraphHazard,
    FoldUbPredicates,
    FoldRecipeLookups,
    RemoveQuantizerSetattrs,
    WidenQuantizedInputs,
    HoistTEConstants,
    CallTEImplDirectly,  # needs the hoisted constants; before the frees / pool check (they treat base ops alike)
    InsertEarlyFrees,
    CheckCudagraphPool,
    FindUbStateReads,  # the Dynamo graph after the Dynamo-stage passes, with fold_ub_predicates' facts
)


def pass_classes() -> tuple[type[TEPass], ...]:
    """:data:`PASSES`."""
    return PASSES


def pass_names() -> list[str]:
    """Registered pass names, in order."""
    return [cls.name for cls in PASSES]


def default_passes() -> list[TEPass]:
    """Fresh instances of every registered pass with its default configuration."""
    return [cls() for cls in PASSES]


def configured_passes(pass_config: dict | None = None) -> list[TEPass]:
    """Every pass built with ``pass_config[name]`` (``te_passes.pass_config``). Raises
    ``TePassesOptionError``: an unknown pass or parameter, or a refused value."""
    return build_passes(PASSES, pass_config) if pass_config else default_passes()
