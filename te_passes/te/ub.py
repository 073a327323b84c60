"""Userbuffers (UB) knowledge: a snapshot of TE's UB registry and the queries it answers.

See docs/internals.md#te_passesteubpy."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Mapping

#: Module holding TE's UB registry.
TE_UB_MODULE = "transformer_engine.pytorch.module.base"

#: Communicator query methods folded by te_passes, in snapshot field order (pybind
#: ``transformer_engine_torch.CommOverlapCore``). A method a communicator lacks is recorded as ``None``.
UB_PREDICATE_METHODS: tuple[str, ...] = (
    "is_fp8_ubuf", "with_cublasmp", "is_atomic_gemm", "is_p2p_overlap", "get_tp_size",
)

#: TE module-level UB functions the pass folds (``module/base.py``).
UB_QUERY_FUNCTIONS: tuple[str, ...] = ("get_ub_is_fp8", "is_ub_initialized", "using_cublasmp_backend")

#: ``UserBufferQuantizationMode`` values (``module/base.py``).
MODE_NONE = "none"
MODE_FP8 = "fp8"
#: Snapshot field of a query method whose name differs (:class:`UbBufferState`).
METHOD_FIELD = {"get_tp_size": "tp_size"}


class UbConfigError(RuntimeError):
    """A UB query or a TE op's UB configuration cannot be satisfied by the UB state: raised at
    compile time instead of TE's run-time ``KeyError`` / ``RuntimeError`` from ``get_ub``. The
    message names the module's ``ub_name``, the buffer and the UB state it was checked against."""


def ub_mode(use_fp8: bool) -> str:
    """``UserBufferQuantizationMode`` value of a ``use_fp8`` flag: ``"fp8"`` or ``"none"``."""
    return MODE_FP8 if use_fp8 else MODE_NONE


def mode_value(mode: Any) -> str:
    """``UserBufferQuantizationMode.FP8`` / ``"fp8"`` / ``"FP8"`` -> ``"fp8"``."""
    v = str(getattr(mode, "value", mode)).lower()
    if v not in (MODE_NONE, MODE_FP8):
        raise ValueError(f"unknown UB quantization mode {mode!r} (expected 'none' or 'fp8')")
    return v


