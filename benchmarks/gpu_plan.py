#!/usr/bin/env python3
"""The GPU session plan: benchmark chunks, each one device call of < 550 s, in order of value.

    python3 benchmarks/gpu_plan.py --command NAME         # one chunk's command
    bash tests/gpu/run_on_device.sh chunk NAME [NAME...]  # on the device (gpu-kit env, results in $OUT/NAME)
    python3 benchmarks/gpu_plan.py --check                # CPU: every chunk's plan fits its call (dry runs)
    python3 benchmarks/gpu_plan.py --markdown > benchmarks/gpu_plan.md

Estimates come from the 2026-12-01 H200 runs (docs/benchmarks/h200_2026-12-01_s4/, _final/):
see :data:`COST_S`. Docs: docs/benchmarks.md "Benchmark harness".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: Seconds per task on the H200, from the 2026-12-01 logs: bench_gpu's stack4 variants took 1 s
#: (eager, mgc) to 4-7 s (compiled) each in one process (_final/bench.log: 40 variants in 150 s);
#: te.TransformerLayer variants 22 s (layer1: 14 in 307 s, 4 workers) and 25 s (4 layers: 10 in
#: 254 s, cf- first calls 15-19 s). Plus this round's kernel-time sum and host / GPU split
#: (~2 s a row) and one worker start (imports, profiler init) per worker.
COST_S = {"worker": 15.0, "stack4": 7.0, "layer1": 22.0, "tl-stack4": 30.0}
#: Wall-clock seconds one device call may take (the device allows 600; the rest is bring-up slack).
CALL_LIMIT_S = 550.0
#: The first CORE chunks are the session's ≈ 20 min of device time; the rest if time is left.
CORE = 7


@dataclasses.dataclass(frozen=True)
class Chunk:
    name: str
    script: str
    args: str
    what: str
    budget_s: float = 400.0
    env: str = ""  # VAR=VALUE prefix (the workers inherit it; the run's meta records TE_PASSES_*)

    def command(self, out_root: str = "$OUT") -> str:
        # keep the gpu-kit's PYTHONPATH (/root/tek/site: torch 2.14.1 + TE), the checkout first
        return (f"{self.env + ' ' if self.env else ''}PYTHONPATH=$PWD${{PYTHONPATH:+:$PYTHONPATH}} "
                f"python3 benchmarks/{self.script} --out {out_root}/{self.name} "
                f"--budget-s {self.budget_s:.0f} {self.args}")


_TL, _GPU = "bench_transformer_layer.py", "bench_gpu.py"
CHUNKS: tuple[Chunk, ...] = (
    Chunk("stack4-delayed-block", _GPU, "--configs 256:fp8-delayed 8192:fp8-delayed 256:fp8-block 8192:fp8-block "
          "--variants eager te_inductor te_inductor-ro te_step-ro mgc mgc-noclone",
          "issues 24 / 26: DelayedScaling and Float8BlockScaling stack4 rows (numerics vs eager per row)", budget_s=330.0),
    Chunk("tl-delayed", _TL, "--models layer1 --precisions fp8-delayed --variants eager te_inductor "
          "te_inductor-ro mgc", "issue 24: DelayedScaling te.TransformerLayer, 1 layer", budget_s=250.0),
    Chunk("tl-untouched-layer1", _TL, "--models layer1 --precisions bf16 fp8 "
          "--variants eager te_inductor te_inductor-ro mgc mgc-noclone",
          "issue 21: untouched te.TransformerLayer, 1 layer seq 1024×b2: default / reduce-overhead vs eager vs mgc; "
          "graphs / breaks / recompiles, peak vs eager"),
    Chunk("tl-untouched-stack4", _TL, "--models stack4 --precisions bf16 fp8 --variants eager te_inductor "
          "te_inductor-ro mgc", "issue 21: the same, 4 layers seq 2048×b1", budget_s=420.0),
    Chunk("stack4-issue22", _GPU, "--configs 256:fp8 256:bf16 --variants eager te_inductor te_inductor-ro "
          "te_step-ro te_mgc te_mgc-noclone mgc mgc-noclone",
          "issue 22: stack4 256 tokens, whole-step and make_graphed over te_inductor vs mgc / mgc-noclone, "
          "kernel-time floor per row", budget_s=250.0),
    Chunk("tl-issue22-layer1", _TL, "--models layer1 --precisions fp8 --variants eager mgc te_step-ro te_mgc "
          "te_mgc-noclone", "issue 22: te.TransformerLayer 1 layer fp8 (the host-bound row) ≥ 1.1× mgc", budget_s=250.0),
    Chunk("stack4-issue22-8192", _GPU, "--configs 8192:fp8 8192:bf16 --variants eager te_inductor-ro te_step-ro "
          "te_mgc-noclone mgc-noclone", "issue 22: at 8192 tokens not slower than te_inductor-ro", budget_s=200.0),
    Chunk("tl-norm-switch", _TL, "--models layer1 --precisions bf16 fp8 --variants te_inductor te_inductor-ro "
          "--tag te-norm", "issue 21: TE's layernorm kernel (rows +te-norm) vs the torch-ops norm of "
          "tl-untouched-layer1 (merge the two)", budget_s=250.0, env="TE_PASSES_UNTOUCHED_NORM=te"),
    Chunk("stack4-rest", _GPU, "--configs 256:fp8 8192:fp8 256:bf16 8192:bf16 --variants eager inductor inductor-ro "
          "te_inductor-nodirect te_inductor-ro-lean te_inductor-ro-trees",
          "the rest of stack4: plain inductor, direct-call pass off, lean vs trees (issue 22 item 4)", budget_s=330.0),
    Chunk("tl-delayed-stack4", _TL, "--models stack4 --precisions fp8-delayed --variants eager te_inductor "
          "te_inductor-ro mgc", "issue 24: DelayedScaling te.TransformerLayer, 4 layers", budget_s=330.0),
    Chunk("tl-compile-friendly", _TL, "--models layer1 stack4 --precisions bf16 fp8 --variants cf-te_inductor-ro",
          "compile_friendly (the explicit form) next to the untouched rows", budget_s=420.0),
)


def _task_cost(t: dict) -> float:
    if "tokens" in t:
        return COST_S["stack4"]
    return COST_S["layer1"] if t["model"] == "layer1" else COST_S["tl-stack4"]


def dry_plan(chunk: Chunk) -> dict:
    """The chunk's task plan from its script's own ``--plan`` (no GPU), with the estimate."""
    argv = [str(HERE / chunk.script), "--out", "/tmp/gpu_plan_check", "--budget-s", str(chunk.budget_s),
            *shlex.split(chunk.args), "--plan"]
    out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, check=True, cwd=HERE.parent)
    plan = json.loads(out.stdout)
    key = ("model", "precision") if chunk.script == _TL else ("tokens", "precision")  # the scripts' worker_split
    workers = 1 + sum(1 for a, b in zip(plan["tasks"], plan["tasks"][1:]) if any(a[k] != b[k] for k in key))
    plan["estimate_s"] = workers * COST_S["worker"] + sum(map(_task_cost, plan["tasks"]))
    return plan


def markdown() -> str:
    lines = ["# GPU session plan (generated by `python3 benchmarks/gpu_plan.py --markdown`)", "",
             "On the device, after the gpu-kit bring-up, one device call per chunk, in this order (value first):",
             "`bash tests/gpu/run_on_device.sh chunk NAME` (= the command below, log in `$OUT/NAME.log`).",
             "Each call ends within its `--budget-s` + 100 s (tasks that would start later are written as skipped).",
             "First (~5 min, one call): the GPU tests fixed after the 2026-12-02 suite, not re-run since",
             "(docs/benchmarks.md \"Session 7\"; the whole suite takes ~16 min in three calls):",
             "`python3 -m pytest -m gpu tests/gpu/test_delayed_scaling_gpu.py tests/gpu/test_untouched_gpu.py "
             "tests/gpu/test_te_inductor_gpu.py::test_transformer_layer_numerics_and_no_eager_islands "
             "tests/gpu/test_lean_cudagraphs_gpu.py::test_transformer_layer_step_correct_whatever_the_policy_decides "
             "tests/gpu/test_step_capture_gpu.py -rA -s`.",
             "After the run: copy `$OUT/*` to `docs/benchmarks/h200_<date>/`; merge a script's chunks with",
             "`python3 benchmarks/<script> --out DIR --merge $OUT/<chunk> ...`.", "",
             "| # | chunk | estimate s | max s | what | command |", "|---|---|---|---|---|---|"]
    total = core = 0.0
    for i, c in enumerate(CHUNKS, 1):
        p = dry_plan(c)
        total += p["estimate_s"]
        core += p["estimate_s"] if i <= CORE else 0.0
        lines.append(f"| {i} | {c.name} | {p['estimate_s']:.0f} | {p['max_wall_s']:.0f} | {c.what} | "
                     f"`{c.command()}` |")
    lines += ["", "After the chunks (CPU is enough): one table per script, every chunk side by side:", "", "```"]
    for script, out in ((_TL, "tl-all"), (_GPU, "stack4-all")):
        dirs = " ".join(f"$OUT/{c.name}" for c in CHUNKS if c.script == script)
        lines.append(f"python3 benchmarks/{script} --out $OUT/{out} --merge {dirs}")
    lines += ["```", "(a chunk that did not run makes --merge stop and name it: leave it out)"]
    lines += ["", f"Estimated: chunks 1–{CORE} (the core, value first) {core:.0f} s ({core / 60:.1f} min); "
              f"all {len(CHUNKS)} {total:.0f} s ({total / 60:.1f} min). Estimates: `COST_S` in benchmarks/gpu_plan.py."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--check", action="store_true", help="every chunk's plan: estimate and max wall < the call limit")
    ap.add_argument("--command", metavar="NAME", help="print one chunk's shell command")
    args = ap.parse_args(argv)
    by = {c.name: c for c in CHUNKS}
    if args.command:
        if args.command not in by:
            raise SystemExit(f"unknown chunk {args.command!r}; known: {', '.join(by)}")
        print(by[args.command].command())
    elif args.markdown:
        print(markdown(), end="")
    elif args.check:
        bad = []
        for c in CHUNKS:
            p = dry_plan(c)
            print(f"{c.name}: {len(p['tasks'])} tasks, estimate {p['estimate_s']:.0f} s, max {p['max_wall_s']:.0f} s")
            if max(p["estimate_s"], p["max_wall_s"]) >= CALL_LIMIT_S:
                bad.append(c.name)
        if bad:
            print(f"over {CALL_LIMIT_S:.0f} s: {bad}")
            return 1
    else:
        ap.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
