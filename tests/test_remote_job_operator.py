"""The remote-job operator's worker phase, in the task SDK's own runner: bounded by an execution_timeout of its own,
which neither cuts the deferred wait nor kills the job when the worker is what was slow; and the box's job record as
the one authority on what a try re-attaches to (no task_state_store beside it)."""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
from airflow.sdk import DAG
from airflow.sdk.exceptions import AirflowTaskTimeout, TaskDeferred

from eagle3_airflow.plan import RunPlan
from eagle3_airflow.remote_job import WORKER_PHASE_TIMEOUT, RemoteJobOperator
from tests.conftest import CONTEXT, plain_config, run_plan, sealed


@pytest.mark.slow
def test_the_worker_phase_has_an_execution_timeout_and_the_deferred_wait_the_stage_timeout(plan):
    """30 minutes for sync, job start and the polls, unless default_args or the task say otherwise. The wait in
    the triggerer is the deferral's: its timeout is stage_timeout_h (Airflow 3.3 does not cap it at the
    execution_timeout), so an 11-hour train is not cut at 30 minutes."""
    assert RemoteJobOperator(task_id="train", stage="train", plan=plan).execution_timeout == timedelta(minutes=30)
    assert WORKER_PHASE_TIMEOUT == timedelta(minutes=30)
    with DAG("d", default_args={"execution_timeout": timedelta(hours=2)}):
        assert RemoteJobOperator(task_id="t", stage="train", plan=plan).execution_timeout == timedelta(hours=2)
    assert RemoteJobOperator(task_id="t", stage="train", plan=plan, execution_timeout=None).execution_timeout is None

    operator = RemoteJobOperator(task_id="train", stage="train", plan=plan)
    context = {**CONTEXT, "ti": SimpleNamespace(task_id="train", map_index=-1, try_number=1, id="0193a1b2")}
    verified = operator.verify_plan(context)
    with pytest.raises(TaskDeferred) as deferred:
        operator.poll_until_complete("train", context)
    assert deferred.value.timeout == timedelta(hours=verified.box.stage_timeout_h) > WORKER_PHASE_TIMEOUT
    assert deferred.value.trigger.stream == "ti-0193a1b2"  # the box keeps this try's place in the log


@pytest.mark.slow
def test_a_worker_phase_that_times_out_fails_the_try_but_leaves_the_job_running(tmp_path, trust_settings, monkeypatch):
    """Airflow's task runner interrupts execute at the execution_timeout and calls on_kill. A slow worker (an SSH
    outage being ridden out, a hung command) says nothing against the job: on_kill leaves it for the next try to
    re-attach to."""
    from airflow.sdk.execution_time.task_runner import _run_execute_callable

    work = tmp_path / "work"
    plan = sealed(run_plan(plain_config(work), require_gpus=False))
    box_commands = []

    class Box:
        def run(self, argv, **_):
            box_commands.append(argv)
            if "ensure" in argv:
                import time

                time.sleep(30)  # the sync that never ends

    monkeypatch.setattr(RunPlan, "remote", lambda self, conn_id=None: Box())
    monkeypatch.setattr(RunPlan, "ensure_code", lambda self, conn_id=None: Box().run(["ensure"]))
    operator = RemoteJobOperator(task_id="train", stage="train", plan=plan, execution_timeout=timedelta(seconds=1))
    context = {**CONTEXT, "ti": SimpleNamespace(task_id="train", map_index=-1, try_number=1, id="0193a1b2")}
    with pytest.raises(AirflowTaskTimeout):
        _run_execute_callable(context, operator.execute, operator)
    assert box_commands == [["ensure"]]  # no `job kill` after it


