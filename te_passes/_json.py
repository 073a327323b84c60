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
