"""Crash-safe file writes: nothing half-written is ever taken as done.

Every file a stage produces goes through here or follows the same recipe: write under a temporary
name in the same directory, fsync the file, rename over the final name (atomic on POSIX), fsync the
directory so the rename itself survives a power cut. A reader therefore sees the old file, the new
file, or nothing; never a torn one. Temporary names start with "." and contain ".tmp-" so that
stores can recognise and delete leftovers of a crash.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

TMP_MARKER = ".tmp-"


def tmp_path_for(path: Path) -> Path:
    """A temporary sibling of `path`, unique per process, recognisable as a leftover."""
    return path.with_name(f".{path.name}{TMP_MARKER}{os.getpid()}")


def is_tmp_leftover(path: Path) -> bool:
    return path.name.startswith(".") and TMP_MARKER in path.name


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, final: Path) -> None:
    """fsync `tmp`, rename it to `final`, fsync the directory."""
    fsync_file(tmp)
    os.replace(tmp, final)
    fsync_dir(final.parent)


@contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Build a directory under a temporary name; on success fsync its files, replace `final` with it,
    fsync the parent. On error the temporary dir is removed and `final` is untouched. The temporary name
    is fixed per target, so a leftover of a crash is cleared by the next attempt."""
    final = Path(final)
    tmp = final.with_name(f".{final.name}{TMP_MARKER}dir")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        for path in tmp.iterdir():
            fsync_file(path)
        fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    fsync_dir(final.parent)


def private_opener(path: str, flags: int) -> int:
    """For open(..., opener=): a file only its owner can read (0600), also if it existed with a wider mode."""
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def atomic_write_bytes(path: Path, data: bytes, private: bool = False) -> None:
    """Replace `path` atomically. private: the file is 0600 from the start (else the umask's mode, usually 0644)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path_for(path)
    try:
        with open(tmp, "wb", opener=private_opener if private else None) as f:
            f.write(data)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    commit(tmp, path)


def atomic_write_text(path: Path, text: str, private: bool = False) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), private)


def append_line_durably(path: Path, line: str) -> None:
    """Append one line and fsync: the journal write behind every manifest.

    A crash can leave at most a torn last line (no trailing newline); readers drop it.
    """
    if "\n" in line:
        raise ValueError("a journal line must not contain a newline")
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def atomic_symlink(link: Path, target: Path) -> None:
    """Point `link` at `target` (a path relative to the link's directory, or absolute), replacing what was there
    in one rename: a reader sees the old link or the new one. The shared stores' links and a lineage's
    `current` switch are made so."""
    link = Path(link)
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}{TMP_MARKER}link")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, link)
    fsync_dir(link.parent)


def try_exclusive_lock(path: Path):
    """An open file holding an exclusive flock on `path`, or None if another process holds it. Closing the file
    (or the process ending, even by SIGKILL) releases it."""
    lock = open(path, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return None
    return lock
