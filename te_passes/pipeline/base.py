"""The one pass interface every te_passes pass implements: :class:`TEPass`, its typed
:class:`PassConfig`, :class:`PassContext` and :class:`TEPassResult`. docs/design.md "The pass interface".
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
import types
import typing
from typing import Any, ClassVar

import torch.fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from te_passes._json import jsonable
from te_passes.compat.api import capture_te_state
from te_passes.config import TePassesOptions
from te_passes.fx.journal import GraphJournal
from te_passes.report import PassRecord
from te_passes.te.state import TEState

__all__ = ["PassConfig", "PassContext", "PassRecord", "PassSkipped", "Stage", "TEPass", "TEPassResult", "jsonable"]

PACKAGE_ROOT: str = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def package_source_files(root: str) -> list[str]:
    """Every ``.py`` file under ``root``, as sorted ``/``-separated relative paths."""
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        out.extend(os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/") for f in files if f.endswith(".py"))
    return sorted(out)


@functools.lru_cache(maxsize=None)
def package_source_hash(root: str | None = None) -> str:
    """sha256 over path and bytes of every source file under ``root`` (default :data:`PACKAGE_ROOT`), once per root."""
    root = root or PACKAGE_ROOT
    h = hashlib.sha256()
    for rel in package_source_files(root):
        with open(os.path.join(root, rel), "rb") as f:
            h.update(rel.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()


class Stage(str, enum.Enum):
    """Where a pass runs: ``DYNAMO`` (the backend's graph), ``JOINT`` (``joint_custom_pre_pass``),
    ``POST_GRAD_FWD`` / ``POST_GRAD_BWD`` (``post_grad_custom_pre_pass``, partitioned forward / backward)."""

    DYNAMO = "dynamo"
    JOINT = "joint"
    POST_GRAD_FWD = "post_grad_fwd"
    POST_GRAD_BWD = "post_grad_bwd"


class TEPassResult(PassResult):
    """``PassResult(graph_module, modified)`` plus ``records`` (:class:`PassRecord`, for people) and
    ``facts`` (typed objects for the pipeline, e.g. ``compat.api.UbDependence``, ``pipeline.facts.AutocastState``)."""

    def __new__(cls, graph_module: torch.fx.GraphModule, modified: bool,
                records: list[PassRecord] | None = None, facts: list[Any] | None = None) -> "TEPassResult":
        self = super().__new__(cls, graph_module, modified)
        self.records = list(records or [])
        self.facts = list(facts or [])
        return self


class PassSkipped(Exception):
    """Raised by a pass that cannot prove its rewrite safe: recorded as ``"skipped"``, its edits undone."""


@dataclasses.dataclass
class PassContext:
    """What a pass may read besides the graph: ``stage``, ``options``, ``te_state`` (the compilation's
    TE snapshot), ``example_inputs`` (fake tensors / SymInts or ``None``), ``graph_id`` (``"g0.fwd"``);
    ``journal``: where it makes every edit (undone when it is skipped or fails); ``analyses``: shared in
    a stage, emptied when a pass changes the graph; ``inputs``: facts from the driver (``"ub_trace_folds"``);
    ``stage_facts``: the typed facts the stage's earlier passes returned (the manager appends them)."""

    stage: Stage
    options: TePassesOptions
    te_state: TEState
    example_inputs: Any = None
    graph_id: str = "g0"
    journal: GraphJournal = dataclasses.field(default_factory=GraphJournal)
    analyses: dict = dataclasses.field(default_factory=dict)
    inputs: dict = dataclasses.field(default_factory=dict)
    stage_facts: list = dataclasses.field(default_factory=list)


def _type_error(ann: Any, value: Any) -> str | None:
    """Why ``value`` is not an ``ann`` (a class, ``X | None``, a ``Literal``'s type), or ``None``."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Literal:
        return _type_error(type(args[0]), value)
    classes = args if origin is typing.Union or origin is types.UnionType else (ann,)
    ok = ann is Any or any(isinstance(value, c) and not (isinstance(value, bool) and c in (int, float))
                           or (c is float and type(value) is int) for c in classes)
    return None if ok else "must be " + " | ".join("None" if c is type(None) else c.__name__ for c in classes)


class PassParameterError(ValueError):
    """A pass parameter's value refused by its ``Config``: ``param`` names it, ``detail`` says why."""

    def __init__(self, param: str, detail: str) -> None:
        super().__init__(f"{param} {detail}")
        self.param, self.detail = param, detail


class PassParameterTypeError(PassParameterError, TypeError):
    """A :class:`PassParameterError` for a value of another type (``"must be bool, got 'no' (str)"``)."""


@dataclasses.dataclass(frozen=True)
class PassConfig:
    """Base of a pass's typed configuration: a frozen dataclass whose fields are its ``te_passes.pass_config``
    parameters, checked against their annotations (raises :class:`PassParameterError`)."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            ann = hints[f.name]
            err = _type_error(ann, value)
            if err is not None:
                raise PassParameterTypeError(f.name, f"{err}, got {value!r} ({type(value).__name__})")
            if typing.get_origin(ann) is typing.Literal and value not in typing.get_args(ann):
                raise PassParameterError(f.name, f"must be one of {list(typing.get_args(ann))}, got {value!r}")

    def to_json(self) -> dict[str, Any]:
        return jsonable({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})


class TEPass(PassBase):
    """Base class of every pass: ``name``, ``stages``, ``description``, ``Config`` (the constructor's
    keywords), ``analysis_only``, ``source_modules`` (modules besides its own that shape its output,
    part of :meth:`uuid`), ``replayable`` (``False``: its records depend on what Dynamo recorded on the
    nodes while tracing, which a saved ``.tegraph`` does not keep, so replay does not compare them).
    :meth:`run` analyses first, edits last and only through ``ctx.journal``, raises :class:`PassSkipped`
    when unsafe and leaves a graph that passes ``graph.lint()``."""

    name: ClassVar[str] = ""
    stages: ClassVar[frozenset[Stage]] = frozenset()
    description: ClassVar[str] = ""
    analysis_only: ClassVar[bool] = False
    replayable: ClassVar[bool] = True
    Config: ClassVar[type[PassConfig]] = PassConfig
    source_modules: ClassVar[tuple[types.ModuleType, ...]] = ()

    def __init__(self, **config: Any) -> None:
        self.cfg = self.Config(**config)

    def config(self) -> dict[str, Any]:
        """The JSON-able configuration, part of :meth:`uuid`."""
        return self.cfg.to_json()

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> TEPassResult:
        """Rewrite ``gm`` in place through ``ctx.journal``; see the class docstring."""
        raise NotImplementedError

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        """torch's ``PassBase`` protocol: run at the pass's first stage with TE state taken live."""
        stage = next(iter(sorted(self.stages, key=lambda s: s.value)), Stage.DYNAMO)
        return self.run(graph_module, PassContext(stage, TePassesOptions(), capture_te_state()))

    @classmethod
    def source_hash(cls) -> str:
        """sha256 of the source files of ``cls``, its bases up to :class:`TEPass` and ``source_modules``."""
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
        for mod in cls.source_modules:
            h.update(inspect.getsource(sys.modules[mod.__name__]).encode())
        return h.hexdigest()

    def uuid(self) -> str:
        """Stable id: the pass's source, the package source and the config."""
        payload = json.dumps({"name": self.name, "src": self.source_hash(),
                              "package": package_source_hash(PACKAGE_ROOT),
                              "config": jsonable(self.config())}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, stages={sorted(s.value for s in self.stages)})"
