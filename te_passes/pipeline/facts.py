"""The typed facts the driver (:class:`~te_passes.pipeline.compilation.Compilation`) reads from the
Dynamo-stage analyses, one type per analysis (``te_passes.passes``: ``find_autocast_state``,
``check_cudagraph_hazard``, ``find_ub_state_reads``). docs/design.md "Stages and the driver".
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Iterable

from te_passes.compat.api import TracedAutocast


@dataclasses.dataclass(frozen=True)
class AutocastState:
    """The ``te.autocast`` state TE's impls read while the compiled graph runs (``state``: ``None``
    when no TE op reads it), or why the graph is refused (``refusal``: the
    :class:`~te_passes.compat.api.RecipeStateError` message; then ``state`` is ``None``).
    Mirrors ``compat.autocast.recipe_state.autocast_for_graph``."""

    producer: ClassVar[str] = "find_autocast_state"
    state: TracedAutocast | None = None
    refusal: str | None = None


#: Passes ``te_passes.disable`` / ``TE_PASSES_DISABLE`` / ``--disable`` may not name: the pipeline needs their fact
#: (pass name -> why). Checked when the backend is built (``te_inductor_backend``), at the first compile and by the CLI.
REQUIRED_PASSES: dict[str, str] = {
    AutocastState.producer: "te_inductor sets the te.autocast state it finds around the compiled call (TE's impls "
                            "read it while they run), so it cannot be disabled",
}


def required_pass_refusal(disabled: Iterable[str], where: str) -> str | None:
    """The refusal message when ``disabled`` (pass names, from ``where``: an option or variable name) names a
    pass of :data:`REQUIRED_PASSES`, else ``None``."""
    named = [n for n in disabled if n in REQUIRED_PASSES]
    if not named:
        return None
    return f"{where} names {named[0]}: {REQUIRED_PASSES[named[0]]}"


@dataclasses.dataclass(frozen=True)
class CudagraphHazard:
    """Why the graph must not be CUDA-graphed (``compat.delayed_scaling.linear.cudagraph_hazard``);
    only returned when there is a reason."""

    producer: ClassVar[str] = "check_cudagraph_hazard"
    reason: str


@dataclasses.dataclass(frozen=True)
class UbStateReads:
    """Why compiling the Dynamo graph reads the UB state, one sentence per reason (empty: it does not;
    ``compat.ub.graph_guard.ub_state_reads``). Decides whether the UB snapshot keys the pipeline uuid."""

    producer: ClassVar[str] = "find_ub_state_reads"
    reasons: tuple[str, ...] = ()


def single_fact(facts: list[Any], kind: type) -> Any:
    """The one fact of ``kind`` in ``facts``, or ``None`` when there is none. Raises ``RuntimeError``:
    more than one (an analysis ran twice in a stage)."""
    found = [f for f in facts if isinstance(f, kind)]
    if len(found) > 1:
        raise RuntimeError(f"te_passes: {len(found)} {kind.__name__} facts in one stage; {kind.producer} returns one")
    return found[0] if found else None