@pytest.mark.slow
def test_a_job_killed_under_a_try_that_re_attached_to_it_is_started_again_in_that_try(plan, monkeypatch):
    """Clearing a deferred task: the old try's trigger sends `job kill` from its on_kill while Airflow already runs
    the next try, whose `job start` may find the job still alive and re-attach to it (the production lane saw it
    spend a retry on every clear). That kill was meant for the earlier try: the stage is started again in this
    try. A job this try started itself and someone killed still fails the try (a retry resumes it)."""
    from airflow.sdk.exceptions import AirflowException

    operator = RemoteJobOperator(task_id="train", stage="train", plan=plan)
    context = {**CONTEXT, "ti": SimpleNamespace(task_id="train", map_index=-1, try_number=2, id="0193a1b3")}
    restarted = []
    monkeypatch.setattr(operator, "start_or_attach", lambda ctx: restarted.append(ctx) or "deferred again")
    killed = {"status": "killed", "key": "train", "reason": "the job was killed", "state": {"try": 1}, "log_tail": []}

    assert operator.execute_complete(context, {**killed, "started_try": None}) == "deferred again"
    assert restarted == [context]
    with pytest.raises(AirflowException, match="train job train killed") as failed:
        operator.execute_complete(context, {**killed, "state": {"try": 2}, "started_try": 2})
    assert restarted == [context] and "A retry (or clearing the task) resumes the stage" in str(failed.value)


@pytest.mark.slow
def test_a_stage_starts_as_its_own_airflow_run_and_a_job_on_another_host_fails_the_task(plan, monkeypatch):
    """`job start` is told the Airflow run from the task's own context (never XCom), so the box refuses a stage of
    a run that does not own the run directory (eagle3.jobs.runowner), even one whose write_config was marked successful.
    A job that runs on another host sharing the
    work directory ("foreign") fails the task with the reason, without a retry: this box can neither wait on it
    nor start a second copy. (The box is a stand-in here: the refusals themselves run for real in test_run_owner
    and test_job.)"""
    from airflow.sdk.exceptions import AirflowFailException

    sent = []

    class Box:
        def run(self, argv, **_):
            sent.append(argv)
            return SimpleNamespace(returncode=0, stderr="", json=lambda what: {"try": 1, "pid": 7, "log": "log"})

    operator = RemoteJobOperator(task_id="train", stage="train", plan=plan)
    context = {**CONTEXT, "ti": SimpleNamespace(task_id="train", map_index=-1, try_number=1, id="0193a1b4")}
    operator.verify_plan(context)
    monkeypatch.setattr(RunPlan, "remote", lambda self, conn_id=None: Box())
    operator.submit_job(context)
    owner = ["--airflow-dag-id", CONTEXT["dag_run"].dag_id, "--airflow-run-id", CONTEXT["dag_run"].run_id]
    (start,) = sent
    assert any(start[i : i + 4] == owner for i in range(len(start))), start

    foreign = {
        "status": "foreign",
        "key": "train",
        "reason": "it runs on host gpu-box-2 (machine id 3f2a...)",
        "state": {"try": 1},
        "log_tail": [],
        "started_try": 1,
    }
    with pytest.raises(AirflowFailException, match="train job train foreign .*runs on host gpu-box-2"):
        operator.execute_complete(context, foreign)


def test_clearing_a_finished_stage_says_how_to_run_it_again(plan, monkeypatch, caplog):
    """A clear of a succeeded stage re-attaches to its finished job and runs nothing (its outputs stand); the task
    log says so and how to redo it: box.redo_from for a stage that can be redone, another run_name otherwise. (The
    box is a stand-in answering as `job start` does for a finished job.)"""

    class Box:
        def run(self, argv, **_):
            return SimpleNamespace(
                returncode=0,
                stderr="",
                json=lambda what: {
                    "try": 2,
                    "pid": 7,
                    "log": "log",
                    "status": "succeeded",
                    "attached": True,
                    "refused": None,
                },
            )

    monkeypatch.setattr(RunPlan, "remote", lambda self, conn_id=None: Box())
    # the task log as a plain logger (Airflow's own goes through structlog, which caplog does not see)
    monkeypatch.setattr(RemoteJobOperator, "log", property(lambda self: logging.getLogger("eagle3.test.task")))
    caplog.set_level("INFO", logger="eagle3.test.task")
    for stage, how in (("train", "box.redo_from 'train'"), ("extract", "another run_name")):
        operator = RemoteJobOperator(task_id=stage, stage=stage, plan=plan)
        context = {**CONTEXT, "ti": SimpleNamespace(task_id=stage, map_index=-1, try_number=3, id="0193a1b5")}
        operator.verify_plan(context)
        operator.submit_job(context)
        assert f"{stage} job {stage} finished in try 2 already: clearing a finished stage runs nothing" in caplog.text
        assert how in caplog.text


