"""Detached, re-attachable jobs on the box: `python -m eagle3 job start|poll|kill`.

Airflow drives each long stage (training runs for hours) over SSH. The SSH session, the Airflow worker or the
network may die at any moment; the stage must keep running anyway, and the next Airflow try must find it again
instead of starting a second copy. So the stage never runs under the SSH command itself:

  start      takes the job's lock and, unless the job is alive (or already succeeded), launches a supervisor in
             a new session (setsid; stdin, stdout and stderr detached from the SSH channel), waits until it has
             reported the new try, prints the state and exits. Closing the SSH session leaves the job running.
  supervise  (internal) the session leader of the job's process group. It runs the stage as its child in that
             group with output appended to `log`, rewrites `state.json` every heartbeat_s, and records how the
             child ended. On SIGTERM it passes the signal on, gives the child 20 s, then SIGKILLs it.
  poll       reads state.json, decides whether the job is really alive, and returns the log from an offset on,
             so that the caller streams the log across polls (and across Airflow tries).
  kill       SIGTERMs the job's process group, SIGKILLs whatever is left after a grace period, records "killed".

Why a supervisor rather than `nohup stage &`: someone has to be there when the stage ends to record its exit code
(the shell that launched it is long gone), and its process group is the one handle on everything the stage spawns
(torchrun, its ranks, data loader workers), so one killpg reaches all of them.

Why liveness takes more than state.json's status: after a crash the status still says "running" (nobody was left
to rewrite it). A running job is alive only if all of these hold:
  - the boot id (/proc/sys/kernel/random/boot_id) is the one recorded: after a reboot every recorded pid is void;
  - the supervisor's pid exists and started at the recorded time (field 22 of /proc/<pid>/stat, clock ticks since
    boot): pids are reused, and a stranger that got the old pid started at another time;
  - its heartbeat is recent: a supervisor that exists but no longer runs (stopped, hung on a dead mount) stops
    rewriting state.json.
A job that fails a check is "dead"; the next start relaunches it (every stage resumes by itself). Before that, start
SIGKILLs whatever is left of the old process group, so that two copies never write the same checkpoints.

Why flock: starts and kills can overlap (a worker that only looked dead, a user's cancel racing a retry). An
exclusive flock on `lock` makes "read the state, then launch or kill" one step, so two starts can't both launch and
a kill can't overwrite a new try's state. The kernel drops a flock when its holder dies, so a crashed start never
leaves the job locked. The supervisor never takes the lock (start holds it while waiting for the supervisor), and
poll doesn't need it: state.json is only ever replaced atomically (eagle3.fsutil).

Files in {jobs_dir}/{key}/, a private (0700) directory because spec.json holds the environment:
  spec.json   what to run: argv, cwd, env, heartbeat_s and the try number
  state.json  the supervisor's report: key, try, status, pid, pgid, pid_start_ticks, boot_id, host, argv,
              started_at, heartbeat_at, exit_code, ended_at, log (and child_pid)
  log         the stage's stdout+stderr, appended across tries; each try starts with a "==== ... ====" line
  lock        the flock file
"""

from __future__ import annotations

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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from eagle3.fsutil import atomic_write_text

KEY_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
DEFAULT_HEARTBEAT_S = 10.0
DEFAULT_STALE_AFTER_S = 120.0
SUPERVISOR_REPORT_TIMEOUT_S = 10.0  # how long start waits for a new supervisor's first state.json
CHILD_GRACE_S = 20.0  # after SIGTERM, how long the supervisor lets the stage shut down before SIGKILL
LEFTOVER_WAIT_S = 10.0  # how long to wait for SIGKILLed processes to vanish (a GPU process can take seconds)
LOG_TAIL_LINES = 30
LOG_TAIL_BYTES = 64 * 1024


class JobError(Exception):
    """A usage error (bad key, no command): the CLI prints it and exits 2."""


class JobLaunchError(RuntimeError):
    """The supervisor did not come up; the message carries the end of the log."""


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


def kill_leftovers(state: dict, wait_s: float = LEFTOVER_WAIT_S) -> None:
    """SIGKILL whatever is left of a job's process group and wait (up to wait_s) until it is gone.

    Only for a state of this boot. The group's id is the supervisor's pid, and Linux never hands out a pid again
    while a process group of that id has members. So the group is this job's, unless a process with that pid
    exists and started at another time: then the job's group is empty and the number belongs to a stranger."""
    pgid = state["pgid"]
    leader = process_stat(pgid)
    if leader is not None and leader[2] != state["pid_start_ticks"]:
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + wait_s
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def liveness(state: dict | None, stale_after_s: float) -> tuple[str, str]:
    """(effective status, reason): the recorded status, except that a "running" job failing a check is "dead"."""
    if state is None:
        return "absent", "no state.json: the job was never started"
    status = state["status"]
    if status == "succeeded":
        return status, "the command exited with code 0"
    if status == "failed":
        return status, f"the command failed with exit code {state['exit_code']}"
    if status == "killed":
        return status, "the job was killed"
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


