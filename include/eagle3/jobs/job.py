"""Detached, re-attachable jobs on the box: `python -m eagle3 job start|poll|kill`.

A stage runs under a supervisor in a session of its own (eagle3.jobs.supervisor), not under the SSH command:
  start  under the job's lock, attach to a live or succeeded try, else launch one (--redo NAME: start over, once)
  poll   the effective status and the log from an offset (--stream: from that stream's cursor.json)
  kill   SIGTERM to the group, SIGKILL after the grace period, status "killed" (--detach: answer at the SIGTERM)
A try is alive while its boot id, supervisor pid and start time, and heartbeat say so; the next start relaunches a
dead one. A try running on another host is "foreign": never relaunched or killed from here (start exits
Exit.FOREIGN). Only a group the job provably owns is signalled; a corrupt state.json is never acted on. start refuses
a run directory another Airflow run owns (eagle3.jobs.runowner).

{jobs_dir}/{key}/ (the DAG's: RUN_DIR/jobs/<task id>[.<map index>]/; directories 0700, files 0600):
  spec.json      argv, cwd, env names (never values), heartbeat_s, try, redo
  state.json     the try's status, pids, boot and host ids, heartbeat, exit code; replaced atomically
  progress.json  the stage's newest beat; with --stall-timeout-s a silent stage's try fails
  log            stdout+stderr of every try, each from a "==== ... ====" line
  cursor.json    how far the last --stream copied the log (stream, try, offset)
  lock, redone/<time>/ (the tries a redo set aside)
poll and kill refuse (UnsafeJobFile) a job file that is a link or another user's.
Why: docs/decisions/2026-11-29-detached-jobs.md, 2026-12-05-foreign-jobs.md, 2026-12-04-redo-never-mix.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from eagle3.contracts import STALE_AFTER_S, JobPoll, JobStart, JobState
from eagle3.disk.fsutil import atomic_write_text, private_opener
from eagle3.disk.layout import REDO_OUTPUTS
from eagle3.jobs.environment import stage_environment, supervisor_python_path
from eagle3.jobs.jobdir import (
    KEY_PATTERN,
    CorruptState,
    JobError,
    job_dir,
    last_try_number,
    locked,
    make_private_dirs,
    open_job_file,
    read_job_file,
    read_log,
    read_log_tail,
    read_state,
    utc_now,
    write_state,
)
from eagle3.jobs.processes import (
    JOB_DIR_VAR,
    SignalRefused,
    foreign_host,
    is_count,
    liveness,
    permission_refusal,
    pid_start_ticks,
    read_boot_id,
    sigkill_group,
    signal_group,
    supervisor_argv,
    supervisor_pids,
)
from eagle3.jobs.runowner import AirflowRun, check_owner
from eagle3.jobs.supervisor import CHILD_GRACE_S, StallLimits

REDONE_OUTPUTS = frozenset(output for outputs in REDO_OUTPUTS.values() for output in outputs)

DEFAULT_HEARTBEAT_S = 10.0

SUPERVISOR_REPORT_TIMEOUT_S = 10.0  # how long start waits for a new supervisor's first state.json


class JobLaunchError(RuntimeError):
    """The supervisor did not come up, or the last try could not be stopped; the message says why."""


class ForeignJob(JobLaunchError):
    """The job is recorded running on another host: nothing is started, redone or killed beside it from here.
    `job start` exits Exit.FOREIGN for it (eagle3.contracts)."""


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
    belongs to another run (eagle3.jobs.runowner), nothing is started, redone or attached (RunDirOwned)."""
    directory = job_dir(jobs_dir, key)
    if not argv:
        raise JobError("job start needs the command to run after `--`")
    if redo is not None and not KEY_PATTERN.fullmatch(redo):
        raise JobError(f"--redo {redo!r} is invalid: it must match {KEY_PATTERN.pattern}")
    outputs = [output_to_set_aside(directory, path) for path in set_aside]
    if not 0 < heartbeat_s <= stale_after_s / 2:
        raise JobError(
            f"--heartbeat-s {heartbeat_s:g} must be positive and at most half of --stale-after-s "
            f"{stale_after_s:g}, or a healthy job would look dead"
        )
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
        supervisor = launch_supervisor(
            directory, argv, heartbeat_s, try_number, env, stall, redo if redo is not None else recorded_redo
        )
        return {**wait_for_report(directory, supervisor, try_number), "attached": False, "refused": refused}


