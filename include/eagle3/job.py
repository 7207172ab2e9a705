"""Detached, re-attachable jobs on the box: `python -m eagle3 job start|poll|kill`.

A long stage runs under a supervisor in a session of its own, never under the SSH command that asked for it: a
dropped connection, a dead worker or a new Airflow try finds the job again instead of starting a second copy.

  start      under the job's lock: attach to a live or succeeded job, else launch a supervisor (setsid, stdio
             detached), wait for its first report and print the state
  supervise  (internal) leads the job's process group, runs the stage in it, rewrites state.json every heartbeat
  poll       the state, whether the job is really alive, and the log from an offset (--stream: from cursor.json)
  kill       SIGTERM to the group, SIGKILL after the grace period, status "killed" (--detach: answer at the SIGTERM)

A running job is alive only if its boot id is this boot's, its supervisor's pid exists with the recorded start
time, and its heartbeat is fresh; a dead one is relaunched by the next start, and the stage resumes. A job recorded
running on another host (its host id, eagle3.hostid, differs: two boxes sharing a work directory) is "foreign": this
host cannot see its processes, so it is never declared dead, started again (start exits Exit.FOREIGN: the
control plane then fails the task without a retry), killed or recorded as killed from here.
A signal goes only to a group the job provably owns (group_ownership_problem). The stage sees an allowlisted
environment (STAGE_ENV_NAMES, STAGE_ENV_PREFIXES, `start --pass-env`). Why: docs/decisions/2026-11-29-detached-jobs.md.

{jobs_dir}/{key}/ (the DAG's: RUN_DIR/jobs/<task id>[.<map index>]/; directories 0700, files 0600):
  spec.json      argv, cwd, env names (never values), heartbeat_s, the try, the redo it belongs to (start --redo)
  state.json     key, try, status, pid, pgid, pid_start_ticks, boot_id, host, host_id, argv, started_at, heartbeat_at,
                 exit_code, ended_at, log, log_start, child_pid; replaced atomically, so poll reads it unlocked
  progress.json  the stage's newest beat (eagle3.progress); with --stall-timeout-s a silent stage's try fails
  log            the stage's stdout+stderr across tries; a try starts with a "==== ... ====" line at log_start
  cursor.json    {"stream", "try", "offset"}: how far one stream has copied the log
  lock           the flock that makes "read the state, then launch or kill" one step
  redone/<time>/ the files of the tries a redo set aside
poll and kill open the directory and these files following no link, and only if they are this user's
(open_job_file): a link could have the log's stream copy any file this user can read to the caller.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from stat import S_IMODE, S_ISDIR, S_ISREG, S_ISVTX, S_IWOTH

from eagle3.contracts import STALE_AFTER_S, Effective, JobPoll, JobStart, JobState
from eagle3.fsutil import atomic_write_text, file_kind, private_opener
from eagle3.hostid import read_host_id
from eagle3.progress import PROGRESS_FILE_VAR
from eagle3.runlayout import REDO_OUTPUTS
from eagle3.runowner import AirflowRun, check_owner

REDONE_OUTPUTS = frozenset(output for outputs in REDO_OUTPUTS.values() for output in outputs)

KEY_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
ENV_NAME_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
GROUP_MARK_VAR = "EAGLE3_JOB_GROUP"  # in the stage's environment: "pid:start ticks" of its supervisor
JOB_DIR_VAR = "EAGLE3_JOB_DIR"  # in the supervisor's and the stage's environment: the job's directory, resolved
# In the stage's environment under a stall limit: the first-progress limit in seconds (StallLimits.first_s), which a
# stage that waited (beating progress) before loading its model announces again as its allowance (eagle3.extract).
FIRST_PROGRESS_VAR = "EAGLE3_FIRST_PROGRESS_TIMEOUT_S"
DEFAULT_HEARTBEAT_S = 10.0
SUPERVISOR_REPORT_TIMEOUT_S = 10.0  # how long start waits for a new supervisor's first state.json
CHILD_GRACE_S = 20.0  # after SIGTERM, how long the supervisor lets the stage shut down before SIGKILL
LEFTOVER_WAIT_S = 10.0  # how long to wait for SIGKILLed processes to vanish (a GPU process can take seconds)
LOG_TAIL_LINES = 30
LOG_TAIL_BYTES = 64 * 1024

# The caller's environment variables a stage gets (and the supervisor between them), by exact name ...
STAGE_ENV_NAMES = frozenset({
    # a working process: where programs and the home directory are, who runs it, its shell and scratch space
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "TMPDIR",
    # text and time: the locale (decoding of tokenizer files, log timestamps) and the time zone
    "LANG", "TZ",
    # the Python the stage runs: its venv, import path and how it writes bytecode and output
    "VIRTUAL_ENV", "PYTHONPATH", "PYTHONSAFEPATH", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED",
    # native libraries and CPU threads (CUDA and MKL libraries outside the default paths, BLAS thread counts)
    "LD_LIBRARY_PATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM",
    # where Hugging Face, torch and triton keep their caches when no *_HOME or *_CACHE_DIR says otherwise
    "XDG_CACHE_HOME",
})
# ... and by prefix.
STAGE_ENV_PREFIXES = (
    "LC_",  # the locale's categories, as LANG
    "CUDA_", "NVIDIA_",  # which GPUs (CUDA_VISIBLE_DEVICES), where CUDA is (CUDA_HOME), the container runtime's view
    "HF_", "TRANSFORMERS_",  # the model and data caches, offline mode, the hub's settings
    "NCCL_", "TORCH_", "PYTORCH_", "TORCHINDUCTOR_", "TRITON_",  # multi-GPU transport, allocator and compiler caches
    "SGLANG_", "SGL_", "FLASHINFER_",  # the inference server the extract and generate stages start, and its kernels
    "VLLM_",  # the other engine a stage may start (server.engine vllm: VLLM_MLA_DISABLE on a CPU box, ...)
    "EAGLE3_",  # this project's own hooks (EAGLE3_SERVER_LAUNCHER, EAGLE3_BOOT_ID_FILE, ...)
)


class JobError(Exception):
    """A usage error (bad key, no command): the CLI prints it and exits 2."""


class JobLaunchError(RuntimeError):
    """The supervisor did not come up, or the last try could not be stopped; the message says why."""


class CorruptState(Exception):
    """state.json exists but no supervisor can have written it: torn, not a JSON object, keys missing or wrong."""

    def __init__(self, path: Path, problem: str, recorded_try: int | None = None):
        super().__init__(f"{path} is not a job state ({problem})")
        self.recorded_try = recorded_try  # the try number, if the file still tells it


class ForeignJob(JobLaunchError):
    """The job is recorded running on another host: nothing is started, redone or killed beside it from here.
    `job start` exits Exit.FOREIGN for it (eagle3.contracts)."""


class SignalRefused(Exception):
    """The recorded process group is not provably the job's, so it was not signalled; the message says why."""