def read_state(directory: Path) -> dict | None:
    try:
        return json.loads((directory / "state.json").read_text())
    except FileNotFoundError:
        return None


def write_state(directory: Path, state: dict) -> None:
    atomic_write_text(directory / "state.json", json.dumps(state, indent=2) + "\n")


@contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Hold the job's exclusive flock, waiting for the current holder if there is one."""
    with open(directory / "lock", "a") as lock_file:  # closing the file releases the lock
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
        with open(path, "rb") as f:
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
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - LOG_TAIL_BYTES))
            text = f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return []
    return text.splitlines()[-lines:]


# ---------------------------------------------------------------------------------------------------------------------
# start, poll, kill


def start_job(
    jobs_dir: str | Path,
    key: str,
    argv: list[str],
    heartbeat_s: float = DEFAULT_HEARTBEAT_S,
    stale_after_s: float = DEFAULT_STALE_AFTER_S,
) -> dict:
    """Make sure the job runs: attach to a live (or succeeded) try, or launch a new one. Returns its state plus
    "attached" (True: nothing was launched)."""
    directory = job_dir(jobs_dir, key)
    if not argv:
        raise JobError("job start needs the command to run after `--`")
    if not 0 < heartbeat_s <= stale_after_s / 2:
        raise JobError(f"--heartbeat-s {heartbeat_s:g} must be positive and at most half of --stale-after-s "
                       f"{stale_after_s:g}, or a healthy job would look dead")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    with locked(directory):
        state = read_state(directory)
        effective, _ = liveness(state, stale_after_s)
        if effective in ("running", "succeeded"):  # a succeeded job is not rerun: the caller decides what it means
            return {**state, "attached": True}
        if state is not None and state["boot_id"] == read_boot_id():
            kill_leftovers(state)  # an earlier try may have left processes (a hung supervisor and its stage)
        try_number = (state["try"] if state else 0) + 1
        supervisor = launch_supervisor(directory, key, argv, heartbeat_s, try_number)
        return {**wait_for_report(directory, supervisor, try_number), "attached": False}


def launch_supervisor(
    directory: Path, key: str, argv: list[str], heartbeat_s: float, try_number: int
) -> subprocess.Popen:
    spec = {"argv": list(argv), "cwd": os.getcwd(), "env": dict(os.environ), "heartbeat_s": heartbeat_s,
            "try": try_number}
    atomic_write_text(directory / "spec.json", json.dumps(spec, indent=2) + "\n")
    # The supervisor must run this very code: put the directory holding this eagle3 package first on its path.
    package_root = str(Path(__file__).resolve().parents[1])
    python_path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    with open(directory / "log", "ab") as log_file:  # its own stderr (a traceback if it ever crashes) goes there
        return subprocess.Popen(
            [sys.executable, "-m", "eagle3", "job", "supervise", "--jobs-dir", str(directory.parent), "--key", key],
            start_new_session=True,  # setsid: out of the SSH session's process group, no controlling terminal
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # not the SSH channel, or `ssh box job start` would wait for the job
            stderr=log_file,
            close_fds=True,  # in particular not the lock, which would stay held as long as the supervisor runs
            env=dict(os.environ, PYTHONPATH=python_path),
        )


def wait_for_report(directory: Path, supervisor: subprocess.Popen, try_number: int) -> dict:
    """The first state the new supervisor writes: usually "running", finished already if the command was quick."""
    deadline = time.monotonic() + SUPERVISOR_REPORT_TIMEOUT_S
    while True:
        exited = supervisor.poll() is not None  # checked before reading, so a state written before exit is seen
        state = read_state(directory)
        if state is not None and state["try"] == try_number and state["pid"] == supervisor.pid:
            return state
        if exited:
            problem = f"the job supervisor exited with code {supervisor.returncode} before reporting"
            break
        if time.monotonic() > deadline:
            os.killpg(supervisor.pid, signal.SIGKILL)  # a late report from it would confuse the next start
            supervisor.wait()
            problem = f"the job supervisor did not report within {SUPERVISOR_REPORT_TIMEOUT_S:g} s"
            break
        time.sleep(0.05)
    tail = "\n".join(read_log_tail(directory / "log", 10))
    raise JobLaunchError(f"{problem}; end of {directory / 'log'}:\n{tail}")


