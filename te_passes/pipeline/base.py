"""The one pass interface every te_passes pass implements.

A pass is a class with a ``name``, the ``stages`` it runs at, a one-line ``description`` and a
``run(gm, ctx)`` method that rewrites ``gm`` in place and returns a :class:`TEPassResult`:
whether it changed the graph plus structured :class:`PassRecord`\\ s of what it did (folded
constants, inserted frees, findings, and the reasons for every rewrite it refused).

Modelled on ``torch.fx.passes.infra.pass_base.PassBase`` (torch 2.14) — :class:`TEPass` is one —
and on vLLM's ``InductorPass`` (``uuid()`` hashes the pass's source and config, so Inductor's FX
graph cache misses exactly when a pass or its configuration changed).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import inspect
import json
import os
import sys
from typing import Any, Callable, ClassVar

import torch.fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from te_passes._json import jsonable
from te_passes.config import TePassesOptions
from te_passes.report import PassRecord
from te_passes.te.state import TEState

__all__ = ["ALL_STAGES", "AOT_STAGES", "PassContext", "PassRecord", "PassSkipped", "Stage", "TEPass", "TEPassResult",
           "jsonable"]


#: The te_passes package directory whose sources :func:`package_source_hash` covers.
PACKAGE_ROOT: str = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def package_source_files(root: str) -> list[str]:
    """Every ``.py`` file under ``root`` (the te_passes package), as sorted ``/``-separated paths
    relative to it (``__pycache__`` skipped)."""
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        out.extend(os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/") for f in files if f.endswith(".py"))
    return sorted(out)


@functools.lru_cache(maxsize=None)
def package_source_hash(root: str | None = None) -> str:
    """sha256 over the path and bytes of every te_passes source file (:func:`package_source_files`
    of ``root``, default :data:`PACKAGE_ROOT`), computed once per process and root.

    Part of every pass's :meth:`TEPass.uuid` and of the pipeline uuid: what a pass does depends on
    more than its own module (analyses, the TE graph model, recipe tables, the runtime's free op
    and constant naming), so any source change re-keys Inductor's FX graph cache (issue 12).
    """
    root = root or PACKAGE_ROOT
    h = hashlib.sha256()
    for rel in package_source_files(root):
        h.update(rel.encode() + b"\0")
        with open(os.path.join(root, rel), "rb") as f:
            h.update(f.read())
        h.update(b"\0")
    return h.hexdigest()


class Stage(str, enum.Enum):
    """Where in the torch.compile pipeline a pass runs.

    * ``DYNAMO`` — on the graph Dynamo hands to the backend (torch-level ops, ``call_method``
      nodes, TE ops as ``transformer_engine_compile.<op>`` OpOverloadPackets);
    * ``JOINT`` — on AOTAutograd's joint forward+backward graph (Inductor's
      ``joint_custom_pre_pass`` hook);
    * ``POST_GRAD_FWD`` / ``POST_GRAD_BWD`` — on the partitioned, functionalized ATen forward /
      backward graphs (Inductor's ``post_grad_custom_pre_pass`` hook).
    """

    DYNAMO = "dynamo"
    JOINT = "joint"
    POST_GRAD_FWD = "post_grad_fwd"
    POST_GRAD_BWD = "post_grad_bwd"

    @property
    def is_aten(self) -> bool:
        """True for stages whose graphs hold ATen ``OpOverload``\\ s (everything after Dynamo)."""
        return self is not Stage.DYNAMO


ALL_STAGES: frozenset[Stage] = frozenset(Stage)
AOT_STAGES: frozenset[Stage] = frozenset({Stage.JOINT, Stage.POST_GRAD_FWD, Stage.POST_GRAD_BWD})


class TEPassResult(PassResult):
    """A ``torch.fx.passes.infra.pass_base.PassResult`` plus the pass's records and facts.

    Fields: ``graph_module`` (the same module, rewritten in place), ``modified`` (bool),
    ``records`` (list of :class:`PassRecord`, for people) and ``facts`` (typed objects for the
    pipeline, e.g. ``te_passes.runtime.ub_graph_guard.UbDependence``: what the compiled graph depends
    on). A pass hands results to the pipeline only this way, never through module globals.
    """

    def __new__(cls, graph_module: torch.fx.GraphModule, modified: bool,
                records: list[PassRecord] | None = None, facts: list[Any] | None = None) -> "TEPassResult":
        self = super().__new__(cls, graph_module, modified)
        self.records = list(records or [])
        self.facts = list(facts or [])
        return self


class PassSkipped(Exception):
    """Raised by a pass that cannot prove its rewrite safe *before* touching the graph.

    The manager records it as a ``"skipped"`` record with the message (never a warning: the
    graph is intact and the refusal is part of the design).
    """


@dataclasses.dataclass
class PassContext:
    """What a pass may read besides the graph.

    * ``stage`` — the :class:`Stage` being run;
    * ``options`` — the parsed ``te_passes.*`` options (:class:`te_passes.config.TePassesOptions`);
    * ``te_state`` — the TE state snapshot taken for this compilation
      (:class:`te_passes.te.state.TEState`: TE version, UB snapshot, active recipe);
    * ``example_inputs`` — the compiled graph's example inputs (fake tensors / SymInts), or ``None``;
    * ``graph_id`` — a stable name for the graph being compiled (``"g0"``, ``"g0.fwd"``, ...).
    """

    stage: Stage
    options: "TePassesOptions"
    te_state: "TEState"
    example_inputs: Any = None
    graph_id: str = "g0"
    #: Call before the first mutation (passes with ``checkpoints_itself = True``): the manager
    #: then takes its rollback copy only when a pass really rewrites (set by the manager).
    #: ``checkpoint(undo)`` with a callable instead registers the pass's own undo (e.g. a log
    #: of the ``args`` it replaced): on rollback the manager calls it instead of restoring a
    #: copy, so a pass that only rewrites arguments never pays for a graph copy.
    checkpoint: Callable[..., None] = lambda undo=None: None
    #: Analyses of the current graph shared between the passes of one stage (e.g. liveness:
    #: ``{("liveness", stage): Liveness}``). The manager empties it whenever a pass changes (or
    #: fails on) the graph, so an entry is always an analysis of the graph as it is now.
    analyses: dict = dataclasses.field(default_factory=dict)
    #: Facts the compilation driver hands to the passes of this compilation, by name: what the
    #: runtime saw before any pass ran (``"ub_trace_folds"``: UB queries Dynamo folded while it
    #: traced this graph; ``"ub_prev_token"``: the UB token this Dynamo frame was traced with
    #: before, on a recompile). Passes read them; they never fetch them from module globals.
    inputs: dict = dataclasses.field(default_factory=dict)


class TEPass(PassBase):
    """Base class of every te_passes pass.

    Subclasses set the class attributes ``name`` (snake_case, unique, what ``te-passes list``
    and ``te_passes.disable`` use), ``stages`` (a frozenset of :class:`Stage`) and
    ``description`` (one line), and implement :meth:`run`.

    Contract for :meth:`run`:
      * analyse first, mutate last: raise :class:`PassSkipped` (graph untouched) when the
        rewrite cannot be proven safe;
      * mutate ``gm.graph`` in place and return ``TEPassResult(gm, changed, records)``;
      * never leave a graph that fails ``graph.lint()`` — the manager lints after each pass and
        restores the pre-pass graph on any exception.

    ``config()`` returns the pass's configuration as JSON-able data; ``uuid()`` hashes the
    source file of the pass's class and every te_passes source file (:func:`package_source_hash`)
    together with it (vLLM ``InductorPass.uuid`` style), so it can key Inductor's FX graph cache.
    """

    name: ClassVar[str] = ""
    stages: ClassVar[frozenset[Stage]] = frozenset()
    description: ClassVar[str] = ""
    #: Whether the pass only analyses (never mutates the graph). Analysis passes run even
    #: when a rewrite pass before them failed, and never trigger a rollback copy.
    analysis_only: ClassVar[bool] = False
    #: Whether the pass calls ``ctx.checkpoint()`` right before its first mutation. Then the
    #: manager copies the graph (for rollback) only when the pass rewrites something; otherwise
    #: it copies before every run (O(nodes), ~30 us/node).
    checkpoints_itself: ClassVar[bool] = False

    def __init__(self, **config: Any) -> None:
        self._config = dict(config)

    def config(self) -> dict[str, Any]:
        """The pass's configuration (JSON-able), part of :meth:`uuid`."""
        return dict(self._config)

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> TEPassResult:
        """Rewrite ``gm`` in place; see the class docstring for the contract."""
        raise NotImplementedError

    # torch.fx.passes.infra.pass_base.PassBase protocol (lets a TEPass run in torch's own
    # PassManager too; the stage defaults to DYNAMO there and TE state is taken live).
    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        stage = next(iter(sorted(self.stages, key=lambda s: s.value)), Stage.DYNAMO)
        return self.run(graph_module, PassContext(stage, TePassesOptions(), TEState.capture()))

    @classmethod
    def source_hash(cls) -> str:
        """sha256 of the source files of ``cls`` and its bases up to :class:`TEPass`."""
        h = hashlib.sha256()
        for klass in cls.__mro__:
            if klass is PassBase or klass is object:
                break
            mod = sys.modules.get(klass.__module__)
            try:
                src = inspect.getsource(mod) if mod is not None else klass.__qualname__
            except (OSError, TypeError):
                src = klass.__qualname__
            h.update(src.encode())
        return h.hexdigest()

    def uuid(self) -> str:
        """Stable id of this pass: its class's source, the te_passes package source
        (:func:`package_source_hash` of :data:`PACKAGE_ROOT`) and its config; changes when any
        changes."""
        payload = json.dumps({"name": self.name, "src": self.source_hash(),
                              "package": package_source_hash(PACKAGE_ROOT),
                              "config": jsonable(self.config())}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, stages={sorted(s.value for s in self.stages)})"
