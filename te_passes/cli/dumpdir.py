"""The dump directory of ``te-passes dump`` / ``replay --out``: its manifest (the only files a later
dump removes), refusal of non-dump directories, and staging into a temporary sibling that is
committed only when the run succeeds."""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Iterable, Sequence

from te_passes.cli._common import CliError


#: The list of files a dump wrote into its directory (relative paths): the only files a later
#: dump or ``replay --out`` into the same directory removes.
MANIFEST = ".te_passes_manifest.json"
#: Top-level folders a dump writes (``g<N>``): a new dump may go into a folder holding only these.
_GRAPH_DIR = re.compile(r"g\d+")
MANIFEST_SCHEMA = "te_passes.dump_manifest/1"
_STAGE_DIR = r"(?:dynamo|joint|post_grad_fwd|post_grad_bwd)(?:_\d+)?"
#: Files a dump written before manifests existed holds inside a ``g<N>/`` folder (the layout of
#: :mod:`te_passes.debug.dump`): what may be removed from such a dump, nothing else.
_LEGACY_GRAPH_FILE = re.compile(rf"(?:report\.json|te_state\.json|{_STAGE_DIR}/(?:input\.py|input\.tegraph|"
                                rf"output\.py|\d\d_[A-Za-z0-9_.-]+/(?:before\.py|after\.py|diff\.patch|"
                                rf"changes\.txt)))")


def _check_old_dump(path: str) -> list[str] | None:
    """What a dump into ``path`` may replace: the relative paths of the earlier dump's files
    (its manifest, or for an older dump the files of :data:`_LEGACY_GRAPH_FILE` layout), ``None``
    when ``path`` holds no earlier dump. Removes nothing.

    Raises:
        CliError: ``path`` holds backend dump sessions, or top-level files a te_passes dump
            writes that are not from a te_passes dump (exit 2; nothing is touched).
    """
    from te_passes.debug.dump_files import SCHEMA
    from te_passes.debug.dump_summary import read_graph_report

    if not os.path.isdir(path):
        return None
    rp = os.path.join(path, "report.json")
    ours = ("report.json", "index.md", "session.json")
    if not os.path.isfile(rp) and os.path.isfile(os.path.join(path, "sessions.json")):
        raise CliError(f"{path} holds te_passes backend dump sessions (te_passes.dump_dir / TE_PASSES_DUMP_DIR; "
                       f"see {os.path.join(path, 'index.md')}); not mixing a te-passes dump into it: choose another "
                       f"--out")
    if not os.path.isfile(rp):
        clash = [n for n in ours if os.path.exists(os.path.join(path, n))]
        if clash:
            raise CliError(f"{path} holds {', '.join(clash)} but no te_passes report.json; not overwriting "
                           f"them: choose another --out")
        foreign = sorted(n for n in os.listdir(path) if not _GRAPH_DIR.fullmatch(n) and not n.startswith("."))
        if foreign:
            shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
            raise CliError(f"{path} holds {len(foreign)} entr{'y' if len(foreign) == 1 else 'ies'} that are not "
                           f"from a te_passes dump ({shown}); a dump goes into a new or empty folder, or one "
                           f"holding an earlier te_passes dump: choose another --out")
        return None
    try:
        with open(rp) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        data = None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        schema = data.get("schema") if isinstance(data, dict) else None
        what = f"schema {schema!r}, this te_passes writes {SCHEMA!r}" if isinstance(schema, str) else \
            "not a te_passes dump"
        raise CliError(f"{path} holds a report.json that is not a te_passes dump of this version ({what}); not "
                       f"overwriting it: choose another --out")
    manifest = _read_manifest(path)
    if manifest is not None:
        return manifest
    files = [n for n in ours if os.path.isfile(os.path.join(path, n))]
    for name in sorted(os.listdir(path)):
        gdir = os.path.join(path, name)
        if os.path.isdir(gdir) and not os.path.islink(gdir) and read_graph_report(path, name) is not None:
            for dirpath, _dirs, names in os.walk(gdir):
                for n in names:
                    rel = os.path.relpath(os.path.join(dirpath, n), gdir).replace(os.sep, "/")
                    if _LEGACY_GRAPH_FILE.fullmatch(rel):
                        files.append(f"{name}/{rel}")
    return files


def _read_manifest(path: str) -> list[str] | None:
    p = os.path.join(path, MANIFEST)
    if not os.path.isfile(p):
        return None
    try:
        with open(p) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CliError(f"{p} is not readable ({type(e).__name__}: {e}); not overwriting {path}: remove the "
                       f"manifest or choose another --out") from None
    files = data.get("files") if isinstance(data, dict) and data.get("schema") == MANIFEST_SCHEMA else None
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise CliError(f"{p} is not a te_passes dump manifest ({MANIFEST_SCHEMA}); not overwriting {path}: "
                       f"choose another --out")
    out = []
    for f in files:  # never outside the directory
        norm = os.path.normpath(f)
        if os.path.isabs(norm) or norm.startswith(".." + os.sep) or norm == "..":
            raise CliError(f"{p} lists {f!r}, outside {path}; not overwriting it: choose another --out")
        out.append(norm)
    return out


