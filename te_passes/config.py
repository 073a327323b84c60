"""te_passes options: the ``te_passes.*`` keys of ``torch.compile(..., options=...)`` parsed into
:class:`TePassesOptions` (other keys are Inductor's); ``TE_PASSES_*`` environment variables fill in
options not given (``TE_PASSES_DISABLE`` adds to ``te_passes.disable``). docs/usage.md "Options".
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import sys
import warnings
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
    """``True``/``False`` (or a numpy bool) only: ``"false"`` or ``0`` are refused, never guessed."""
    if isinstance(value, bool):
        return value
    np = sys.modules.get("numpy")  # a numpy bool can only come from an imported numpy
    if np is not None and isinstance(value, np.bool_):
        return bool(value)
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


def _as_ub_snapshot(key: str, value: Any) -> Any:
    """A ``UbSnapshot``, a mapping or a JSON file path (loaded and checked by ``UbSnapshot.load``);
    anything else is refused here, naming the key once."""
    if isinstance(value, (str, os.PathLike, Mapping)) or _looks_like_ub_snapshot(value):
        return value
    raise TePassesOptionError(f"option {PREFIX}{key} must be a UbSnapshot, a dict or a JSON file path, "
                              f"got {value!r} ({type(value).__name__})")


def _looks_like_ub_snapshot(value: Any) -> bool:
    # config sits below te_passes.te (import layers): te.ub.UbSnapshot by name and module
    cls = type(value)
    return cls.__name__ == "UbSnapshot" and cls.__module__ == "te_passes.te.ub"


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
    "ub_snapshot": _Spec(_as_ub_snapshot),  # UB state to fold against: UbSnapshot, dict or JSON path
    "ub_on_change": _Spec(_as_choice("recompile", "error")),  # what a UB-dependent graph does on a UB change
    "pass_config": _Spec(_as_pass_config),  # per-pass constructor arguments
    "cudagraphs": _Spec(_as_choice("lean", "trees"), "TE_PASSES_CUDAGRAPHS"),  # reduce-overhead replay
    "untouched": _Spec(_as_bool, "TE_PASSES_UNTOUCHED"),  # trace TE's disabled forwards through the polyfills
    "untouched_norm": _Spec(_as_choice("te", "torch"), "TE_PASSES_UNTOUCHED_NORM"),  # the polyfills' norm / act
    "fused_attn": _Spec(_as_bool, "TE_PASSES_FUSED_ATTN"),  # TE's fused attention as one op in untouched graphs
}


#: ``TE_PASSES_*`` environment variables without a ``te_passes.*`` option: read elsewhere (runtime, tests,
#: tools). Any other ``TE_PASSES_*`` name is warned about once (:func:`check_environment`).
OTHER_ENV_VARS: dict[str, str] = {
    "TE_PASSES_VENV": "the venv make setup builds",
    "TE_PASSES_COMMIT": "the commit GPU runs record",
    "TE_PASSES_GPU_OUT": "where GPU tests write graphs",
    "TE_PASSES_PROPERTY_EXAMPLES": "hypothesis examples of the property tests",
}


def known_env_vars() -> list[str]:
    """Every ``TE_PASSES_*`` environment variable te_passes reads."""
    return sorted({s.env for s in OPTION_SPECS.values() if s.env} | set(OTHER_ENV_VARS))


def env_option(key: str, environ: Mapping[str, str] | None = None) -> Any:
    """Option ``key``'s value from its ``TE_PASSES_*`` alias in ``environ`` (default ``os.environ``), converted
    as :meth:`TePassesOptions.parse` does (``disable``: a tuple of names); ``None`` when unset or empty.

    Raises:
        TePassesOptionError: ``key`` has no environment alias, or the variable's value is invalid.
    """
    spec = OPTION_SPECS.get(key)
    if spec is None or spec.env is None:
        raise TePassesOptionError(f"option {PREFIX}{key} has no environment variable")
    text = (os.environ if environ is None else environ).get(spec.env)
    if not text:
        return None
    try:
        return _env_bool(key, text) if spec.convert is _as_bool else spec.convert(key, text)
    except TePassesOptionError as e:
        raise TePassesOptionError(f"environment variable {spec.env}={text!r}: {e}") from None


def env_aliases(*keys: str) -> dict[str, str]:
    """``{variable: value}`` of the ``TE_PASSES_*`` aliases of options ``keys`` set (non-empty) in ``os.environ``:
    the environment to parse with when only those apply (``te-passes replay``: ``TE_PASSES_DISABLE`` only).
    Raises ``KeyError``: an unknown option key."""
    names = {OPTION_SPECS[k].env for k in keys}
    return {n: os.environ[n] for n in sorted(n for n in names if n) if os.environ.get(n)}


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Warn about any unknown ``TE_PASSES_*`` name of ``environ`` (default ``os.environ``): a ``RuntimeWarning``
    naming the closest valid name, once per name and process (the values of known ones are checked by
    :meth:`TePassesOptions.parse`)."""
    environ = os.environ if environ is None else environ
    known = known_env_vars()
    for name in sorted(k for k in environ if k.startswith("TE_PASSES_") and k not in known):
        _warn_unknown_env(name, tuple(known))


