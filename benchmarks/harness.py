"""The one benchmark harness: plan -> worker processes under a budget -> JSON + markdown with ratios.

A benchmark script gives a :class:`Bench` (its name, the fields that group rows, its columns, the
variants ratios are taken against, its goals) and two functions: ``plan(args)`` (tasks, in run
order) and ``measure(task, args)`` (one row, in a worker). :func:`main` does the rest: ``--dry-run``
(the same plan, workers and tables with made-up numbers, no GPU, no torch), ``--merge`` of chunk
outputs, budgets, hung-worker kills. Imports torch lazily (the dry run works without it).
Docs: docs/benchmarks.md "Benchmark harness".
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import math
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
#: worker exit status after a failed ``isolate`` task: TE may be left in capture state, the rest
#: of the tasks go to a fresh worker.
ISOLATE_RC = 3
RESULT = "RESULT "


@dataclasses.dataclass(frozen=True)
class Col:
    """One table column: ``header``, the row key, and a format (``"{:.3f}"``) or a function of the row."""

    header: str
    key: str
    fmt: str | Callable[[dict], str] = "{}"

    def cell(self, row: dict) -> str:
        if callable(self.fmt):
            return self.fmt(row)
        v = row.get(self.key)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        return self.fmt.format(v)


@dataclasses.dataclass
class Bench:
    """What one benchmark script declares; :func:`main` runs it.

    ``group``: the row fields that make one configuration (ratios compare rows of one group);
    ``ratios``: header -> baseline variant (``"× eager": "eager"`` = eager ms / row ms, > 1 faster);
    ``goals(rows)`` -> ``[(goal, verdict, measured)]``; ``fake(task, i)`` -> made-up measurements.
    """

    name: str
    script: str
    title: str
    group: tuple[str, ...]
    columns: list[Col]
    ratios: dict[str, str]
    plan: Callable[[argparse.Namespace], list[dict]]
    measure: Callable[[dict, argparse.Namespace], dict]
    add_args: Callable[[argparse.ArgumentParser], None] = lambda ap: None
    goals: Callable[[list[dict]], list[tuple[str, str, str]]] = lambda rows: []
    fake: Callable[[dict, int], dict] | None = None
    #: peak memory is shown against this variant's too (``peak / <mem_vs>``, per group)
    mem_vs: str | None = None
    #: a new worker process starts whenever one of these task fields changes
    worker_split: tuple[str, ...] = ()
    notes: Callable[[argparse.Namespace], str] = lambda args: ""
    #: markdown after the table (e.g. a per-layer pivot of the rows)
    appendix: Callable[[list[dict]], str] = lambda rows: ""
    warmup: int = 6
    iters: int = 30
    budget_s: float = 400.0
    grace_s: float = 100.0
    worker_timeout_s: float = 240.0
    #: seconds a worker needs to start (imports) and its first task: no worker starts with less left
    start_s: float = 20.0


def verdict(ok: bool | None) -> str:
    return "NOT MEASURED" if ok is None else ("MET" if ok else "NOT MET")


def status(row: dict) -> str:
    """``ok`` / ``failed: ...`` / ``skipped: ...`` / ``unavailable: ...`` (the row's one-line state)."""
    for k in ("unavailable", "skipped", "error"):
        if row.get(k):
            return ("failed: " if k == "error" else f"{k}: ") + str(row[k]).splitlines()[0][:200]
    return "ok" if row.get("median_ms") is not None else "no measurement"


def ok(row: dict | None) -> bool:
    return row is not None and status(row) == "ok"


# --------------------------------------------------------------------------------------- timing
def time_steps(step: Callable[[], Any], *, warmup: int, iters: int) -> dict[str, float]:
    """Per-step CUDA-event ms (median, p10, p90; host time included: the end event is enqueued after
    the step's last launch), the back-to-back mean, and the median host ms (``perf_counter``)."""
    import torch

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    host = []
    for i in range(iters):
        t0 = time.perf_counter()
        starts[i].record()
        step()
        ends[i].record()
        host.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return dict(median_ms=statistics.median(ms), p10_ms=ms[int(0.1 * (iters - 1))], p90_ms=ms[int(0.9 * (iters - 1))],
                b2b_ms=starts[0].elapsed_time(ends[-1]) / iters, host_ms=statistics.median(host), iters=iters)


def per_call(fns: dict[str, Callable], *, calls: int, rounds: int = 5, warmup: int = 50, args: tuple = (),
             stat: Callable[[list[float]], float] = statistics.median) -> dict[str, float]:
    """µs per call of ``f(*args)`` for each ``fns`` value: ``rounds`` runs of ``calls`` back-to-back
    calls, the functions interleaved (a, b, a, b: machine noise hits all alike); ``stat`` of the runs."""
    for f in fns.values():
        for _ in range(warmup):
            f(*args)
    runs: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                f(*args)
            runs[k].append((time.perf_counter() - t0) / calls * 1e6)
    return {k: stat(v) for k, v in runs.items()}


def md_table(header: list[str], rows: list[list[Any]]) -> str:
    """A markdown table of ``rows`` (cells formatted with ``str``)."""
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                      *("| " + " | ".join(map(str, r)) + " |" for r in rows)])


