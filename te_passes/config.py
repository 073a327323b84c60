"""te_passes options: the ``te_passes.*`` keys of ``torch.compile(..., options=...)`` parsed into
:class:`TePassesOptions` (other keys are Inductor's); ``TE_PASSES_*`` environment variables fill in
options not given (``TE_PASSES_DISABLE`` adds to ``te_passes.disable``). docs/usage.md "Options".
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping

from te_passes._json import jsonable

PREFIX = "te_passes."


class TePassesOptionError(ValueError):
    """A ``te_passes.*`` option key or value is invalid; the message names it and the valid ones."""


def _as_name_list(key: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [v for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple, set, frozenset)) or not all(isinstance(v, str) for v in value):
        raise TePassesOptionError(f"option {PREFIX}{key} must be a list of pass names, got {value!r}")
    return tuple(v.strip() for v in value)


def _as_bool(key: str, value: Any) -> bool:
    """``True``/``False`` only: ``"false"`` or ``0`` are refused, never guessed."""
    if isinstance(value, bool):
        return value
    raise TePassesOptionError(f"option {PREFIX}{key} must be a bool (True or False), got {value!r} "
                              f"({type(value).__name__})")


#: Environment spellings of a bool option (``TE_PASSES_STRICT=1``); anything else is refused.
ENV_BOOLS = {**dict.fromkeys(("1", "true", "yes", "on"), True), **dict.fromkeys(("0", "false", "no", "off"), False)}


def _env_bool(key: str, text: str) -> bool:
    try:
        return ENV_BOOLS[text.strip().lower()]
    except KeyError:
        raise TePassesOptionError(f"option {PREFIX}{key} must be a bool (one of {', '.join(ENV_BOOLS)}), "
                                  f"got {text!r}") from None


def _as_opt_path(key: str, value: Any) -> str | None:
    if value is None:
        return None
    path = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if isinstance(path, str) and path.strip():
        return path
    raise TePassesOptionError(f"option {PREFIX}{key} must be a non-empty path (str or os.PathLike) or None, "
                              f"got {value!r}")


def _as_pass_config(key: str, value: Any) -> dict[str, dict[str, Any]]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, dict) for k, v in value.items()):
        raise TePassesOptionError(f"option {PREFIX}{key} must be a dict {{pass name: {{parameter: value}}}}, "
                                  f"got {value!r}")
    return {k: dict(v) for k, v in value.items()}


def _as_choice(*choices: str) -> Callable[[str, Any], str]:
    def conv(key: str, value: Any) -> str:
        if value not in choices:
            raise TePassesOptionError(f"option {PREFIX}{key} must be one of {list(choices)}, got {value!r}")
        return value
    return conv


@dataclasses.dataclass(frozen=True)
class _Spec:
    convert: Callable[[str, Any], Any]
    env: str | None = None


#: Every valid ``te_passes.*`` key (without the prefix): its converter and environment variable. Each is a
#: field of :class:`TePassesOptions` and a row of docs/usage.md "Options".
OPTION_SPECS: dict[str, _Spec] = {
    "disable": _Spec(_as_name_list, "TE_PASSES_DISABLE"),  # pass names to skip
    "strict": _Spec(_as_bool, "TE_PASSES_STRICT"),  # raise instead of warn when a pass or a check fails
    "dump_dir": _Spec(_as_opt_path, "TE_PASSES_DUMP_DIR"),  # per-pass graphs, diffs and report.json
    "ub_snapshot": _Spec(lambda _key, value: value),  # UB state to fold against: UbSnapshot, dict or JSON path
    "ub_on_change": _Spec(_as_choice("recompile", "error")),  # what a UB-dependent graph does on a UB change
    "pass_config": _Spec(_as_pass_config),  # per-pass constructor arguments
    "cudagraphs": _Spec(_as_choice("lean", "trees"), "TE_PASSES_CUDAGRAPHS"),  # reduce-overhead replay
    "untouched": _Spec(_as_bool, "TE_PASSES_UNTOUCHED"),  # trace TE's disabled forwards through the polyfills
}


#: ``te_passes.*`` keys that are refused with a reason (not options a backend can honour).
REFUSED_OPTIONS: dict[str, str] = {
    "compile_friendly": "te_passes.compile_friendly is a model rewrite, not a backend option: a backend only "
                        "sees FX graphs traced after TE's eager islands were cut. Call "
                        "te_passes.compile_friendly(model) on the model before torch.compile",
    "guards": "te_passes.guards is not a backend option: Dynamo evaluates guards before a backend runs, so "
              "te_inductor cannot honour it. Pass it to te_passes.compile_step(..., options={'te_passes.guards': "
              "...}), or use torch.compile's guard_filter_fn / torch.compiler.set_stance(skip_guard_eval_unsafe=True) "
              "yourself",
}

#: ``te_passes.guards`` values (``te_passes.compile_step`` only): ``"all"`` (Dynamo evaluates every guard
#: on every call, the default) and ``"skip_unsafe"`` (``set_stance(skip_guard_eval_unsafe=True)`` around
#: calls whose argument signature was seen: a changed shape recompiles, a changed global state does not).
GUARD_MODES: tuple[str, ...] = ("all", "skip_unsafe")


def parse_guards_option(value: Any) -> str:
    """``te_passes.guards`` checked. Raises ``TePassesOptionError``: not one of :data:`GUARD_MODES`."""
    return _as_choice(*GUARD_MODES)("guards", value)


@dataclasses.dataclass(frozen=True)
class TePassesOptions:
    """Parsed ``te_passes.*`` options (defaults shown). Immutable; build with :meth:`parse`."""

    disable: tuple[str, ...] = ()
    strict: bool = False
    dump_dir: str | None = None
    ub_snapshot: Any = None
    ub_on_change: str = "recompile"
    pass_config: Any = None
    cudagraphs: str = "trees"
    untouched: bool = True
    #: The options whose value came from a ``TE_PASSES_*`` environment variable (not hashed).
    from_env: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, options: Mapping[str, Any] | None, *, known_passes: set[str] | None = None,
              environ: Mapping[str, str] | None = None) -> tuple["TePassesOptions", dict[str, Any]]:
        """``(TePassesOptions, inductor_options)`` from ``torch.compile``'s ``options`` and ``environ``
        (default ``os.environ``); ``known_passes``: the valid ``disable`` names. Raises
        ``TePassesOptionError``: an unknown ``te_passes.*`` key, a bad value, an unknown pass name."""
        environ = os.environ if environ is None else environ
        ours: dict[str, Any] = {}
        inductor: dict[str, Any] = {}
        for key, value in (options or {}).items():
            if not isinstance(key, str) or not key.startswith(PREFIX):
                inductor[key] = value
                continue
            short = key[len(PREFIX):]
            if short in REFUSED_OPTIONS:
                raise TePassesOptionError(REFUSED_OPTIONS[short])
            spec = OPTION_SPECS.get(short)
            if spec is None:
                valid = ", ".join(PREFIX + k for k in OPTION_SPECS)
                raise TePassesOptionError(f"unknown te_inductor option {key!r}; valid te_passes options: {valid}")
            ours[short] = spec.convert(short, value)
        from_env: dict[str, tuple[str, ...]] = {}
        for short, spec in OPTION_SPECS.items():
            if not (spec.env and environ.get(spec.env)):
                continue
            try:
                value = _env_bool(short, environ[spec.env]) if spec.convert is _as_bool else \
                    spec.convert(short, environ[spec.env])
            except TePassesOptionError as e:
                raise TePassesOptionError(f"environment variable {spec.env}={environ[spec.env]!r}: {e}") from None
            if short == "disable" or short not in ours:
                from_env[short] = value
                ours[short] = tuple(ours.get(short, ())) + value if short == "disable" else value
        parsed = cls(**ours, from_env=frozenset(from_env))
        if known_passes is not None:
            unknown = [p for p in parsed.disable if p not in known_passes]
            if unknown:
                where = " / ".join(
                    [f"{PREFIX}disable"] * any(p not in from_env.get("disable", ()) for p in unknown)
                    + ["TE_PASSES_DISABLE"] * any(p in from_env.get("disable", ()) for p in unknown))
                raise TePassesOptionError(
                    f"unknown pass name(s) in {where}: {unknown}; known passes: {sorted(known_passes)}")
        return parsed, inductor

    def fingerprint_data(self) -> dict[str, Any]:
        """The options that change what passes do (the cache-key part: not dump_dir, cudagraphs)."""
        skip = ("dump_dir", "cudagraphs", "from_env")
        return jsonable({k: v for k, v in dataclasses.asdict(self).items() if k not in skip})
