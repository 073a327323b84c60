"""Pass instances from their typed configs: :func:`build_passes` validates ``te_passes.pass_config``
against each pass's :class:`~te_passes.pipeline.base.PassConfig`, in one place. The ordered pass list
is ``te_passes.passes.order``."""

from __future__ import annotations

import dataclasses
import typing

from te_passes.config import TePassesOptionError
from te_passes.pipeline.base import PassParameterError, TEPass


def build_passes(classes: typing.Sequence[type[TEPass]], pass_config: dict | None = None) -> list[TEPass]:
    """One instance of each class, in order, built with ``pass_config[name]``. Raises ``TePassesOptionError``:
    an unknown pass name or parameter (listing the pass's parameters) or a value its ``Config`` refuses."""
    pass_config = pass_config or {}
    by_name = {cls.name: cls for cls in classes}
    unknown = [n for n in pass_config if n not in by_name]
    if unknown:
        raise TePassesOptionError(f"te_passes.pass_config names unknown pass(es) {unknown}; "
                                  f"known passes: {sorted(by_name)}")
    out = []
    for name, cls in by_name.items():
        kwargs = pass_config.get(name) or {}
        valid = [f.name for f in dataclasses.fields(cls.Config)]
        bad = [k for k in kwargs if k not in valid]
        if bad:
            raise TePassesOptionError(f"te_passes.pass_config[{name!r}]: unknown parameter(s) {bad}; "
                                      f"{name} takes {valid or 'no parameters'}")
        try:
            out.append(cls(**kwargs))
        except PassParameterError as e:
            raise TePassesOptionError(f"te_passes.pass_config[{name!r}][{e.param!r}] {e.detail}") from None
        except (TypeError, ValueError) as e:
            raise TePassesOptionError(f"te_passes.pass_config[{name!r}]: {e}") from None
    return out
