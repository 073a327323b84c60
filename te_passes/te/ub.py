"""Userbuffers (UB) knowledge: a snapshot of TE's UB registry and TE's buffer-use rules.

Transformer Engine keeps its comm+GEMM overlap communicators in a process-global registry,
``transformer_engine/pytorch/module/base.py`` (TE 2.20.2):

* ``_ub_communicators: dict[(name, UserBufferQuantizationMode), CommOverlap | CommOverlapP2P]``
  filled by ``initialize_ub(...)`` for the TransformerLayer GEMM names (``qkv_fprop``,
  ``proj_dgrad``, ``fc1_wgrad``, ...) once per quantization mode (``NONE`` = ``"none"``,
  ``FP8`` = ``"fp8"``), emptied by ``destroy_ub()``;
* ``_ub_initialized`` / ``_ub_with_cublasmp`` behind ``is_ub_initialized()`` and
  ``using_cublasmp_backend()``;
* ``get_ub(name, use_fp8)`` — the communicator of ``(name, FP8 if use_fp8 else NONE)``
  (``RuntimeError`` when UB is not initialised, ``KeyError`` for an unknown key);
* ``get_ub_is_fp8(name, use_fp8)`` — ``get_ub(...).is_fp8_ubuf()`` under
  ``torch.compiler.assume_constant_result`` (a constant with *no* Dynamo guard).

The communicators are pybind objects (``transformer_engine_torch.CommOverlap[P2P]``, methods
``is_fp8_ubuf()``, ``with_cublasmp()``, ``is_atomic_gemm()``, ``is_p2p_overlap()``); calling one
while Dynamo traces is a graph break. This module

* captures the registry into a :class:`UbSnapshot` (JSON round-trip, stable fingerprint), the
  only UB state passes read;
* evaluates UB queries against a snapshot exactly as TE would (:meth:`UbSnapshot.query`);
* mirrors which buffers a ``te.Linear`` op fetches for given config flags
  (:func:`linear_ub_buffer_uses`, from ``module/linear.py``) and checks a TE op config against
  a snapshot (:func:`check_linear_ub_config`);
* (:mod:`te_passes.runtime.ub` offers ``reinitialize_ub`` / ``destroy_ub_keep_compiled`` to
  re-initialise UB without TE's process-wide ``torch.compiler.reset()``; see
  :mod:`te_passes.runtime.ub_guard` for why that is safe under ``te_inductor``).

Nothing here needs a GPU: tests populate TE's registry with stand-in objects that expose the
communicator methods, then call :func:`te_passes.runtime.ub.notify_ub_changed`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from typing import Any, Mapping

#: Module holding TE's UB registry (TE 2.20.2).
TE_UB_MODULE = "transformer_engine.pytorch.module.base"

#: Communicator query methods folded by te_passes, in snapshot field order: the query methods
#: of TE 2.20.2's pybind ``transformer_engine_torch.CommOverlapCore`` (``CommOverlap`` and
#: ``CommOverlapP2P`` inherit them). A method a communicator lacks is recorded as ``None``.
UB_PREDICATE_METHODS: tuple[str, ...] = (
    "is_fp8_ubuf", "with_cublasmp", "is_atomic_gemm", "is_p2p_overlap", "get_tp_size",
)

#: TE module-level UB functions the pass folds (``module/base.py``, TE 2.20.2).
UB_QUERY_FUNCTIONS: tuple[str, ...] = ("get_ub_is_fp8", "is_ub_initialized", "using_cublasmp_backend")

#: ``UserBufferQuantizationMode`` values (TE 2.20.2 ``module/base.py``).
MODE_NONE = "none"
MODE_FP8 = "fp8"

#: Where the buffer-use rules below come from.
LINEAR_SOURCE_FWD = ("transformer_engine/pytorch/module/linear.py:_linear_forward_impl "
                     "('Configure Userbuffers communication'), TE 2.20.2")
LINEAR_SOURCE_BWD = ("transformer_engine/pytorch/module/linear.py:_linear_backward_impl "
                     "('Configure Userbuffers communication' + MXFP8 wgrad all-gather), TE 2.20.2")
LINEAR_SOURCE_SETUP = ("transformer_engine/pytorch/module/linear.py:_linear_setup_backward "
                       "(bwd ub_* flags from fwd flags; all off when backward_override is set), TE 2.20.2")


class UbConfigError(RuntimeError):
    """A UB query or a TE op's UB configuration cannot be satisfied by the UB state.

    Raised at compile time instead of TE's run-time ``KeyError`` / ``RuntimeError`` from
    ``get_ub`` (which, under CUDA graph trees, would surface inside a replayed graph). The
    message names the module's ``ub_name``, the buffer and the UB state it was checked against.
    """


def _mode(use_fp8: bool) -> str:
    return MODE_FP8 if use_fp8 else MODE_NONE


def _mode_value(mode: Any) -> str:
    """``UserBufferQuantizationMode.FP8`` / ``"fp8"`` / ``"FP8"`` -> ``"fp8"``."""
    v = getattr(mode, "value", mode)
    v = str(v).lower()
    if v not in (MODE_NONE, MODE_FP8):
        raise ValueError(f"unknown UB quantization mode {mode!r} (expected 'none' or 'fp8')")
    return v


# --------------------------------------------------------------------------- snapshot
@dataclasses.dataclass(frozen=True)
class UbBufferState:
    """The query results of one UB communicator ``(name, mode)``.

    Fields: ``name`` (e.g. ``"qkv_fprop"``), ``mode`` (``"none"``/``"fp8"``, TE's
    ``UserBufferQuantizationMode`` value), and the communicator's ``is_fp8_ubuf``,
    ``with_cublasmp``, ``is_atomic_gemm``, ``is_p2p_overlap`` (bools) and ``tp_size`` (int)
    — each ``None`` when the communicator lacks that method.
    """

    name: str
    mode: str
    is_fp8_ubuf: bool | None = None
    with_cublasmp: bool | None = None
    is_atomic_gemm: bool | None = None
    is_p2p_overlap: bool | None = None
    tp_size: int | None = None

    def method_value(self, method: str) -> Any:
        """Result of ``communicator.<method>()`` (one of :data:`UB_PREDICATE_METHODS`).

        Raises:
            UbConfigError: unknown method, or the communicator did not expose it.
        """
        field = {"get_tp_size": "tp_size"}.get(method, method)
        if method not in UB_PREDICATE_METHODS:
            raise UbConfigError(f"UB communicator query {method!r} is not one te_passes folds "
                                f"(known: {list(UB_PREDICATE_METHODS)})")
        value = getattr(self, field)
        if value is None:
            raise UbConfigError(f"UB buffer {self.name!r} (mode {self.mode}) has no recorded "
                                f"{method}() result in the snapshot")
        return value

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class UbSnapshot:
    """TE's Userbuffers registry as data, taken at one instant.

    Fields:
        initialized: ``is_ub_initialized()`` (``module/base.py`` ``_ub_initialized``).
        with_cublasmp: ``_ub_with_cublasmp`` (``using_cublasmp_backend()`` is
            ``initialized and with_cublasmp``).
        buffers: one :class:`UbBufferState` per ``(name, mode)`` key of ``_ub_communicators``,
            sorted by ``(name, mode)``.
        source: where it came from (``"live"``, ``"dict"``, ``"file:<path>"``, ``"absent"`` when
            TE is not loaded) — informational, not part of :meth:`fingerprint`.
    """

    initialized: bool = False
    with_cublasmp: bool = False
    buffers: tuple[UbBufferState, ...] = ()
    source: str = "live"

    # ---------------------------------------------------------------- building
    @classmethod
    def capture(cls) -> "UbSnapshot":
        """Read TE's live UB registry (``transformer_engine.pytorch.module.base``).

        Does not import TE: when TE is not loaded in this process no UB can be initialised and
        an empty, uninitialised snapshot (``source="absent"``) is returned. Each communicator's
        :data:`UB_PREDICATE_METHODS` are called once (cheap host calls).

        Raises:
            UbConfigError: a registry key is not ``(str, UserBufferQuantizationMode)``.
        """
        base = sys.modules.get(TE_UB_MODULE)
        if base is None:
            return cls(source="absent")
        comms = getattr(base, "_ub_communicators", None) or {}
        bufs = []
        for key, comm in comms.items():
            if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str)):
                raise UbConfigError(f"unexpected key {key!r} in {TE_UB_MODULE}._ub_communicators "
                                    "(expected (name, UserBufferQuantizationMode))")
            vals: dict[str, Any] = {}
            for m in UB_PREDICATE_METHODS:
                fn = getattr(comm, m, None)
                v = fn() if callable(fn) else None
                field = {"get_tp_size": "tp_size"}.get(m, m)
                vals[field] = (int(v) if field == "tp_size" else bool(v)) if v is not None else None
            bufs.append(UbBufferState(key[0], _mode_value(key[1]), **vals))
        bufs.sort(key=lambda b: (b.name, b.mode))
        return cls(initialized=bool(getattr(base, "_ub_initialized", False)),
                   with_cublasmp=bool(getattr(base, "_ub_with_cublasmp", False)),
                   buffers=tuple(bufs), source="live")

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, source: str = "dict") -> "UbSnapshot":
        """Build from :meth:`to_json` output.

        Raises:
            UbConfigError: missing/unknown keys or wrongly typed values (message names them).
        """
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
                mode = _mode_value(b["mode"])
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

        Raises:
            UbConfigError: unreadable file, bad JSON or bad content (the message names the path).
            TypeError: ``obj`` is none of those.
        """
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

    # ---------------------------------------------------------------- output
    def to_json(self) -> dict[str, Any]:
        """``{"initialized", "with_cublasmp", "buffers": [...], "fingerprint"}`` (JSON types)."""
        return {"initialized": self.initialized, "with_cublasmp": self.with_cublasmp,
                "buffers": [b.to_json() for b in self.buffers], "fingerprint": self.fingerprint()}

    def save(self, path: str | os.PathLike) -> None:
        """Write :meth:`to_json` to ``path`` (for offline replay with ``te_passes.ub_snapshot``)."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=2, sort_keys=True)

    def fingerprint(self) -> str:
        """sha256 (hex, 64 chars) of the state that queries can observe; ``source`` excluded.

        Equal snapshots — same buffers, modes and query results — have equal fingerprints in
        every process.
        """
        payload = {"initialized": self.initialized, "with_cublasmp": self.with_cublasmp,
                   "buffers": [b.to_json() for b in self.buffers]}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    # ---------------------------------------------------------------- queries
    def buffer(self, name: str, use_fp8: bool) -> UbBufferState | None:
        """The buffer TE's ``get_ub(name, use_fp8)`` would return, or ``None``."""
        mode = _mode(bool(use_fp8))
        for b in self.buffers:
            if b.name == name and b.mode == mode:
                return b
        return None

    def names(self) -> list[str]:
        """``"name[mode]"`` of every buffer (for messages)."""
        return [f"{b.name}[{b.mode}]" for b in self.buffers]

    def get_ub(self, name: str, use_fp8: bool) -> UbBufferState:
        """Mirror of TE's ``get_ub(name, use_fp8)`` (``module/base.py``) on the snapshot.

        Raises:
            UbConfigError: UB not initialised (TE: ``RuntimeError``) or no such buffer
                (TE: ``KeyError``); the message lists the registered buffers.
        """
        if not self.initialized:
            raise UbConfigError(f"get_ub({name!r}, use_fp8={bool(use_fp8)}): UB is not initialised "
                                "(initialize_ub() was not called) in the UB state compiled against")
        b = self.buffer(name, use_fp8)
        if b is None:
            raise UbConfigError(f"get_ub({name!r}, use_fp8={bool(use_fp8)}): no UB buffer "
                                f"({name!r}, {_mode(bool(use_fp8))}) is registered; registered: {self.names()}")
        return b

    def query(self, api: str, args: tuple = ()) -> Any:
        """Evaluate one UB query on the snapshot, exactly as TE 2.20.2 would live.

        ``api`` is ``"get_ub_is_fp8"`` (args ``(name, use_fp8)``), ``"is_ub_initialized"``,
        ``"using_cublasmp_backend"`` (no args), or ``"get_ub.<method>"`` with ``<method>`` in
        :data:`UB_PREDICATE_METHODS` (args ``(name, use_fp8)``).

        Raises:
            UbConfigError: unknown api, wrong arguments, or TE would raise for this state.
        """
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