def host_gpu_split(step: Callable[[], Any], steps: int) -> dict[str, Any]:
    """Host and GPU ms per step apart: a ``torch.cuda._sleep`` is queued first so the host enqueues
    ``steps`` steps while the GPU sleeps. ``host_waited`` True: a step waited for the GPU (a sync,
    or a full launch queue), so ``split_host_ms`` is not pure host time."""
    import torch

    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    torch.cuda._sleep(int(5e8))  # ~0.25 s on an H200: longer than enqueueing the steps
    ev[0].record()
    host = []
    for i in range(steps):
        t0 = time.perf_counter()
        step()
        ev[i + 1].record()
        host.append((time.perf_counter() - t0) * 1e3)
    waited = ev[0].query()
    torch.cuda.synchronize()
    return dict(split_host_ms=statistics.median(host),
                split_gpu_ms=statistics.median(ev[i].elapsed_time(ev[i + 1]) for i in range(steps)),
                host_waited=bool(waited))


def kernel_sum_ms(step: Callable[[], Any], steps: int = 10, trace_to: Path | None = None,
                  by_name: dict[str, list[float]] | None = None) -> float:
    """Sum of the device-side events' durations per step under ``torch.profiler`` (kernels, memcpy,
    memset; kernels inside CUDA-graph replays included): the step's kernel-time floor, in ms (0
    without a GPU). ``trace_to``: also write the key-averages tables (by device / host time) there.
    ``by_name``: filled with device event name -> ``[launches, µs]`` per step (the kernel list)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            step()
        sync()
    if trace_to is not None:
        ka = prof.key_averages()
        trace_to.write_text(f"torch.profiler, {steps} steps\n\n## by device time\n"
                            + ka.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=40)
                            + "\n## by host time\n" + ka.table(sort_by="self_cpu_time_total", row_limit=40))
    dev = [e for e in prof.events()  # GPU-side user ranges would double count
           if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    if by_name is not None:
        for e in dev:
            n_us = by_name.setdefault(e.name, [0.0, 0.0])
            n_us[0] += 1 / steps
            n_us[1] += e.time_range.elapsed_us() / steps
    return sum(e.time_range.elapsed_us() for e in dev) / 1e3 / steps


def cprofile(step: Callable[[], Any], path: Path, steps: int = 20) -> None:
    """cProfile ``steps`` steps; the top 30 functions by own time to ``path``."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    path.write_text(f"host profile, {steps} steps\n" + buf.getvalue())


