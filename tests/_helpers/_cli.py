"""The ``te-passes`` CLI run as a user runs it (a subprocess of ``python -m te_passes.cli``), for
the tests of tests/cli/ and tests/debug/."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

#: The repository root.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cli(*args: str, cwd: str, env: dict[str, str] | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    e.pop("TE_PASSES_DISABLE", None)
    e.pop("TE_PASSES_DUMP_DIR", None)
    e.pop("TORCH_TRACE", None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "te_passes.cli", *args], cwd=cwd, env=e,
                          capture_output=True, text=True, timeout=timeout)


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("te-passes: error: "), lines[0]
    return lines[0]


def snapshot(root) -> dict[str, str]:
    out = {}
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            if n == ".te_passes_sessions.lock":  # the lock's holder note comes and goes
                continue
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, root)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def clear_old_dump(path: str) -> None:
    """Remove the earlier te_passes dump in ``path`` as ``dump``'s commit does (only the files it
    wrote, never through a symbolic link; refusals of ``te_passes.cli.dumpdir._check_old_dump``)."""
    import shutil
    import tempfile

    from te_passes.cli.dumpdir import _TRASH_PREFIX, _move, _old_paths, _remove_empty_dirs

    old = _old_paths(path)
    trash = tempfile.mkdtemp(prefix=_TRASH_PREFIX, dir=path)
    for rel in old:
        _move(os.path.join(path, rel), os.path.join(trash, rel))
    shutil.rmtree(trash, ignore_errors=True)
    _remove_empty_dirs(path, old)


def dump_example(tmp_path_factory, example: str, name: str = "base") -> Path:
    """``te-passes dump --example EXAMPLE`` into a fresh temporary folder (TE graphs captured on
    fake CUDA tensors); returns the dump folder. Skips without TE."""
    import pytest

    pytest.importorskip("transformer_engine.pytorch")
    d = tmp_path_factory.mktemp(name)
    proc = run_cli("dump", "--example", example, "--out", str(d / "D"), cwd=str(d))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return d / "D"
