"""The ``te-passes`` CLI end to end, in subprocesses, on real TE graphs (CPU capture).

* ``dump --example linear-fp8``: the report's sections are checked against the records of an
  independent in-process run of the same passes on the same captured graphs
  (``te_passes.testing.capture.run_pipeline``, which does not use the dump code), and against
  the pass registry as it is at test time (every registered pass appears at exactly its stages);
* the dumped graphs are TE-aware (storages, buffer roles, config fields) and every file
  ``index.md`` links exists;
* ``replay`` of the saved graphs reproduces the report; with a pass disabled it does not, and
  ``--check`` says so;
* a real ``torch.compile(backend="te_inductor")`` target on CPU: a TE eager island
  (``te.Fp8Padding`` is ``@no_torch_dynamo``) named with its reason, a recompile with its guard;
* TORCH_TRACE gets the dump as tlparse artifacts;
* each bad input prints one ``te-passes: error:`` line and exits non-zero.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from _cli import ROOT, _one_error_line, run_cli  # noqa: F401 - ROOT, run_cli: tests here use them
STAGES = ("dynamo", "joint", "post_grad_fwd", "post_grad_bwd")


def registered():
    from te_passes.passes.order import pass_classes

    return list(pass_classes())


def expected_passes(stage: str) -> list[str]:
    return [c.name for c in registered() if stage in {s.value for s in c.stages}]


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def fp8_dump(tmp_path_factory):
    out = tmp_path_factory.mktemp("dump")
    proc = run_cli("dump", "--example", "linear-fp8", "--out", str(out / "d"), cwd=str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "d" / "report.json") as f:
        report = json.load(f)
    return out / "d", report, proc


@pytest.fixture(scope="module")
def independent_run():
    """The same passes on the same real graphs, run in this process without the dump code."""
    from te_passes.compat.dynamo.hooks import register
    from te_passes.testing.capture import capture_aot, run_pipeline
    from te_passes.testing.fake_gpu import fake_gpu

    register()  # the backend's one install moment (te-passes dump loads the backend): the patch table and the
    # Dynamo start callback (TE's first-forward lazy init before the trace), as before any te_inductor trace
    aot = capture_aot("linear", "fp8-cs", 1, 32, 64, 128)
    with fake_gpu("fp8-cs"):
        reports = run_pipeline(aot, graph_id="g0")
    return {r.stage: r for r in reports}


# --------------------------------------------------------------------------- dump
def test_dump_lists_every_registered_pass_at_its_stages(fp8_dump):
    d, report, _ = fp8_dump
    assert report["schema"] == "te_passes.dump/1"
    assert [g["graph_id"] for g in report["graphs"]] == ["g0"]
    assert report["graphs"][0]["stages"] == ["g0:dynamo", "g0.joint:joint", "g0.fwd:post_grad_fwd", "g0.bwd:post_grad_bwd"]
    for stage in STAGES:
        rows = [p for p in report["passes"] if p["stage"] == stage]
        assert [p["name"] for p in rows] == expected_passes(stage), stage
        for p in rows:
            assert set(p) >= {"name", "stage", "changed", "time_ms", "nodes_before", "nodes_after", "status"}
            assert p["status"] in ("ok", "skipped", "disabled"), p
            assert p["time_ms"] >= 0
    assert "compile path" not in report  # sanity: key names are snake_case
    assert report["compile_path"].startswith("offline pass pipeline")
    assert "No GPU here" in report["note"]


def test_dump_records_match_an_independent_run(fp8_dump, independent_run):
    """Every pass run in report.json equals the same pass run in process: status, changed,
    node counts and records (timings aside); the flat sections are exactly those records."""
    d, report, _ = fp8_dump
    with open(d / "g0" / "report.json") as f:
        graph = json.load(f)
    assert [s["stage"] for s in graph["stages"]] == list(STAGES)
    all_records = []
    for st in graph["stages"]:
        mine = independent_run[st["stage"]]
        assert [r["name"] for r in st["runs"]] == [r.name for r in mine.runs]
        for rj, r in zip(st["runs"], mine.runs):
            assert (rj["status"], rj["changed"], rj["nodes_before"], rj["nodes_after"]) == \
                (r.status, r.changed, r.nodes_before, r.nodes_after), (st["stage"], r.name)
            assert rj["records"] == [x.to_json() for x in r.records], (st["stage"], r.name)
            all_records += [(st["graph_id"], r.name, x) for x in rj["records"]]

    def section(kinds):
        return [(g, p, rec["kind"], rec["node"]) for g, p, rec in all_records if rec["kind"] in kinds]

    from te_passes.debug.dump_files import FOLDED_KINDS, FREE_KINDS, SKIPPED_KINDS

    assert [(f["graph_id"], f["pass"], f["kind"], f["node"]) for f in report["folded"]] == section(FOLDED_KINDS)
    assert [(f["graph_id"], f["pass"], f["kind"], f["node"]) for f in report["frees"]] == section(FREE_KINDS)
    assert [(f["graph_id"], f["pass"], f["kind"], f["node"]) for f in report["skipped"]] == section(SKIPPED_KINDS)
    for f in report["folded"]:
        assert {"kind", "source", "args", "value", "node"} <= set(f)
    for f in report["frees"]:
        assert {"node", "role", "bytes"} <= set(f)
        assert isinstance(f["bytes"], int) and f["bytes"] > 0
    pool = [(g, p, rec["kind"]) for g, p, rec in all_records if str(rec["kind"]).startswith("pool")]
    assert [(x["graph_id"], x["pass"], x["kind"]) for x in report["pool_check"]] == pool
    mem = [rec for _, _, rec in all_records if rec["kind"] == "memory"]
    assert len(report["memory"]["stages"]) == len(mem)
    for m, rec in zip(report["memory"]["stages"], mem):
        assert m["peak_before"] == rec["peak_before"] and m["peak_after"] == rec["peak_after"]
    if mem:
        assert report["memory"]["peak_before"] == max(r["peak_before_concrete"] for r in mem)
        assert report["memory"]["peak_after"] == max(r["peak_after_concrete"] for r in mem)
    # strict about the passes that exist: what each does on a real fp8 te.Linear
    names = {c.name for c in registered()}
    if "remove_quantizer_setattrs" in names:  # the 23 __setattr__ residue calls of the fp8 Dynamo graph traced
        # after TE's first-forward lazy init (the backend's start callback prepares the module with the forward's
        # gemm arguments, session 19: 17) plus the 6 no-op writes of the traced quantizer copies (row
        # autocast.traced_quantizer_copies, session 20; docs/passes/remove_quantizer_setattrs.md)
        setattrs = [f for f in report["folded"] if f["kind"] == "folded_setattr"]
        assert len(setattrs) == 23 and all(f["graph_id"] == "g0" for f in setattrs)
        assert all(f["expr"].startswith("Float8CurrentScalingQuantizer.") for f in setattrs)
    if "insert_early_frees" in names:
        # one te.Linear: every quantized buffer is a forward output saved for backward, or a saved
        # tensor the backward receives; each one is either freed or kept with a reason
        decided = [x for x in report["frees"] + report["skipped"] if x["pass"] == "insert_early_frees"]
        assert {x["stage"] for x in decided} == {"post_grad_fwd", "post_grad_bwd"}
        assert all(x["kind"] == "free" or x["reason"] for x in decided)
        assert [m["stage"] for m in report["memory"]["stages"]] == ["post_grad_fwd", "post_grad_bwd"]
        assert all(m["peak_after"] <= m["peak_before"] for m in report["memory"]["stages"])
    if "check_cudagraph_pool" in names:
        assert {x["stage"] for x in report["pool_check"] if x["kind"] == "pool_check"} == {"post_grad_fwd",
                                                                                            "post_grad_bwd"}


def test_dump_uuid_and_te_state(fp8_dump):
    d, report, _ = fp8_dump
    u = report["uuid"]["g0"]
    assert set(u) == {"package", "passes", "options", "te_state", "reads_ub", "ub_reads", "uuid"}
    assert u["reads_ub"] is False and u["ub_reads"] == []  # no UB: the UB snapshot is not in the uuid
    assert list(u["passes"]) == [c.name for c in registered()]
    with open(d / "g0" / "te_state.json") as f:
        te_state = json.load(f)
    from te_passes.te.state import TEState

    from te_passes.debug.offline import te_state_from_json

    assert te_state_from_json(te_state).fingerprint(include_ub=False) == u["te_state"]
    assert te_state["te_version"] == "2.20.2"


def test_dump_files_are_te_aware_and_linked(fp8_dump):
    d, report, _ = fp8_dump
    bwd = (d / "g0" / "post_grad_bwd" / "input.py").read_text()
    assert "OpaqueValueBundle object" not in bwd and "_rebuild_quantizer" not in bwd
    # the saved fp8 input of the backward: one storage, its two buffers with roles, quantizer fields
    assert re.search(r"inputmat=Float8TensorStorage\(\n\s+_transpose=\w+,\s+# columnwise_data u8\[64, 32\]\n"
                     r"\s+_scale_inv=\w+,\s+# scale_inv f32\[1\]", bwd), bwd[:2000]
    assert "# te.Linear backward (transformer_engine_compile::linear_backward)" in bwd
    assert "fp8_dtype=DType.kFloat8E4M3" in bwd and "config={" in bwd and "# userbuffers" in bwd
    dyn = (d / "g0" / "dynamo" / "input.py").read_text()
    assert 'l_inp_: "bf16[32, 64]"' in dyn
    assert "dtype=DType.kFloat8E5M2" in dyn  # grad_output_quantizer
    # every pass that ran has its dump; unchanged passes have empty diffs, changed ones do not
    for p in report["passes"]:
        pdir = d / p["dump"]
        for f in ("before.py", "after.py", "diff.patch", "changes.txt"):
            assert (pdir / f).is_file(), (p, f)
        patch = (pdir / "diff.patch").read_text()
        assert bool(patch) == p["changed"], p
        head = (pdir / "changes.txt").read_text().splitlines()[0]
        m = re.search(r"nodes (\d+) -> (\d+) \((\d+) added, (\d+) removed", head)
        assert (int(m[1]), int(m[2])) == (p["nodes_before"], p["nodes_after"])
        assert int(m[2]) - int(m[1]) == int(m[3]) - int(m[4])
    index = (d / "index.md").read_text()
    links = re.findall(r"\]\(([^)]+)\)", index)
    assert len(links) > 10
    for link in links:
        assert (d / link).exists(), link


def test_dump_field_level_changes_name_the_removed_residue(fp8_dump):
    d, report, _ = fp8_dump
    if "remove_quantizer_setattrs" not in {c.name for c in registered()}:
        pytest.skip("remove_quantizer_setattrs not registered")
    run = next(p for p in report["passes"] if p["stage"] == "dynamo" and p["name"] == "remove_quantizer_setattrs")
    changes = (d / run["dump"] / "changes.txt").read_text()
    removed = set(re.findall(r"^- node (\w+)$", changes, re.M))
    folded = {f["node"] for f in report["folded"] if f["kind"] == "folded_setattr"}
    assert removed == folded
    patch = (d / run["dump"] / "diff.patch").read_text()
    assert sum(1 for ln in patch.splitlines() if ln.startswith("-        setattr_")) == len(folded)


def test_show_prints_the_tables(fp8_dump):
    d, report, _ = fp8_dump
    proc = run_cli("show", str(d), cwd=str(d))
    assert proc.returncode == 0, proc.stderr
    assert "Passes" in proc.stdout and "compile path:" in proc.stdout
    for p in report["passes"]:
        assert p["name"] in proc.stdout
    proc = run_cli("show", str(d), "--json", cwd=str(d))
    assert json.loads(proc.stdout)["passes"] == report["passes"]


# --------------------------------------------------------------------------- replay
def test_replay_reproduces_the_report(fp8_dump, tmp_path):
    d, report, _ = fp8_dump
    proc = run_cli("replay", str(d), "--check", "--json", "--out", str(tmp_path / "r"), cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    (res,) = json.loads(proc.stdout)
    assert res["differences"] == []
    with open(d / "g0" / "report.json") as f:
        saved = json.load(f)

    # find_autocast_state reads what Dynamo recorded on the nodes while tracing: a .tegraph does not keep it
    unreplayable = {c.name for c in registered() if not c.replayable}
    assert unreplayable == {"find_autocast_state"}

    def strip(stages):
        return [[{k: v for k, v in r.items() if k not in ("time_ms", "dump", "changes")
                  and not (k == "records" and r["name"] in unreplayable)} for r in s["runs"]] for s in stages]

    assert strip(res["report"]["stages"]) == strip(saved["stages"])
    assert res["report"]["uuid"] == saved["uuid"]
    with open(tmp_path / "r" / "report.json") as f:
        replayed = json.load(f)
    assert [(f["node"], f["kind"]) for f in replayed["folded"]] == [(f["node"], f["kind"]) for f in report["folded"]]
    # one saved graph file on its own (the forward: hoist_te_constants numbers the constants it
    # hoists process-wide, so a backward replayed without its forward gets other names)
    one = run_cli("replay", str(d / "g0" / "post_grad_fwd" / "input.tegraph"), "--check", cwd=str(tmp_path))
    assert one.returncode == 0, one.stderr[-2000:]
    assert "reproduces the saved report" in one.stdout
    # a stage directory is that stage's graph file: the other saved stages are not "missing"
    stage = run_cli("replay", str(d / "g0" / "dynamo"), "--check", cwd=str(tmp_path))
    assert stage.returncode == 0, stage.stdout[-2000:] + stage.stderr[-2000:]
    assert "reproduces the saved report" in stage.stdout and "no replayable graph file" not in stage.stdout


def test_replay_check_fails_when_the_passes_differ(fp8_dump, tmp_path):
    d, report, _ = fp8_dump
    changing = [p["name"] for p in report["passes"] if p["changed"]]
    if not changing:
        pytest.skip("no registered pass changes the fp8 graphs")
    proc = run_cli("replay", str(d), "--check", "--disable", changing[0], cwd=str(tmp_path))
    assert proc.returncode == 1
    assert f"{changing[0]}: status 'ok' -> 'disabled'" in proc.stdout
    assert proc.stderr.strip().splitlines()[-1].startswith("te-passes: error: replay differs")


# --------------------------------------------------------------------------- real target
REAL_TARGET = '''
import torch


def main(mode=None):
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16)
    pad = te.Fp8Padding(1, align_size=16)  # forward is @no_torch_dynamo in TE 2.20; no GPU needed here

    def step(x):
        y = lin(x)
        y, _ = pad(y, [x.shape[0]])
        return torch.relu(y) * 2

    compiled = torch.compile(step, backend="te_inductor", mode=mode, dynamic=False)
    compiled(torch.randn(16, 16))
    compiled(torch.randn(32, 16))  # new shape: recompile
'''


def test_dump_of_a_real_te_inductor_target(tmp_path):
    (tmp_path / "target.py").write_text(REAL_TARGET)
    proc = run_cli("dump", "target.py:main", "--out", "out", cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "out" / "report.json") as f:
        report = json.load(f)
    # 2 graphs around the TE island, each compiled twice (recompile on the new shape)
    assert [g["graph_id"] for g in report["graphs"]] == ["g0", "g1", "g2", "g3"]
    for g in report["graphs"]:
        assert g["stages"][0].endswith(":dynamo") and len(g["stages"]) == 3  # inference: no backward
    (island,) = report["eager_fallbacks"]
    assert island["module"] == "te.Fp8Padding" and island["kind"] == "disabled_forward"
    assert "@no_torch_dynamo" in island["reason"]
    line = next(i for i, ln in enumerate(REAL_TARGET.splitlines(), 1) if "pad(y, [" in ln)
    assert any(loc.endswith(f"target.py:{line} (step)") for loc in island["locations"]), island
    assert all(b["te"]["module"] == "te.Fp8Padding" for b in report["graph_breaks"])
    assert any("size mismatch at index 0. expected 16, actual 32" in r["reason"] for r in report["recompiles"])
    assert "te.Fp8Padding" in proc.stdout and "Recompiles" in proc.stdout
    for g in report["graphs"]:
        gid = g["graph_id"]
        assert (tmp_path / "out" / gid / "dynamo" / "input.tegraph").is_file()


def test_torch_trace_gets_the_dump_as_artifacts(tmp_path):
    proc = run_cli("dump", "--example", "linear-bf16", "--out", "d", cwd=str(tmp_path),
                   env={"TORCH_TRACE": str(tmp_path / "trace")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = "".join(p.read_text() for p in (tmp_path / "trace").iterdir())
    names = set(re.findall(r'"name": "(te_passes_[^"]+)"', text))
    for stage, gid in zip(STAGES, ("g0", "g0.joint", "g0.fwd", "g0.bwd")):
        assert f"te_passes_{gid}_{stage}_input" in names
        assert f"te_passes_{gid}_{stage}_output" in names
    assert "te_passes_g0_report" in names and "te_passes_report" in names


# --------------------------------------------------------------------------- list / help
def test_list_shows_the_registry_and_te_passes_disable(tmp_path):
    classes = registered()
    proc = run_cli("list", "--json", cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [r["name"] for r in rows] == [c.name for c in classes]
    assert [r["description"] for r in rows] == [c.description for c in classes]
    assert all(r["enabled"] is True for r in rows)
    from te_passes.pipeline.facts import REQUIRED_PASSES

    optional = [c.name for c in classes if c.name not in REQUIRED_PASSES]  # a required one: refused (bad input)
    if optional:
        proc = run_cli("list", cwd=str(tmp_path), env={"TE_PASSES_DISABLE": optional[0]})
        assert re.search(rf"{optional[0]}\s.*no \(TE_PASSES_DISABLE\)", proc.stdout)


def test_help(tmp_path):
    proc = run_cli("--help", cwd=str(tmp_path))
    assert proc.returncode == 0
    for cmd in ("dump", "list", "show", "replay", "doctor"):
        assert cmd in proc.stdout


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("case", ["missing_file", "raises", "compiles_nothing", "unknown_pass", "unknown_pass_env",
                                  "out_is_a_file", "out_under_a_file", "unknown_example", "replay_missing",
                                  "replay_not_a_graph", "show_missing", "show_pass_name", "file_with_mode",
                                  "required_pass", "required_pass_env", "required_pass_list", "required_pass_replay"])
def test_bad_input_gets_one_clear_line(case, tmp_path):
    (tmp_path / "raises.py").write_text("def main():\n    raise ValueError('boom: bad config')\n")
    (tmp_path / "nothing.py").write_text("import torch\n\ndef main():\n    return torch.ones(2) + 1\n")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "junk.tegraph").write_bytes(b"not a pickle")
    args, env, code, expect = {
        "missing_file": (["dump", "nope.py"], {}, 2, "target file not found: nope.py"),
        "raises": (["dump", "raises.py:main"], {}, 1, "target raises.py:main raised ValueError: boom: bad config"),
        "compiles_nothing": (["dump", "nothing.py:main"], {}, 1, "compiled nothing with backend 'te_inductor'"),
        "unknown_pass": (["dump", "--example", "linear-fp8", "--disable", "no_such_pass"], {}, 2,
                         "unknown pass name no_such_pass in --disable"),
        "unknown_pass_env": (["dump", "--example", "linear-fp8"], {"TE_PASSES_DISABLE": "nope_pass"}, 2,
                             "unknown pass name nope_pass in TE_PASSES_DISABLE"),
        "out_is_a_file": (["dump", "--example", "linear-fp8", "--out", "afile"], {}, 2,
                          "dump directory afile exists and is not a directory"),
        "out_under_a_file": (["dump", "--example", "linear-fp8", "--out", "afile/sub"], {}, 2,
                             "dump directory afile/sub is not writable: afile is not a directory"),
        "unknown_example": (["dump", "--example", "nope"], {}, 2, "unknown example 'nope'"),
        "replay_missing": (["replay", "nothing/here"], {}, 2, "no such graph file or dump directory"),
        "replay_not_a_graph": (["replay", "junk.tegraph"], {}, 2, "is not a te_passes graph file"),
        "show_missing": (["show", "nowhere"], {}, 2, "no te_passes dump at nowhere"),
        "show_pass_name": (["show", "fold_ub_predicates"], {}, 2,
                           "fold_ub_predicates is a pass name: te-passes show takes a dump directory"),
        "file_with_mode": (["dump", "nothing.py", "--mode", "reduce-overhead"], {}, 2,
                           "--mode/--precision apply to module:function targets"),
        # the backend refuses these (session 22's user trial: the CLI showed a pipeline the backend refuses)
        "required_pass": (["dump", "--example", "linear-fp8", "--disable", "find_autocast_state"], {}, 2,
                          "--disable names find_autocast_state: te_inductor sets the te.autocast state"),
        "required_pass_env": (["dump", "--example", "linear-fp8"], {"TE_PASSES_DISABLE": "find_autocast_state"}, 2,
                              "TE_PASSES_DISABLE names find_autocast_state"),
        "required_pass_list": (["list"], {"TE_PASSES_DISABLE": "find_autocast_state"}, 2,
                               "TE_PASSES_DISABLE names find_autocast_state"),
        "required_pass_replay": (["replay", "junk.tegraph", "--disable", "find_autocast_state"], {}, 2,
                                 "--disable names find_autocast_state"),
    }[case]
    proc = run_cli(*args, cwd=str(tmp_path), env=env)
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    line = _one_error_line(proc)
    assert expect in line, line
    assert "Traceback" not in proc.stderr + proc.stdout


def test_backend_emits_tlparse_artifacts_without_a_dump_dir(tmp_path):
    """TORCH_TRACE alone (no te_passes.dump_dir): the backend's dump writer emits the dump as
    tlparse artifacts and writes no directory."""
    code = textwrap.dedent("""
        import torch
        f = torch.compile(lambda x: torch.sin(x) + 1, backend="te_inductor")
        f(torch.randn(8))
    """)
    # caches off: on an FX-graph/AOTAutograd cache hit the post-grad stages do not run at all
    e = dict(os.environ, PYTHONPATH=ROOT, TORCH_TRACE=str(tmp_path / "trace"), TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")
    e.pop("TE_PASSES_DUMP_DIR", None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=e, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = "".join(p.read_text() for p in (tmp_path / "trace").iterdir())
    names = set(re.findall(r'"name": "(te_passes_[^"]+)"', text))
    assert {"te_passes_g0_dynamo_input", "te_passes_g0_dynamo_output", "te_passes_g0_report"} <= names, names
    assert "te_passes_g0.fwd_post_grad_fwd_input" in names
    assert "te_passes_report" not in names  # the directory summary needs a directory (docs/cli.md)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace"]


TE_FALLBACK_SCRIPT = '''
import json, torch
from torch._subclasses.fake_tensor import FakeTensorMode
from te_passes.testing.fake_gpu import constructing, fake_gpu, import_te
from te_passes.debug.graph_breaks import CompileEvents

te = import_te()
with fake_gpu("bf16"):
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode, constructing():
        lin = te.Linear(64, 128, params_dtype=torch.bfloat16, device="cuda", fuse_wgrad_accumulation=True)
        lin.weight.main_grad = torch.zeros(128, 64, dtype=torch.float32, device="cuda")
        x = torch.randn(32, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    f = torch.compile(lambda t: lin(t), backend=lambda gm, ex: gm.forward)
    with CompileEvents(reemit_warnings=False) as ev:
        try:
            with mode:
                f(x)  # Dynamo breaks the graph; the eager fallback then needs a GPU and raises
        except Exception:
            pass
print("JSON" + json.dumps(ev.to_json()))
'''


def test_real_te_linear_fallback_is_named_with_tes_reason(tmp_path):
    """te.Linear(fuse_wgrad_accumulation=True) under torch.compile: TE's own
    ``torch._dynamo.graph_break(msg="te.Linear falling back to eager: <reason>")`` and warning
    become one te.Linear eager island with TE's reason (Linear._compile_eager_fallback_reason)."""
    (tmp_path / "fb.py").write_text(TE_FALLBACK_SCRIPT)
    e = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "fb.py"], cwd=str(tmp_path), env=e, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ev = json.loads(proc.stdout.split("JSON", 1)[1])
    (island,) = ev["eager_fallbacks"]
    assert (island["module"], island["kind"], island["reason"]) == \
        ("te.Linear", "linear_config", "fuse_wgrad_accumulation (main_grad)")
    line = next(i for i, ln in enumerate(TE_FALLBACK_SCRIPT.splitlines(), 1) if "torch.compile(lambda" in ln)
    assert island["location"] == f"fb.py:{line} (<lambda>)"
    assert all(b["te"] is not None and b["te"]["module"] == "te.Linear" for b in ev["graph_breaks"])
    assert any("_forward_eager_fallback" in b["full_reason"] for b in ev["graph_breaks"])


