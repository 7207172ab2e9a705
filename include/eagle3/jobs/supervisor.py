"""The supervisor (`job supervise`, started by `job start`): leads the job's process group, runs the stage in it,
rewrites state.json every heartbeat, and stops a stage that stalls (StallWatch) or outlives a kill."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from eagle3.disk.fsutil import private_opener
from eagle3.disk.hostid import read_host_id
from eagle3.jobs.environment import package_root, stage_python_path
from eagle3.jobs.jobdir import job_dir, utc_now, write_state
from eagle3.jobs.processes import GROUP_MARK_VAR, group_members, pid_start_ticks, read_boot_id
from eagle3.jobs.progress import PROGRESS_FILE_VAR

# In the stage's environment under a stall limit: the first-progress limit in seconds (StallLimits.first_s), which a
# stage that waited (beating progress) before loading its model announces again as its allowance
# (eagle3.stages.extract).
FIRST_PROGRESS_VAR = "EAGLE3_FIRST_PROGRESS_TIMEOUT_S"

CHILD_GRACE_S = 20.0  # after SIGTERM, how long the supervisor lets the stage shut down before SIGKILL


@dataclasses.dataclass(frozen=True)
class StallLimits:
    """How long a stage may go without a progress beat (eagle3.jobs.progress.beat) before it counts as hung:
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
            "key": key,
            "try": spec["try"],
            "status": "running",
            "pid": os.getpid(),
            "pgid": os.getpgid(0),
            "pid_start_ticks": pid_start_ticks(os.getpid()),
            "boot_id": read_boot_id(),
            "host": host,
            "host_id": read_host_id(),
            "argv": spec["argv"],
            "started_at": utc_now(),
            "heartbeat_at": time.time(),
            "exit_code": None,
            "ended_at": None,
            "log": str(log_path),
            "log_start": log_start,
            "code": package_root(),
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
                spec["argv"],
                cwd=spec["cwd"],
                env=stage_env,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
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
        write_state(
            directory,
            {
                **state,
                "status": status,
                "exit_code": child.returncode,
                "ended_at": utc_now(),
                "heartbeat_at": time.time(),
            },
        )