class UnsafeJobFile(JobError):
    """A job's directory or one of its files that is a symbolic link, not a directory or regular file, or another
    user's: nothing is read from it, written to it or done on its word. The message names it and the fix."""


# ---------------------------------------------------------------------------------------------------------------------
# Processes, as /proc sees them


def read_boot_id() -> str:
    """This boot's id; it changes at every reboot. EAGLE3_BOOT_ID_FILE overrides the path (tests fake a reboot)."""
    return Path(os.environ.get("EAGLE3_BOOT_ID_FILE", BOOT_ID_PATH)).read_text().strip()


def process_stat(pid: int) -> tuple[str, int, int] | None:
    """(state letter, process group, start time in clock ticks since boot) of `pid`, or None if there is no such pid.

    A zombie (state "Z") still has an entry: it has exited, but its parent has not reaped it yet."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 2, the command name, is in parentheses and may contain spaces and ')': split after the last ')'.
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[2]), int(fields[19])  # fields 3, 5 and 22 of proc(5)


def pid_start_ticks(pid: int) -> int | None:
    """Start time of a process that has not exited (zombies count as exited), or None."""
    stat = process_stat(pid)
    return None if stat is None or stat[0] == "Z" else stat[2]


def group_members(pgid: int) -> list[int]:
    """Pids of the processes in group `pgid` that have not exited."""
    members = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = process_stat(int(name))
            if stat is not None and stat[0] != "Z" and stat[1] == pgid:
                members.append(int(name))
    return members


def supervisor_argv(directory: Path) -> list[str]:
    # -P: the working directory (an SSH login directory) stays off the path, so no eagle3/ there can shadow this one
    return [sys.executable, "-P", "-m", "eagle3", "job", "supervise", "--jobs-dir", str(directory.parent),
            "--key", directory.name]


def supervisor_pids(directory: Path) -> list[int]:
    """Pids of live processes whose command line is this job's supervisor's (any interpreter). Reason enough to
    hold back a second launch; never a reason to signal anything, for a command line is easy to copy."""
    wanted = [arg.encode() for arg in supervisor_argv(directory)[1:]]
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                argv = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")[:-1]
            except OSError:
                continue
            if argv[1:] == wanted and pid_start_ticks(int(name)) is not None:
                pids.append(int(name))
    return pids


def environment_of(pid: int) -> list[bytes]:
    """The NAME=value entries `pid` started with (readable for our own processes only; none otherwise)."""
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return []


def job_dir_entry(directory: Path) -> bytes:
    return f"{JOB_DIR_VAR}={os.path.realpath(directory)}".encode()


def carries_mark(pid: int, mark: str, directory: Path | None = None) -> bool:
    """Whether `pid` started with GROUP_MARK_VAR=mark in its environment, and, given the job's `directory`, with no
    other job's directory (a stage started before JOB_DIR_VAR existed has none; its mark alone decides)."""
    environment = environment_of(pid)
    if f"{GROUP_MARK_VAR}={mark}".encode() not in environment:
        return False
    if directory is None:
        return True
    dirs = [entry for entry in environment if entry.startswith(f"{JOB_DIR_VAR}=".encode())]
    return not dirs or dirs == [job_dir_entry(directory)]


def is_jobs_supervisor(pid: int, directory: Path) -> bool:
    """Whether `pid` was started with this job's directory in its environment, as start launches a supervisor."""
    return job_dir_entry(directory) in environment_of(pid)


# ---------------------------------------------------------------------------------------------------------------------
# Who may be signalled


def is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # (JSON true would pass for 1 otherwise)


def group_fields_problem(state: dict) -> str | None:
    """Why the recorded pid, pgid and pid_start_ticks cannot be a supervisor's own group, or None."""
    pid, pgid, ticks = state.get("pid"), state.get("pgid"), state.get("pid_start_ticks")
    if not (is_count(pid) and is_count(pgid) and is_count(ticks)):
        return f"pid {pid!r}, pgid {pgid!r} and pid_start_ticks {ticks!r} must be whole numbers"
    if pgid != pid:
        return f"pgid {pgid} is not pid {pid}, yet the supervisor always leads its own process group"
    if pid <= 1:
        return f"pid {pid} cannot be a supervisor's (0 means the signaller's own group, 1 is init)"
    return None


