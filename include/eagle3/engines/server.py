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
  again: the server's pid, group, start time and a random mark (SERVER_MARK_VAR in its environment) are recorded
  in server.json beside the log; a record whose group carries no such mark names no server, and is left alone.
The server runs in its own session, so one killpg reaches every process it started.

The port is the engine's alone: a stage refuses server.port while something already listens there, and after /health
answers, unless every socket listening on it belongs to the engine's process group (ServerError either way). A box
user listening first would otherwise be answered as the engine: sent the conversations, and measured as the drafter.

EAGLE3_SERVER_LAUNCHER names a Python file to run instead of `-m sglang.launch_server`, with the same flags:
tests put a stand-in there, since SGLang cannot run on a CPU machine (vLLM's CPU build runs for real).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import secrets
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from eagle3.disk.fsutil import atomic_write_text
from eagle3.engines import Speculation, engine_for
from eagle3.jobs.jobdir import read_log_tail
from eagle3.jobs.processes import environment_of, group_members, kill_leftovers, pid_start_ticks, read_boot_id
from eagle3.jobs.progress import beat

if TYPE_CHECKING:
    from eagle3.config import RunConfig

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
SERVER_MARK_VAR = "EAGLE3_SERVER"  # in the server's environment: the random mark its server.json records
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
    """Kill what is left of a server an earlier, killed run of this stage started (same boot, same process, and a
    process of its group carries the record's mark: a planted record may name any live group, another run's train)."""
    try:
        record = json.loads(record_path.read_text())
        pgid, mark = int(record["pgid"]), str(record["mark"])
    except (OSError, ValueError, TypeError, KeyError):
        record_path.unlink(missing_ok=True)
        return
    members = group_members(pgid) if record.get("boot_id") == read_boot_id() else []
    if any(f"{SERVER_MARK_VAR}={mark}".encode() in environment_of(member) for member in members):
        log.warning("server: stopping what is left of an earlier try's server (process group %d)", pgid)
        kill_leftovers(record)
    elif members:
        log.warning(
            "server: %s names process group %d, which is no server of this stage's; left alone", record_path, pgid
        )
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
                    refuse_other_listeners(process, base_url)  # the 200 may not be our engine's
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


# -- the port is the engine's: a box user listening there first would be answered as the engine ----------------


def refuse_taken_port(port: int) -> None:
    """Before the engine starts: whatever already listens on the port would answer the stage in its place."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # an earlier engine's TIME_WAIT is no listener
        try:
            probe.bind((HOST, port))
        except OSError as err:
            raise ServerError(
                f"server.port: {HOST}:{port} is taken ({err.strerror}) before the engine started, and whatever "
                "listens there would be answered as the engine; stop it, or set server.port to a free port"
            ) from None


def listening_sockets(port: int) -> set[int]:
    """Inodes of the sockets listening on TCP `port` (any address, IPv4 or IPv6), from /proc/net."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    inodes.add(int(fields[9]))
    return inodes


def sockets_of(pid: int) -> set[int]:
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    return inodes


def refuse_other_listeners(process: subprocess.Popen, base_url: str) -> None:
    """The engine answered /health: refuse if any socket listening on its port is not its process group's (a box user
    who got there first, or between the check and the bind, answers instead of it)."""
    port = int(base_url.rsplit(":", 1)[1])
    ours = {inode for pid in group_members(process.pid) for inode in sockets_of(pid)}
    if listening_sockets(port) - ours:
        raise ServerError(
            f"server.port: another process listens on {HOST}:{port} beside the engine this stage started, so an "
            "answer there may not be the engine's; stop it, or set server.port to a free port"
        )


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
    refuse_taken_port(cfg.server.port)
    base_url = f"http://{HOST}:{cfg.server.port}"
    log.info("server: starting %s (log: %s)", shlex.join(argv), log_path)
    mark = secrets.token_hex(16)
    with sigterm_as_exit(), open(log_path, "ab") as log_file:
        process = subprocess.Popen(
            argv,
            env={**os.environ, SERVER_MARK_VAR: mark},
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
                        "mark": mark,
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