@functools.cache  # once per name and process
def _warn_unknown_env(name: str, known: tuple[str, ...]) -> None:
    n = len("TE_PASSES_")  # compared without the shared prefix (else every name is "close")
    close = difflib.get_close_matches(name[n:], [k[n:] for k in known], n=1)
    hint = f"did you mean TE_PASSES_{close[0]}?" if close else f"te_passes reads {', '.join(known)}"
    warnings.warn(f"te_passes: unknown environment variable {name} is ignored; {hint}", RuntimeWarning, stacklevel=4)


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
    untouched_norm: str = "te"
    fused_attn: bool = True
    #: The options whose value came from a ``TE_PASSES_*`` environment variable (not hashed).
    from_env: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, options: Mapping[str, Any] | None, *, known_passes: set[str] | None = None,
              environ: Mapping[str, str] | None = None) -> tuple["TePassesOptions", dict[str, Any]]:
        """``(TePassesOptions, inductor_options)`` from ``torch.compile``'s ``options`` and ``environ``
        (default ``os.environ``); ``known_passes``: the valid ``disable`` names. Raises
        ``TePassesOptionError``: ``options`` not a mapping, a key that is not a string, an unknown ``te_passes.*``
        key, a bad value, an unknown pass name, a bad ``TE_PASSES_*`` value (:func:`check_environment`, which also warns
        about unknown ``TE_PASSES_*`` names)."""
        environ = os.environ if environ is None else environ
        if options is not None and not isinstance(options, Mapping):
            raise TePassesOptionError(f"options must be a dict {{option name: value}} (e.g. "
                                      f"{{'{PREFIX}strict': True}}), got {type(options).__name__}: {options!r}")
        check_environment(environ)
        ours: dict[str, Any] = {}
        inductor: dict[str, Any] = {}
        for key, value in (options or {}).items():
            if not isinstance(key, str):
                raise TePassesOptionError(f"option names are strings ('{PREFIX}strict', 'triton.cudagraphs', ...); "
                                          f"got {key!r} ({type(key).__name__})")
            if not key.startswith(PREFIX):
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
        for short in (k for k, spec in OPTION_SPECS.items() if spec.env):
            value = env_option(short, environ)
            if value is None:
                continue
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


# --------------------------------------------------------------------------- errors reach the caller unwrapped
@functools.cache
def _shortened(cls: type) -> type:
    """``cls`` with ``torch._dynamo.exc.ShortenTraceback`` as a second base (Dynamo re-raises those unwrapped)."""
    from torch._dynamo.exc import ShortenTraceback

    def __init__(self, *args: Any) -> None:  # noqa: N807 - ShortenTraceback's frame argument
        Exception.__init__(self, *args)
        self.first_useful_frame = None
        self.te_passes_message = cls.__str__(self)

    def __str__(self) -> str:  # noqa: N807 - te_passes' one line, not the args Dynamo appends its hints to
        return self.te_passes_message

    return type(cls.__name__, (cls, ShortenTraceback), {"__init__": __init__, "__str__": __str__,
                                                        "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                                        "__doc__": cls.__doc__})


def unwrapped(e: BaseException) -> BaseException:
    """``e`` as an instance of a subclass of its own class that is also a ``torch._dynamo.exc.ShortenTraceback``
    (same name, message, attributes and cause). Dynamo re-raises a ``ShortenTraceback`` raised in a backend or
    while it traces as it is (torch 2.14 ``_dynamo/convert_frame.py`` ``_compile``, ``output_graph.py``
    ``call_user_compiler``), instead of wrapping it in ``BackendCompilerFailed`` /
    ``InternalTorchDynamoError``: ``except TePassesOptionError`` then catches it at the compiled call. Its
    ``str()`` stays te_passes' message: Dynamo appends its "from user code" stack and "report to PyTorch"
    hint to ``args[0]`` (``torch._dynamo.exc.augment_exc_message``), which are about Dynamo, not this error."""
    from torch._dynamo.exc import ShortenTraceback

    if isinstance(e, ShortenTraceback):
        return e
    new = _shortened(type(e))(*e.args)
    new.__cause__ = e.__cause__
    new.__dict__.update({k: v for k, v in vars(e).items() if k not in ("first_useful_frame", "te_passes_message")})
    return new