def test_backend_only_dump_lists_graph_breaks_and_islands(tmp_path):
    """options-free backend dump (TE_PASSES_DUMP_DIR): the summary carries the process's graph
    breaks and TE eager islands, so a dump made without the CLI still names them."""
    e = dict(os.environ, PYTHONPATH=ROOT, TE_PASSES_DUMP_DIR=str(tmp_path / "d"),
             TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")
    code = "from te_passes.examples.cpu_island import main; main()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=e, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(tmp_path / "d" / "sessions.json") as f:
        (session,) = json.load(f)["sessions"]  # backend-only dumps go to a per-process session folder
    with open(tmp_path / "d" / session["dir"] / "report.json") as f:
        report = json.load(f)
    assert report["owner"] == "backend"
    assert [g["graph_id"] for g in report["graphs"]] == ["g0", "g1", "g2", "g3"]
    assert [i["module"] for i in report["eager_fallbacks"]] == ["te.Fp8Padding"]
    assert report["recompiles"]  # the ones finished before the last graph's dump


# --------------------------------------------------------------------------- user data / foreign folders
def _our_graph_report(gid: str) -> dict:
    return {"graph_id": gid, "mode": None, "uuid": {}, "te_state": {}, "stages": [], "time_ms_passes": 0.0,
            "time_ms_total": 0.0}


def _fake_old_dump(root) -> None:
    from te_passes.debug.dump_files import SCHEMA

    (root / "report.json").write_text(json.dumps({"schema": SCHEMA, "graphs": [], "passes": []}))
    (root / "g0").mkdir()
    (root / "g0" / "report.json").write_text(json.dumps(_our_graph_report("g0")))
    (root / "g0" / "te_state.json").write_text("{}")
    for name, content in (("golden", "{}"), ("g7", "{}"), ("g8", json.dumps(_our_graph_report("g0"))),
                          ("graphs", json.dumps(_our_graph_report("graphs")))):
        (root / name).mkdir()
        (root / name / "report.json").write_text(content)
        (root / name / "results.csv").write_text("important\n")


def test_clearing_an_old_dump_keeps_user_folders(tmp_path):
    """Only folders named g<N> whose report.json is our graph report for g<N> are removed."""
    from _cli import clear_old_dump

    _fake_old_dump(tmp_path)
    clear_old_dump(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g7", "g8", "golden", "graphs"]
    for name in ("golden", "g7", "g8", "graphs"):
        assert (tmp_path / name / "results.csv").read_text() == "important\n"


def test_summary_ignores_foreign_report_folders(tmp_path):
    """A folder in the dump directory holding someone else's report.json is not read as a graph."""
    from te_passes.debug.dump_summary import write_summary

    _fake_old_dump(tmp_path)
    (tmp_path / "s3" / "a").mkdir(parents=True)
    (tmp_path / "s3" / "a" / "report.json").write_text("{}")
    (tmp_path / "g9").mkdir()
    (tmp_path / "g9" / "report.json").write_text("[1, 2]")
    summary = write_summary(str(tmp_path), {"owner": "cli"})
    assert [g["graph_id"] for g in summary["graphs"]] == ["g0"]
    assert "g0" in (tmp_path / "index.md").read_text()


SIBLING = "def main():\n    raise ValueError('sibling module reached')\n"


@pytest.mark.parametrize("target", ["sub/runme.py", "sub/mymod.py:main"])
def test_file_target_imports_its_siblings(target, tmp_path):
    """Like ``python sub/runme.py``: the target file's folder is first on sys.path."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "tgt.py").write_text(SIBLING)
    (tmp_path / "sub" / "runme.py").write_text("from tgt import main\nif __name__ == '__main__':\n    main()\n")
    (tmp_path / "sub" / "mymod.py").write_text("from tgt import main\n")
    proc = run_cli("dump", target, "--out", "d", cwd=str(tmp_path))
    assert proc.returncode == 1, proc.stderr
    line = _one_error_line(proc)
    assert "raised ValueError: sibling module reached" in line, line


STRAY_TARGET = '''
import torch


def main():
    own = torch.compile(lambda x: torch.sin(x) + 1, backend="te_inductor",
                        options={"te_passes.dump_dir": "elsewhere"})
    own(torch.randn(8))
    plain = torch.compile(lambda x: torch.cos(x) * 2, backend="te_inductor")
    plain(torch.randn(8))
'''


def test_dump_collects_graphs_with_their_own_dump_dir(tmp_path):
    """A torch.compile with options={"te_passes.dump_dir": ...} dumps there; te-passes dump copies
    that graph under --out, lists it and warns where it went. Also: graphs[].mode is "default"
    (not null) for a compile without mode; no TE op -> "no TE modules"; the dynamo_pgo warning
    that dump's own force_disable_caches causes is not reported; --disable before TARGET."""
    (tmp_path / "stray.py").write_text(STRAY_TARGET)
    proc = run_cli("dump", "--disable", "insert_early_frees", "stray.py:main", "--out", "d", cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "d" / "report.json").read_text())
    assert [g["graph_id"] for g in report["graphs"]] == ["g0", "g1"]
    (session,) = json.loads((tmp_path / "elsewhere" / "sessions.json").read_text())["sessions"]
    where = os.path.join("elsewhere", session["dir"])  # a backend-only dump: its process's session folder
    assert report["elsewhere"] == [{"graph_id": "g0", "dump_dir": where, "copied": True}]
    assert (tmp_path / where / "g0" / "report.json").is_file()
    assert (tmp_path / "d" / "g0" / "dynamo" / "input.tegraph").is_file()
    assert f"g0 was compiled with its own te_passes.dump_dir: its dump went to {where!r} (copied here)" in proc.stdout
    assert f"its dump went to {where!r}" in (tmp_path / "d" / "index.md").read_text()
    assert [g["mode"] for g in report["graphs"]] == ["default", "default"]
    assert [g["te_ops"] for g in report["graphs"]] == [0, 0]
    assert "TE eager islands: none (no TE modules in the compiled graphs)" in proc.stdout
    assert not any("dynamo_pgo" in w["message"] for w in report["warnings"]), report["warnings"]
    assert "warnings:" not in proc.stdout
    assert report["disabled"] == ["insert_early_frees"]


def test_disable_takes_one_value_per_flag(tmp_path):
    from te_passes.cli import build_parser

    p = build_parser()
    a = p.parse_args(["dump", "--disable", "a,b", "t.py:main", "--disable", "c"])
    assert (a.target, a.disable) == ("t.py:main", ["a,b", "c"])
    a = p.parse_args(["replay", "--disable", "x", "g0"])
    assert (a.path, a.disable) == ("g0", ["x"])


def test_index_md_cells_match_the_terminal(tmp_path):
    """Memory cells are plain (not JSON-quoted); pool check / other records carry a detail text."""
    from te_passes.debug.dump_summary import build_summary, render_index

    stage = {"graph_id": "g0.fwd", "stage": "post_grad_fwd", "facts": {}, "runs": [
        {"name": "check_cudagraph_pool", "status": "ok", "changed": False, "time_ms": 0.1, "nodes_before": 3,
         "nodes_after": 3, "records": [{"kind": "pool_check", "node": None, "findings": 0, "cudagraphs": False,
                                        "allocated_values": 9}]},
        {"name": "insert_early_frees", "status": "ok", "changed": False, "time_ms": 0.1, "nodes_before": 3,
         "nodes_after": 3, "records": [{"kind": "saved_roles", "node": None, "count": 0, "roles": {}},
                                       {"kind": "memory", "node": None, "peak_before": 1168, "peak_after": 1168,
                                        "peak_node_after": "linear"}]}]}
    g = {**_our_graph_report("g0"), "stages": [stage]}
    text = render_index(build_summary([g], {}), str(tmp_path))
    assert "| g0.fwd | post_grad_fwd | insert_early_frees | 1168 | 1168 | linear |" in text, text
    assert "| check_cudagraph_pool | pool_check |  | 0 findings, 9 allocated values, cudagraphs off |" in text
    assert "| saved_roles |  | count=0, roles={} |" in text
    assert '"linear"' not in text


def test_location_columns_keep_the_line_number():
    from te_passes.cli.show import _short_left

    loc = "/very/long/path/" + "x" * 80 + "/model_file.py:123 (forward)"
    cut = _short_left(loc, 50)
    assert len(cut) == 50 and cut.endswith("model_file.py:123 (forward)") and cut.startswith("…")


def test_list_json_types(tmp_path):
    proc = run_cli("list", "--json", cwd=str(tmp_path))
    rows = json.loads(proc.stdout)
    for r, c in zip(rows, registered()):
        assert r["enabled"] is True
        assert isinstance(r["stages"], list) and set(r["stages"]) == {s.value for s in c.stages}


@pytest.mark.parametrize("case", ["dir_target", "interrupt"])
def test_target_messages(case, tmp_path):
    (tmp_path / "d_file").mkdir()
    (tmp_path / "intr.py").write_text("def main():\n    raise KeyboardInterrupt\n")
    args, code, expect = {"dir_target": (["dump", "d_file"], 2, "target d_file is a directory, not a Python file"),
                          "interrupt": (["dump", "intr.py:main"], 130, "target intr.py:main interrupted")}[case]
    proc = run_cli(*args, cwd=str(tmp_path))
    assert proc.returncode == code, proc.stderr
    assert expect in _one_error_line(proc)


@pytest.mark.parametrize("foreign", ["report.json", "index.md"])
def test_dump_does_not_overwrite_foreign_top_level_files(foreign, tmp_path):
    from te_passes.cli import CliError
    from _cli import clear_old_dump

    (tmp_path / foreign).write_text("{}")
    with pytest.raises(CliError, match="not overwriting"):
        clear_old_dump(str(tmp_path))
    assert (tmp_path / foreign).read_text() == "{}"


def test_stray_graph_whose_own_dump_failed_gets_its_report(tmp_path):
    from te_passes.cli.dump_cmd import _collect_strays
    from te_passes.debug.dump_summary import elsewhere_warnings, read_graph_report
    from te_passes.report import CompileReport

    rep = CompileReport(graph_id="g5")
    rep.dump_dir = str(tmp_path)  # our writer was given --out but wrote nothing (its failure is logged)
    strays = _collect_strays(str(tmp_path), [rep])
    assert strays == [{"graph_id": "g5", "dump_dir": None, "copied": False, "dump_failed": True}]
    assert read_graph_report(str(tmp_path), "g5")["graph_id"] == "g5"
    assert "writing its dump failed" in elsewhere_warnings({"elsewhere": strays})[0]


def test_dump_with_a_bad_te_passes_env_value_is_bad_input_exit_2(tmp_path):
    """A TE_PASSES_* value the options refuse is bad input (exit 2, docs/cli.md), not a failed target."""
    proc = run_cli("dump", "--example", "linear-bf16", "--out", "D", cwd=str(tmp_path),
                   env={"TE_PASSES_STRICT": "maybe"})
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-1500:])
    assert "TePassesOptionError" in proc.stderr and "must be a bool" in proc.stderr
    assert not (tmp_path / "D").exists()
