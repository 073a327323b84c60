"""The globals a pickle references, read statically (tests of the ``.tegraph`` allow-list,
``te_passes.debug.graph_safety.allowed_global``)."""

from __future__ import annotations

from typing import Any


def pickle_globals(data: bytes) -> list[tuple[str, str]]:
    """Every ``(module, name)`` global a pickle references (read with :mod:`pickletools`,
    nothing is built), in first-seen order."""
    import pickletools

    out: list[tuple[str, str]] = []
    pushed: list[Any] = []  # the last values pushed (strings, or None for anything else)
    memo: dict[int, Any] = {}
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8", "SHORT_BINSTRING",
                    "BINSTRING", "STRING"):
            pushed.append(arg)
        elif name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[int(arg)] = pushed[-1] if pushed else None
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            pushed.append(memo.get(int(arg)))
        elif name in ("GLOBAL", "INST"):
            mod, gname = arg.split(" ", 1)
            out.append((mod, gname))
            pushed.append(None)
        elif name == "STACK_GLOBAL":
            if len(pushed) >= 2 and isinstance(pushed[-2], str) and isinstance(pushed[-1], str):
                out.append((pushed[-2], pushed[-1]))
            else:
                out.append(("?", "?"))  # not statically known: never allowed
            pushed.append(None)
        elif op.stack_after:
            pushed.append(None)
    return list(dict.fromkeys(out))