def versions() -> dict[str, Any]:
    """python / torch / CUDA / TE / triton versions, the GPU, ``TE_PASSES_COMMIT``."""
    out: dict[str, Any] = {"python": sys.version.split()[0], "commit": os.environ.get("TE_PASSES_COMMIT")}
    for mod in ("torch", "transformer_engine", "triton"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as exc:  # noqa: BLE001 - reported, not hidden
            out[mod] = f"not importable ({type(exc).__name__})"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        out["cuda"], out["gpu"] = torch.version.cuda, torch.cuda.get_device_name(0)
    return out


# ------------------------------------------------------------------------------------- workers
def _worker(bench: Bench, tasks: list[dict], args: argparse.Namespace) -> int:
    """Run ``tasks`` here, one ``RESULT <json>`` line each; past ``args.deadline`` a task is written
    as skipped. Returns :data:`ISOLATE_RC` after a failed ``isolate`` task (the rest run elsewhere)."""
    for i, task in enumerate(tasks):
        if time.time() > args.deadline:
            print(RESULT + json.dumps(dict(task, skipped="budget spent (worker)")), flush=True)
            continue
        t0 = time.perf_counter()
        try:
            row = dict(task, **(bench.fake(task, i) if args.dry_run else bench.measure(task, args)))
        except Exception as exc:  # noqa: BLE001 - one variant failing must not lose the others
            row = dict(task, error=f"{type(exc).__name__}: {exc}"[:800], tb=traceback.format_exc()[-1500:])
        row["wall_s"] = round(time.perf_counter() - t0, 2)
        print(RESULT + json.dumps(row, default=str), flush=True)
        if task.get("isolate") and row.get("error"):
            return ISOLATE_RC
    return 0


def _die_with_parent() -> None:
    """In the worker, before exec: SIGKILL when the parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    except Exception:  # noqa: BLE001 - not Linux: the parent's finally still kills the group
        pass


def _run_worker(cmd: list[str], task_timeout: float, total_timeout: float, on_result: Callable[[dict], None],
                log: Path) -> tuple[int, str, int | None]:
    """Run one worker in its own process group (stderr to ``log``), handing each ``RESULT`` row to
    ``on_result`` as it comes; kill the group when a task runs past ``task_timeout`` or the worker
    past ``total_timeout``. Returns ``(rows seen, stderr tail, rc)``; ``rc`` None = killed."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT, start_new_session=True,
                                preexec_fn=_die_with_parent)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [*map(lines.put, proc.stdout), lines.put(None)], daemon=True).start()
        seen, end, task_end, killed = 0, time.time() + total_timeout, time.time() + task_timeout, False
        try:
            while True:
                try:
                    line = lines.get(timeout=max(min(task_end, end) - time.time(), 0.01))
                except queue.Empty:
                    killed = True
                    break
                if line is None:
                    break
                if line.startswith(RESULT):
                    seen += 1
                    on_result(json.loads(line[len(RESULT):]))
                    task_end = time.time() + task_timeout
            if not killed:
                try:
                    proc.wait(timeout=max(min(task_end, end) - time.time(), 1.0))
                except subprocess.TimeoutExpired:
                    killed = True
        except BaseException:  # the parent interrupted (SIGTERM, Ctrl-C): its worker goes with it
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        if killed:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        err.seek(0)
        return seen, err.read()[-4000:], None if killed else proc.returncode