def poll_job(
    jobs_dir: str | Path,
    key: str,
    log_offset: int = 0,
    max_log_bytes: int = 65536,
    stale_after_s: float = DEFAULT_STALE_AFTER_S,
) -> dict:
    """The job's effective status and the log from log_offset on. Never changes anything."""
    directory = job_dir(jobs_dir, key)
    if log_offset < 0 or max_log_bytes < 0:
        raise JobError("--log-offset and --max-log-bytes must not be negative")
    state = read_state(directory)
    effective, reason = liveness(state, stale_after_s)
    # The state is read before the log: once it says finished, the log read next is complete.
    log, new_offset = read_log(directory / "log", log_offset, max_log_bytes, whole_lines=effective == "running")
    return {
        "key": key,
        "effective": effective,
        "reason": reason,
        "state": state,
        "log": log,
        "log_offset": new_offset,
        "log_tail": read_log_tail(directory / "log") if effective in ("failed", "dead", "killed") else [],
    }


def kill_job(jobs_dir: str | Path, key: str, grace_s: float = CHILD_GRACE_S) -> dict:
    """Stop the job (SIGTERM, then SIGKILL after grace_s) and record "killed". A finished or absent job is left as
    it is. Returns poll_job's answer, without log text (log_tail still holds the end of the log)."""
    directory = job_dir(jobs_dir, key)
    if read_state(directory) is not None:  # (no state: nothing to kill, and no directory to create for the lock)
        with locked(directory):  # held throughout, so that no start relaunches the job while it is being killed
            state = read_state(directory)
            if state["status"] == "running":
                if liveness(state, stale_after_s=math.inf)[0] == "running":  # a stale heartbeat: still kill it
                    terminate(state, grace_s)
                if state["boot_id"] == read_boot_id():
                    kill_leftovers(state)
                latest = read_state(directory)
                if latest["status"] == "running":  # the supervisor was SIGKILLed or gone before it could record it
                    write_state(directory, {**latest, "status": "killed", "ended_at": utc_now()})
    return poll_job(jobs_dir, key, max_log_bytes=0)


def terminate(state: dict, grace_s: float) -> None:
    """SIGTERM the whole group (the supervisor passes it on too) and wait until the supervisor has exited."""
    try:
        os.killpg(state["pgid"], signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while pid_start_ticks(state["pid"]) == state["pid_start_ticks"] and time.monotonic() < deadline:
        time.sleep(0.05)


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
    with open(log_path, "ab") as log_file:

        def log_line(text: str) -> None:
            log_file.write(f"==== eagle3 job {key} try {spec['try']} {text} ====\n".encode())
            log_file.flush()

        log_line(f"started {utc_now()} on {host}")
        state = {
            "key": key, "try": spec["try"], "status": "running", "pid": os.getpid(), "pgid": os.getpgid(0),
            "pid_start_ticks": pid_start_ticks(os.getpid()), "boot_id": read_boot_id(), "host": host,
            "argv": spec["argv"], "started_at": utc_now(), "heartbeat_at": time.time(), "exit_code": None,
            "ended_at": None, "log": str(log_path),
        }
        try:
            # Same process group as the supervisor (the default), so that kill's killpg reaches the whole stage.
            child = subprocess.Popen(
                spec["argv"], cwd=spec["cwd"], env={**spec["env"], "PYTHONUNBUFFERED": "1"},
                stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
            )
        except OSError as err:  # no such program, cwd gone, ...
            log_line(f"cannot start {spec['argv'][0]!r}: {err}")
            write_state(directory, {**state, "status": "failed", "exit_code": 127, "ended_at": utc_now()})
            return
        state["child_pid"] = child.pid
        write_state(directory, state)

        next_heartbeat = time.monotonic() + spec["heartbeat_s"]
        while child.poll() is None and not stop_requested:
            time.sleep(0.1)
            if time.monotonic() >= next_heartbeat:
                next_heartbeat = time.monotonic() + spec["heartbeat_s"]  # (no burst of catch-up beats after a stall)
                try:
                    write_state(directory, {**state, "heartbeat_at": time.time()})
                except OSError as err:  # a full disk must not end the stage; missing beats make it look dead, though
                    print(f"eagle3 job supervisor: cannot write the heartbeat: {err}", file=sys.stderr, flush=True)
        if stop_requested:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=CHILD_GRACE_S)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            status = "killed"
        else:
            status = "succeeded" if child.returncode == 0 else "failed"
        # The log is complete before the state says so: a poll that sees the end then reads the whole log.
        log_line(f"{status} (exit code {child.returncode}) {utc_now()}")
        write_state(directory, {**state, "status": status, "exit_code": child.returncode, "ended_at": utc_now(),
                                "heartbeat_at": time.time()})