# --------------------------------------------------------------------------- TE op rules
@dataclasses.dataclass(frozen=True)
class UbBufferUse:
    """One communicator fetch a TE op will make: ``get_ub(buffer, use_fp8)``.

    ``phase`` is ``"fprop"``/``"dgrad"``/``"wgrad"``; ``overlap`` the overlap kind (``"AG"``,
    ``"RS"``, ``"bulk AG"``, ``"bulk RS"``, ``"AG (MXFP8 wgrad)"``); ``flag`` the config flag that
    requires it; ``source`` the TE code it mirrors.
    """

    buffer: str
    use_fp8: bool
    phase: str
    overlap: str
    flag: str
    source: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _is_mxfp8_quantizer(q: Any) -> bool:
    return q is not None and any(k.__name__ == "MXFP8Quantizer" for k in type(q).__mro__)


def _backward_flags_from_forward(cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    """``LinearBwdArgs`` UB fields as ``_linear_setup_backward`` derives them, or ``None`` when
    no backward op will run (grad disabled / nothing requires grad)."""
    if not cfg.get("is_grad_enabled", True):
        return None
    if not any(cfg.get(k, False) for k in ("input_requires_grad", "weight_requires_grad", "bias_requires_grad")):
        return None
    override = cfg.get("backward_override") is not None
    return {
        "ub_name": cfg.get("ub_name"),
        "ub_overlap_ag": bool(cfg.get("ub_overlap_ag_dgrad")) and not override,
        "ub_overlap_rs_dgrad": bool(cfg.get("ub_overlap_rs_dgrad")) and not override,
        "ub_bulk_dgrad": bool(cfg.get("ub_bulk_dgrad")) and not override,
        "ub_bulk_wgrad": bool(cfg.get("ub_bulk_wgrad")) and not override,
        "fp8": bool(cfg.get("fp8")) and not override,
        "requires_dgrad": bool(cfg.get("input_requires_grad", True)),
        "requires_wgrad": bool(cfg.get("weight_requires_grad", True)),
        "grad_output_quantizer": None if override else cfg.get("grad_output_quantizer"),
        "grad_input_quantizer": None if override else cfg.get("grad_input_quantizer"),
    }


def _backward_uses(bwd: Mapping[str, Any], snapshot: UbSnapshot | None) -> list[UbBufferUse]:
    name, fp8 = bwd.get("ub_name"), bool(bwd.get("fp8"))
    out: list[UbBufferUse] = []
    if not name:
        return out
    src = LINEAR_SOURCE_BWD
    if bwd.get("ub_overlap_ag"):
        out.append(UbBufferUse(f"{name}_dgrad", fp8, "dgrad", "AG", "ub_overlap_ag_dgrad", src))
        # MXFP8 grad_output cannot reuse the row-scaled gathered tensor for wgrad: TE gathers
        # it again through the *_wgrad communicator unless the dgrad buffer uses cuBLASMp.
        if bwd.get("requires_wgrad") and _is_mxfp8_quantizer(bwd.get("grad_output_quantizer")):
            dg = snapshot.buffer(f"{name}_dgrad", fp8) if snapshot is not None else None
            if dg is None or not dg.with_cublasmp:
                out.append(UbBufferUse(f"{name}_wgrad", fp8, "wgrad", "AG (MXFP8 wgrad)",
                                       "ub_overlap_ag_dgrad", src))
    elif bwd.get("ub_overlap_rs_dgrad"):
        out.append(UbBufferUse(f"{name}_dgrad", fp8, "dgrad", "RS", "ub_overlap_rs_dgrad", src))
    else:
        if bwd.get("ub_bulk_dgrad"):
            out.append(UbBufferUse(f"{name}_dgrad", fp8, "dgrad", "bulk AG", "ub_bulk_dgrad", src))
        if bwd.get("ub_bulk_wgrad"):
            out.append(UbBufferUse(f"{name}_wgrad", fp8, "wgrad", "bulk RS", "ub_bulk_wgrad", src))
    return out


def linear_ub_buffer_uses(op: str, config: Mapping[str, Any],
                          snapshot: UbSnapshot | None = None) -> list[UbBufferUse]:
    """Every ``get_ub(...)`` a ``te.Linear`` op makes for its config bundle, in TE's order.

    Mirrors TE 2.20.2 ``module/linear.py``:

    * forward (``op="linear"``, ``LinearFwdArgs``): ``ub_overlap_rs_fprop`` ->
      ``{ub_name}_fprop`` (RS), else ``ub_overlap_ag_fprop`` -> ``{ub_name}_fprop`` (AG), mode
      ``FP8 if fp8 else NONE``; plus the backward's fetches derived from the forward flags
      (``_linear_setup_backward``: bwd ``ub_overlap_ag`` = fwd ``ub_overlap_ag_dgrad``, all off
      when ``backward_override`` is set) when a backward will run;
    * backward (``op="linear_backward"``, ``LinearBwdArgs``): ``ub_overlap_ag`` ->
      ``_dgrad`` (AG), elif ``ub_overlap_rs_dgrad`` -> ``_dgrad`` (RS), else ``ub_bulk_dgrad`` ->
      ``_dgrad`` (bulk AG) and ``ub_bulk_wgrad`` -> ``_wgrad`` (bulk RS); with ``ub_overlap_ag``,
      an MXFP8 ``grad_output_quantizer`` and ``requires_wgrad``, also ``_wgrad`` unless the dgrad
      communicator uses cuBLASMp (needs ``snapshot``; assumed not without one).

    ``op`` may carry a ``_base`` suffix. Returns ``[]`` when no UB flag is set.

    Raises:
        ValueError: ``op`` is not a linear op.
    """
    kind = op.removesuffix("_base")
    if kind not in ("linear", "linear_backward"):
        raise ValueError(f"no UB buffer-use rules for TE op {op!r} (known: linear, linear_backward)")
    if kind == "linear_backward":
        return _backward_uses(config, snapshot)
    name, fp8 = config.get("ub_name"), bool(config.get("fp8"))
    out: list[UbBufferUse] = []
    if name:
        if config.get("ub_overlap_rs_fprop"):
            out.append(UbBufferUse(f"{name}_fprop", fp8, "fprop", "RS", "ub_overlap_rs_fprop", LINEAR_SOURCE_FWD))
        elif config.get("ub_overlap_ag_fprop"):
            out.append(UbBufferUse(f"{name}_fprop", fp8, "fprop", "AG", "ub_overlap_ag_fprop", LINEAR_SOURCE_FWD))
    bwd = _backward_flags_from_forward(config)
    if bwd is not None:
        out.extend(_backward_uses(bwd, snapshot))
    return out


#: Config flags that name Userbuffers overlap, per op kind (``LinearFwdArgs`` / ``LinearBwdArgs``).
UB_FLAGS = {
    "linear": ("ub_overlap_ag_fprop", "ub_overlap_rs_fprop", "ub_overlap_ag_dgrad",
               "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad"),
    "linear_backward": ("ub_overlap_ag", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad"),
}


def ub_flags_set(op: str, config: Mapping[str, Any]) -> list[str]:
    """The UB overlap flags set (truthy) in a TE op config, in declaration order."""
    return [k for k in UB_FLAGS.get(op.removesuffix("_base"), ()) if config.get(k)]


@dataclasses.dataclass
class UbCheckResult:
    """Outcome of :func:`check_linear_ub_config`: the buffer ``uses`` with the snapshot's
    answers (``found``: ``{buffer: UbBufferState | None}``) and the ``problems`` (messages)."""

    ub_name: str | None
    uses: list[UbBufferUse]
    found: dict[str, UbBufferState | None]
    problems: list[tuple[str, str]]  # (buffer or "", message)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_linear_ub_config(op: str, config: Mapping[str, Any], snapshot: UbSnapshot) -> UbCheckResult:
    """Check a ``te.Linear`` op's UB configuration against a UB snapshot.

    Checks, each mirroring TE 2.20.2 code that would otherwise fail (or silently misbehave)
    at run time:

    1. a UB flag is set but ``ub_name`` is ``None`` (``Linear.__init__`` asserts this);
    2. UB is not initialised (``get_ub`` raises ``RuntimeError``);
    3. each buffer of :func:`linear_ub_buffer_uses` is registered in its mode (``get_ub``
       raises ``KeyError``);
    4. the buffer's ``tp_size`` equals the op's ``tp_size`` (when both are known);
    5. fp8 agreement: an FP8 RS ``_fprop`` buffer (``is_fp8_ubuf()``) requires ``fp8_output`` and
       an ``output_quantizer`` (``Linear.forward`` forces ``fp8_output=True`` from
       ``get_ub_is_fp8(ub_name + "_fprop", ...)``); an FP8 RS ``_dgrad`` buffer requires a
       ``grad_input_quantizer`` when dgrad is computed (``fp8_grad=True`` likewise);
    6. bulk overlaps with the cuBLASMp backend (``initialize_ub`` rejects bulk methods and
       ``Linear.__init__`` turns them into ``ub_overlap_rs_dgrad`` when cuBLASMp is active).

    Returns:
        :class:`UbCheckResult`; ``problems`` empty when the config is consistent.
    """
    kind = op.removesuffix("_base")
    flags = ub_flags_set(kind, config)
    name = config.get("ub_name")
    uses = linear_ub_buffer_uses(kind, config, snapshot) if flags else []
    found: dict[str, UbBufferState | None] = {}
    problems: list[tuple[str, str]] = []
    if not flags:
        return UbCheckResult(name, uses, found, problems)
    who = f"TE {kind} op with ub_name={name!r}"
    if not name:
        problems.append(("", f"{who}: UB overlap flags {flags} are set but ub_name is None"))
        return UbCheckResult(name, uses, found, problems)
    if not snapshot.initialized:
        problems.append(("", f"{who} uses UB overlap ({', '.join(flags)}) but UB is not initialised "
                             "in the UB state compiled against (call initialize_ub() before compiling)"))
        return UbCheckResult(name, uses, found, problems)
    tp_size = config.get("tp_size")
    for use in uses:
        b = snapshot.buffer(use.buffer, use.use_fp8)
        found[f"{use.buffer}[{_mode(use.use_fp8)}]"] = b
        if b is None:
            problems.append((use.buffer, (
                f"{who}: {use.flag} needs UB buffer {use.buffer!r} in mode {_mode(use.use_fp8)!r} "
                f"({use.phase} {use.overlap}) but it is not registered; registered: {snapshot.names()}")))
            continue
        if isinstance(tp_size, int) and b.tp_size is not None and b.tp_size != tp_size:
            problems.append((use.buffer, (
                f"{who}: UB buffer {use.buffer!r} was initialised for tp_size={b.tp_size} but the "
                f"op runs with tp_size={tp_size}")))
    if snapshot.with_cublasmp:
        bulk = [f for f in flags if f.startswith("ub_bulk_")]
        if bulk:
            problems.append((f"{name}_dgrad" if "ub_bulk_dgrad" in bulk else f"{name}_wgrad", (
                f"{who}: {bulk} set but UB uses the cuBLASMp backend, which has no bulk overlap "
                "(the module was built before UB was re-initialised with with_cublasmp=True; rebuild it)")))
    fp8 = bool(config.get("fp8"))
    if fp8 and kind == "linear" and config.get("ub_overlap_rs_fprop"):
        b = snapshot.buffer(f"{name}_fprop", True)
        if b is not None and b.is_fp8_ubuf and not (config.get("fp8_output") and config.get("output_quantizer") is not None):
            problems.append((f"{name}_fprop", (
                f"{who}: UB buffer {name + '_fprop'!r} is an FP8 reduce-scatter buffer (is_fp8_ubuf()=True), "
                f"so TE's Linear.forward sets fp8_output=True, but the op was traced with "
                f"fp8_output={config.get('fp8_output')!r} and output_quantizer="
                f"{'set' if config.get('output_quantizer') is not None else 'None'} (traced against another UB state)")))
    rs_dgrad = config.get("ub_overlap_rs_dgrad") and not config.get("ub_overlap_ag" if kind == "linear_backward" else "ub_overlap_ag_dgrad")
    needs_dgrad = (config.get("requires_dgrad", True) if kind == "linear_backward"
                   else (config.get("is_grad_enabled", True) and config.get("input_requires_grad", True)
                         and config.get("backward_override") is None))
    if fp8 and rs_dgrad and needs_dgrad:
        b = snapshot.buffer(f"{name}_dgrad", True)
        if b is not None and b.is_fp8_ubuf and config.get("grad_input_quantizer") is None:
            problems.append((f"{name}_dgrad", (
                f"{who}: UB buffer {name + '_dgrad'!r} is an FP8 reduce-scatter buffer (is_fp8_ubuf()=True), "
                "so TE's Linear.forward sets fp8_grad=True, but the op has no grad_input_quantizer "
                "(traced against another UB state)")))
    return UbCheckResult(name, uses, found, problems)


# --------------------------------------------------------------------------- FX query nodes
def _unwrap(fn: Any) -> Any:
    seen = 0
    while seen < 4:
        inner = getattr(fn, "__te_passes_original__", None)
        if inner is None:
            break
        fn, seen = inner, seen + 1
    return fn


def ub_query_function(target: Any) -> str | None:
    """Which UB function an FX ``call_function`` target is, or ``None``.

    Returns ``"get_ub_is_fp8"``, ``"is_ub_initialized"``, ``"using_cublasmp_backend"``,
    ``"get_ub"`` (TE 2.20.2 ``module/base.py`` functions, also when rebound by te_passes' hooks)
    or ``"ub_query"`` (:func:`te_passes.runtime.ub_guard.ub_query`).
    """
    fn = _unwrap(target)
    mod, name = getattr(fn, "__module__", None), getattr(fn, "__name__", None)
    if mod == TE_UB_MODULE and name in (*UB_QUERY_FUNCTIONS, "get_ub"):
        return name
    if mod == "te_passes.runtime.ub_guard" and name == "ub_query":
        return "ub_query"
    return None