def group_ownership_problem(state: dict, marked: bool = True, directory: Path | None = None) -> str | None:
    """None if the recorded process group is the job's own and may be signalled; else why not, as a sentence.

    `marked`: the group's processes carry GROUP_MARK_VAR (a job's stage does; a caller's own child, such as
    eagle3.server's, does not). `directory`: the job's, whose name its supervisor carries (JOB_DIR_VAR). The group
    is the job's when the recorded supervisor leads it (pgid == pid > 1) in this boot and
      - the supervisor still exists and started at the recorded time (if it started at another time, the pid was
        reused, which Linux does only once nothing is left in the job's group), and, for a marked group, it carries
        the job's directory or a process of its group carries its mark: a file can name any live group leader, and
        only the marks show that this one is the job's supervisor, or
      - the supervisor is gone but its group is not: Linux hands out no pid while a process group of that number
        has members, so the group has been one and the same since its leader started; a member carrying the
        supervisor's mark shows that this leader was the job's supervisor, not a stranger that got the number
        after the job had ended."""
    problem = group_fields_problem(state)
    if problem:
        return problem
    pid, ticks = state["pid"], state["pid_start_ticks"]
    if state.get("boot_id") != read_boot_id():
        return f"it was recorded in another boot ({state.get('boot_id')}): none of its processes can be left"
    leader = process_stat(pid)
    if leader is not None and leader[0] == "Z":
        # Exited, not yet reaped (a SIGKILLed supervisor whose parent, init, has not got round to it): gone, as far
        # as signals go; its environment can no longer be read, so the checks below would take it for a stranger.
        leader = None
    mark = f"{pid}:{ticks}"
    if leader is not None:
        if leader[2] != ticks:
            return f"pid {pid} is another process now (started at tick {leader[2]}, not {ticks})"
        if not marked or (directory is not None and is_jobs_supervisor(pid, directory)):
            return None
        if any(carries_mark(member, mark, directory) for member in group_members(pid)):
            return None  # (a supervisor started before JOB_DIR_VAR existed: its stage carries the mark)
        marks = ([f"{JOB_DIR_VAR}={os.path.realpath(directory)}"] if directory is not None else []) + \
            [f"{GROUP_MARK_VAR}={mark}"]
        return (f"pid {pid} leads a live process group, but neither it nor any process of its group carries this "
                f"job's marks ({', '.join(marks)}): it is not the job's supervisor")
    members = group_members(pid)
    older = [member for member in members if (pid_start_ticks(member) or ticks) < ticks]
    if older:
        return f"process {older[0]} of group {pid} started before the group's recorded leader: not the job's group"
    if marked and members and not any(carries_mark(member, mark, directory) for member in members):
        return (f"supervisor {pid} is gone, and no process left in group {pid} carries its mark "
                f"{GROUP_MARK_VAR}={mark}: the group is not the job's")
    return None


def signal_group(state: dict, signum: int, marked: bool = True, directory: Path | None = None) -> bool:
    """Send `signum` to the job's process group. True: sent; False: the group has no process left.

    Raises SignalRefused when the group is not provably the job's (group_ownership_problem), and PermissionError
    when the kernel refuses."""
    problem = group_ownership_problem(state, marked, directory)
    if problem:
        raise SignalRefused(f"process group {state.get('pgid')!r} was not signalled: {problem}")
    try:
        os.killpg(state["pgid"], signum)
    except ProcessLookupError:
        return False
    return True


def permission_refusal(state: dict, err: PermissionError) -> str:
    return (f"the kernel refused to signal process group {state['pgid']} ({err.strerror or err}): some of its "
            f"processes belong to another user or are out of this user's reach; stop them as their owner "
            f"(kill -KILL -- -{state['pgid']}) and check with ps -g {state['pgid']}")


