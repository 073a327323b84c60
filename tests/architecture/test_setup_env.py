"""scripts/setup_env.sh's torch switch (issue 40), run against stub venvs (nothing is installed): the
venv per torch version, the pins every pip call gets (our constraints file, replacing a machine-wide
pip constraint), curand for torch 2.15, a TE rebuilt without pip's wheel cache when the venv's torch
changed, and the refusal of a torch it does not know. The stub ``python`` answers the script's
``have DIST VERSION`` checks from a list of installed distributions; the stub ``pip`` records its
arguments and ``PIP_CONSTRAINT``."""

from __future__ import annotations

import hashlib
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "setup_env.sh")
DEV = ["ninja", "pybind11", "wheel", "pytest", "hypothesis", "rich", "pytest-timeout", "import-linter", "te-passes"]

_PYTHON = """#!/bin/bash
# have DIST VERSION: installed when "DIST VERSION" or "DIST *" is listed; -c CODE: succeeds
if [ "$1" = "-" ]; then
  cat >/dev/null
  grep -qxF -e "$2 $3" -e "$2 *" "$(dirname "$0")/../installed" || { [ "$3" = "*" ] && grep -q "^$2 " "$(dirname "$0")/../installed"; }
  exit $?
fi
exit 0
"""
_PIP = """#!/bin/bash
echo "PIP_CONSTRAINT=$PIP_CONSTRAINT $*" >> "$(dirname "$0")/../pip.log"
"""


def _venv(path, installed: list[str]):
    (path / "bin").mkdir(parents=True)
    for name, text in (("python", _PYTHON), ("pip", _PIP)):
        (path / "bin" / name).write_text(text)
        (path / "bin" / name).chmod(0o755)
    (path / "installed").write_text("".join(f"{d}\n" for d in installed + [f"{n} *" for n in DEV]))
    digest = hashlib.sha256(open(os.path.join(ROOT, "pyproject.toml"), "rb").read()).hexdigest()[:16]
    (path / ".te_passes_editable").write_text(f"{ROOT} {digest}\n")
    return path


def _run(tmp_path, **env):
    e = {k: v for k, v in os.environ.items() if k not in ("TORCH", "TE_PASSES_VENV", "PIP_CONSTRAINT")}
    e.update(HOME=str(tmp_path), **env)
    return subprocess.run(["bash", SCRIPT], env=e, capture_output=True, text=True, timeout=120)


def _pip_calls(venv) -> list[str]:
    log = venv / "pip.log"
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize("torch_v,toolkit", [("2.15.0", "13.2.2"), ("2.14.1", "13.0.3")])
def test_default_venv_per_torch_version_is_only_checked_when_complete(tmp_path, torch_v, toolkit):
    venv = _venv(tmp_path / ".cache" / "te_passes" / f"venv-torch{torch_v}",
                 [f"torch {torch_v}", f"cuda-toolkit {toolkit}", "nvidia-curand *", "transformer_engine 2.20.2",
                  "transformer_engine_torch 2.20.2"])
    (venv / ".te_built_against_torch").write_text(f"{torch_v}\n")
    proc = _run(tmp_path, **({} if torch_v == "2.15.0" else {"TORCH": torch_v}))  # 2.15.0: the default
    assert proc.returncode == 0, proc.stderr
    assert f"[setup 1/5] venv {venv} exists" in proc.stdout, proc.stdout
    assert f"Transformer Engine 2.20.2 (built against torch {torch_v}) present" in proc.stdout, proc.stdout
    assert f"(torch {torch_v}, transformer_engine 2.20.2" in proc.stdout
    assert _pip_calls(venv) == []


def test_torch_change_installs_pins_and_rebuilds_te_without_the_wheel_cache(tmp_path):
    """A venv whose TE was built against torch 2.14.1, asked for 2.15.0 (TE_PASSES_VENV): torch,
    cuda-toolkit 13.2.2 with curand, then only transformer_engine_torch rebuilt, --no-cache-dir."""
    venv = _venv(tmp_path / "v", ["torch 2.14.1", "cuda-toolkit 13.0.3", "nvidia-curand *",
                                  "transformer_engine 2.20.2", "transformer_engine_torch 2.20.2"])
    (venv / ".te_built_against_torch").write_text("2.14.1\n")
    proc = _run(tmp_path, TORCH="2.15.0", TE_PASSES_VENV=str(venv))
    assert proc.returncode == 0, proc.stderr
    calls = _pip_calls(venv)
    pins = os.path.join(ROOT, "scripts", "constraints", "torch-2.15.0.txt")
    assert len(calls) == 2 and all(c.startswith(f"PIP_CONSTRAINT={pins} install ") for c in calls), calls
    assert "torch==2.15.0 cuda-toolkit[crt,cccl,curand]==13.2.2" in calls[0], calls
    assert "--no-cache-dir" in calls[1] and calls[1].endswith("--force-reinstall --no-deps transformer_engine_torch==2.20.2")
    assert (venv / ".te_built_against_torch").read_text().strip() == "2.15.0"


def test_fresh_toolchain_builds_te_with_its_deps_without_the_wheel_cache(tmp_path):
    venv = _venv(tmp_path / "v", [])
    proc = _run(tmp_path, TORCH="2.14.1", TE_PASSES_VENV=str(venv))
    assert proc.returncode == 0, proc.stderr
    calls = _pip_calls(venv)
    assert len(calls) == 2, calls
    assert "torch==2.14.1 cuda-toolkit[crt,cccl,curand]==13.0.3" in calls[0]
    assert "--no-cache-dir" in calls[1] and calls[1].endswith("transformer-engine[pytorch]==2.20.2"), calls
    assert "--force-reinstall" not in calls[1]
    assert (venv / ".te_built_against_torch").read_text().strip() == "2.14.1"