def spec_field(directory: Path, name: str):
    """A field of the job's spec.json (what its last try was launched with), or None."""
    try:
        spec = json.loads((directory / "spec.json").read_bytes())
    except (OSError, ValueError):
        return None
    return spec.get(name) if isinstance(spec, dict) else None


def output_to_set_aside(directory: Path, path: str) -> Path:
    """A stage's output that a redo moves aside: only one of the outputs a redo may move (eagle3.disk.layout's
    REDO_OUTPUTS), directly in the run directory the jobs directory is in."""
    run_dir, name = directory.parent.parent, Path(path).name
    if Path(path).parent.absolute() != run_dir or name not in REDONE_OUTPUTS:
        raise JobError(
            f"--set-aside {path!r} is not an output this job may move: it must be one of "
            f"{', '.join(sorted(REDONE_OUTPUTS))} in the run directory {run_dir}"
        )
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
        raise JobLaunchError(
            f"job {directory.name} is running (try {state['try']}, pid {state['pid']}): a redo does "
            "not start beside a live try. Wait for it to end, or kill it (mark the task failed, or "
            f"`python -m eagle3 job kill --jobs-dir {directory.parent} --key {directory.name}`), then "
            "start again"
        )
    if state is not None:
        stop_last_try(state, directory)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for output in outputs:
        if output.exists() or output.is_symlink():
            os.rename(output, output.with_name(f"{output.name}.before-redo-{stamp}"))
    archive = directory / "redone" / stamp
    names = [
        name for name in ("state.json", "spec.json", "log", "progress.json", CURSOR_FILE) if (directory / name).exists()
    ]
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
        raise JobLaunchError(
            f"what is left of try {state['try']} of job {state['key']} cannot be stopped: "
            f"{permission_refusal(state, err)}; then start the job again"
        ) from None
    return None


def launch_supervisor(
    directory: Path,
    argv: list[str],
    heartbeat_s: float,
    try_number: int,
    env: dict[str, str],
    stall: StallLimits | None = None,
    redo: str | None = None,
) -> subprocess.Popen:
    """Start the supervisor with `env` (stage_environment's), which it hands on to the stage."""
    spec = {
        "argv": list(argv),
        "cwd": os.getcwd(),
        "env_names": sorted(env),
        "heartbeat_s": heartbeat_s,
        "try": try_number,
        "stall": dataclasses.asdict(stall) if stall else None,
        "redo": redo,
    }
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
            env={
                **env,
                "PYTHONPATH": supervisor_python_path(env.get("PYTHONPATH")),
                JOB_DIR_VAR: os.path.realpath(directory),
            },
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
    return {
        **poll_job(jobs_dir, key, max_log_bytes=0),
        "signalled": signalled,
        "refused": refused,
        "detached": detached,
    }


def stop_running_job(directory: Path, grace_s: float, detach: bool = False) -> tuple[bool, str | None, bool]:
    """kill_job's work, under the lock: (signalled, refused, detached: the rest goes on in a detached process)."""
    try:
        state = read_state(directory)
    except CorruptState as err:
        alive = supervisor_pids(directory)
        who = f"its supervisor (pid {alive[0]}) still runs and" if alive else "if the job still runs, its supervisor"
        return (
            False,
            (
                f"{err}; nothing was signalled on its word: {who} rewrites the file within a heartbeat; "
                "kill the job again then"
            ),
            False,
        )
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
