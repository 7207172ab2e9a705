"""Processes as /proc sees them (boot id, start ticks, a group's members, a supervisor's mark), and who may be
signalled: a signal goes only to a group the job provably owns (group_ownership_problem); liveness of a recorded job."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

from eagle3.contracts import Effective, JobState
from eagle3.disk.hostid import read_host_id

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"

GROUP_MARK_VAR = "EAGLE3_JOB_GROUP"  # in the stage's environment: "pid:start ticks" of its supervisor

JOB_DIR_VAR = "EAGLE3_JOB_DIR"  # in the supervisor's and the stage's environment: the job's directory, resolved

LEFTOVER_WAIT_S = 10.0  # how long to wait for SIGKILLed processes to vanish (a GPU process can take seconds)


class SignalRefused(Exception):
    """The recorded process group is not provably the job's, so it was not signalled; the message says why."""


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
    return [
        sys.executable,
        "-P",
        "-m",
        "eagle3",
        "job",
        "supervise",
        "--jobs-dir",
        str(directory.parent),
        "--key",
        directory.name,
    ]


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
    eagle3.engines.server's, does not). `directory`: the job's, whose name its supervisor carries (JOB_DIR_VAR). The
    group is the job's when the recorded supervisor leads it (pgid == pid > 1) in this boot and
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
        marks = ([f"{JOB_DIR_VAR}={os.path.realpath(directory)}"] if directory is not None else []) + [
            f"{GROUP_MARK_VAR}={mark}"
        ]
        return (
            f"pid {pid} leads a live process group, but neither it nor any process of its group carries this "
            f"job's marks ({', '.join(marks)}): it is not the job's supervisor"
        )
    members = group_members(pid)
    older = [member for member in members if (pid_start_ticks(member) or ticks) < ticks]
    if older:
        return f"process {older[0]} of group {pid} started before the group's recorded leader: not the job's group"
    if marked and members and not any(carries_mark(member, mark, directory) for member in members):
        return (
            f"supervisor {pid} is gone, and no process left in group {pid} carries its mark "
            f"{GROUP_MARK_VAR}={mark}: the group is not the job's"
        )
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
    return (
        f"the kernel refused to signal process group {state['pgid']} ({err.strerror or err}): some of its "
        f"processes belong to another user or are out of this user's reach; stop them as their owner "
        f"(kill -KILL -- -{state['pgid']}) and check with ps -g {state['pgid']}"
    )


def sigkill_group(
    state: dict, wait_s: float = LEFTOVER_WAIT_S, marked: bool = True, directory: Path | None = None
) -> bool:
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
    that leads its own group (eagle3.engines.server's sglang server): then its pid is its pgid, and a record without a
    boot id is of this boot. `directory`: the job's (group_ownership_problem)."""
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
    return (
        f"running on another host, {state.get('host')!r} (host id {recorded}), as pid {state['pid']}: this host "
        f"({socket.gethostname()!r}, host id {read_host_id()}) cannot see its processes, so it neither restarts "
        f"nor kills it; its last heartbeat was {age:.0f} s ago. Run this stage from that host's box, or, if that "
        "host is gone for good and the job with it, move this job's state.json aside and start it again"
    )


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