def test_venv_from_before_the_stamp_is_adopted_when_its_torch_is_right(tmp_path):
    """A venv set up by the earlier script (no stamp; torch already the one asked for) is not rebuilt."""
    venv = _venv(tmp_path / "v", ["torch 2.14.1", "cuda-toolkit 13.0.3", "nvidia-curand *",
                                  "transformer_engine 2.20.2", "transformer_engine_torch 2.20.2"])
    proc = _run(tmp_path, TORCH="2.14.1", TE_PASSES_VENV=str(venv))
    assert proc.returncode == 0, proc.stderr
    assert _pip_calls(venv) == []
    assert (venv / ".te_built_against_torch").read_text().strip() == "2.14.1"


def test_unknown_torch_is_refused_naming_the_supported_ones(tmp_path):
    proc = _run(tmp_path, TORCH="2.13.0", TE_PASSES_VENV=str(tmp_path / "v"))
    assert proc.returncode == 2
    assert "TORCH=2.13.0 is not supported (supported: 2.15.0, 2.14.1" in proc.stderr, proc.stderr
    assert not (tmp_path / "v").exists()


@pytest.mark.parametrize("fail", [None, "test TORCH=2.14.1 *", "test PYTEST_ARGS=-p no:cacheprovider *"])
def test_ci_lints_first_then_tests_both_torch_versions_and_fails_when_either_fails(tmp_path, fail):
    """.ci/run against a stub ``make`` (records its arguments; fails the call whose arguments hold
    match the glob ``fail``): lint, the default's tests, then TORCH=2.14.1's; both run, either failing
    fails CI."""
    import shutil

    shutil.copytree(os.path.join(ROOT, ".ci"), tmp_path / "repo" / ".ci")
    (tmp_path / "bin").mkdir()
    stub = tmp_path / "bin" / "make"
    (tmp_path / "fail").write_text(fail or "no call matches this")
    stub.write_text(f"#!/bin/bash\necho \"$*\" >> {tmp_path}/make.log\n"
                    f"[[ \"$*\" == $(cat {tmp_path}/fail) ]] && exit 2\nexit 0\n")
    stub.chmod(0o755)
    e = {k: v for k, v in os.environ.items() if k != "CI_OTHER_TESTS"}
    e["PATH"] = f"{tmp_path / 'bin'}:{e['PATH']}"
    proc = subprocess.run(["bash", str(tmp_path / "repo" / ".ci" / "run")], env=e, capture_output=True, text=True,
                          timeout=60)
    calls = (tmp_path / "make.log").read_text().splitlines()
    assert calls[0] == "lint" and calls[1].startswith("test PYTEST_ARGS=-p no:cacheprovider"), calls
    assert calls[2].startswith("test TORCH=2.14.1 PYTEST_ARGS=-p no:cacheprovider tests/"), calls
    # the listed torch-2.15-only failures (none now): deselected from the default run, run on torch 2.14.1
    with open(os.path.join(ROOT, ".ci", "known-failures-torch2.15.txt")) as f:
        known = [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
    assert all(f"--deselect {t} " in calls[1] + " " and t in calls[2].split() for t in known), calls
    assert calls[1].count("--deselect") == len(known), calls
    assert "tests/runtime/test_untouched.py" in calls[2] and "tests/cli/test_cli.py" in calls[2], calls
    assert len(calls) == 3
    if fail is None:
        assert proc.returncode == 0 and "CI: torch 2.14.1: passed" in proc.stdout, proc.stdout + proc.stderr
    else:
        failed = "torch 2.14.1" if "TORCH=2.14.1" in fail else "torch 2.15.0 (default)"
        assert proc.returncode == 1 and f"CI: {failed}: failed" in proc.stderr, proc.stdout + proc.stderr


@pytest.mark.parametrize("known", [[], ["tests/a.py::t", "tests/b.py::t2[x-y]"]], ids=["empty", "two"])
def test_ci_deselects_each_known_torch215_failure_and_runs_it_on_214(tmp_path, known):
    """.ci/run with a known-failures list of its own (stub ``make`` as above): each node id (``[params]``
    not globbed) is deselected from the torch 2.15 run and added to the 2.14.1 run; a list of comments only
    deselects nothing and CI still passes."""
    import shutil

    shutil.copytree(os.path.join(ROOT, ".ci"), tmp_path / "repo" / ".ci")
    (tmp_path / "repo" / ".ci" / "known-failures-torch2.15.txt").write_text(
        "# comment\n" + "".join(t + "\n" for t in known))
    (tmp_path / "bin").mkdir()
    stub = tmp_path / "bin" / "make"
    stub.write_text(f"#!/bin/bash\necho \"$*\" >> {tmp_path}/make.log\nexit 0\n")
    stub.chmod(0o755)
    e = {k: v for k, v in os.environ.items() if k != "CI_OTHER_TESTS"}
    e["PATH"] = f"{tmp_path / 'bin'}:{e['PATH']}"
    proc = subprocess.run(["bash", str(tmp_path / "repo" / ".ci" / "run")], env=e, capture_output=True, text=True,
                          timeout=60)
    calls = (tmp_path / "make.log").read_text().splitlines()
    assert len(calls) == 3 and proc.returncode == 0, (calls, proc.stdout + proc.stderr)
    assert calls[1].split()[3:] == [w for t in known for w in ("--deselect", t)], calls
    assert all(t in calls[2].split() for t in known) and "comment" not in calls[1] + calls[2], calls