@dataclasses.dataclass(frozen=True)
class UbBufferState:
    """The query results of one UB communicator ``(name, mode)``."""

    name: str
    mode: str
    is_fp8_ubuf: bool | None = None
    with_cublasmp: bool | None = None
    is_atomic_gemm: bool | None = None
    is_p2p_overlap: bool | None = None
    tp_size: int | None = None

    def method_value(self, method: str) -> Any:
        """Result of ``communicator.<method>()`` (one of :data:`UB_PREDICATE_METHODS`); raises
        :class:`UbConfigError` for an unknown method or one the communicator did not expose."""
        if method not in UB_PREDICATE_METHODS:
            raise UbConfigError(f"UB communicator query {method!r} is not one te_passes folds "
                                f"(known: {list(UB_PREDICATE_METHODS)})")
        value = getattr(self, METHOD_FIELD.get(method, method))
        if value is None:
            raise UbConfigError(f"UB buffer {self.name!r} (mode {self.mode}) has no recorded "
                                f"{method}() result in the snapshot")
        return value

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class UbSnapshot:
    """TE's Userbuffers registry as data, taken at one instant (``module/base.py``):
    ``initialized`` (``_ub_initialized``), ``with_cublasmp`` (``_ub_with_cublasmp``), one
    :class:`UbBufferState` per ``(name, mode)`` key of ``_ub_communicators`` (sorted), and
    ``source`` (``"live"``, ``"dict"``, ``"file:<path>"``, ``"absent"``: not in :meth:`fingerprint`). Taken from
    a running TE by :func:`te_passes.compat.live_state.capture_ub`."""

    initialized: bool = False
    with_cublasmp: bool = False
    buffers: tuple[UbBufferState, ...] = ()
    source: str = "live"

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, source: str = "dict") -> "UbSnapshot":
        """Build from :meth:`to_json` output; raises :class:`UbConfigError` naming missing/unknown
        keys or wrongly typed values."""
        if not isinstance(data, Mapping):
            raise UbConfigError(f"UB snapshot must be a JSON object, got {type(data).__name__}")
        unknown = set(data) - {"initialized", "with_cublasmp", "buffers", "source", "fingerprint"}
        if unknown:
            raise UbConfigError(f"UB snapshot has unknown keys {sorted(unknown)}; expected "
                                "initialized, with_cublasmp, buffers")
        fields = {f.name for f in dataclasses.fields(UbBufferState)}
        bufs = []
        for i, b in enumerate(data.get("buffers", [])):
            if not isinstance(b, Mapping) or "name" not in b or "mode" not in b:
                raise UbConfigError(f"UB snapshot buffers[{i}] must be an object with 'name' and 'mode', got {b!r}")
            bad = set(b) - fields
            if bad:
                raise UbConfigError(f"UB snapshot buffers[{i}] ({b.get('name')!r}) has unknown keys {sorted(bad)}; "
                                    f"expected {sorted(fields)}")
            try:
                mode = mode_value(b["mode"])
            except ValueError as e:
                raise UbConfigError(f"UB snapshot buffers[{i}] ({b['name']!r}): {e}") from None
            bufs.append(UbBufferState(**{**b, "mode": mode}))
        bufs.sort(key=lambda b: (b.name, b.mode))
        keys = [(b.name, b.mode) for b in bufs]
        if len(set(keys)) != len(keys):
            raise UbConfigError(f"UB snapshot lists a (name, mode) twice: {keys}")
        return cls(initialized=bool(data.get("initialized", bool(bufs))),
                   with_cublasmp=bool(data.get("with_cublasmp", False)), buffers=tuple(bufs),
                   source=source)

    @classmethod
    def load(cls, obj: Any) -> "UbSnapshot":
        """A snapshot from a :class:`UbSnapshot` (returned as is), a dict, or a JSON file path.
        Raises :class:`UbConfigError` (naming the path) for an unreadable file, bad JSON or bad
        content, ``TypeError`` when ``obj`` is none of those."""
        if isinstance(obj, UbSnapshot):
            return obj
        if isinstance(obj, Mapping):
            return cls.from_json(obj)
        if isinstance(obj, (str, os.PathLike)):
            path = os.fspath(obj)
            try:
                with open(path, encoding="utf-8") as f:
                    data = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise UbConfigError(f"cannot read UB snapshot {path!r}: {e}") from e
            try:
                return cls.from_json(data, source=f"file:{path}")
            except UbConfigError as e:
                raise UbConfigError(f"UB snapshot {path!r}: {e}") from None
        raise TypeError(f"te_passes.ub_snapshot must be a UbSnapshot, dict or JSON path, got {type(obj).__name__}")

    def to_json(self) -> dict[str, Any]:
        """``{"initialized", "with_cublasmp", "buffers": [...], "fingerprint"}`` (JSON types)."""
        return {"initialized": self.initialized, "with_cublasmp": self.with_cublasmp,
                "buffers": [b.to_json() for b in self.buffers], "fingerprint": self.fingerprint()}

    def save(self, path: str | os.PathLike) -> None:
        """Write :meth:`to_json` to ``path`` (for offline replay with ``te_passes.ub_snapshot``)."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=2, sort_keys=True)

    def fingerprint(self) -> str:
        """sha256 (hex) of the state queries can observe (``source`` excluded), equal across processes."""
        payload = {"initialized": self.initialized, "with_cublasmp": self.with_cublasmp,
                   "buffers": [b.to_json() for b in self.buffers]}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def buffer(self, name: str, use_fp8: bool) -> UbBufferState | None:
        """The buffer TE's ``get_ub(name, use_fp8)`` would return, or ``None``."""
        mode = ub_mode(bool(use_fp8))
        for b in self.buffers:
            if b.name == name and b.mode == mode:
                return b
        return None

    def names(self) -> list[str]:
        """``"name[mode]"`` of every buffer (for messages)."""
        return [f"{b.name}[{b.mode}]" for b in self.buffers]

    def get_ub(self, name: str, use_fp8: bool) -> UbBufferState:
        """Mirror of TE's ``get_ub(name, use_fp8)`` (``module/base.py``) on the snapshot; raises
        :class:`UbConfigError` where TE raises (UB not initialised, no such buffer: lists the registered)."""
        if not self.initialized:
            raise UbConfigError(f"get_ub({name!r}, use_fp8={bool(use_fp8)}): UB is not initialised "
                                "(initialize_ub() was not called) in the UB state compiled against")
        b = self.buffer(name, use_fp8)
        if b is None:
            raise UbConfigError(f"get_ub({name!r}, use_fp8={bool(use_fp8)}): no UB buffer "
                                f"({name!r}, {ub_mode(bool(use_fp8))}) is registered; registered: {self.names()}")
        return b

    def query(self, api: str, args: tuple = ()) -> Any:
        """Evaluate one UB query on the snapshot as TE would live; raises :class:`UbConfigError` for
        an unknown api, wrong arguments, or where TE would raise for this state."""
        if api == "is_ub_initialized":
            return self.initialized
        if api == "using_cublasmp_backend":
            return self.initialized and self.with_cublasmp
        if api == "get_ub_is_fp8" or api.startswith("get_ub."):
            if len(args) != 2 or not isinstance(args[0], str):
                raise UbConfigError(f"{api}{tuple(args)!r}: expected (name: str, use_fp8: bool)")
            method = "is_fp8_ubuf" if api == "get_ub_is_fp8" else api.split(".", 1)[1]
            return self.get_ub(args[0], bool(args[1])).method_value(method)
        raise UbConfigError(f"unknown UB query {api!r}")
