"""docs/cli.md shows `make demo`'s real output (``te-passes dump --example linear-fp8``); its tables must list
the passes the pipeline runs, stage by stage, in pipeline order (session 20's user trial found them three
passes short: the Dynamo-stage analyses added since were missing from every table)."""

from __future__ import annotations

import pathlib
import re

from te_passes.passes.order import PASSES
from te_passes.pipeline.base import Stage

CLI_MD = pathlib.Path(__file__).resolve().parents[2] / "docs" / "cli.md"
#: The graph ids of the example's stages (docs/cli.md "The main job").
GRAPH_IDS = {Stage.DYNAMO: "g0", Stage.JOINT: "g0.joint", Stage.POST_GRAD_FWD: "g0.fwd",
             Stage.POST_GRAD_BWD: "g0.bwd"}


def _passes_table(text: str) -> list[tuple[str, str, str]]:
    """``(graph, stage, pass)`` rows of the first ``Passes`` table in ``text``."""
    block = text[text.index("```\nPasses\n"):]
    block = block[:block.index("\n```", 4)]
    return [tuple(line.split()[:3]) for line in block.splitlines()[4:] if line.strip()]


def test_the_main_job_passes_table_lists_every_pass_of_every_stage_in_order():
    expected = [(GRAPH_IDS[stage], stage.value, cls.name) for stage in GRAPH_IDS for cls in PASSES
                if stage in cls.stages]
    assert _passes_table(CLI_MD.read_text()) == expected


def test_the_replay_example_lists_the_dynamo_passes_in_order():
    text = CLI_MD.read_text()
    block = text[text.index("$ te-passes replay te_passes_dump --check"):]
    rows = re.findall(r"^(dynamo)\s+(\w+)\s", block[:block.index("\n```")], flags=re.M)
    assert [name for _, name in rows] == [cls.name for cls in PASSES if Stage.DYNAMO in cls.stages]


def test_every_built_in_example_is_in_the_help_and_in_cli_md():
    """Session 22's user trial: ``dump --help`` and docs/cli.md listed 6 of the 8 examples (not the Llama ones)."""
    from te_passes.cli.main import build_parser
    from te_passes.examples import EXAMPLES

    text = CLI_MD.read_text()
    table = text[text.index("## Built-in examples"):]
    dump = next(a for a in build_parser()._subparsers._group_actions[0].choices["dump"]._actions
                if "--example" in a.option_strings)
    for name in EXAMPLES:
        assert f"| `{name}` |" in table, f"docs/cli.md's examples table lacks {name}"
        assert name in dump.help, f"te-passes dump --example's help lacks {name}"
    assert "examples: " + ", ".join(EXAMPLES) + "`" in text, "docs/cli.md's 'unknown example' line"