def run_plan(bench: Bench, tasks: list[dict], args: argparse.Namespace, argv: list[str], rows: list[dict],
             save: Callable[[], None]) -> None:
    """Run ``tasks`` in worker processes, one at a time (a fresh one per :attr:`Bench.worker_split`
    group and after a failed ``isolate`` task; stderr in ``<out>/<name>.worker<N>.log``); after the budget no worker starts and the rest is
    written as skipped; a worker whose task runs past ``--worker-timeout-s`` (or past budget +
    grace) is killed and that task written as failed. Rows are saved as they come."""
    t_start = time.time()
    deadline = t_start + args.budget_s
    groups: list[list[dict]] = []
    for t in tasks:
        if not groups or any(t.get(k) != groups[-1][0].get(k) for k in bench.worker_split):
            groups.append([])
        groups[-1].append(t)

    def on_result(r: dict) -> None:
        print(f"[{bench.name} +{time.time() - t_start:4.0f}s] " + json.dumps(
            {k: v for k, v in r.items() if k != "tb" and not isinstance(v, (dict, list))}), flush=True)
        rows.append(r)
        save()

    n_workers = 0
    for pending in groups:
        while pending:
            left = deadline + bench.grace_s - time.time()
            if time.time() > deadline or left < bench.start_s:
                rows.extend(dict(t, skipped=f"budget {args.budget_s:.0f}s spent") for t in pending)
                break
            cmd = [sys.executable, bench.script, *argv, "--worker", json.dumps(pending), "--deadline", str(deadline)]
            n_workers += 1
            seen, err, rc = _run_worker(cmd, args.worker_timeout_s, left, on_result,
                                        Path(args.out) / f"{bench.name}.worker{n_workers}.log")
            rest = pending[seen:]
            if rest and rc != ISOLATE_RC:  # the worker died or was killed on rest[0]
                tail = " | ".join(err.strip().splitlines()[-6:])[-600:]
                why = "worker killed (task past --worker-timeout-s or the budget)" if rc is None else f"worker rc={rc}"
                rows.append(dict(rest[0], error=f"{why}: {tail}"))
                rest = rest[1:]
            pending = rest
            save()


# ------------------------------------------------------------------------------------- reports
def by_group(rows: list[dict], keys: tuple[str, ...]) -> list[tuple[tuple, dict[str, dict]]]:
    """``[(group values, {variant: row})]`` sorted by group (the goals' view of the rows)."""
    out: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        out.setdefault(tuple(r.get(k) for k in keys), {})[r["variant"]] = r
    return sorted(out.items(), key=lambda kv: [(0, v, "") if isinstance(v, (int, float)) else (1, 0, str(v))
                                               for v in kv[0]])


def fill_ratios(bench: Bench, rows: list[dict]) -> None:
    """``ratio:<header>`` = baseline median ms / row median ms, per group (absent if either is missing)."""
    base = {(tuple(r.get(k) for k in bench.group), r["variant"]): r["median_ms"] for r in rows if ok(r)}
    for r in rows:
        g = tuple(r.get(k) for k in bench.group)
        for head, variant in bench.ratios.items():
            b = base.get((g, variant))
            r[f"ratio:{head}"] = b / r["median_ms"] if b and ok(r) else None
    if bench.mem_vs:
        mem = {tuple(r.get(k) for k in bench.group): r.get("peak_mib") for r in rows
               if ok(r) and r["variant"] == bench.mem_vs}
        for r in rows:
            m = mem.get(tuple(r.get(k) for k in bench.group))
            r["ratio:mem"] = r["peak_mib"] / m if m and ok(r) and r.get("peak_mib") is not None else None


def table(bench: Bench, rows: list[dict]) -> str:
    """One markdown table: the group fields, variant, the columns with the ratios after median ms."""
    cols = [*(Col(k, k) for k in bench.group), Col("variant", "variant")]
    for c in bench.columns:
        cols.append(c)
        if c.key == "median_ms":
            cols += [Col(h, f"ratio:{h}", "{:.2f}×") for h in bench.ratios]
        if c.key == "peak_mib" and bench.mem_vs:
            cols.append(Col(f"peak / {bench.mem_vs}", "ratio:mem", "{:.2f}"))
    cols.append(Col("status", "", status))
    return md_table([c.header for c in cols], [[c.cell(r) for c in cols] for r in rows])


def write(bench: Bench, out: Path, meta: dict, rows: list[dict], dry_run: bool, notes: str = "") -> str:
    """``<name>.json`` (meta, rows, goals) and ``<name>.md`` under ``out``; returns the markdown."""
    fill_ratios(bench, rows)
    goals = bench.goals(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{bench.name}.json").write_text(json.dumps(
        {"meta": meta, "rows": rows, "goals": [dict(zip(("goal", "verdict", "measured"), g)) for g in goals]},
        indent=1, default=str))
    label = "DRY RUN (made-up numbers) — " if dry_run else ""
    md = [f"# {label}{bench.title}", "", f"`{meta.get('command', '')}` — {meta.get('date_utc', '')}", "",
          "Versions: " + ", ".join(f"{k} {v}" for k, v in meta.get("versions", {}).items()), ""]
    md += [notes, ""] if notes else []
    md += [table(bench, rows)]
    extra = bench.appendix(rows)
    md += ["", extra] if extra else []
    if goals:
        md += ["", "## Goals", "", "| goal | verdict | measured |", "|---|---|---|"]
        md += [f"| {g} | {v} | {m} |" for g, v, m in goals]
    text = "\n".join(md) + "\n"
    (out / f"{bench.name}.md").write_text(text)
    return text


