"""The job directory: private directories, files opened following no link and only if this user's (open_job_file),
state.json checked, read and replaced atomically, the lock, and the log read by offset or tail."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from stat import S_IMODE, S_ISDIR, S_ISREG, S_ISVTX, S_IWOTH

from eagle3.contracts import JobState
from eagle3.disk.fsutil import atomic_write_text, file_kind
from eagle3.jobs.processes import group_fields_problem, is_count

KEY_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")

LOG_TAIL_LINES = 30

LOG_TAIL_BYTES = 64 * 1024


class JobError(Exception):
    """A usage error (bad key, no command): the CLI prints it and exits 2."""


class CorruptState(Exception):
    """state.json exists but no supervisor can have written it: torn, not a JSON object, keys missing or wrong."""

    def __init__(self, path: Path, problem: str, recorded_try: int | None = None):
        super().__init__(f"{path} is not a job state ({problem})")
        self.recorded_try = recorded_try  # the try number, if the file still tells it


class UnsafeJobFile(JobError):
    """A job's directory or one of its files that is a symbolic link, not a directory or regular file, or another
    user's: nothing is read from it, written to it or done on its word. The message names it and the fix."""


def job_dir(jobs_dir: str | Path, key: str) -> Path:
    # fullmatch: with re.match, "$" would also accept a trailing newline
    if not KEY_PATTERN.fullmatch(key):
        raise JobError(
            f"job key {key!r} is invalid: it must match {KEY_PATTERN.pattern} (letters, digits, '.', '_', '-'; "
            "starting with a letter or digit; at most 200 characters)"
        )
    return Path(jobs_dir).absolute() / key


