"""Analysis ``find_autocast_state``: the ``te.autocast`` state TE's impls read while the compiled graph runs.

See docs/passes/find_autocast_state.md."""

from __future__ import annotations

import torch.fx

from te_passes.compat.api import RecipeStateError, autocast_for_graph
from te_passes.pipeline.base import PassContext, PassRecord, Stage, TEPass, TEPassResult
from te_passes.pipeline.facts import AutocastState


class FindAutocastState(TEPass):
    """The state ``compat.autocast.recipe_state.autocast_for_graph`` finds on the Dynamo graph as Dynamo traced
    it (before any pass changes it: first in the pipeline). Returns one :class:`AutocastState` fact;
    ``Compilation`` raises its refusal (live) and sets its state around the compiled call. Records:
    ``"autocast_state"`` (``state``: one line or ``None``, ``source``, ``guard``) or ``"refused"`` (``reason``)."""

    name = AutocastState.producer
    stages = frozenset({Stage.DYNAMO})
    description = "find the te.autocast state TE's impls read at run time (set around the compiled call)"
    analysis_only = True
    replayable = False  # the state is node meta Dynamo's trace recorded; a saved .tegraph does not keep it

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> TEPassResult:
        try:
            state = autocast_for_graph(gm)
        except RecipeStateError as e:  # the driver raises it (live); offline replay only records it
            return TEPassResult(gm, False, [PassRecord("refused", None, {"reason": str(e)})],
                                [AutocastState(refusal=str(e))])
        data = {"state": None, "source": None, "guard": None} if state is None else \
            {"state": state.describe(), "source": state.source, "guard": state.guard}
        return TEPassResult(gm, False, [PassRecord("autocast_state", None, data)], [AutocastState(state)])
