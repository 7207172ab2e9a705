"""Whose a run directory is: the Airflow runs that wrote it, recorded by `eagle3 init` in RUN_DIR/owner.json.

    python -m eagle3 init --config - --airflow-dag-id=D --airflow-run-id=R [--triggered-by=U] [--redo-from=S]

A run directory is one user's, so that whoever approves its drafter made no part of it (eagle3_airflow.approvals).
The Airflow run whose init made it owns it; its tries, retries and clears go on in it, and a later run of the same
user (box.redo_from, or a rerun) takes it over, listed after the runs before it, the owner last. A run triggered by
another user is refused at init before it writes anything, and `job start` refuses a stage of any run but the owner
(check_owner). Runs with no user (scheduler, Asset, CLI: triggered_by None) count as one user. `eagle3 init` by hand
records nothing and refuses a directory an Airflow run owns; an Airflow run refuses a directory that holds a run
config and no owner.json; an unreadable owner.json is refused. Every refusal is RunDirOwned: the CLI exits 2 with
its message, which names the owner and the fix.

owner.json: {"runs": [{"dag_id", "run_id", "triggered_by", "redo_from", "recorded_at", "host", "host_id"}, ...]},
replaced atomically under RUN_DIR/owner.lock. "host" and "host_id" (eagle3.disk.hostid) name the box that recorded
the owner, whose `runs prune` alone may remove the directory (owner_host; eagle3.box.retention); the owner's init on
another box moves them there. Light (no pydantic): job start imports it.
Why: docs/decisions/2026-12-05-run-dir-one-user.md.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import re
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from eagle3.disk.fsutil import atomic_write_text
from eagle3.disk.hostid import read_host_id
from eagle3.disk.layout import CONFIG, OWNER, OWNER_LOCK, REDO_OUTPUTS

DAG_ID_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,250}$")  # Airflow's own rule for a DAG id
PRINTABLE_PATTERN = re.compile(r"^[^\x00-\x1f\x7f]{1,256}$")  # run ids and user names: one line, bounded
OWNER_MAX_BYTES = 1 << 20


class RunDirOwned(Exception):
    """The run directory is another Airflow run's (or cannot be told whose), or a value names no Airflow run: the CLI
    exits 2 with the message, which names the owner and the fix."""


@dataclasses.dataclass(frozen=True)
class AirflowRun:
    """The Airflow run that inits a run directory, as the control plane names it (from the task's own DAG run, never
    from XCom): its DAG, its run id, the user who triggered it (None: the scheduler, an Asset, the CLI) and the
    stage it redoes from (box.redo_from; None when it redoes nothing)."""

    dag_id: str
    run_id: str
    triggered_by: str | None = None
    redo_from: str | None = None

    def __post_init__(self) -> None:
        for name, value, pattern in (
            ("--airflow-dag-id", self.dag_id, DAG_ID_PATTERN),
            ("--airflow-run-id", self.run_id, PRINTABLE_PATTERN),
            ("--triggered-by", self.triggered_by, PRINTABLE_PATTERN),
        ):
            if value is not None and not pattern.fullmatch(value):
                raise RunDirOwned(f"{name} {value!r}: not an Airflow name (it must match {pattern.pattern})")
        if self.redo_from is not None and self.redo_from not in REDO_OUTPUTS:
            raise RunDirOwned(f"--redo-from {self.redo_from!r}: not a stage a run may redo ({', '.join(REDO_OUTPUTS)})")

    def same_run(self, entry: dict) -> bool:
        return (entry.get("dag_id"), entry.get("run_id")) == (self.dag_id, self.run_id)

    def record(self) -> dict:
        """Its owner.json entry, made on this host."""
        return {
            "dag_id": self.dag_id,
            "run_id": self.run_id,
            "triggered_by": self.triggered_by,
            "redo_from": self.redo_from,
            "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **this_host(),
        }


def this_host() -> dict:
    """{"host", "host_id"} of the host this runs on, as owner.json records it."""
    return {"host": socket.gethostname(), "host_id": read_host_id()}


def owner_host(runs: list[dict]) -> dict:
    """{"host", "host_id"} of the box that recorded the owner (the last of `runs`)."""
    return {"host": runs[-1].get("host"), "host_id": runs[-1].get("host_id")}


def describe(entry: dict) -> str:
    """An owner.json entry as the refusal names it: run id, DAG, who triggered it."""
    user = entry.get("triggered_by")
    who = f"triggered by {user!r}" if user is not None else "triggered by no user (the scheduler, an Asset or the CLI)"
    return f"Airflow run {entry.get('run_id')!r} of DAG {entry.get('dag_id')!r} ({who})"


def read_owners(run_dir: Path) -> list[dict] | None:
    """The runs that wrote `run_dir`, the owner last; None when no owner is recorded. Refuses (RunDirOwned) a record
    that cannot be read: whose the directory is is then unknown."""
    path = run_dir / OWNER
    try:
        data = path.read_bytes()[: OWNER_MAX_BYTES + 1]
    except FileNotFoundError:
        return None
    except OSError as err:
        raise RunDirOwned(
            f"{path}: cannot be read ({err.strerror or err}); whose {run_dir} is cannot be told. "
            "Trigger with another run_name"
        ) from None
    try:
        runs = json.loads(data)["runs"]
        if not (runs and len(data) <= OWNER_MAX_BYTES and all(isinstance(entry, dict) for entry in runs)):
            raise ValueError("no runs")
    except (ValueError, TypeError, KeyError):  # (UnicodeDecodeError is a ValueError)
        raise RunDirOwned(
            f"{path}: not a record of the Airflow runs that wrote {run_dir} (a JSON object whose "
            '"runs" lists them); whose the directory is cannot be told. Trigger with another '
            "run_name"
        ) from None
    return runs


def write_owners(run_dir: Path, runs: list[dict]) -> None:
    atomic_write_text(run_dir / OWNER, json.dumps({"runs": runs}, indent=2) + "\n")


def refusal(run_dir: Path, runs: list[dict], run: AirflowRun | None) -> str | None:
    """Why `run` (None: init by hand) may not init `run_dir`, owned by the last of `runs`; None when it may: the
    owner itself, or a run of the owner's user, which then takes the directory over."""
    owner = runs[-1]
    if run is None:
        return (
            f"{run_dir} belongs to {describe(owner)}: init by hand does not write into an Airflow run's "
            "directory. Clear that run's write_config task to init it again, or init another run_name"
        )
    if run.same_run(owner) or run.triggered_by == owner.get("triggered_by"):
        return None  # a retry or clear of the owner; or the same user's next run (a redo), which takes it over
    redo = f"box.redo_from {run.redo_from}: " if run.redo_from else ""
    return (
        f"{redo}{run_dir} belongs to {describe(owner)}, and {describe(run.record())} was triggered by another "
        "user. A run directory is written by one user's runs: whoever approves a promotion must have made no "
        "part of the drafter, and the approval knows the user who triggered the run that proposes it. To go on "
        "with that run, its user clears its failed task (a clear resumes it); for a run of your own, trigger "
        "with another run_name, or leave it empty (the run is then named after its DAG and run id)"
    )


