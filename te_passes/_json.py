"""JSON helpers shared by the options, the reports and the pass records (bottom layer: imports
nothing from te_passes)."""

from __future__ import annotations

import enum
from typing import Any


def jsonable(value: Any) -> Any:
    """Map ``value`` onto JSON types: containers recursively, enums by value, others by repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return jsonable(value.value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    return repr(value)


#: Limits of a JSON file read back from a dump (:func:`read_json_file`): nesting depth, values
#: in all, digits of an integer, bytes of the file. te_passes' own files stay far below.
JSON_BUDGET = {"depth": 64, "items": 5_000_000, "digits": 100, "bytes": 256 * 2**20}


class JsonBudgetError(ValueError):
    """A JSON file is over :data:`JSON_BUDGET` or not JSON at all (the message says which)."""


def read_json_file(path: str) -> Any:
    """``json.load`` of ``path`` within :data:`JSON_BUDGET`, checked before anything walks the result recursively.

    Raises:
        OSError: ``path`` cannot be read. UnicodeDecodeError: it is not UTF-8.
        json.JSONDecodeError: it is not valid JSON.
        JsonBudgetError: over the budget (the message says which limit).
    """
    import json
    import os

    b = JSON_BUDGET
    if os.path.getsize(path) > b["bytes"]:
        raise JsonBudgetError(f"larger than {b['bytes'] >> 20} MiB")
    with open(path, encoding="utf-8") as f:
        text = f.read()

    def parse_int(digits: str) -> int:
        if len(digits.lstrip("-")) > b["digits"]:
            raise JsonBudgetError(f"an integer of more than {b['digits']} digits")
        return int(digits)

    try:
        data = json.loads(text, parse_int=parse_int)
    except RecursionError:
        raise JsonBudgetError(f"nested more than {b['depth']} levels deep") from None
    stack, items = [(data, 0)], 0
    while stack:  # JSON has no shared references: a plain walk counts each value once
        v, depth = stack.pop()
        items += 1
        if items > b["items"]:
            raise JsonBudgetError(f"more than {b['items']} values")
        if isinstance(v, (dict, list)):
            if depth >= b["depth"]:
                raise JsonBudgetError(f"nested more than {b['depth']} levels deep")
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return data


def read_json_or_none(path: str) -> Any:
    """:func:`read_json_file`, or ``None`` when ``path`` is unreadable, not UTF-8 JSON or over the budget."""
    try:
        return read_json_file(path)
    except (OSError, UnicodeDecodeError, ValueError):  # JSONDecodeError and JsonBudgetError are ValueErrors
        return None