def merge(bench: Bench, dirs: list[str], out: Path) -> str:
    """One table from the ``<name>.json`` of chunk output directories ``dirs``."""
    rows, metas = [], []
    for d in dirs:
        f = Path(d) / f"{bench.name}.json"
        if not f.is_file():
            raise SystemExit(f"--merge: {f} does not exist (chunk not run?)")
        data = json.loads(f.read_text())
        rows += data["rows"]
        metas.append(data["meta"])
    dry = all(m.get("dry_run") for m in metas)
    return write(bench, out, {"merged": metas, "command": f"--merge {' '.join(dirs)}"}, rows, dry)


# ---------------------------------------------------------------------------------------- main
def parse_kv(items: list[str] | None) -> dict[str, Any]:
    """``["a=1", "b=x"]`` -> ``{"a": 1, "b": "x"}`` (values parsed as JSON where they parse)."""
    out: dict[str, Any] = {}
    for it in items or []:
        k, sep, v = it.partition("=")
        if not sep or not k:
            raise SystemExit(f"want KEY=VALUE, got {it!r}")
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def main(bench: Bench, argv: list[str] | None = None) -> int:
    """The command line every benchmark shares (``--help`` lists it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=bench.title)
    ap.add_argument("--out", default=os.environ.get("OUT", f"/tmp/{bench.name}"), help="JSON + markdown go here")
    ap.add_argument("--warmup", type=int, default=bench.warmup, help="untimed steps after the first")
    ap.add_argument("--iters", type=int, default=bench.iters, help="timed steps")
    ap.add_argument("--budget-s", type=float, default=bench.budget_s,
                    help=f"no worker or task starts after this; a run ends within it + {bench.grace_s:.0f} s")
    ap.add_argument("--worker-timeout-s", type=float, default=bench.worker_timeout_s,
                    help="per task; a worker past it is killed")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: the plan, workers and tables on made-up numbers")
    ap.add_argument("--plan", action="store_true", help="print the task plan as JSON and exit")
    ap.add_argument("--merge", nargs="+", metavar="DIR", help="merge the JSON of these --out dirs into --out")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    bench.add_args(ap)
    args = ap.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        ap.error("--iters must be >= 1 and --warmup >= 0")
    if args.worker:
        return _worker(bench, json.loads(args.worker), args)
    out = Path(args.out)
    if args.merge:
        print(merge(bench, args.merge, out))
        return 0
    tasks = bench.plan(args)
    if args.plan:
        print(json.dumps({"tasks": tasks, "budget_s": args.budget_s, "max_wall_s": args.budget_s + bench.grace_s},
                         indent=1))
        return 0
    meta = {"command": " ".join([Path(bench.script).name, *argv]),
            "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "versions": {"python": sys.version.split()[0]} if args.dry_run else versions(),
            "dry_run": args.dry_run, "warmup": args.warmup, "iters": args.iters, "budget_s": args.budget_s,
            "env": {k: v for k, v in os.environ.items() if k.startswith(("TE_PASSES_", "NVTE_"))}}
    rows: list[dict] = []
    t0 = time.time()

    def save() -> None:
        write(bench, out, meta, rows, args.dry_run, bench.notes(args))

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still stops the worker
    run_plan(bench, tasks, args, argv, rows, save)
    meta["wall_s"] = round(time.time() - t0, 1)
    text = write(bench, out, meta, rows, args.dry_run, bench.notes(args))
    print(text)
    print(f"wrote {out / (bench.name + '.json')} ({meta['wall_s']} s)")
    return 0
