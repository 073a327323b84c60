"""Small CLI / backend defects (issue 16, item 14): a closed pipe is not an error, --version and
``python -m te_passes``, the summary names TE_PASSES_DUMP_DIR when that set the dump directory,
``--precision`` is what the summary reports, a warm-cache compile says its AOT stages did not
run, no invalid escapes in the sources, no ANSI codes from setup_env.sh in a pipe, the tlparse
``te_passes_report`` artifact emitted once per te-passes dump."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest

from _cli import ROOT, run_cli


def _env(**kw):
    e = dict(os.environ, PYTHONPATH=ROOT)
    for k in ("TE_PASSES_DISABLE", "TE_PASSES_DUMP_DIR", "TORCH_TRACE", "TORCH_LOGS"):
        e.pop(k, None)
    e.update(kw)
    return e


@pytest.mark.parametrize("argv", [["list", "--plain"], ["list", "--json"], ["--help"]])
def test_closed_pipe_is_not_an_error(argv, tmp_path):
    """``te-passes list | head -1``: the reader is gone; exit 0, nothing on stderr."""
    code = (f"import os, sys\nr, w = os.pipe()\nos.close(r)\nos.dup2(w, 1)\n"
            f"from te_passes.cli import main\ntry:\n    rc = main({argv!r})\nexcept SystemExit as e:\n"
            f"    rc = e.code\nos._exit(rc or 0) if rc else sys.exit(0)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "BrokenPipeError" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    # and through a real `| head -1`
    proc = subprocess.run(f"set -o pipefail; {sys.executable} -m te_passes.cli {' '.join(argv)} | head -1",
                          shell=True, executable="/bin/bash", cwd=str(tmp_path), env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "Error" not in proc.stderr, proc.stderr


def test_version_and_python_m_te_passes(tmp_path):
    from te_passes import __version__

    for cmd in ([sys.executable, "-m", "te_passes.cli", "--version"], [sys.executable, "-m", "te_passes",
                                                                              "--version"]):
        proc = subprocess.run(cmd, cwd=str(tmp_path), env=_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == f"te-passes {__version__}"
    proc = subprocess.run([sys.executable, "-m", "te_passes", "list", "--json"], cwd=str(tmp_path), env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and json.loads(proc.stdout)


BACKEND_ONLY = textwrap.dedent("""
    import sys, torch
    opts = {"te_passes.dump_dir": sys.argv[1]} if len(sys.argv) > 1 else None
    f = torch.compile(lambda x: torch.sin(x) + 1, backend="te_inductor", options=opts)
    f(torch.randn(8, requires_grad=True)).sum().backward()
""")


def _session_report(d):
    sessions = json.loads((d / "sessions.json").read_text())["sessions"]
    return json.loads((d / sessions[-1]["dir"] / "report.json").read_text())


@pytest.mark.parametrize("how", ["env", "option"])
def test_summary_names_how_the_dump_dir_was_set(how, tmp_path):
    (tmp_path / "t.py").write_text(BACKEND_ONLY)
    d = tmp_path / "d"
    argv = [sys.executable, "t.py"] + ([str(d)] if how == "option" else [])
    env = _env(TORCHINDUCTOR_FORCE_DISABLE_CACHES="1", **({"TE_PASSES_DUMP_DIR": str(d)} if how == "env" else {}))
    proc = subprocess.run(argv, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    path = _session_report(d)["compile_path"]
    if how == "env":
        assert "TE_PASSES_DUMP_DIR" in path and "options=" not in path, path
    else:
        assert "options={'te_passes.dump_dir'" in path and "TE_PASSES_DUMP_DIR" not in path, path


def test_warm_cache_session_says_the_aot_stages_did_not_run(tmp_path):
    (tmp_path / "t.py").write_text(BACKEND_ONLY)
    env = _env(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"), TORCH_LOGS="+te_passes")
    for i in range(2):
        d = tmp_path / f"d{i}"
        proc = subprocess.run([sys.executable, "t.py", str(d)], cwd=str(tmp_path), env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
    cold, warm = _session_report(tmp_path / "d0"), _session_report(tmp_path / "d1")
    assert len(cold["graphs"][0]["stages"]) == 4 and cold["graphs"][0].get("cache_hit") is None
    assert [s.split(":")[1] for s in warm["graphs"][0]["stages"]] == ["dynamo"]
    assert warm["graphs"][0]["cache_hit"], warm["graphs"][0]
    note = "cache hit: the joint and post-grad passes did not run"
    assert note in proc.stderr, proc.stderr[-3000:]  # TORCH_LOGS=+te_passes
    sessions = json.loads((tmp_path / "d1" / "sessions.json").read_text())["sessions"]
    show = run_cli("show", str(tmp_path / "d1" / sessions[-1]["dir"]), "--plain", cwd=str(tmp_path))
    assert show.returncode == 0, show.stderr
    assert re.search(r"note: +g0: .*cache hit: the joint and post-grad passes did not run",
                     show.stdout), show.stdout


def test_precision_override_is_reported(tmp_path):
    proc = run_cli("dump", "--example", "linear-fp8", "--precision", "mxfp8", "--out", "d", cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "d" / "report.json").read_text())
    assert report["precision"] == "mxfp8"
    assert "MXFP8BlockScaling" in report["target"] and "Float8CurrentScaling" not in report["target"], report["target"]
    assert "MXFP8BlockScaling" in proc.stdout


def test_te_passes_report_artifact_emitted_once(tmp_path):
    proc = run_cli("dump", "--example", "linear-bf16", "--out", "d", cwd=str(tmp_path),
                   env={"TORCH_TRACE": str(tmp_path / "trace")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = "".join(p.read_text() for p in (tmp_path / "trace").iterdir())
    assert len(re.findall(r'"name": "te_passes_report"', text)) == 1


def test_sources_have_no_invalid_escapes():
    for dirpath, _dirs, names in os.walk(os.path.join(ROOT, "te_passes")):
        for n in names:
            if n.endswith(".py"):
                p = os.path.join(dirpath, n)
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    compile(open(p).read(), p, "exec")


def test_setup_env_has_no_ansi_codes_in_a_pipe(tmp_path):
    """Run scripts/setup_env.sh against a stub venv whose every check passes (nothing is installed)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\ncat >/dev/null\nexit 0\n")
    (venv / "bin" / "python").chmod(0o755)
    digest = hashlib.sha256(open(os.path.join(ROOT, "pyproject.toml"), "rb").read()).hexdigest()[:16]
    (venv / ".te_passes_editable").write_text(f"{ROOT} {digest}\n")
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "setup_env.sh")], env=_env(TE_PASSES_VENV=str(venv)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "[setup 5/5] te_passes installed (editable)" in proc.stdout, proc.stdout
    assert "\033" not in proc.stdout + proc.stderr
