"""Graph diffs for pass dumps: a unified text diff plus structured, field-level changes.

See docs/internals.md#te_passesdebugdiffpy."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import torch.fx

from te_passes.debug.printer import format_graph, node_fields


@dataclasses.dataclass
class GraphSnapshot:
    """A graph's state at one moment: ``text`` (TE-aware printout), ``fields`` (``{node name:
    {field path: text}}`` in graph order) and ``num_nodes``."""

    text: str
    fields: dict[str, dict[str, str]]
    num_nodes: int

    @classmethod
    def take(cls, gm: torch.fx.GraphModule | torch.fx.Graph, *, notes=None) -> "GraphSnapshot":
        """Snapshot ``gm`` (never mutates it)."""
        graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
        return cls(format_graph(gm, notes=notes), {n.name: node_fields(n) for n in graph.nodes},
                   len(graph.nodes))


def unified_diff(before: str, after: str, fromfile: str = "before.py", tofile: str = "after.py",
                 context: int = 3) -> str:
    """``difflib.unified_diff`` of two printouts, as one string (``""`` when equal)."""
    lines = difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                 fromfile, tofile, n=context)
    return "".join(lines)


def graph_changes(before: GraphSnapshot, after: GraphSnapshot) -> dict[str, Any]:
    """Structured changes between two snapshots of one graph.

    Returns:
        ``{"added": [node names], "removed": [node names], "changed": [{"node", "field",
        "before", "after"}, ...]}``; a field missing on one side is reported with ``None``.
    """
    added = [n for n in after.fields if n not in before.fields]
    removed = [n for n in before.fields if n not in after.fields]
    changed = []
    for name, bf in before.fields.items():
        af = after.fields.get(name)
        if af is None or af == bf:
            continue
        for key in list(bf) + [k for k in af if k not in bf]:
            if bf.get(key) != af.get(key):
                changed.append({"node": name, "field": key, "before": bf.get(key), "after": af.get(key)})
    return {"added": added, "removed": removed, "changed": changed}


def format_changes(changes: dict[str, Any], *, limit: int = 200) -> str:
    """Plain-text rendering of :func:`graph_changes` (one line per change; at most ``limit``)."""
    lines = []
    for n in changes["added"]:
        lines.append(f"+ node {n}")
    for n in changes["removed"]:
        lines.append(f"- node {n}")
    for c in changes["changed"]:
        lines.append(f"~ {c['node']}.{c['field']}: {c['before']} -> {c['after']}")
    if len(lines) > limit:
        lines = lines[:limit] + [f"... {len(lines) - limit} more"]
    return "\n".join(lines) + ("\n" if lines else "")