class JobBox:
    """A stand-in box answering `job start` and `job poll` as the box does for a job of each key's status."""

    def __init__(self, statuses: dict[str, str]):
        self.statuses = statuses
        self.sent: list[list[str]] = []

    def run(self, argv, **_):
        self.sent.append(argv)
        command, key = argv[argv.index("job") + 1], argv[argv.index("--key") + 1]
        status = self.statuses.get(key, "absent")
        if command == "start":
            answer = {
                "try": 2,
                "pid": 7,
                "log": "log",
                "status": status if status == "succeeded" else "running",
                "attached": status in ("running", "succeeded"),
                "refused": None,
            }
        else:
            answer = {
                "effective": status,
                "state": {"try": 1, "status": status, "exit_code": 0},
                "log": "",
                "log_offset": 0,
            }
        return SimpleNamespace(returncode=0, stderr="", json=lambda what: answer)


class StateStore:
    """A task_state_store as the Task SDK hands it over (get/set), holding what a REST API caller or an older
    deployment put there."""

    def __init__(self, values: dict):
        self.values = dict(values)

    def get(self, key, default=None):
        return self.values.get(key, default)

    def set(self, key, value, **_):
        self.values[key] = value


@pytest.mark.parametrize(
    "stored",
    [
        None,
        {},
        {"eagle3_job_key": "train"},
        {"eagle3_job_key": {"not": "a key"}},
        {"eagle3_job_key": "../../other-run/jobs/evaluate"},
    ],
)
def test_every_try_asks_the_boxs_job_record_whatever_the_task_state_store_holds(plan, monkeypatch, stored):
    """The job key is the task's own, and `job start` on the box decides (re-attach, finished, start): an empty or
    missing task_state_store changes nothing, and one holding another stage's key (the store is writable through
    the REST API with the permission that clears) neither finishes evaluate on train's succeeded job nor polls
    another key. (ResumableJobMixin would have polled the stored key and, finding it succeeded, returned without
    running evaluate.)"""
    from airflow.sdk.exceptions import TaskDeferred

    box = JobBox({"train": "succeeded"})
    monkeypatch.setattr(RunPlan, "remote", lambda self, conn_id=None: box)
    monkeypatch.setattr(RunPlan, "ensure_code", lambda self, conn_id=None: "/code")
    operator = RemoteJobOperator(task_id="evaluate", stage="evaluate", plan=plan)
    context = {
        **CONTEXT,
        "ti": SimpleNamespace(task_id="evaluate", map_index=-1, try_number=2, id="0193a1b6", stats_tags={}),
    }
    if stored is not None:
        context["task_state_store"] = StateStore(stored)
    with pytest.raises(TaskDeferred) as deferred:
        operator.execute(context)
    assert deferred.value.trigger.key == "evaluate" and deferred.value.trigger.started_try == 2
    keys = [argv[argv.index("--key") + 1] for argv in box.sent]
    commands = [argv[argv.index("job") + 1] for argv in box.sent]
    assert keys == ["evaluate"] and commands == ["start"]
    assert stored is None or context["task_state_store"].values == stored  # nothing written there either


def test_a_clear_of_a_succeeded_stage_goes_through_job_start_and_says_how_to_redo_it(plan, monkeypatch, caplog):
    """Through execute, not submit_job alone: a clear of a succeeded stage whose task_state_store still holds its
    key (a store is kept across clears) asks `job start`, which reports the finished job, and the log says how to
    redo it; the try then ends with that job's result at once, without deferring (a trigger would replay the job's
    whole log into this try's)."""
    box = JobBox({"train": "succeeded"})
    monkeypatch.setattr(RunPlan, "remote", lambda self, conn_id=None: box)
    monkeypatch.setattr(RunPlan, "ensure_code", lambda self, conn_id=None: "/code")
    monkeypatch.setattr(RemoteJobOperator, "log", property(lambda self: logging.getLogger("eagle3.test.task")))
    caplog.set_level("INFO", logger="eagle3.test.task")
    operator = RemoteJobOperator(task_id="train", stage="train", plan=plan)
    ti = SimpleNamespace(task_id="train", map_index=-1, try_number=3, id="0193a1b7", stats_tags={})
    context = {**CONTEXT, "ti": ti, "task_state_store": StateStore({"eagle3_job_key": "train"})}
    result = operator.execute(context)  # no TaskDeferred
    assert "clearing a finished stage runs nothing" in caplog.text and "box.redo_from 'train'" in caplog.text
    assert (result["stage"], result["job"]) == ("train", "train")
    assert [argv[argv.index("job") + 1] for argv in box.sent] == ["start", "poll"]


