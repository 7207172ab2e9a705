"""A serving engine's server that a stage starts on the box, waits for, and always stops again.

    with serving(cfg, log_path, Speculation(drafter_dir, draft_length=3)) as base_url:   # http://127.0.0.1:PORT
        ...  # talk to it (eagle3.engines: SGLang or vLLM, server.engine)

The command line is the engine's (eagle3.engines): the run config's `server` section (model path, tp size, port,
memory fraction, extra flags) plus the drafter a stage loads. The server's output goes to a log file in the run
directory; when it fails to come up, its last lines are in the error.

No orphan, however the stage ends:
- normal exit or an exception: the with-block stops the server (SIGTERM to its process group, then SIGKILL);
- SIGTERM to the stage (a job kill): it becomes SystemExit, so the same with-block runs;
- SIGKILL of the stage: the kernel sends the server SIGTERM (PR_SET_PDEATHSIG); the engine then stops its own
  worker processes;
- whatever survived even that (a process of the server's group) is killed when a stage starts the server
  again: the server's pid, group and start time are recorded in server.json beside the log.
The server runs in its own session, so one killpg reaches every process it started.

EAGLE3_SERVER_LAUNCHER names a Python file to run instead of `-m sglang.launch_server`, with the same flags:
tests put a stand-in there, since SGLang cannot run on a CPU machine (vLLM's CPU build runs for real).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from eagle3.disk.fsutil import atomic_write_text
from eagle3.engines import Speculation, engine_for
from eagle3.jobs.jobdir import read_log_tail
from eagle3.jobs.processes import group_members, kill_leftovers, pid_start_ticks, read_boot_id
from eagle3.jobs.progress import beat

if TYPE_CHECKING:
    from eagle3.config import RunConfig

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
STOP_GRACE_S = 30.0
PR_SET_PDEATHSIG = 1


class ServerError(RuntimeError):
    """The server did not come up (it exited, or /health never answered); the message holds its last log lines."""


_libc = ctypes.CDLL(None, use_errno=True)  # loaded here: between fork and exec, do as little as possible


def _die_with_parent() -> None:
    """In the server's process, before exec: SIGTERM it when the stage that started it dies, even by SIGKILL."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Turn SIGTERM into SystemExit for the duration, so with-blocks (the server's stop) run on a job kill."""

    def exit_on_sigterm(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop_leftover(record_path: Path) -> None:
    """Kill what is left of a server an earlier, killed run of this stage started (same boot, same process)."""
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError):
        return
    if record.get("boot_id") == read_boot_id() and group_members(record["pgid"]):
        log.warning("server: stopping what is left of an earlier try's server (process group %d)", record["pgid"])
        kill_leftovers(record)
    record_path.unlink(missing_ok=True)


def wait_until_healthy(process: subprocess.Popen, base_url: str, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    started = time.monotonic()
    next_note = started + 60
    with httpx.Client(timeout=5.0) as client:
        while True:
            if process.poll() is not None:
                raise ServerError(
                    f"the server exited with code {process.returncode} before it served; "
                    f"last lines of {log_path}:\n" + "\n".join(read_log_tail(log_path))
                )
            try:
                if client.get(f"{base_url}/health").status_code == 200:
                    log.info("server: healthy after %.0f s at %s", time.monotonic() - started, base_url)
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise ServerError(
                    f"the server did not answer {base_url}/health within {timeout_s:.0f} s "
                    f"(server.startup_timeout_s); last lines of {log_path}:\n" + "\n".join(read_log_tail(log_path))
                )
            if time.monotonic() > next_note:
                next_note += 60
                log.info("server: still starting after %.0f s (log: %s)", time.monotonic() - started, log_path)
            time.sleep(1.0)


def stop(process: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the server's whole group, SIGKILL after grace_s, and wait until every member is gone."""
    record = {"pgid": process.pid, "pid_start_ticks": pid_start_ticks(process.pid)}
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        log.warning("server: did not stop within %.0f s of SIGTERM; killing it", grace_s)
    if record["pid_start_ticks"] is not None:
        kill_leftovers(record)  # SIGKILL to whatever is left of the group (its children), and wait for them
    process.wait()


@contextlib.contextmanager
def serving(
    cfg: RunConfig, log_path: Path, speculation: Speculation | None = None, tree: dict | None = None
) -> Iterator[str]:
    """Start the run's engine (with the drafter of `speculation`, if any; `tree`: benchmark's SGLang tree shape),
    wait for /health, yield its base URL; stop it on the way out, whatever happened."""
    argv = engine_for(cfg).launch_argv(cfg, speculation, tree)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    record_path = log_path.with_suffix(".json")
    stop_leftover(record_path)
    base_url = f"http://{HOST}:{cfg.server.port}"
    log.info("server: starting %s (log: %s)", shlex.join(argv), log_path)
    with sigterm_as_exit(), open(log_path, "ab") as log_file:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        try:
            atomic_write_text(
                record_path,
                json.dumps(
                    {
                        "pgid": process.pid,
                        "pid_start_ticks": pid_start_ticks(process.pid),
                        "boot_id": read_boot_id(),
                        "argv": argv,
                    }
                ),
            )
            # The supervisor's stall limit would count a 1T model's load as a hang: announce the silence.
            beat(f"server: starting {cfg.target.model_path}", allowance_s=cfg.server.startup_timeout_s + 60)
            wait_until_healthy(process, base_url, log_path, cfg.server.startup_timeout_s)
            yield base_url
        finally:
            stop(process)
            record_path.unlink(missing_ok=True)
            log.info("server: stopped")
