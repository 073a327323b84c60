"""Storages of an FX graph and their lifetimes: the result types of
:func:`te_passes.analyses.liveness.analyze`.

See docs/internals.md#te_passesanalysesbufferspy."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Iterable

import torch
import torch.fx
from torch._prims_common import compute_required_storage_length

from te_passes.te.quantized import QuantizedInfo

__all__ = ["Buffer", "BufferOrigin", "Escape", "Liveness", "live_intervals", "tensor_nbytes"]


_UNSET = object()


class BufferOrigin(str, enum.Enum):
    """Who owns a buffer's storage."""

    INPUT = "input"          # a placeholder: owned by the caller for the whole call
    CONSTANT = "constant"    # a get_attr constant / parameter of the GraphModule
    ALLOCATED = "allocated"  # allocated by a node inside the graph


@dataclasses.dataclass(eq=False, slots=True)
class Buffer:
    """One storage a graph value may point into."""

    id: int
    node: torch.fx.Node
    index: int | None
    origin: BufferOrigin
    val: Any = None
    handle: torch.fx.Node | None = None
    quantized: QuantizedInfo | None = None
    _nbytes: Any = _UNSET
    _nbytes_val: Any = None

    @property
    def name(self) -> str:
        """``node`` name, with ``[index]`` for a multi-output node's element."""
        if self.handle is not None:
            return self.handle.name
        return self.node.name if self.index is None else f"{self.node.name}[{self.index}]"

    def nbytes(self):
        """Bytes of the storage (int, or a ``sympy.Expr`` with symbolic sizes); ``None`` unknown."""
        if self._nbytes is _UNSET or self._nbytes_val is not self.val:
            self._nbytes = tensor_nbytes(self.val)
            self._nbytes_val = self.val
        return self._nbytes

    def __repr__(self) -> str:
        return f"Buffer({self.name}, {self.origin.value})"


@dataclasses.dataclass
class Escape:
    """A buffer that stays referenced past the graph's end without being a graph output: it escapes
    at ``node`` ``how`` (e.g. ``"stored into a Python object by setattr"``)."""

    buffer: Buffer
    node: torch.fx.Node
    how: str


def tensor_nbytes(val: Any):
    """Storage bytes a tensor value needs (``torch._prims_common.compute_required_storage_length`` times
    the element size; ``numel`` with symbolic sizes), a ``sympy.Expr`` when symbolic, ``None`` for non-tensors."""
    if not isinstance(val, torch.Tensor):
        return None
    try:
        if val._has_symbolic_sizes_strides:
            # Symbolic sizes: no boolean test on SymInts (it would add guards to the ShapeEnv).
            n = val.numel()
        elif val.is_contiguous() and val.storage_offset() == 0:
            n = val.numel()
        else:
            n = compute_required_storage_length(val.shape, val.stride(), val.storage_offset())
    except Exception:  # noqa: BLE001 - sparse / nested / odd layouts
        n = val.numel()
    nbytes = n * val.element_size()
    if isinstance(nbytes, torch.SymInt):
        return nbytes.node.expr
    return int(nbytes)


@dataclasses.dataclass
class Liveness:
    """Result of :func:`te_passes.analyses.liveness.analyze` (see that module's docstring)."""

    graph: torch.fx.Graph
    order: dict[torch.fx.Node, int]
    buffers: list[Buffer]
    aliases: dict[torch.fx.Node, frozenset[Buffer]]
    elements: dict[torch.fx.Node, list[frozenset[Buffer]]]
    first_def: dict[Buffer, torch.fx.Node]
    last_use: dict[Buffer, torch.fx.Node]
    holders: dict[Buffer, set[Buffer]]
    output_buffers: frozenset[Buffer]
    escapes: list[Escape]
    saved_inputs: frozenset[torch.fx.Node]
    opaque_uses: dict[Buffer, list[torch.fx.Node]]
    unknown_alias_nodes: list[torch.fx.Node]

    def buffers_of(self, node: torch.fx.Node) -> frozenset[Buffer]:
        """The buffers ``node``'s value may alias."""
        return self.aliases.get(node, frozenset())

    def owned_buffer(self, node: torch.fx.Node) -> Buffer | None:
        """The buffer ``node`` is the handle of (its value *is* that storage's base), else None."""
        bufs = self.aliases.get(node, frozenset())
        return next((b for b in bufs if b.handle is node), None) if len(bufs) == 1 else None

    def escaped(self, buf: Buffer) -> list[Escape]:
        """Escapes of ``buf`` (directly, or through a buffer that holds it)."""
        if not self.escapes:
            return []
        seen = self._holder_closure(buf)
        return [e for e in self.escapes if e.buffer in seen]

    def is_output(self, buf: Buffer) -> bool:
        """Whether a graph output aliases ``buf`` or a buffer holding it."""
        if buf in self.output_buffers:
            return True
        if not self.holders:
            return False
        return any(b in self.output_buffers for b in self._holder_closure(buf))

    def live_at_end(self, buf: Buffer) -> bool:
        """Whether ``buf``'s storage is still referenced when the graph returns."""
        return buf.origin is not BufferOrigin.ALLOCATED or self.is_output(buf) or bool(self.escaped(buf))

    def _holder_closure(self, buf: Buffer) -> set[Buffer]:
        seen = {buf}
        stack = [buf]
        while stack:
            for h in self.holders.get(stack.pop(), ()):
                if h not in seen:
                    seen.add(h)
                    stack.append(h)
        return seen

    def quantized_buffers(self) -> list[Buffer]:
        """Buffers classified as parts of quantized tensors, in graph order."""
        return [b for b in self.buffers if b.quantized is not None]


def live_intervals(lv: Liveness, buffers: Iterable[Buffer] | None = None) -> dict[Buffer, tuple[int, int]]:
    """``{buffer: (def position, last-use position)}``; graph outputs and escapes extend to the
    output node, inputs/constants span the whole graph."""
    end = len(lv.order) - 1
    out = {}
    for b in (lv.buffers if buffers is None else buffers):
        if b.origin is not BufferOrigin.ALLOCATED:
            out[b] = (0, end)
        elif lv.live_at_end(b):
            out[b] = (lv.order[b.node], end)
        else:
            out[b] = (lv.order[b.node], lv.order[lv.last_use[b]])
    return out