def check_owner(run_dir: Path, run: AirflowRun) -> None:
    """Refuse (RunDirOwned) a stage of `run` where another Airflow run owns `run_dir` (job start, before a stage
    writes there): a run refused at init, its write_config then marked successful, or a run whose directory a later
    run of its user took over, starts nothing there. A directory with no owner recorded is left to init to judge."""
    runs = read_owners(Path(run_dir))
    if runs is None or run.same_run(runs[-1]):
        return
    taken = " (it took the directory over from this run)" if any(run.same_run(entry) for entry in runs) else ""
    raise RunDirOwned(
        f"{run_dir} belongs to {describe(runs[-1])}{taken}: stages of Airflow run {run.run_id!r} of DAG "
        f"{run.dag_id!r} do not start in it. Go on with the run that owns it (clear its failed task), "
        "or trigger with another run_name"
    )


@contextmanager
def claimed(run_dir: Path, run: AirflowRun | None) -> Iterator[None]:
    """Hold the run directory while init writes it, for `run` (None: init by hand): refuse (RunDirOwned) a directory
    that is another user's run's (refusal), else record `run` as its owner. A new directory's owner is recorded
    before the body (an init cut off before config.json then finds its own run), a takeover by the owner's user's
    later run after it (so that a config the directory refuses changes no owner)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / OWNER_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two runs that init one new directory at once: one owns it
        runs = read_owners(run_dir)
        if runs is None:
            if run is not None and (run_dir / CONFIG).exists():
                raise RunDirOwned(
                    f"{run_dir} holds a run config but no record of the Airflow run that owns it (made "
                    "by `eagle3 init` by hand): whose it is cannot be told. Trigger with another "
                    "run_name"
                )
            if run is not None:
                write_owners(run_dir, [run.record()])
            yield
            return
        why = refusal(run_dir, runs, run)
        if why:
            raise RunDirOwned(why)
        yield
        if run is not None and not run.same_run(runs[-1]):  # the same user's later run: listed after the rest
            write_owners(run_dir, [*runs, run.record()])
        elif run is not None and owner_host(runs) != (host := this_host()):
            # The owner's init again, on a box that is not the one recorded (the run's box changed): its stages run
            # here now, and this host's retention is the one that may prune.
            write_owners(run_dir, [*runs[:-1], {**runs[-1], **host}])
