"""Per-variant kernel lists diffed against a baseline's (TE eager's): which kernels a variant adds,
removes or fuses, from the ``row["kernels"]`` the harness records (kernel name -> ``[launches, µs]``
per step under ``torch.profiler``: ``harness.kernel_sum_ms(by_name=...)``).

Docs: docs/benchmarks.md "Llama-class sizes (issue 41)".
"""

from __future__ import annotations

import re
from typing import Iterable

import harness

#: a kernel whose launches per step and time are within these of the baseline's counts as unchanged
SAME_US, SAME_FRAC = 2.0, 0.05


def short(name: str, width: int = 80) -> str:
    """A kernel name for a table cell: the argument list dropped, ``|`` escaped, cut to ``width``."""
    n = name.split("(", 1)[0] if not name.startswith("(") else name
    n = n.removeprefix("void ").replace("|", "\\|")
    return n if len(n) <= width else n[: width - 1] + "…"


def fused_ops(name: str) -> str | None:
    """The ops an Inductor Triton kernel fuses (``triton_poi_fused_add_mul_silu_3`` -> ``add_mul_silu``),
    or None for a kernel Inductor did not generate."""
    m = re.match(r"^triton_(?:poi|red|per|tem|for|spl)_fused_(.+?)(?:_\d+)?$", name)
    return m.group(1) if m else None


def diff(base: dict[str, list], other: dict[str, list]) -> list[dict]:
    """One entry per kernel name in either list: ``name``, ``change`` (``added`` / ``removed`` /
    ``changed`` / ``same``), launches and µs per step in each (0 when absent) and ``delta_us``
    (``other - base``); sorted by ``|delta_us|``, largest first."""
    out = []
    for name in set(base) | set(other):
        bn, bu = base.get(name, (0, 0.0))
        on, ou = other.get(name, (0, 0.0))
        if name not in base:
            change = "added"
        elif name not in other:
            change = "removed"
        elif round(bn, 2) != round(on, 2) or abs(ou - bu) > max(SAME_US, SAME_FRAC * bu):
            change = "changed"
        else:
            change = "same"
        out.append(dict(name=name, change=change, base_n=bn, base_us=bu, n=on, us=ou, delta_us=ou - bu))
    return sorted(out, key=lambda e: (-abs(e["delta_us"]), e["name"]))


def summary(entries: list[dict]) -> dict[str, float]:
    """Launches and µs per step of both lists, and the µs of the added / removed / changed kernels."""
    s = dict(base_n=sum(e["base_n"] for e in entries), base_us=sum(e["base_us"] for e in entries),
             n=sum(e["n"] for e in entries), us=sum(e["us"] for e in entries))
    for kind in ("added", "removed", "changed"):
        sel = [e for e in entries if e["change"] == kind]
        s[f"{kind}_kinds"], s[f"{kind}_us"] = len(sel), sum(e["delta_us"] for e in sel)
    return s


def section(title: str, base_name: str, name: str, entries: list[dict], top: int = 12) -> str:
    """Markdown for one variant against the baseline: a one-line summary, the Inductor fusions it
    runs, and the ``top`` kernels that moved most (added / removed / changed)."""
    s = summary(entries)
    lines = [f"**{title}: {name} vs {base_name}** — {s['n']:.0f} vs {s['base_n']:.0f} launches, "
             f"{s['us']:.0f} vs {s['base_us']:.0f} µs per step; added {s['added_kinds']} kernels "
             f"({s['added_us']:+.0f} µs), removed {s['removed_kinds']} ({s['removed_us']:+.0f} µs), "
             f"changed {s['changed_kinds']} ({s['changed_us']:+.0f} µs)", ""]
    fusions = sorted({f for e in entries if e["n"] and (f := fused_ops(e["name"]))})
    if fusions:
        lines += ["Inductor kernels (fused ops): " + ", ".join(f"`{f}`" for f in fusions[:30])
                  + (f" … (+{len(fusions) - 30})" if len(fusions) > 30 else ""), ""]
    moved = [e for e in entries if e["change"] != "same"]
    if moved:
        rows = [[e["change"], f"`{short(e['name'])}`", f"{e['base_n']:.0f} × / {e['base_us']:.1f}",
                 f"{e['n']:.0f} × / {e['us']:.1f}", f"{e['delta_us']:+.1f}"] for e in moved[:top]]
        lines.append(harness.md_table(["change", "kernel", f"{base_name} launches / µs", f"{name} launches / µs",
                                       "Δ µs"], rows))
        if len(moved) > top:
            lines.append(f"\n(+{len(moved) - top} more; every kernel in the JSON rows' `kernels`)")
    else:
        lines.append("(same kernels, same launch counts)")
    return "\n".join(lines)


def appendix(rows: Iterable[dict], group: tuple[str, ...], base: str = "eager", top: int = 12) -> str:
    """``## Kernels against <base>``: :func:`section` for every measured variant with a kernel list,
    per group of ``rows`` (the fields ``group``), against that group's ``base`` row."""
    out = []
    for key, g in harness.by_group(list(rows), group):
        b = g.get(base)
        if not harness.ok(b) or not b.get("kernels"):
            continue
        for name, r in g.items():
            if name != base and harness.ok(r) and r.get("kernels"):
                out.append(section("/".join(map(str, key)), base, name, diff(b["kernels"], r["kernels"]), top))
    return "## Kernels against TE eager (per step, torch.profiler)\n\n" + "\n\n".join(out) if out else ""
