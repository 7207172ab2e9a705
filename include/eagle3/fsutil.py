"""Crash-safe file writes: nothing half-written is ever taken as done.

Every file a stage produces goes through here or follows the same recipe: write under a temporary
name in the same directory, fsync the file, rename over the final name (atomic on POSIX), fsync the
directory so the rename itself survives a power cut. A reader therefore sees the old file, the new
file, or nothing; never a torn one. Temporary names start with "." and contain ".tmp-" so that
stores can recognise and delete leftovers of a crash.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import shutil
import stat
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


# -- trees of regular files, and removing what the project made ------------------------------------------------------
#
# A drafter directory is copied into a lineage's versions/, and run directories and stores are deleted, on the word of
# files anyone with write access to the work directory can change. Links are never followed there: a link in a
# drafter would copy its target (any file this user can read) into versions/, and a link in place of a directory to
# delete would delete the link's target. Every step goes through file descriptors opened with O_NOFOLLOW, so a link
# swapped in between a check and the act is refused too.

NOFOLLOW_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # (NONBLOCK: a FIFO never blocks the open)


class UnsafeTree(ValueError):
    """A tree that holds a symbolic link or a special file where only regular files and directories may be; the
    message names it."""


def _open_nofollow(name: str | Path, dir_fd: int | None, shown: Path) -> tuple[int, os.stat_result]:
    try:
        fd = os.open(name, NOFOLLOW_FLAGS, dir_fd=dir_fd)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UnsafeTree(f"{shown}: a symbolic link, where only regular files and directories may be") from None
        raise
    return fd, os.fstat(fd)


def _walk_regular(directory_fd: int, shown: Path, prefix: str) -> Iterator[tuple[str, int | None]]:
    """(relative path, fd) for each regular file below a directory, (relative path, None) for each subdirectory
    before its contents; the caller closes the fds. Each entry is looked at (lstat) before it is opened, so that no
    special file is ever opened (opening a device can act on it), and checked again once open."""
    for name in sorted(os.listdir(directory_fd)):
        kind = stat.S_IFMT(os.stat(name, dir_fd=directory_fd, follow_symlinks=False).st_mode)
        if kind == stat.S_IFLNK:
            raise UnsafeTree(f"{shown / name}: a symbolic link, where only regular files and directories may be")
        if kind not in (stat.S_IFREG, stat.S_IFDIR):
            raise UnsafeTree(f"{shown / name}: not a regular file (a FIFO, socket or device), where only regular "
                             "files and directories may be")
        fd, st = _open_nofollow(name, directory_fd, shown / name)
        if stat.S_IFMT(st.st_mode) != kind:
            os.close(fd)
            raise UnsafeTree(f"{shown / name}: replaced by another kind of file while it was read")
        if kind == stat.S_IFREG:
            yield f"{prefix}{name}", fd
            continue
        try:
            yield f"{prefix}{name}", None
            yield from _walk_regular(fd, shown / name, f"{prefix}{name}/")
        finally:
            os.close(fd)


@contextmanager
def _opened_dir(root: Path) -> Iterator[int]:
    fd, st = _open_nofollow(root, None, root)
    try:
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafeTree(f"{root}: not a directory")
        yield fd
    finally:
        os.close(fd)


def _sha256_fd(fd: int) -> str:
    h = hashlib.sha256()
    while block := os.read(fd, 1 << 20):
        h.update(block)
    return h.hexdigest()


def tree_digests(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every regular file under `root` (subdirectories included). Raises UnsafeTree,
    naming it, for a symbolic link or a special file anywhere, `root` itself included."""
    root = Path(root)
    digests = {}
    with _opened_dir(root) as root_fd:
        for relative, fd in _walk_regular(root_fd, root, ""):
            if fd is not None:
                try:
                    digests[relative] = _sha256_fd(fd)
                finally:
                    os.close(fd)
    return digests


def copy_regular_tree(src: Path, dst: Path) -> None:
    """Copy the regular files and directories under `src` into the existing directory `dst`, each file fsynced.
    Raises UnsafeTree, naming it, for a symbolic link or a special file anywhere in `src`, `src` included."""
    src, dst = Path(src), Path(dst)
    with _opened_dir(src) as src_fd:
        for relative, fd in _walk_regular(src_fd, src, ""):
            if fd is None:
                (dst / relative).mkdir()
                continue
            try:
                with open(dst / relative, "xb") as out:
                    while block := os.read(fd, 1 << 20):
                        out.write(block)
                    out.flush()
                    os.fsync(out.fileno())
            finally:
                os.close(fd)
    for directory, _, _ in os.walk(dst):
        fsync_dir(Path(directory))


def remove_tree_in(parent: Path, name: str) -> None:
    """Remove the directory `parent`/`name`, following no symbolic link: `parent` is opened without following a
    link in its last component, and shutil.rmtree refuses `name` (or anything below it) if it is one."""
    if "/" in name or name in ("", ".", ".."):
        raise ValueError(f"{name!r}: not a name of an entry in {parent}")
    with _opened_dir(Path(parent)) as parent_fd:
        shutil.rmtree(name, dir_fd=parent_fd)