def sigkill_group(state: dict, wait_s: float = LEFTOVER_WAIT_S, marked: bool = True,
                  directory: Path | None = None) -> bool:
    """SIGKILL the job's process group and wait (up to wait_s) until it is gone. Raises as signal_group does."""
    if not signal_group(state, signal.SIGKILL, marked, directory):
        return False
    deadline = time.monotonic() + wait_s
    while group_members(state["pgid"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return True


def kill_leftovers(state: dict, wait_s: float = LEFTOVER_WAIT_S, directory: Path | None = None) -> str | None:
    """SIGKILL whatever is left of a job's process group and wait (up to wait_s) until it is gone. Returns None,
    or why nothing was signalled (the group is not provably the job's, or the kernel refused).

    `state` is a job's state, or a bare record {"pgid", "pid_start_ticks"[, "boot_id"]} of a caller's own child
    that leads its own group (eagle3.server's sglang server): then its pid is its pgid, and a record without a boot
    id is of this boot. `directory`: the job's (group_ownership_problem)."""
    marked = "pid" in state
    if not marked:
        state = {"pid": state.get("pgid"), "boot_id": state.get("boot_id", read_boot_id()), **state}
    try:
        sigkill_group(state, wait_s, marked, directory)
    except SignalRefused as err:
        return str(err)
    except PermissionError as err:
        return permission_refusal(state, err)
    return None


def foreign_host(state: dict) -> str | None:
    """Why a running job is another host's, or None when it is this host's."""
    recorded = state["host_id"]
    if recorded == read_host_id():
        return None
    age = time.time() - state["heartbeat_at"]
    return (f"running on another host, {state.get('host')!r} (host id {recorded}), as pid {state['pid']}: this host "
            f"({socket.gethostname()!r}, host id {read_host_id()}) cannot see its processes, so it neither restarts "
            f"nor kills it; its last heartbeat was {age:.0f} s ago. Run this stage from that host's box, or, if that "
            "host is gone for good and the job with it, move this job's state.json aside and start it again")


def liveness(state: JobState | None, stale_after_s: float) -> tuple[Effective, str]:
    """(effective status, reason): the recorded status, except that a "running" job failing a check is "dead", and
    one recorded on another host is "foreign" (foreign_host), never dead."""
    if state is None:
        return "absent", "no state.json: the job was never started"
    status = state["status"]
    if status == "succeeded":
        return status, "the command exited with code 0"
    if status == "failed":
        if state.get("stalled"):
            return status, state["stalled"]
        return status, f"the command failed with exit code {state.get('exit_code')}"
    if status == "killed":
        return status, "the job was killed"
    foreign = foreign_host(state)
    if foreign:
        return "foreign", foreign
    boot_id, pid = read_boot_id(), state["pid"]
    if state["boot_id"] != boot_id:
        return "dead", f"boot id changed (box rebooted): {state['boot_id']} then, {boot_id} now"
    ticks = pid_start_ticks(pid)
    if ticks is None:
        return "dead", f"pid {pid} is gone: the supervisor died without recording how the job ended"
    if ticks != state["pid_start_ticks"]:
        return "dead", f"pid {pid} is another process now (started at tick {ticks}, not {state['pid_start_ticks']})"
    age = time.time() - state["heartbeat_at"]
    if age > stale_after_s:
        return "dead", f"heartbeat {age:.0f} s old (limit {stale_after_s:g} s): the supervisor is stopped or hung"
    return "running", f"supervisor pid {pid} is alive, heartbeat {age:.0f} s old"


# ---------------------------------------------------------------------------------------------------------------------
# The job directory


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
            raise JobError(f"job directory {path} belongs to uid {info.st_uid}, not to this user "
                           f"(uid {os.geteuid()}): its files would not be private; remove it or use another --jobs-dir")
        shared = info.st_mode & S_ISVTX and info.st_mode & S_IWOTH
        if S_IMODE(info.st_mode) != 0o700 and not shared:
            os.chmod(path, 0o700)


# A job's directory and files are made by its own user, private (make_private_dirs), and never links. poll and kill
# open them so, each step through a descriptor opened with O_NOFOLLOW and checked once open: a link would have them
# read (and a stream copy to the caller) any file this user can read, and another user's file says nothing of a job.
JOB_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # (NONBLOCK: a FIFO swapped in never blocks the open)


def unsafe_job_file(path: Path, problem: str) -> UnsafeJobFile:
    return UnsafeJobFile(f"{path}: {problem}. A job's files are its own user's and never links, so someone else put "
                         "this there: nothing was read from it or done on its word. Look at who did; remove it (as its "
                         "owner or root), then run the job command again, or use another --jobs-dir")


def check_job_entry(path: Path, info: os.stat_result, directory: bool) -> None:
    """Raise UnsafeJobFile unless `info` is of a directory (`directory`) or regular file of this user."""
    if not (S_ISDIR if directory else S_ISREG)(info.st_mode):
        raise unsafe_job_file(path, f"{file_kind(info.st_mode)}, where the job keeps "
                                    f"{'its directory' if directory else 'a regular file'}")
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


STATE_FIELDS = {"key": str, "try": int, "status": str, "pid": int, "pgid": int, "pid_start_ticks": int,
                "boot_id": str, "host_id": str, "heartbeat_at": (int, float), "log_start": int}
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


# ---------------------------------------------------------------------------------------------------------------------
# The stage's environment


def stage_environment(pass_env: Iterable[str] = ()) -> dict[str, str]:
    """The part of this process's environment that the supervisor and its stage get: the variables the allowlist
    names (STAGE_ENV_NAMES, STAGE_ENV_PREFIXES) and those named in pass_env, where they are set."""
    extra = set()
    for name in pass_env:
        if not ENV_NAME_PATTERN.fullmatch(name):
            raise JobError(f"--pass-env {name!r} is not an environment variable's name: it must match "
                           f"{ENV_NAME_PATTERN.pattern}")
        extra.add(name)
    return {name: value for name, value in sorted(os.environ.items())
            if name in STAGE_ENV_NAMES or name.startswith(STAGE_ENV_PREFIXES) or name in extra}


def package_root() -> str:
    """The directory holding this eagle3 package: first on the supervisor's PYTHONPATH, so that it runs this code."""
    return str(Path(__file__).resolve().parents[1])


def supervisor_python_path(stage_path: str | None) -> str:
    return os.pathsep.join(filter(None, [package_root(), stage_path]))


def stage_python_path(supervisor_path: str) -> str | None:
    """The PYTHONPATH the caller of start had (None: none), from the supervisor's (supervisor_python_path)."""
    root = package_root()
    if supervisor_path.startswith(root + os.pathsep):
        return supervisor_path[len(root) + 1 :]
    return None if supervisor_path in ("", root) else supervisor_path


# ---------------------------------------------------------------------------------------------------------------------
# start, poll, kill


def start_job(
    jobs_dir: str | Path,
    key: str,
    argv: list[str],
    heartbeat_s: float = DEFAULT_HEARTBEAT_S,
    stale_after_s: float = STALE_AFTER_S,
    pass_env: Iterable[str] = (),
    stall: StallLimits | None = None,
    redo: str | None = None,
    set_aside: Iterable[str] = (),
    owner: AirflowRun | None = None,
) -> JobStart:
    """Make sure the job runs: attach to a live (or succeeded) try, or launch a new one. Returns its state plus
    "attached" (True: nothing was launched) and "refused" (why nothing of the last try was signalled before the
    relaunch, or None). pass_env: names of environment variables the stage gets beyond the allowlist. stall: when
    to kill a stage that stopped making progress (None: never).

    redo: a name for one request to run the job again from scratch, however its last try ended (see redo_job); the
    job's earlier tries and the `set_aside` outputs are moved aside once per name, and a start with the same name
    later (a retry) attaches, resumes or relaunches as usual.

    owner: the Airflow run that starts the job; where the run directory the jobs directory is in (RUN_DIR/jobs)
    belongs to another run (eagle3.runowner), nothing is started, redone or attached (RunDirOwned)."""
    directory = job_dir(jobs_dir, key)
    if not argv:
        raise JobError("job start needs the command to run after `--`")
    if redo is not None and not KEY_PATTERN.fullmatch(redo):
        raise JobError(f"--redo {redo!r} is invalid: it must match {KEY_PATTERN.pattern}")
    outputs = [output_to_set_aside(directory, path) for path in set_aside]
    if not 0 < heartbeat_s <= stale_after_s / 2:
        raise JobError(f"--heartbeat-s {heartbeat_s:g} must be positive and at most half of --stale-after-s "
                       f"{stale_after_s:g}, or a healthy job would look dead")
    env = stage_environment(pass_env)
    if owner is not None:
        check_owner(directory.parent.parent, owner)
    make_private_dirs(directory)
    with locked(directory):
        recorded_redo = spec_field(directory, "redo")
        if redo is not None and redo != recorded_redo:
            redo_job(directory, redo, outputs, stale_after_s)
        try:
            state = read_state(directory)
        except CorruptState as corrupt:
            # Nothing in the file can be trusted, so nothing is signalled on its word, and the job is relaunched as
            # a dead one would be: a file that blocked every start would need a person to remove it. Unless its
            # supervisor still runs: it rewrites the file at its next heartbeat, and a second copy would not only
            # run the stage twice but also fight it over state.json.
            alive = supervisor_pids(directory)
            if alive:
                raise JobLaunchError(
                    f"{corrupt}, yet this job's supervisor (pid {alive[0]}) still runs: not launching a second copy "
                    "beside it. A running supervisor rewrites state.json within its heartbeat (heartbeat_s in "
                    f"spec.json): start the job again then. If the file stays broken, the supervisor hangs: stop "
                    f"it by hand (kill -KILL -- -{alive[0]}) and start again"
                ) from None
            refused = f"{corrupt}; nothing was signalled on its word"
            try_number = last_try_number(directory, corrupt) + 1
        else:
            effective, reason = liveness(state, stale_after_s)
            if effective in ("running", "succeeded"):  # a succeeded job is not rerun: the caller decides what it means
                return {**state, "attached": True, "refused": None}
            if effective == "foreign":  # a second copy beside it would write the same outputs
                raise ForeignJob(f"job {key} (try {state['try']}) is {reason}")
            refused = stop_last_try(state, directory) if state is not None else None
            try_number = (state["try"] if state else 0) + 1
        supervisor = launch_supervisor(directory, argv, heartbeat_s, try_number, env, stall,
                                       redo if redo is not None else recorded_redo)
        return {**wait_for_report(directory, supervisor, try_number), "attached": False, "refused": refused}


def spec_field(directory: Path, name: str):
    """A field of the job's spec.json (what its last try was launched with), or None."""
    try:
        spec = json.loads((directory / "spec.json").read_bytes())
    except (OSError, ValueError):
        return None
    return spec.get(name) if isinstance(spec, dict) else None


def output_to_set_aside(directory: Path, path: str) -> Path:
    """A stage's output that a redo moves aside: only one of the outputs a redo may move (eagle3.runlayout's
    REDO_OUTPUTS), directly in the run directory the jobs directory is in."""
    run_dir, name = directory.parent.parent, Path(path).name
    if Path(path).parent.absolute() != run_dir or name not in REDONE_OUTPUTS:
        raise JobError(f"--set-aside {path!r} is not an output this job may move: it must be one of "
                       f"{', '.join(sorted(REDONE_OUTPUTS))} in the run directory {run_dir}")
    return run_dir / name


def redo_job(directory: Path, redo: str, outputs: list[Path], stale_after_s: float) -> None:
    """Make the next try start from scratch, under the job's lock: refuse while a try runs; stop what is left of the
    last one; rename each output to NAME.before-redo-<time> (kept whole beside the new one, never mixed with it:
    a stage resumes from what it finds, so it must find nothing); move the job's files (state, spec, log,
    cursor) into redone/<time>/. The new try is try 1, and its spec records `redo`."""
    try:
        state = read_state(directory)
    except CorruptState:
        state = None  # (a torn file: start relaunches over it, as it would without a redo)
    effective, reason = liveness(state, stale_after_s) if state is not None else ("absent", "")
    if effective == "foreign":
        raise ForeignJob(f"job {directory.name} (try {state['try']}) is {reason}; a redo does not start beside it")
    if effective == "running":
        raise JobLaunchError(f"job {directory.name} is running (try {state['try']}, pid {state['pid']}): a redo does "
                             "not start beside a live try. Wait for it to end, or kill it (mark the task failed, or "
                             f"`python -m eagle3 job kill --jobs-dir {directory.parent} --key {directory.name}`), then "
                             "start again")
    if state is not None:
        stop_last_try(state, directory)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for output in outputs:
        if output.exists() or output.is_symlink():
            os.rename(output, output.with_name(f"{output.name}.before-redo-{stamp}"))
    archive = directory / "redone" / stamp
    names = [name for name in ("state.json", "spec.json", "log", "progress.json", CURSOR_FILE)
             if (directory / name).exists()]
    if names:
        archive.mkdir(mode=0o700, parents=True, exist_ok=True)
        for name in ("state.json", "progress.json", CURSOR_FILE, "log", "spec.json"):  # spec last: it names the redo
            if name in names:
                os.rename(directory / name, archive / name)


def stop_last_try(state: dict, directory: Path) -> str | None:
    """SIGKILL what an earlier try may have left (a hung supervisor and its stage) before a relaunch, so that two
    copies never write the same checkpoints. Returns why nothing was signalled, or None. Raises JobLaunchError
    when the group is the job's but the kernel will not let it be killed: better no new try than two."""
    if state["boot_id"] != read_boot_id():
        return None  # a try of an earlier boot left nothing behind
    try:
        sigkill_group(state, directory=directory)
    except SignalRefused as err:
        return str(err)
    except PermissionError as err:
        raise JobLaunchError(f"what is left of try {state['try']} of job {state['key']} cannot be stopped: "
                             f"{permission_refusal(state, err)}; then start the job again") from None
    return None


def launch_supervisor(
    directory: Path, argv: list[str], heartbeat_s: float, try_number: int, env: dict[str, str],
    stall: StallLimits | None = None, redo: str | None = None,
) -> subprocess.Popen:
    """Start the supervisor with `env` (stage_environment's), which it hands on to the stage."""
    spec = {"argv": list(argv), "cwd": os.getcwd(), "env_names": sorted(env), "heartbeat_s": heartbeat_s,
            "try": try_number, "stall": dataclasses.asdict(stall) if stall else None, "redo": redo}
    atomic_write_text(directory / "spec.json", json.dumps(spec, indent=2) + "\n", private=True)
    # The supervisor's own stderr (a traceback, should it ever crash) goes to the log.
    with open(directory / "log", "ab", opener=private_opener) as log_file:
        return subprocess.Popen(
            supervisor_argv(directory),
            start_new_session=True,  # setsid: out of the SSH session's process group, no controlling terminal
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # not the SSH channel, or `ssh box job start` would wait for the job
            stderr=log_file,
            close_fds=True,  # in particular not the lock, which would stay held as long as the supervisor runs
            # The job's directory marks the supervisor (and, inherited, its stage) as this job's: see
            # group_ownership_problem.
            env={**env, "PYTHONPATH": supervisor_python_path(env.get("PYTHONPATH")),
                 JOB_DIR_VAR: os.path.realpath(directory)},
        )


def wait_for_report(directory: Path, supervisor: subprocess.Popen, try_number: int) -> JobState:
    """The first state the new supervisor writes: usually "running", finished already if the command was quick."""
    deadline = time.monotonic() + SUPERVISOR_REPORT_TIMEOUT_S
    while True:
        exited = supervisor.poll() is not None  # checked before reading, so a state written before exit is seen
        try:
            state = read_state(directory)
        except CorruptState:  # the file the new supervisor is about to replace
            state = None
        if state is not None and state["try"] == try_number and state["pid"] == supervisor.pid:
            return state
        if exited:
            problem = f"the job supervisor exited with code {supervisor.returncode} before reporting"
            break
        if time.monotonic() > deadline:
            # (Our own child, which leads its own group.) A late report from it would confuse the next start.
            os.killpg(supervisor.pid, signal.SIGKILL)
            supervisor.wait()
            problem = f"the job supervisor did not report within {SUPERVISOR_REPORT_TIMEOUT_S:g} s"
            break
        time.sleep(0.05)
    tail = "\n".join(read_log_tail(directory / "log", 10))
    raise JobLaunchError(f"{problem}; end of {directory / 'log'}:\n{tail}")


def poll_job(
    jobs_dir: str | Path,
    key: str,
    log_offset: int | None = 0,
    max_log_bytes: int = 65536,
    stale_after_s: float = STALE_AFTER_S,
    stream: str | None = None,
) -> JobPoll:
    """The job's effective status and the log from log_offset on (None: from the recorded try's first line, its
    log_start). log_size says how much log there is, so that a caller can read on to its end once the job is over.
    Changes nothing, unless `stream` is given.

    stream: the name of one place the caller copies the log into (an Airflow try's task log), whose progress the box
    keeps in the stream's cursor (cursor.json), so that a caller that lost its own (a triggerer restarted, and the
    trigger rebuilt from its arguments) goes on where it stopped instead of repeating the try from its start. A
    log_offset given is recorded there first (everything before it has been copied: the caller asks from where its
    last answer ended); log_offset None reads from the stream's cursor, if it is for the recorded try, else from the
    try's first line. At worst the lines of one answer are copied twice: an answer the caller never acknowledged.

    Raises UnsafeJobFile, reading nothing through it, where the job's directory, state.json, cursor.json or log is a
    link, a special file or another user's (open_job_file)."""
    directory = job_dir(jobs_dir, key)
    if (log_offset is not None and log_offset < 0) or max_log_bytes < 0:
        raise JobError("--log-offset and --max-log-bytes must not be negative")
    if stream is not None and not KEY_PATTERN.fullmatch(stream):
        raise JobError(f"--stream {stream!r} is invalid: it must match {KEY_PATTERN.pattern}")
    try:
        state = read_state(directory)
        effective, reason = liveness(state, stale_after_s)
    except CorruptState as err:
        # "dead", as a crashed job: nothing shows that the job runs, and a caller that sees a dead job starts it
        # again, which relaunches it over the file. (A status of its own would be one more for every caller.)
        state, effective, reason = None, "dead", f"{err}; the next job start relaunches the job over it"
    try_start = state["log_start"] if state else 0
    if stream is not None and state is not None:
        if log_offset is None:
            log_offset = stream_cursor(directory, stream, state["try"], try_start)
        else:
            write_stream_cursor(directory, stream, state["try"], log_offset)
    if log_offset is None:
        log_offset = try_start
    # The state is read before the log: once it says finished, the log read next is complete.
    try:
        with os.fdopen(open_job_file(directory / "log"), "rb") as log_file:
            log_size = os.fstat(log_file.fileno()).st_size
    except FileNotFoundError:
        log_size = 0
    # Whole lines only, so that no caller prints half a line; the end of a finished job's log as it is.
    whole_lines = effective == "running" or log_offset + max_log_bytes < log_size
    log, new_offset = read_log(directory / "log", log_offset, max_log_bytes, whole_lines)
    return {
        "key": key,
        "effective": effective,
        "reason": reason,
        "state": state,
        "log": log,
        "log_offset": new_offset,
        "log_size": log_size,
        "log_tail": read_log_tail(directory / "log") if effective in ("failed", "dead", "killed") else [],
    }


CURSOR_FILE = "cursor.json"  # {"stream", "try", "offset"}: how far one stream has copied the log (poll --stream)


def stream_cursor(directory: Path, stream: str, try_number: int, try_start: int) -> int:
    """Where `stream` stopped copying the log of try `try_number`; the try's first line if it never did."""
    try:
        cursor = json.loads(read_job_file(directory / CURSOR_FILE))
    except (OSError, ValueError):
        return try_start
    if not isinstance(cursor, dict) or (cursor.get("stream"), cursor.get("try")) != (stream, try_number):
        return try_start  # another stream's (an earlier Airflow try), or an earlier job try's
    offset = cursor.get("offset")
    return offset if is_count(offset) and offset >= try_start else try_start


def write_stream_cursor(directory: Path, stream: str, try_number: int, offset: int) -> None:
    cursor = {"stream": stream, "try": try_number, "offset": offset}
    atomic_write_text(directory / CURSOR_FILE, json.dumps(cursor) + "\n", private=True)


def kill_job(jobs_dir: str | Path, key: str, grace_s: float = CHILD_GRACE_S, detach: bool = False) -> dict:
    """Stop the job (SIGTERM, then SIGKILL after grace_s) and record "killed". A finished or absent job is left as
    it is. Returns poll_job's answer, without log text (log_tail still holds the end of the log), plus "signalled"
    (whether the job's process group got a signal), "refused" (why it got none, or None) and "detached".

    detach: return as soon as the SIGTERM is sent; a detached process (its own session, no output) waits out the
    grace period, SIGKILLs what is left and records the kill. It inherits the job's lock and holds it to the end, so
    a start that comes meanwhile waits and then relaunches, never attaching to the try being killed. For callers on
    a deadline: the triggerer gives a trigger's on_kill 30 s ([triggerer] on_kill_timeout), and a stage that ignores
    SIGTERM makes the whole kill take grace_s plus the wait for its processes to vanish.

    A state.json that cannot be trusted is never acted on: a corrupt one is left as it is, and a group that is not
    provably the job's is not signalled (the job's own group is gone then, so the kill is recorded). A job directory,
    state.json, log or lock that is a link or another user's raises UnsafeJobFile (open_job_file) before anything is
    signalled or recorded."""
    directory = job_dir(jobs_dir, key)
    for name in ("state.json", "log"):  # (what the answer reads: refused now, not after the kill)
        try:
            os.close(open_job_file(directory / name))
        except FileNotFoundError:
            pass
    signalled, refused, detached = False, None, False
    if (directory / "state.json").exists():  # (no state: nothing to kill, and no directory to create for the lock)
        with locked(directory):  # held throughout, so that no start relaunches the job while it is being killed
            signalled, refused, detached = stop_running_job(directory, grace_s, detach)
    return {**poll_job(jobs_dir, key, max_log_bytes=0), "signalled": signalled, "refused": refused,
            "detached": detached}


def stop_running_job(directory: Path, grace_s: float, detach: bool = False) -> tuple[bool, str | None, bool]:
    """kill_job's work, under the lock: (signalled, refused, detached: the rest goes on in a detached process)."""
    try:
        state = read_state(directory)
    except CorruptState as err:
        alive = supervisor_pids(directory)
        who = f"its supervisor (pid {alive[0]}) still runs and" if alive else "if the job still runs, its supervisor"
        return False, (f"{err}; nothing was signalled on its word: {who} rewrites the file within a heartbeat; "
                       "kill the job again then"), False
    if state is None or state["status"] != "running":
        return False, None, False
    foreign = foreign_host(state)
    if foreign:  # its processes are out of reach, and recording "killed" would have it relaunched beside itself
        return False, f"job {state['key']} was not killed from this host: it is {foreign}", False
    signalled, refused = False, None
    if state["boot_id"] == read_boot_id():  # (processes of an earlier boot are gone: the kill is only recorded)
        try:
            if liveness(state, stale_after_s=math.inf)[0] == "running":  # a stale heartbeat: still kill it
                signalled = signal_group(state, signal.SIGTERM, directory=directory)
                if signalled and detach and in_detached_child():
                    try:  # the child: the lock's file description is shared with the parent, and stays held here
                        finish_kill(state, directory, grace_s)
                    finally:
                        os._exit(0)
                if signalled and detach:
                    return True, None, True  # the parent: answer now
                if signalled:
                    wait_for_supervisor_exit(state, grace_s)
            # whatever ignored SIGTERM, or outlived the supervisor
            signalled = sigkill_group(state, directory=directory) or signalled
        except SignalRefused as err:
            refused = str(err)
        except PermissionError as err:
            return signalled, permission_refusal(state, err), False  # the job may well run on: record nothing
    record_kill(directory, state)
    return signalled, refused, False


def finish_kill(state: dict, directory: Path, grace_s: float) -> None:
    """After the SIGTERM: the grace period, SIGKILL for whatever is left, the record. (kill_job's detached part.)"""
    wait_for_supervisor_exit(state, grace_s)
    try:
        sigkill_group(state, directory=directory)
    except (SignalRefused, PermissionError):
        pass  # the group is gone, or no longer provably the job's: nothing of it is signalled
    record_kill(directory, state)


def record_kill(directory: Path, state: dict) -> None:
    try:
        latest = read_state(directory) or state  # the supervisor's last word, if it had the time to record the kill
    except CorruptState:
        latest = state
    if latest["status"] == "running":  # the supervisor was SIGKILLed or gone before it could record it
        write_state(directory, {**latest, "status": "killed", "ended_at": utc_now()})


def in_detached_child() -> bool:
    """Fork; True in the child, which leaves the caller's session and output (an SSH channel stays open until every
    holder of its stdout has closed it), False in the parent."""
    sys.stdout.flush()
    sys.stderr.flush()
    if os.fork() != 0:
        return False
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    return True


def wait_for_supervisor_exit(state: dict, grace_s: float) -> None:
    """After the SIGTERM (which the supervisor passes on to its stage): until the supervisor has exited, or grace_s."""
    deadline = time.monotonic() + grace_s
    while pid_start_ticks(state["pid"]) == state["pid_start_ticks"] and time.monotonic() < deadline:
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------------------------------------
# Stalls: a stage that is alive but no longer moves on


@dataclasses.dataclass(frozen=True)
class StallLimits:
    """How long a stage may go without a progress beat (eagle3.progress.beat) before it counts as hung:
    `first_s` until its first beat (loading a model comes first), `between_s` after that. A beat may announce a
    longer silence of its own (its allowance_s)."""

    first_s: float
    between_s: float


class StallWatch:
    """The supervisor's view of its stage's progress file."""

    def __init__(self, limits: StallLimits, progress_file: Path):
        self.limits, self.progress_file = limits, progress_file
        self.started = time.time()
        self.last: dict | None = None  # the newest beat: {"at", "line", "allowance_s"}

    def progress(self) -> dict:
        """The newest beat, for state.json: progress_at and progress_line."""
        try:
            beat = json.loads(self.progress_file.read_text())
            if isinstance(beat, dict) and isinstance(beat.get("at"), int | float):
                self.last = beat
        except (OSError, ValueError):
            pass  # none yet, or being replaced: the last one read stands
        if self.last is None:
            return {}
        return {"progress_at": self.last["at"], "progress_line": self.last.get("line")}

    def stalled(self) -> str | None:
        """Why the stage counts as hung ("no progress for N s since ..."), or None."""
        now = time.time()
        if self.last is None:
            silent, limit, since = now - self.started, self.limits.first_s, "the stage started (no progress yet)"
        else:
            allowance = self.last.get("allowance_s")
            limit = max(self.limits.between_s, allowance if isinstance(allowance, int | float) else 0)
            silent, since = now - self.last["at"], f"its last progress: {self.last.get('line')!r}"
        if silent <= limit:
            return None
        return f"no progress for {silent:.0f} s (limit {limit:g} s) since {since}"


def stop_stage(child: subprocess.Popen, own_group: int, grace_s: float = CHILD_GRACE_S) -> None:
    """Stop a hung stage: SIGCONT and SIGTERM (a stopped process acts on TERM only once continued), SIGKILL after
    grace_s, then SIGKILL whatever else is left in this group (torchrun's ranks, a server), the supervisor aside."""
    for signum in (signal.SIGCONT, signal.SIGTERM):
        child.send_signal(signum)
    try:
        child.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    for pid in group_members(own_group):
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# ---------------------------------------------------------------------------------------------------------------------
# The supervisor


def supervise(jobs_dir: str | Path, key: str) -> None:
    """Run the command of spec.json to its end, keeping state.json current. Started by start_job only."""
    stop_requested = False

    def request_stop(signum, frame):  # acted on in the loop below, never in the middle of a state write
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    directory = job_dir(jobs_dir, key)
    spec = json.loads((directory / "spec.json").read_text())
    host, log_path = socket.gethostname(), directory / "log"
    with open(log_path, "ab", opener=private_opener) as log_file:

        def log_line(text: str) -> None:
            log_file.write(f"==== eagle3 job {key} try {spec['try']} {text} ====\n".encode())
            log_file.flush()

        log_start = os.fstat(log_file.fileno()).st_size  # this try's lines begin here (the log holds every try)
        # Which code this try runs: on a box, the synced directory named by the digest the run pinned at validate.
        log_line(f"started {utc_now()} on {host}, code {package_root()}")
        state = {
            "key": key, "try": spec["try"], "status": "running", "pid": os.getpid(), "pgid": os.getpgid(0),
            "pid_start_ticks": pid_start_ticks(os.getpid()), "boot_id": read_boot_id(), "host": host,
            "host_id": read_host_id(),
            "argv": spec["argv"], "started_at": utc_now(), "heartbeat_at": time.time(), "exit_code": None,
            "ended_at": None, "log": str(log_path), "log_start": log_start, "code": package_root(),
        }
        # The stage gets this process's environment, which start filtered already, with the caller's PYTHONPATH
        # and the group's mark, by which a later start or kill recognises what is left of it once this is gone.
        stage_env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
        stage_path = stage_python_path(os.environ.get("PYTHONPATH", ""))
        if stage_path is not None:
            stage_env["PYTHONPATH"] = stage_path
        stage_env.update({"PYTHONUNBUFFERED": "1", GROUP_MARK_VAR: f"{state['pid']}:{state['pid_start_ticks']}"})
        progress_file = directory / "progress.json"
        progress_file.unlink(missing_ok=True)  # an earlier try's beats say nothing of this one
        stage_env[PROGRESS_FILE_VAR] = str(progress_file)
        watch = StallWatch(StallLimits(**spec["stall"]), progress_file) if spec.get("stall") else None
        if watch is not None:
            stage_env[FIRST_PROGRESS_VAR] = f"{watch.limits.first_s:g}"
        try:
            # Same process group as the supervisor (the default), so that kill's killpg reaches the whole stage.
            child = subprocess.Popen(
                spec["argv"], cwd=spec["cwd"], env=stage_env,
                stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
            )
        except OSError as err:  # no such program, cwd gone, ...
            log_line(f"cannot start {spec['argv'][0]!r}: {err}")
            write_state(directory, {**state, "status": "failed", "exit_code": 127, "ended_at": utc_now()})
            return
        state["child_pid"] = child.pid
        write_state(directory, state)

        next_heartbeat = time.monotonic() + spec["heartbeat_s"]
        stalled = None
        while child.poll() is None and not stop_requested and stalled is None:
            time.sleep(0.1)
            if time.monotonic() >= next_heartbeat:
                next_heartbeat = time.monotonic() + spec["heartbeat_s"]  # (no burst of catch-up beats after a stall)
                if watch is not None:
                    state.update(watch.progress())
                    stalled = watch.stalled()
                try:
                    write_state(directory, {**state, "heartbeat_at": time.time()})
                except OSError as err:  # a full disk must not end the stage; missing beats make it look dead, though
                    print(f"eagle3 job supervisor: cannot write the heartbeat: {err}", file=sys.stderr, flush=True)
        if stalled is not None:
            # Hung, not slow: the stage (and whatever it started, in this group) is stopped, and the try fails with
            # the reason, so that a retry resumes the stage from what it wrote.
            log_line(f"{stalled}; stopping the stage")
            stop_stage(child, os.getpgid(0))
            state["stalled"] = stalled
            status = "failed"
        elif stop_requested:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=CHILD_GRACE_S)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            status = "killed"
        elif stalled is None:
            status = "succeeded" if child.returncode == 0 else "failed"
        # The log is complete before the state says so: a poll that sees the end then reads the whole log.
        log_line(f"{status} (exit code {child.returncode}) {utc_now()}")
        write_state(directory, {**state, "status": status, "exit_code": child.returncode, "ended_at": utc_now(),
                                "heartbeat_at": time.time()})
