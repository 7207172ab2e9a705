"""Crash-safe file writes: nothing half-written is ever taken as done.

Every file a stage produces goes through here or follows the same recipe: write under a temporary
name in the same directory, fsync the file, rename over the final name (atomic on POSIX), fsync the
directory so the rename itself survives a power cut. A reader therefore sees the old file, the new
file, or nothing; never a torn one. Temporary names start with "." and contain ".tmp-" so that
stores can recognise and delete leftovers of a crash.

Reads of what anyone with write access to the box's directories could have changed are here too: trees of regular
files, never through a link (tree_digests, copy_regular_tree, remove_tree_in), and one small regular file that a
config names, never a link, a special file or the kernel's (read_small_file).
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
            raise UnsafeTree(
                f"{shown / name}: not a regular file (a FIFO, socket or device), where only regular "
                "files and directories may be"
            )
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


# -- one small file that a config names ------------------------------------------------------------------------------
#
# A stage reads some files whole because a config names them (a chat template). Read naively, a FIFO waits for a
# writer forever, /proc/self/pagemap (a "regular file" of size 0) never ends, and a link puts any file this user can
# read in the file's place. read_small_file reads none of those.

PSEUDO_FILESYSTEMS = (Path("/proc"), Path("/sys"))  # the kernel's files: not data, and a read may block or never end


class UnsafeFile(ValueError):
    """A file read_small_file will not read; the message names it and says why. The caller adds the field that
    named it and the fix."""


def file_kind(mode: int) -> str:
    """What a stat mode is, for a message: "a directory", "a FIFO", ..."""
    kinds = (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
    )
    return next((kind for test, kind in kinds if test(mode)), "a special file")


def _pseudo_filesystem_of(path: Path) -> Path | None:
    """/proc or /sys if `path` is in one, as written or with every link resolved; else None."""
    for seen in (Path(os.path.abspath(path)), Path(os.path.realpath(path))):
        for root in PSEUDO_FILESYSTEMS:
            if seen == root or root in seen.parents:
                return root
    return None


def _on_pseudo_filesystem(info: os.stat_result) -> Path | None:
    """/proc or /sys if an opened file's device is theirs (a link in a directory swapped after the path check)."""
    for root in PSEUDO_FILESYSTEMS:
        try:
            if os.stat(root).st_dev == info.st_dev:
                return root
        except OSError:
            continue  # (no /sys in this container)
    return None


def read_small_file(path: str | Path, max_bytes: int) -> bytes:
    """The bytes of the regular file `path`, which may hold at most `max_bytes`.

    Raises UnsafeFile, naming the file, for: a symbolic link (the last component; directories above may be links),
    anything but a regular file (looked at before it is opened, so no device is ever opened, and checked again on
    the opened descriptor), a file in /proc or /sys (by its path, with and without links resolved, and by the
    opened file's device), and a file over max_bytes (by its size, and by what a read gives: at most max_bytes + 1
    bytes are read, so a file that grows, or a kernel file that says 0, ends there). Raises OSError
    (FileNotFoundError, PermissionError) as open() would."""
    path = Path(path)
    root = _pseudo_filesystem_of(path)
    if root is not None:
        raise UnsafeFile(
            f"{path}: a file in {root}, the kernel's view of processes and devices, not a data file "
            "(a read there may block or never end)"
        )
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        raise UnsafeFile(f"{path}: {file_kind(info.st_mode)}, not a regular file")
    try:
        fd = os.open(path, NOFOLLOW_FLAGS)
    except OSError as err:
        if err.errno == errno.ELOOP:  # (made a link after the lstat)
            raise UnsafeFile(f"{path}: a symbolic link, not a regular file") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeFile(f"{path}: {file_kind(info.st_mode)}, not a regular file")
        root = _on_pseudo_filesystem(info)
        if root is not None:
            raise UnsafeFile(f"{path}: a file in {root} (through a link in a directory above it), not a data file")
        if info.st_size > max_bytes:
            raise UnsafeFile(f"{path}: {info.st_size} bytes, more than the {max_bytes} read here")
        chunks, left = [], max_bytes + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise UnsafeFile(
            f"{path}: more than the {max_bytes} bytes read here (it grew while it was read, or is not the size it says)"
        )
    return data