def make_private_dirs(directory: Path) -> None:
    """Create the jobs dir and the job's dir, both 0700, and make existing ones 0700 too (made by hand, or under
    another umask).

    The job's dir must be this user's: one that another user made could be read, or swapped, by them. A shared
    jobs dir (world-writable and sticky, like /tmp) keeps its mode: the job's own dir is private all the same."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    for path in (directory.parent, directory):
        info = path.stat()
        if info.st_uid != os.geteuid():
            if path == directory.parent:
                continue  # not ours to change (a shared directory); the job's dir below is checked all the same
            raise JobError(
                f"job directory {path} belongs to uid {info.st_uid}, not to this user "
                f"(uid {os.geteuid()}): its files would not be private; remove it or use another --jobs-dir"
            )
        shared = info.st_mode & S_ISVTX and info.st_mode & S_IWOTH
        if S_IMODE(info.st_mode) != 0o700 and not shared:
            os.chmod(path, 0o700)


# A job's directory and files are made by its own user, private (make_private_dirs), and never links. poll and kill
# open them so, each step through a descriptor opened with O_NOFOLLOW and checked once open: a link would have them
# read (and a stream copy to the caller) any file this user can read, and another user's file says nothing of a job.
JOB_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # (NONBLOCK: a FIFO swapped in never blocks the open)


def unsafe_job_file(path: Path, problem: str) -> UnsafeJobFile:
    return UnsafeJobFile(
        f"{path}: {problem}. A job's files are its own user's and never links, so someone else put "
        "this there: nothing was read from it or done on its word. Look at who did; remove it (as its "
        "owner or root), then run the job command again, or use another --jobs-dir"
    )


def check_job_entry(path: Path, info: os.stat_result, directory: bool) -> None:
    """Raise UnsafeJobFile unless `info` is of a directory (`directory`) or regular file of this user."""
    if not (S_ISDIR if directory else S_ISREG)(info.st_mode):
        raise unsafe_job_file(
            path, f"{file_kind(info.st_mode)}, where the job keeps {'its directory' if directory else 'a regular file'}"
        )
    if info.st_uid != os.geteuid():
        raise unsafe_job_file(path, f"owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})")


def open_job_file(path: Path, flags: int = os.O_RDONLY) -> int:
    """A descriptor of the job file `path` (its directory being the job's), opened following no link: the job's
    directory and the file must be a directory and a regular file of this user, both looked at before they are
    opened and checked again once open. Raises UnsafeJobFile otherwise, and FileNotFoundError where either is
    absent (unless flags has O_CREAT: then the file is made, 0600)."""
    directory, name = path.parent, path.name
    check_job_entry(directory, os.lstat(directory), directory=True)
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | JOB_OPEN_FLAGS)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            raise unsafe_job_file(directory, "made a link or a file while it was opened") from None
        raise
    try:
        check_job_entry(directory, os.fstat(dir_fd), directory=True)
        try:
            check_job_entry(path, os.stat(name, dir_fd=dir_fd, follow_symlinks=False), directory=False)
        except FileNotFoundError:
            if not flags & os.O_CREAT:
                raise
        try:
            fd = os.open(name, flags | JOB_OPEN_FLAGS, 0o600, dir_fd=dir_fd)
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.ENXIO):  # (ENXIO: a FIFO opened to write without a reader)
                raise unsafe_job_file(path, "made a link or a special file while it was opened") from None
            raise
    finally:
        os.close(dir_fd)
    try:
        check_job_entry(path, os.fstat(fd), directory=False)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_job_file(path: Path) -> bytes:
    """The bytes of a job file (open_job_file's checks)."""
    with os.fdopen(open_job_file(path), "rb") as f:
        return f.read()


STATE_FIELDS = {
    "key": str,
    "try": int,
    "status": str,
    "pid": int,
    "pgid": int,
    "pid_start_ticks": int,
    "boot_id": str,
    "host_id": str,
    "heartbeat_at": (int, float),
    "log_start": int,
}

STATUSES = ("running", "succeeded", "failed", "killed")


def json_kind(value) -> str:
    kinds = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return kinds.get(type(value), "a number")


def state_problem(state, key: str) -> str | None:
    """Why `state` (parsed state.json of job `key`) cannot be a supervisor's report, or None."""
    if not isinstance(state, dict):
        return f"JSON {json_kind(state)}, not an object"
    missing = [name for name in STATE_FIELDS if name not in state]
    if missing:
        return f"no {', '.join(missing)}"
    for name, kind in STATE_FIELDS.items():
        value = state[name]
        if isinstance(value, bool) or not isinstance(value, kind):
            return f"{name} is {json_kind(value)}, {value!r}"
    if state["key"] != key:
        return f"it is job {state['key']!r}'s, not {key!r}'s"
    if state["status"] not in STATUSES:
        return f"status {state['status']!r} is none of {', '.join(STATUSES)}"
    if state["try"] < 1:
        return f"try {state['try']} is not a try number"
    return group_fields_problem(state)


def read_state(directory: Path) -> JobState | None:
    """The job's state.json, or None if there is none. Raises CorruptState for a file no supervisor wrote, and
    UnsafeJobFile for a link or another user's file (open_job_file)."""
    path = directory / "state.json"
    try:
        data = read_job_file(path)
    except FileNotFoundError:
        return None
    try:
        state = json.loads(data)
    except ValueError as err:  # (UnicodeDecodeError included)
        raise CorruptState(path, f"not valid JSON: {err}") from None
    problem = state_problem(state, directory.name)
    if problem:
        recorded_try = state.get("try") if isinstance(state, dict) else None
        raise CorruptState(path, problem, recorded_try if is_count(recorded_try) and recorded_try > 0 else None)
    return state


def write_state(directory: Path, state: dict) -> None:
    atomic_write_text(directory / "state.json", json.dumps(state, indent=2) + "\n", private=True)


def last_try_number(directory: Path, corrupt: CorruptState) -> int:
    """The try a corrupt state.json was about, from the file itself or else from spec.json; 0 if neither tells."""
    if corrupt.recorded_try is not None:
        return corrupt.recorded_try
    try:
        recorded = json.loads((directory / "spec.json").read_bytes()).get("try")
    except (OSError, ValueError, AttributeError):  # (AttributeError: spec.json is JSON, but not an object)
        return 0
    return recorded if is_count(recorded) and recorded > 0 else 0


@contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Hold the job's exclusive flock, waiting for the current holder if there is one."""
    fd = open_job_file(directory / "lock", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    with open(fd, "a") as lock_file:  # closing the file releases the lock
        os.fchmod(fd, 0o600)  # (whatever mode it was made with)
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        yield


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def run_seconds(state: dict) -> float | None:
    """How long the recorded try ran (whole seconds, from state.json's timestamps); None while it runs."""
    from datetime import datetime

    if not (state.get("started_at") and state.get("ended_at")):
        return None
    return (datetime.fromisoformat(state["ended_at"]) - datetime.fromisoformat(state["started_at"])).total_seconds()


def read_log(path: Path, offset: int, max_bytes: int, whole_lines: bool) -> tuple[str, int]:
    """Log text from byte `offset` on (at most max_bytes) and the offset after it.

    While the job runs, the text ends at the last newline, so that a caller never sees half a line; a line longer
    than max_bytes is returned in pieces all the same, or the stream would stall on it."""
    try:
        with os.fdopen(open_job_file(path), "rb") as f:
            if offset > os.fstat(f.fileno()).st_size:
                offset = 0  # the log was replaced (jobs dir wiped): start over rather than wait forever
            f.seek(offset)
            chunk = f.read(max_bytes)
    except FileNotFoundError:
        return "", 0
    if whole_lines:
        end = chunk.rfind(b"\n") + 1
        if end > 0 or len(chunk) < max_bytes:  # (no newline in a full chunk: a very long line, given in pieces)
            chunk = chunk[:end]
    return chunk.decode("utf-8", errors="replace"), offset + len(chunk)


def read_log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    try:
        with os.fdopen(open_job_file(path), "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - LOG_TAIL_BYTES))
            text = f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return []
    return text.splitlines()[-lines:]
