"""Whose a run directory is: the Airflow run that made it, recorded by `eagle3 init` in RUN_DIR/owner.json.

    python -m eagle3 init --config - --airflow-dag-id=D --airflow-run-id=R [--triggered-by=U] [--redo-from=S]

A run directory belongs to one Airflow run (issue 43, item 6). Its tries, retries and clears (resume = clear the
failed task) are that run, the same DAG id and run id, and go on in it. Another run is refused at init, before it
writes anything, naming the run that owns the directory and the fix: clear that run's failed task, or trigger with
another run_name. Why: the approval of a promotion is refused to the user who triggered the training run
(eagle3_airflow.promotion), and that holds only if no one else made any part of the drafter. An approver who
triggered a run with someone else's run_name and box.redo_from would otherwise re-make the drafter in that user's
directory, clear that user's propose task, and approve her own drafter as theirs.

box.redo_from runs stages again in an existing run directory from a new Airflow run, so a redo may take the directory
over, and only a redo triggered by the user who triggered its owner (a scheduled, Asset-started or CLI run has no
user: a redo by one such run of another's directory is allowed too). Every run that wrote the directory stays listed
in owner.json, the owner last: all of them triggered by one user, the one the approval refuses.

`eagle3 init` by hand (no --airflow-dag-id) records and checks nothing in a directory no Airflow run owns, as before
owners were recorded; it refuses one that an Airflow run owns. An Airflow run refuses a directory that holds a run
config and no owner (made by hand, or before owners were recorded): whose it is cannot be told.

owner.json: {"runs": [{"dag_id", "run_id", "triggered_by", "redo_from", "recorded_at"}, ...]}, replaced atomically
under RUN_DIR/owner.lock, so two runs that init one new directory at once cannot both own it. `job start` given the
Airflow run checks it too (check_owner), before a stage writes: a run refused at init writes nothing by another way.
Light (no pydantic): job start imports it.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from eagle3.fsutil import atomic_write_text
from eagle3.runlayout import CONFIG, OWNER, OWNER_LOCK, REDO_OUTPUTS

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
        for name, value, pattern in (("--airflow-dag-id", self.dag_id, DAG_ID_PATTERN),
                                     ("--airflow-run-id", self.run_id, PRINTABLE_PATTERN),
                                     ("--triggered-by", self.triggered_by, PRINTABLE_PATTERN)):
            if value is not None and not pattern.fullmatch(value):
                raise RunDirOwned(f"{name} {value!r}: not an Airflow name (it must match {pattern.pattern})")
        if self.redo_from is not None and self.redo_from not in REDO_OUTPUTS:
            raise RunDirOwned(f"--redo-from {self.redo_from!r}: not a stage a run may redo ({', '.join(REDO_OUTPUTS)})")

    def same_run(self, entry: dict) -> bool:
        return (entry.get("dag_id"), entry.get("run_id")) == (self.dag_id, self.run_id)

    def record(self) -> dict:
        return {"dag_id": self.dag_id, "run_id": self.run_id, "triggered_by": self.triggered_by,
                "redo_from": self.redo_from, "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


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
        data = path.read_bytes()[:OWNER_MAX_BYTES + 1]
    except FileNotFoundError:
        return None
    except OSError as err:
        raise RunDirOwned(f"{path}: cannot be read ({err.strerror or err}); whose {run_dir} is cannot be told. "
                          "Trigger with another run_name") from None
    try:
        runs = json.loads(data)["runs"]
        if not (runs and len(data) <= OWNER_MAX_BYTES and all(isinstance(entry, dict) for entry in runs)):
            raise ValueError("no runs")
    except (ValueError, TypeError, KeyError):  # (UnicodeDecodeError is a ValueError)
        raise RunDirOwned(f"{path}: not a record of the Airflow runs that wrote {run_dir} (a JSON object whose "
                          "\"runs\" lists them); whose the directory is cannot be told. Trigger with another "
                          "run_name") from None
    return runs


def write_owners(run_dir: Path, runs: list[dict]) -> None:
    atomic_write_text(run_dir / OWNER, json.dumps({"runs": runs}, indent=2) + "\n")


def refusal(run_dir: Path, runs: list[dict], run: AirflowRun | None) -> str | None:
    """Why `run` (None: init by hand) may not write `run_dir`, owned by the last of `runs`; None when it may."""
    owner = runs[-1]
    if run is None:
        return (f"{run_dir} belongs to {describe(owner)}: init by hand does not write into an Airflow run's "
                "directory. Clear that run's write_config task to init it again, or init another run_name")
    if run.same_run(owner):
        return None  # a retry or a clear of the owner: resume
    this = describe(run.record())
    if run.redo_from is None:
        taken = any(run.same_run(entry) for entry in runs)
        return (f"{run_dir} belongs to {describe(owner)}"
                + (f", which took it over from {this} to redo stages" if taken else "")
                + f": a run directory is one Airflow run's, so {this} does not write into it. To go on with that "
                "run, clear its failed task (a clear resumes it); for a run of your own, trigger with another "
                "run_name, or leave it empty (the run is then named after its DAG and run id)")
    if run.triggered_by != owner.get("triggered_by"):
        return (f"box.redo_from {run.redo_from}: {run_dir} belongs to {describe(owner)}, and {this} was triggered by "
                "another user. A redo in a run directory is its own user's: whoever approves a promotion must have "
                "made no part of the drafter, and its approval knows only the user who triggered the owner. Have "
                "that user trigger the redo, or trigger with another run_name")
    return None


def check_owner(run_dir: Path, run: AirflowRun) -> None:
    """Refuse (RunDirOwned) `run` where another Airflow run owns `run_dir` (job start, before a stage writes there:
    a run whose init was refused must not write by another way, such as its write_config task marked successful).
    A directory with no owner recorded is left to init to judge."""
    runs = read_owners(Path(run_dir))
    if runs is not None and not run.same_run(runs[-1]):
        raise RunDirOwned(refusal(Path(run_dir), runs, dataclasses.replace(run, redo_from=None)))


@contextmanager
def claimed(run_dir: Path, run: AirflowRun | None) -> Iterator[None]:
    """Hold the run directory while init writes it, for `run` (None: init by hand): refuse (RunDirOwned) a directory
    that is another run's, else record `run` as its owner. A new directory's owner is recorded before the body (an
    init cut off before config.json then finds its own run), a redo's takeover after it (so that a config the
    directory refuses changes no owner)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / OWNER_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two runs that init one new directory at once: one owns it
        runs = read_owners(run_dir)
        if runs is None:
            if run is not None and (run_dir / CONFIG).exists():
                raise RunDirOwned(f"{run_dir} holds a run config but no record of the Airflow run that owns it (made "
                                  "by `eagle3 init` by hand, or before owners were recorded): whose it is cannot be "
                                  "told. Trigger with another run_name")
            if run is not None:
                write_owners(run_dir, [run.record()])
            yield
            return
        why = refusal(run_dir, runs, run)
        if why:
            raise RunDirOwned(why)
        yield
        if run is not None and not run.same_run(runs[-1]):  # a redo's takeover, listed after the runs before it
            write_owners(run_dir, [*runs, run.record()])
