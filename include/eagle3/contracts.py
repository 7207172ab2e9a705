"""The contracts between the control plane (plugins/eagle3_airflow) and the box (`python -m eagle3`), imported by both
sides: no torch, no Airflow, no pydantic (`job poll` runs every few seconds for hours and must start fast).

PROTOCOL numbers everything a run carries across a deploy: the commands, flags and JSON replies the control plane
uses on the box, and the run plan it seals into XCom. A run's box code is pinned when the run is validated
(eagle3_airflow.codesync), so a worker deployed since may speak another protocol than the run's code on the box: it
refuses the run, saying what to do, instead of guessing what that code understands. Bump it with any such change.

The JSON replies are TypedDicts: the box builds them, the control plane reads them, and the type checker holds both
to the same keys (`make check`).
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, Literal, NotRequired, TypedDict

PROTOCOL = 1
STALE_AFTER_S = 120.0  # a running job whose heartbeat is older is dead (box.stale_after_s, `job poll` by hand)


class Exit(IntEnum):
    """How `python -m eagle3` ends."""

    OK = 0
    FAILED = 1  # an error a retry may get past: a crash, a lost device, a supervisor that did not come up
    REFUSED = 2  # wrong input (config, data, a file) or a refusal (another run's directory, a usage error): a retry
    #              cannot help
    FOREIGN = 3  # the job runs on another host sharing the work directory: this box can neither wait on it nor start it


# -- jobs: `job start`, `job poll` (eagle3.jobs.job; eagle3_airflow.remote_job) ------------------------------------

JobStatus = Literal["running", "succeeded", "failed", "killed"]
# What a poll makes of the record: running only while alive; "dead" for a running record whose process is gone or
# silent, "foreign" for one another host runs, "absent" before the first start.
Effective = Literal["running", "succeeded", "failed", "killed", "dead", "foreign", "absent"]


# state.json, written by the job's supervisor (a try) and read by every start, poll and kill. (Functional syntax:
# "try" is a Python keyword.)
JobState = TypedDict(
    "JobState",
    {
        "key": str,
        "try": int,
        "status": JobStatus,
        "pid": int,
        "pgid": int,
        "pid_start_ticks": int,
        "boot_id": str,
        "host": str,
        "host_id": str,
        "argv": list[str],
        "started_at": str,
        "heartbeat_at": float,
        "exit_code": int | None,
        "ended_at": str | None,
        "log": str,
        "log_start": int,
        "child_pid": NotRequired[int],
        "code": NotRequired[str],
    },
)


class JobStart(JobState):
    """`job start`'s answer: the state of the try it attached to or launched."""

    attached: bool  # True: nothing was launched (a live or succeeded try)
    refused: str | None  # why nothing of the last try was signalled before the relaunch


class JobPoll(TypedDict):
    """`job poll`'s answer: the state, what it means now, and the log from an offset."""

    key: str
    effective: Effective
    reason: str
    state: JobState | None
    log: str
    log_offset: int
    log_size: int
    log_tail: list[str]  # the log's last lines when the job failed, died or was killed


# -- facts about the box: `box info` (eagle3.box.facts; eagle3_airflow.tasks.sync_code) -------------------------------


class BoxInfo(TypedDict):
    protocol: int  # what the control plane checks before it drives this code
    python: str
    executable: str
    hostname: str
    boot_id: str | None
    packages: dict[str, str | None]
    cuda: dict[str, Any] | None  # the torch/CUDA facts and each GPU as the box reports them: free-form JSON
    gpus: list[dict[str, Any]]
    missing: list[str]  # required packages that are not installed


# -- a run's files for the report: `report manifest` (eagle3.box.reportfiles; eagle3_airflow.results)
# -------------------


class ManifestEntry(TypedDict):
    name: str
    present: NotRequired[bool]
    size: NotRequired[int]
    sha256: NotRequired[str]
    refused: NotRequired[str]  # why the file may not be read (a link, not regular, too big)


class FileManifest(TypedDict):
    run_dir: str
    files: list[ManifestEntry]
    plots: NotRequired[list[str]]  # with --plots: <stage>/<name>.png
