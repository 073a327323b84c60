"""README.md and docs/usage.md open with the same "Before you ..." section; a user reads one of them, so its
"Not one graph yet" paragraph must say the same thing in both (session 20's user trial: usage.md still called
reduce-overhead gradient accumulation a "known failure" after README said te_passes moves such a ``.grad``
out of the CUDA-graph pool)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
START = "Not one graph yet"
END = "`compile_step` not covered)."


def _not_one_graph(path: pathlib.Path) -> str:
    """The paragraph from ``START`` to ``END`` (inclusive), whitespace collapsed."""
    text = path.read_text()
    start = text.find(START)
    assert start >= 0, f"{path.name}: no '{START}' paragraph"
    end = text.find(END, start)
    assert end >= 0, f"{path.name}: the '{START}' paragraph does not end with '{END}'"
    return re.sub(r"\s+", " ", text[start:end + len(END)])


def test_not_one_graph_paragraph_is_the_same_in_readme_and_usage():
    readme, usage = _not_one_graph(ROOT / "README.md"), _not_one_graph(ROOT / "docs" / "usage.md")
    assert readme == usage, f"README.md:\n{readme}\n\ndocs/usage.md:\n{usage}"
    assert "stable_grads.py" in usage and "Known failure" not in usage