def _remove_files(path: str, files: Iterable[str]) -> None:
    """Remove ``path/f`` for each relative ``f`` (plain files only), then the folders they
    leave empty (never ``path`` itself, never a folder still holding anything)."""
    dirs: set[str] = set()
    for rel in files:
        p = os.path.join(path, rel)
        if os.path.isfile(p) or os.path.islink(p):
            os.remove(p)
        d = os.path.dirname(rel)
        while d:
            dirs.add(d)
            d = os.path.dirname(d)
    for d in sorted(dirs, key=lambda x: x.count(os.sep), reverse=True):
        try:
            os.rmdir(os.path.join(path, d))
        except OSError:  # not empty (a user's file) or already gone
            pass


def _clear_old_dump(path: str) -> None:
    """Remove the previous te_passes dump in ``path``: only the files it wrote (its manifest,
    or :data:`_LEGACY_GRAPH_FILE` for older dumps); see :func:`_check_old_dump` for what is refused."""
    files = _check_old_dump(path)
    if files is not None:
        _remove_files(path, files + [MANIFEST])


def _commit(stage: str, path: str) -> None:
    """Move the finished dump in ``stage`` into ``path``: the earlier dump's files are removed
    (:func:`_clear_old_dump`), every new file is moved in (``os.replace``, same filesystem) and
    the manifest lists them."""
    from te_passes.debug.dump_files import atomic_write

    new = []
    for dirpath, _dirs, names in os.walk(stage):
        for n in names:
            new.append(os.path.relpath(os.path.join(dirpath, n), stage))
    _clear_old_dump(path)
    for rel in sorted(new):
        dest = os.path.join(path, rel)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        os.replace(os.path.join(stage, rel), dest)
    atomic_write(os.path.join(path, MANIFEST), json.dumps({"schema": MANIFEST_SCHEMA, "files": sorted(new)},
                                                           indent=1))


def _overlaps(a: str, b: str) -> bool:
    ra, rb = os.path.realpath(a), os.path.realpath(b)
    return ra == rb or ra.startswith(rb.rstrip(os.sep) + os.sep) or rb.startswith(ra.rstrip(os.sep) + os.sep)


@contextlib.contextmanager
def staged_out(path: str, *, sources: Sequence[str] = ()):
    """Yield a staging folder for a dump into ``path`` (``--out``) and move it into place only
    if the body succeeds.

    Checks first (nothing touched): ``path`` is writable and holds no foreign files
    (:func:`_check_old_dump`) and does not overlap any of ``sources`` (the dump being replayed).
    Then ``path`` is locked for the whole run (:func:`te_passes.debug.dump_files.dir_lock`, the lock
    backend dump sessions use) and the body writes into a fresh folder next to it. On success
    the earlier dump's files (only those) are replaced by the new ones (:func:`_commit`); on any
    failure — an exception, ``SystemExit``, Ctrl-C — the staging folder is removed and ``path``
    is exactly as before (a folder this call created is removed again).

    Raises:
        CliError: overlap with a source, foreign files, not writable, locked by another run.
    """
    import shutil
    import tempfile

    from te_passes.debug.dump_files import DumpDirError, DumpDirLocked, dir_lock, ensure_writable_dir

    for src in sources:
        if _overlaps(path, src):
            raise CliError(f"--out {path} overlaps the dump being replayed ({src}): writing there would replace "
                           f"what is read; choose another --out")
    existed = os.path.isdir(path)
    _check_old_dump(path)
    try:
        path = ensure_writable_dir(path)
    except DumpDirError as e:
        raise CliError(str(e)) from e
    lock_file = os.path.join(path, ".te_passes_sessions.lock")
    lock_existed = os.path.exists(lock_file)
    stage = None
    ok = False
    try:
        with dir_lock(path, blocking=False):
            parent = os.path.dirname(os.path.abspath(path))
            try:
                stage = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(path))}.te_passes-tmp-",
                                         dir=parent)
            except OSError:  # a parent we cannot write to: stage inside path (same filesystem)
                stage = tempfile.mkdtemp(prefix=".te_passes-tmp-", dir=path)
            yield stage
            _commit(stage, path)
            ok = True
    except DumpDirLocked as e:
        raise CliError(str(e)) from None
    finally:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
        if not ok:
            if not lock_existed:
                with contextlib.suppress(OSError):
                    os.remove(lock_file)
            if not existed:
                with contextlib.suppress(OSError):
                    os.rmdir(path)