def test_the_operator_keeps_no_job_id_in_the_task_state_store():
    """One authority, the box's record: the mixin that kept a second copy in the metadata database is gone."""
    assert not hasattr(RemoteJobOperator, "execute_resumable") and not hasattr(RemoteJobOperator, "external_id_key")


@pytest.mark.slow
def test_a_start_refused_for_good_fails_the_task_without_spending_its_retries(plan, tmp_path, monkeypatch):
    """`job start` run for real on the local box. A job that another host sharing the work directory runs
    (FOREIGN_EXIT), or a run directory another Airflow run owns (exit 2), is refused again by every retry: the task
    fails at once (AirflowFailException), saying which host runs the job and what to do. A start that failed in a way
    a retry may mend (exit 1: the supervisor did not come up) is still an error Airflow retries."""
    import json
    import time

    from airflow.sdk.exceptions import AirflowFailException

    from eagle3_airflow.transport import CommandResult, RemoteCommandError

    this_host = tmp_path / "machine-id"
    this_host.write_text("machine-id-of-gpu-box-2\n")
    monkeypatch.setenv("EAGLE3_HOST_ID_FILE", str(this_host))
    operator = RemoteJobOperator(task_id="train", stage="train", plan=plan)
    context = {**CONTEXT, "ti": SimpleNamespace(task_id="train", map_index=-1, try_number=1, id="0193a1b8")}
    verified = operator.verify_plan(context)
    job_dir = Path(verified.jobs_dir) / "train"
    job_dir.mkdir(parents=True, mode=0o700)
    (job_dir / "state.json").write_text(
        json.dumps(
            {
                "key": "train",
                "try": 1,
                "status": "running",
                "pid": 4_000_000,
                "pgid": 4_000_000,
                "pid_start_ticks": 1,
                "boot_id": "boot-of-gpu-box-1",
                "host": "gpu-box-1",
                "host_id": "machine-id-of-gpu-box-1",
                "argv": ["x"],
                "started_at": "2026-01-01T00:00:00Z",
                "heartbeat_at": time.time(),
                "exit_code": None,
                "ended_at": None,
                "log_start": 0,
            }
        )
    )
    with pytest.raises(AirflowFailException) as foreign:
        operator.submit_job(context)
    said = str(foreign.value)
    assert said.startswith("train job train was not started on local: it runs on another host"), said
    assert "'gpu-box-1' (host id machine-id-of-gpu-box-1)" in said and "this task does not retry" in said
    assert f"job kill --jobs-dir {verified.jobs_dir} --key train" in said and "then clear this task" in said
    assert json.loads((job_dir / "state.json").read_text())["pid"] == 4_000_000  # nothing launched beside it

    (job_dir / "state.json").unlink()
    (Path(verified.run_dir) / "owner.json").write_text(
        json.dumps({"runs": [{"dag_id": "eagle3_drafter", "run_id": "scheduled__2026-12-01", "triggered_by": None}]})
    )
    with pytest.raises(AirflowFailException, match=r"refused it, and retrying cannot help") as owned:
        operator.submit_job(context)
    assert "belongs to Airflow run 'scheduled__2026-12-01'" in str(owned.value)
    assert not (job_dir / "state.json").exists()

    class FailingBox:
        def run(self, argv, **_):
            return CommandResult(argv, 1, "", "error: the job supervisor exited with code 1 before reporting")

    monkeypatch.setattr(RunPlan, "remote", lambda self, conn_id=None: FailingBox())
    with pytest.raises(RemoteCommandError, match="exit 1"):  # not AirflowFailException: retried
        operator.submit_job(context)
