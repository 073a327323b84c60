"""The dump directory of ``te-passes dump`` / ``replay --out``: its manifest (the only files a later
dump removes), refusal of non-dump directories, staging inside it, and the journaled commit that
replaces the earlier dump in one step (undone after a kill by the next run). Nothing is written
or deleted through a symbolic link. See docs/cli.md, "How a dump directory is written"."""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import sys
from typing import Iterable, Sequence

from te_passes._json import read_json_file, read_json_or_none
from te_passes.cli._common import CliError, EXIT_FAIL


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
    """What a dump into ``path`` may replace: the relative paths of the earlier dump's files (its manifest, or
    for an older dump the files of :data:`_LEGACY_GRAPH_FILE` layout), ``None`` when ``path`` holds no
    earlier dump.

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
    data = read_json_or_none(rp)
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
        data = read_json_file(p)
    except (OSError, UnicodeDecodeError, ValueError) as e:
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


#: The commit journal: present only while :func:`_commit` moves files (its removal is the commit
#: point); a later ``dump`` / ``replay --out`` / ``show`` finding one undoes the partial commit.
JOURNAL = ".te_passes_commit.json"
JOURNAL_SCHEMA = "te_passes.dump_commit/1"
_STAGE_PREFIX, _TRASH_PREFIX = ".te_passes-stage-", ".te_passes-old-"
_WORK_DIR = re.compile(r"\.te_passes-(?:stage|old)-[A-Za-z0-9_]+")


def _check_path(root: str, rel: str, *, what: str) -> str:
    """``root/rel`` when no component of ``rel`` is a symbolic link or on another filesystem than
    ``root`` and the last one, if present, is a regular file (``os.lstat``: nothing is followed).

    Raises:
        CliError: naming the component (exit 2; nothing was touched).
    """
    norm = os.path.normpath(rel)
    if os.path.isabs(norm) or norm == ".." or norm.startswith(".." + os.sep) or norm in ("", "."):
        raise CliError(f"{what} {rel!r:.80} is outside {root}; not touching it: choose another --out")
    dev = os.stat(root).st_dev  # --out itself may be a link to a folder (followed once)
    cur = root
    parts = norm.split(os.sep)
    for i, part in enumerate(parts):
        cur = os.path.join(cur, part)
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            return os.path.join(root, norm)
        kind = "file" if i == len(parts) - 1 else "folder"
        if stat.S_ISLNK(st.st_mode):
            raise CliError(f"{cur} is a symbolic link; a dump never writes or deletes through one: remove it or "
                           f"choose another --out")
        if st.st_dev != dev:
            raise CliError(f"{cur} is on another filesystem than {root} (a mount point); a dump is committed by "
                           f"renames within one filesystem: choose another --out")
        if kind == "folder" and not stat.S_ISDIR(st.st_mode) or kind == "file" and not stat.S_ISREG(st.st_mode):
            raise CliError(f"{cur} is not a regular {kind}; not touching it: choose another --out")
    return os.path.join(root, norm)


def _files_under(top: str) -> list[str]:
    """Relative paths of the regular files below ``top`` (symbolic links are not followed;
    a link or special file there is an error: a staging folder holds only what we wrote)."""
    out = []
    for dirpath, dirs, names in os.walk(top):
        for n in names + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]:
            p = os.path.join(dirpath, n)
            if not stat.S_ISREG(os.lstat(p).st_mode):
                raise CliError(f"{p} is not a regular file; the dump is not committed")
            out.append(os.path.relpath(p, top))
    return sorted(out)


def _write_json_atomic(path: str, data: dict) -> None:
    """``data`` as JSON at ``path`` (:func:`te_passes.debug.dump_files.atomic_write`: a fresh file fsynced, then
    renamed), its folder fsynced."""
    from te_passes.debug.dump_files import atomic_write

    atomic_write(path, json.dumps(data, indent=1))
    _fsync_dir(os.path.dirname(path))


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _move(src: str, dst: str) -> None:
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    os.rename(src, dst)


def _undo(path: str, journal: dict) -> None:
    """Put ``path`` back as it was before the commit ``journal`` describes: new files moved in go
    back to the staging folder, the earlier dump's files come back from the trash folder. Each
    step is a rename that is a no-op when already done, so an interrupted undo can run again."""
    stage, trash = os.path.join(path, journal["stage"]), os.path.join(path, journal["trash"])
    for rel in journal["new"]:
        dest, src = os.path.join(path, rel), os.path.join(stage, rel)
        if os.path.lexists(dest) and not os.path.lexists(src):
            _move(dest, src)
    for rel in journal["old"]:
        if os.path.lexists(os.path.join(trash, rel)):
            _move(os.path.join(trash, rel), os.path.join(path, rel))


def _read_journal(path: str) -> dict | None:
    p = os.path.join(path, JOURNAL)
    if not os.path.lexists(p):
        return None
    try:
        j = read_json_file(_check_path(path, JOURNAL, what="the commit journal"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CliError(f"{p} is not readable ({type(e).__name__}: {e}); {path} holds an interrupted dump commit: "
                       f"remove {p} by hand after checking the folder") from None
    ok = isinstance(j, dict) and j.get("schema") == JOURNAL_SCHEMA and all(
        isinstance(j.get(k), str) and _WORK_DIR.fullmatch(j[k]) for k in ("stage", "trash")) and all(
        isinstance(j.get(k), list) and all(isinstance(f, str) for f in j[k]) for k in ("old", "new"))
    if not ok:
        raise CliError(f"{p} is not a te_passes commit journal ({JOURNAL_SCHEMA}); not touching {path}")
    for rel in (*j["old"], *j["new"]):
        _check_path(path, rel, what=f"{p} lists")
    return j


def settle(path: str) -> str | None:
    """Finish what a killed run left in dump directory ``path`` (call with its lock held): an interrupted
    commit (:data:`JOURNAL`) is undone, so the earlier dump is whole again; staging and trash folders of
    killed runs are removed.

    Raises:
        CliError: the journal is unreadable or names paths outside ``path`` (nothing touched).
    """
    import shutil

    if not os.path.isdir(path):
        return None
    notes = []
    j = _read_journal(path)
    if j is not None:
        _undo(path, j)
        os.remove(os.path.join(path, JOURNAL))
        _fsync_dir(path)
        notes.append(f"undid an interrupted dump commit in {path} (the earlier dump is back)")
    stale = [n for n in os.listdir(path) if _WORK_DIR.fullmatch(n) and not os.path.islink(os.path.join(path, n))]
    for n in stale:
        shutil.rmtree(os.path.join(path, n), ignore_errors=True)
    if stale:
        notes.append(f"removed {len(stale)} staging folder(s) left by killed runs ({', '.join(sorted(stale)[:3])})")
    return "; ".join(notes) or None


def _remove_empty_dirs(path: str, rels: Iterable[str]) -> None:
    dirs: set[str] = set()
    for rel in rels:
        d = os.path.dirname(rel)
        while d:
            dirs.add(d)
            d = os.path.dirname(d)
    for d in sorted(dirs, key=lambda x: x.count(os.sep), reverse=True):
        try:
            os.rmdir(os.path.join(path, d))
        except OSError:  # not empty (a user's file) or already gone
            pass


def _old_paths(path: str) -> list[str]:
    """The earlier dump's files in ``path`` that exist (:func:`_check_old_dump`, its manifest
    included), each checked by :func:`_check_path` (no link, no mount point on the way).

    Raises:
        CliError: see :func:`_check_old_dump` and :func:`_check_path`.
    """
    files = _check_old_dump(path) or []
    return [f for f in files + [MANIFEST] if os.path.lexists(_check_path(path, f, what="the manifest lists"))]


def _commit(stage: str, path: str) -> None:
    """Replace the earlier dump in ``path`` by the finished one in ``stage`` (a folder inside ``path``, so
    every move is a rename within one filesystem), as one step: the journal (:data:`JOURNAL`) is written,
    the earlier dump's files are renamed into a trash folder, the new ones (their manifest included) into
    place, and removing the journal commits.

    Raises:
        CliError: a path to write or remove crosses a symbolic link or a mount point, or a new
            file would replace a file the earlier dump did not write (checked before any move).
        OSError: a rename failed (the earlier dump is back in place).
    """
    import shutil
    import signal
    import tempfile
    import threading

    old = _old_paths(path)
    new = _files_under(stage)
    _write_json_atomic(os.path.join(stage, MANIFEST), {"schema": MANIFEST_SCHEMA,
                                                       "files": sorted(n for n in new if n != MANIFEST)})
    new = sorted(set(new) | {MANIFEST})
    old_set = set(os.path.normpath(f) for f in old)
    for rel in new:
        dest = _check_path(path, rel, what="a new file")
        if os.path.lexists(dest) and os.path.normpath(rel) not in old_set:
            raise CliError(f"{dest} is not from the earlier dump (not in its manifest); not overwriting it: move "
                           f"it away or choose another --out")
    trash = tempfile.mkdtemp(prefix=_TRASH_PREFIX, dir=path)
    journal = {"schema": JOURNAL_SCHEMA, "stage": os.path.basename(stage), "trash": os.path.basename(trash),
               "old": old, "new": new}
    pending: list[int] = []
    saved = {}
    if threading.current_thread() is threading.main_thread():  # hold the signals (any thread may receive them)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            saved[sig] = signal.signal(sig, lambda signum, _frame: pending.append(signum))
    try:
        _write_json_atomic(os.path.join(path, JOURNAL), journal)
        try:
            for rel in old:
                _move(os.path.join(path, rel), os.path.join(trash, rel))
            for rel in new:
                _move(os.path.join(stage, rel), os.path.join(path, rel))
            _fsync_dir(path)
        except BaseException:
            _undo(path, journal)
            os.remove(os.path.join(path, JOURNAL))
            raise
        os.remove(os.path.join(path, JOURNAL))  # the commit point
        _fsync_dir(path)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        if pending:
            shutil.rmtree(trash, ignore_errors=True)
            signal.raise_signal(pending[0])  # delivered now, to the handler it was meant for
    shutil.rmtree(trash, ignore_errors=True)
    _remove_empty_dirs(path, set(old) - set(new))


def _overlaps(a: str, b: str) -> bool:
    ra, rb = os.path.realpath(a), os.path.realpath(b)
    return ra == rb or ra.startswith(rb.rstrip(os.sep) + os.sep) or rb.startswith(ra.rstrip(os.sep) + os.sep)


@contextlib.contextmanager
def staged_out(path: str, *, sources: Sequence[str] = ()):
    """Yield a staging folder for a dump into ``path`` (``--out``) and commit it only if the body succeeds.

    Raises:
        CliError: overlap with a source, foreign files, not writable, locked by another run,
            symbolic links or mount points in the way.
    """
    import shutil
    import tempfile

    from te_passes.debug.dump_files import DumpDirError, DumpDirLocked, dir_lock, ensure_writable_dir
    from te_passes.debug.dump_sessions import write_errors

    path = os.path.abspath(path)
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
    lock_existed = os.path.lexists(lock_file)
    stage = None
    ok = False
    try:
        with dir_lock(path, blocking=False):
            note = settle(path)
            if note:
                print(f"te-passes: note: {note}", file=sys.stderr, flush=True)
            _old_paths(path)  # links / mount points in the way: refused before the target runs
            stage = tempfile.mkdtemp(prefix=_STAGE_PREFIX, dir=path)
            if os.lstat(stage).st_dev != os.stat(path).st_dev:  # pragma: no cover - a folder inside path
                raise CliError(f"staging folder {stage} is not on the filesystem of {path}")
            yield stage
            errors = write_errors(stage)
            if errors:
                raise CliError(f"writing the dump failed ({len(errors)} write error{'s' if len(errors) > 1 else ''}, "
                               f"first: {errors[0]}); {path} is unchanged", EXIT_FAIL)
            _commit(stage, path)
            ok = True
    except DumpDirLocked as e:
        raise CliError(str(e)) from None
    except OSError as e:
        if isinstance(e, DumpDirError):
            raise CliError(str(e)) from None
        raise CliError(f"writing the dump failed: {type(e).__name__}: {e}; {path} is unchanged", EXIT_FAIL) from None
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


def settle_for_reading(path: str) -> None:
    """Before ``show`` / ``replay`` read dump directory ``path``: when a killed run left an
    interrupted commit there (:data:`JOURNAL`), undo it under the directory's lock (:func:`settle`)
    so what is read is one whole dump, and say so on stderr.

    Raises:
        CliError: another process is writing ``path`` (its lock is held), or the journal is bad.
    """
    if not os.path.isdir(path) or not os.path.lexists(os.path.join(path, JOURNAL)):
        return
    from te_passes.debug.dump_files import DumpDirError, dir_lock

    try:
        with dir_lock(path, blocking=False):
            note = settle(path)
    except DumpDirError as e:
        raise CliError(str(e)) from None
    if note:
        print(f"te-passes: note: {note}", file=sys.stderr, flush=True)
