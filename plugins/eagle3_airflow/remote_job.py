"""RemoteJobOperator: one pipeline stage as a detached job on the box that survives everything but the disk.

It drives the box's `python -m eagle3 job start|poll|kill` (include/eagle3/jobs/job.py), whose record in
`{run_dir}/jobs/{key}/state.json` is the only record of a job. The key is `{task_id}` (plus `.{map_index}`), the same
for every try, clear and DAG run sharing the run directory. Every try runs `job start`, which under the job's lock
re-attaches to a live job, reports a succeeded one (its result at once, and a log line on how to redo it), or starts
a new try that resumes the stage (after a failure, a kill, a stale heartbeat or a reboot).

After the start the task defers: the trigger polls from the triggerer, streams new log lines into the task log, and
rides out SSH outages until `box.ssh_grace_s`; the wait is bounded by `box.stage_timeout_h`. Marking the task failed
or clearing it kills the job's process group (`job kill --detach`). The worker's part (code sync, `job start`, polls)
is idempotent and has an `execution_timeout` of its own, WORKER_PHASE_TIMEOUT unless default_args or the task set
one; when it runs out the try fails and the job runs on, for the next try to re-attach.

Failures: a job on another host (Exit.FOREIGN) or a refused start or input (Exit.REFUSED) fail the task without a
retry; any other failure, or the box unreachable past ssh_grace_s, is an error Airflow retries. The plan comes from
XCom, so `execute` and `execute_complete` check its seal for this run first (eagle3_airflow.plan.verified_plan), and
a mapped shard must be one of the plan's.
Why: docs/decisions/2026-11-29-detached-jobs.md, 2026-11-29-job-key-in-run-dir.md, 2026-12-05-box-job-record-only.md,
2026-12-04-worker-execution-timeout.md, 2026-12-04-sealed-run-plan.md.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import (
    AirflowException,
    AirflowFailException,
    AirflowSkipException,
    AirflowTaskTimeout,
)
from airflow.triggers.base import BaseTrigger, TriggerEvent
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential_jitter,
)

from eagle3.contracts import STALE_AFTER_S, Exit, JobPoll, JobStart, JobState
from eagle3.disk.layout import REDO_OUTPUTS
from eagle3.jobs.jobdir import run_seconds
from eagle3_airflow.plan import RunPlan, verified_plan
from eagle3_airflow.transport import BoxUnreachable, CommandResult, box_for

if TYPE_CHECKING:
    from airflow.sdk import Context
    from airflow.sdk.types import RuntimeTaskInstanceProtocol

T = TypeVar("T")

# "foreign": the job runs on another host sharing the work directory (eagle3.jobs.processes.foreign_host); this box can
# neither wait on its processes nor start a second copy, so the task ends with the reason.
TERMINAL = {"succeeded", "failed", "killed", "dead", "absent", "foreign"}


def foreign_advice(jobs_dir: str, key: str) -> str:
    """What to do about a job another host runs (the box's message names the host): this box can neither wait on
    its processes nor start a second copy beside it, so retrying from here cannot help while it runs."""
    return (
        f"Retrying from this box cannot help while that host runs it, so this task does not retry. Either let it "
        f"finish there, then clear this task (a job that succeeded is this task's result then, one that failed "
        f"runs again here); or stop it there: mark failed the Airflow task that runs it on that host (its kill "
        f"stops the job), or on that host run `python -m eagle3 job kill --jobs-dir {jobs_dir} --key {key}`, "
        f"then clear this task. If that host is gone for good, and its job with it, move "
        f"{jobs_dir}/{key}/state.json aside, then clear this task"
    )


def job_key(task_id: str, map_index: int | None) -> str:
    return task_id if map_index is None or map_index < 0 else f"{task_id}.{map_index}"


def job_argv(eagle3_argv: list[str], jobs_dir: str, command: str, key: str, *args: str) -> list[str]:
    """`python -m eagle3 job <command> --jobs-dir DIR --key KEY ...` with the synced package on the box."""
    return [*eagle3_argv, "job", command, "--jobs-dir", jobs_dir, "--key", key, *args]


# Between SSH attempts during an outage: short enough to notice a box that is back within half a minute, long
# enough not to hammer an sshd that is starting up.
OUTAGE_BACKOFF_MAX_S = 30.0
OUTAGE_ERRORS = (BoxUnreachable, TimeoutError)  # TimeoutError: asyncssh's, when a dropped link hangs a command
# A trigger's on_kill, SSH connection included, ends within this: well inside the triggerer's on_kill_timeout (30 s
# by default), which cancels it silently.
ON_KILL_BUDGET_S = 20.0


class RetryLog(Protocol):
    """Where outage retries are told: the operator's log or the trigger's (Airflow's loggers)."""

    def warning(self, event: str, *args: object) -> object: ...


def outage_retry(conn_id: str, grace_s: float, log: RetryLog) -> dict[str, Any]:
    """tenacity's arguments for a box command that is safe to repeat: retried while the box is unreachable,
    with exponential backoff and jitter capped at OUTAGE_BACKOFF_MAX_S, for up to `grace_s`; then the last
    error is raised. One policy for the worker's commands and the trigger's polls. A command that ran and
    failed is not an outage and is not retried."""

    def log_retry(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None  # (set before a retry's sleep)
        log.warning(
            "box %s unreachable for %.0f s (tolerated for %.0f s); retrying in %.0f s: %s",
            conn_id,
            state.seconds_since_start,
            grace_s,
            state.upcoming_sleep,
            error,
        )

    return {
        "retry": retry_if_exception_type(OUTAGE_ERRORS),
        "stop": stop_after_delay(grace_s),
        "wait": wait_exponential_jitter(initial=1, max=OUTAGE_BACKOFF_MAX_S),
        "before_sleep": log_retry,
        "reraise": True,
    }


# What the worker does around a stage takes seconds; riding out an SSH outage takes up to ssh_grace_s (15 min by
# default) per command. Longer, the worker is stuck: the try fails, and the next one re-attaches to the job.
WORKER_PHASE_TIMEOUT = timedelta(minutes=30)


def log_stream(ti: RuntimeTaskInstanceProtocol) -> str:
    """The name under which the box keeps a trigger's place in the job log (`job poll --stream`): one per Airflow
    try, whose task log the trigger writes. Airflow 3 gives every try its own task instance id."""
    ti_id = getattr(ti, "id", None)
    return f"ti-{ti_id}" if ti_id else f"try-{ti.try_number}"


class RemoteJobOperator(BaseOperator):
    """Run `python -m eagle3 <stage> --config RUN_DIR/config.json` on the box as a resumable, detached job.

    :param stage: the box-side stage (extract, vocab, train, export, evaluate).
    :param plan: the run plan dict from the DAG's first task (an XComArg).
    :param shard: for extract, which shard this (mapped) task runs; its box is chosen from the plan.
    :param only_if: a stage the run may leave out: the RunPlan flag (e.g. "generate") that must be on, or the
        task is skipped.
    """

    template_fields = ("plan", "shard")
    ui_color = "#e8eefc"

    def __init__(
        self,
        *,
        stage: str,
        plan: Any,
        shard: int | None = None,
        only_if: str | None = None,
        stage_args: list[str] | None = None,
        **kwargs: Any,
    ) -> None:
        # The worker's part only (sync, `job start`, the polls around the deferral): in Airflow 3.3 the task runner
        # times each worker run of a task on its own, and the wait in the triggerer is not one (the deferral's own
        # timeout, stage_timeout_h, governs it). default_args or the task may set another.
        if "execution_timeout" not in (kwargs.get("default_args") or {}):  # (the DAG's and task group's, merged)
            kwargs.setdefault("execution_timeout", WORKER_PHASE_TIMEOUT)
        super().__init__(**kwargs)
        self.stage = stage
        self.plan = plan
        self.shard = shard
        self.only_if = only_if
        self.stage_args = list(stage_args or [])  # fixed flags of the stage's command (never a user's value)
        self._verified: RunPlan | None = None
        # The job try this Airflow try started itself (None: it re-attached to one it found running): see
        # execute_complete's "killed".
        self._started_try: int | None = None
        self._finished_already = False  # job start found this stage's job succeeded already (start_or_attach)

    # -- what this task instance runs where ------------------------------------------------------
    def verify_plan(self, context: Context) -> RunPlan:
        """Check the plan from XCom (its seal for this run) and, for a mapped extract, that its shard is one of the
        plan's; everything this task does on the box uses the plan checked here."""
        plan = verified_plan(self.plan, context.get("dag_run"))
        shards = plan.config.extract.num_shards
        if self.shard is not None and not (isinstance(self.shard, int) and 0 <= self.shard < shards):
            raise AirflowFailException(
                f"shard {self.shard!r} (from the `shards` task's XCom) is not a shard of this "
                f"run, which has {shards}: the XCom was edited. Trigger a new run."
            )
        self._verified = plan
        return plan

    @property
    def run_plan(self) -> RunPlan:
        if self._verified is None:  # a code path that forgot verify_plan: fail, never use the unchecked XCom
            raise AirflowException(f"{self.task_id}: the run plan was used before its seal was checked")
        return self._verified

    @property
    def conn_id(self) -> str:
        return self.run_plan.conn_for_shard(self.shard) if self.shard is not None else self.run_plan.box.conn_ids[0]

    def _key(self, context: Context) -> str:
        ti = context["ti"]
        return job_key(ti.task_id, ti.map_index)

    def _stage_argv(self) -> list[str]:
        plan = self.run_plan
        argv = [
            plan.box.python,
            "-P",
            "-m",
            "eagle3",
            self.stage,
            "--config",
            plan.config_path,  # -P: RunPlan.eagle3
            *self.stage_args,
        ]
        if self.shard is not None:
            argv += [
                "--shard",
                str(self.shard),
                "--num-shards",
                str(plan.config.extract.num_shards),
                "--gpu-group",
                str(plan.gpu_group_for_shard(self.shard)),
            ]
        return argv

    def _job(self, command: str, key: str, *args: str) -> list[str]:
        return job_argv(self.run_plan.eagle3(), self.run_plan.jobs_dir, command, key, *args)

    # -- start or re-attach, wait in the triggerer ---------------------------------------------------
    def execute(self, context: Context) -> dict[str, Any] | None:
        plan = self.verify_plan(context)
        if self.only_if and not getattr(plan.config, self.only_if).enabled:
            raise AirflowSkipException(f"{self.only_if}.enabled is off for this run")
        self._running_key = self._key(context)  # for on_kill, which gets no context
        try:
            # A rebooted or reimaged box may have lost the code dir; syncing is a no-op when it is there.
            self._riding_out_outages(lambda: plan.ensure_code(self.conn_id))  # the run's pinned code
            return self.start_or_attach(context)
        except AirflowTaskTimeout:
            self._timed_out = True  # (the task runner calls on_kill next): see on_kill
            self.log.error(
                "the worker's part of %s (code sync, job start, polls) took longer than its "
                "execution_timeout %s; the job, if it started, is left running and the next try "
                "re-attaches to it",
                self.stage,
                self.execution_timeout,
            )
            raise

    def start_or_attach(self, context: Context) -> dict[str, Any] | None:
        """`job start` (it re-attaches to a running job, or reports a finished one), then defer to the trigger,
        whose event comes to execute_complete; a job that had succeeded already (a clear of a finished stage) is
        this try's result at once, without a deferral that would replay its whole log into this try's."""
        key = self.submit_job(context)
        if self._finished_already:
            return self.get_job_result(key, context)
        self.poll_until_complete(key, context)
        return None

    def _riding_out_outages(self, command: Callable[[], T]) -> T:
        """Run an idempotent box command through an outage, as the trigger polls (outage_retry)."""
        return Retrying(**outage_retry(self.conn_id, self.run_plan.box.ssh_grace_s, self.log))(command)

    def submit_job(self, context: Context) -> str:
        key = self._key(context)
        plan, box_settings = self.run_plan, self.run_plan.box
        heartbeat_s = max(1.0, min(30.0, box_settings.stale_after_s / 4))
        passed_env = [arg for name in plan.box_env for arg in ("--pass-env", name)]
        stall = [
            "--stall-timeout-s",
            f"{box_settings.stall_timeout_s:g}",
            "--first-progress-timeout-s",
            f"{box_settings.first_progress_timeout_s or box_settings.stall_timeout_s:g}",
        ]
        # The Airflow run this stage belongs to, from the task's own context (never XCom): the box refuses a stage
        # of a run that does not own the run directory (eagle3.jobs.runowner), as init did
        dag_run = context["dag_run"]
        owner = ["--airflow-dag-id", str(dag_run.dag_id), "--airflow-run-id", str(dag_run.run_id)]

        argv = self._job(
            "start",
            key,
            "--heartbeat-s",
            f"{heartbeat_s:g}",
            "--stale-after-s",
            f"{box_settings.stale_after_s:g}",
            *stall,
            *passed_env,
            *self._redo(context),
            *owner,
            "--",
            *self._stage_argv(),
        )
        box = plan.remote(self.conn_id)
        result = self._riding_out_outages(lambda: box.run(argv, timeout=120))
        self._refuse_without_retry(result, key)
        state: JobStart = result.json(f"starting job {key}")
        self._finished_already = bool(state.get("attached") and state.get("status") == "succeeded")
        if self._finished_already:
            # A clear of a finished stage re-attaches to the finished job: nothing runs again, which surprises whoever
            # cleared it to redo the stage. Say how to redo it.
            how = (
                f"trigger a new run with box.redo_from {self.stage!r} (this stage and every later one run again "
                "from scratch, their old outputs renamed aside)"
                if self.stage in REDO_OUTPUTS
                else "trigger a new run with another run_name (this stage's outputs are reused by key, not redone)"
            )
            self.log.info(
                "%s job %s finished in try %s already: clearing a finished stage runs nothing. To run it again, %s",
                self.stage,
                key,
                state.get("try"),
                how,
            )
        verb = "attached to" if state.get("attached") else "started"
        self._started_try = None if state.get("attached") else state.get("try")
        self.log.info(
            "%s %s job %s on %s: try %s, pid %s (log: %s)",
            verb,
            self.stage,
            key,
            self.conn_id,
            state.get("try"),
            state.get("pid"),
            state.get("log"),
        )
        return key

    def _refuse_without_retry(self, result: CommandResult, key: str) -> None:
        """Fail the task without a retry (AirflowFailException) where `job start` says that retrying cannot help:
        the job runs on another host (Exit.FOREIGN), or the start was refused (Exit.REFUSED: the run directory is
        another Airflow run's, a job file is a link or another user's). Exit.FAILED, a supervisor that did not come
        up, stays an error Airflow retries."""
        if result.returncode not in (Exit.FOREIGN, Exit.REFUSED):
            return
        said = "\n".join(result.stderr.strip().splitlines()[-20:])
        where = f"{self.stage} job {key} was not started on {self.conn_id}"
        if result.returncode == Exit.FOREIGN:
            raise AirflowFailException(
                f"{where}: it runs on another host sharing the work directory.\n{said}\n"
                f"{foreign_advice(self.run_plan.jobs_dir, key)}"
            )
        raise AirflowFailException(
            f"{where}: `job start` refused it, and retrying cannot help, so this task does not "
            f"retry. Fix what the box says, then clear this task:\n{said}"
        )

    def _redo(self, context: Context) -> list[str]:
        """`job start`'s redo flags when this run redoes this stage (box.redo_from): once per DAG run, its earlier
        tries and outputs set aside; every try of this run passes the same name, so a retry resumes the redo."""
        plan = self.run_plan
        if not plan.redoes(self.stage):
            return []
        dag_run = context["dag_run"]
        name = "run-" + hashlib.sha256(f"{dag_run.dag_id}/{dag_run.run_id}".encode()).hexdigest()[:16]
        outputs = [arg for output in REDO_OUTPUTS[self.stage] for arg in ("--set-aside", f"{plan.run_dir}/{output}")]
        self.log.info(
            "box.redo_from %s: %s runs again from scratch (redo %s; its earlier outputs are renamed aside)",
            plan.redo_from,
            self.stage,
            name,
        )
        return ["--redo", name, *outputs]

    def poll_until_complete(self, key: str, context: Context) -> None:
        plan = self.run_plan
        self.defer(
            trigger=RemoteJobTrigger(
                conn_id=self.conn_id,
                eagle3_argv=plan.eagle3(),
                jobs_dir=plan.jobs_dir,
                key=str(key),
                poll_interval_s=plan.box.poll_interval_s,
                ssh_grace_s=plan.box.ssh_grace_s,
                stale_after_s=plan.box.stale_after_s,
                stream=log_stream(context["ti"]),
                started_try=self._started_try,
            ),
            method_name="execute_complete",
            # However it progresses, a stage this long is not waited for (a retry re-attaches, or resumes it).
            timeout=timedelta(hours=plan.box.stage_timeout_h),
        )

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any] | None:
        self.verify_plan(context)  # a new process: the plan is read from XCom again
        status = event["status"]
        if status == "succeeded":
            return self.get_job_result(event["key"], context)
        if status == "unreachable":
            raise AirflowException(
                f"{self.stage} job {event['key']}: box {self.conn_id!r} unreachable for more than "
                f"{self.run_plan.box.ssh_grace_s:g} s ({event['reason']}). The job may still be running: "
                "a retry (or clearing this task) re-attaches to it."
            )
        state = event.get("state") or {}
        if status == "killed" and event.get("started_try") is None:
            # Killed while this try waited on a job it had re-attached to, not one it started: the kill was meant
            # for an earlier try. Clearing a deferred task does this: the old try's trigger sends `job kill` from
            # its on_kill while Airflow already runs the next try, whose `job start` may find the job still alive
            # and attach to it. What the clear asks for is the stage run again, so it is started again now, in this
            # try (a retry would do the same, spending one); a job this try started and someone killed fails it.
            self.log.warning(
                "%s job %s (try %s), which this try re-attached to, was killed meanwhile (a clear of the "
                "previous try stops its job); starting it again",
                self.stage,
                event["key"],
                state.get("try"),
            )
            self._running_key = self._key(context)
            return self.start_or_attach(context)
        tail = "\n".join(event.get("log_tail") or [])
        message = (
            f"{self.stage} job {event['key']} {status} (exit code {state.get('exit_code')}; {event['reason']}) "
            f"on {self.conn_id}, try {state.get('try')} (job log on the box: {state.get('log')}). "
            f"Last log lines:\n{tail}"
        )
        if status == "foreign":  # the job became another host's while this try waited on it: see foreign_advice
            raise AirflowFailException(f"{message}\n{foreign_advice(self.run_plan.jobs_dir, event['key'])}")
        if state.get("exit_code") == Exit.REFUSED:
            # The stage refused its input (the message above says which field or file): retrying cannot help. Fix
            # the cause, then clear the task.
            raise AirflowFailException(message)
        raise AirflowException(message + "\nA retry (or clearing the task) resumes the stage.")

    def get_job_status(self, key: str, context: Context) -> str:
        """The job's effective status now (one `job poll`): running, succeeded, failed, killed, dead, absent or
        foreign."""
        return self._poll(str(key))["effective"]

    def get_job_result(self, key: str, context: Context) -> dict[str, Any]:
        state: JobState | dict[str, Any] = self._poll(str(key))["state"] or {}
        return {
            "stage": self.stage,
            "job": str(key),
            "box": self.conn_id,
            "try": state.get("try"),
            "pid": state.get("pid"),
            "exit_code": state.get("exit_code"),
            "seconds": run_seconds(dict(state)),  # (a plain dict, which eagle3.jobs.job reads)
            "log": state.get("log"),
        }

    def on_kill(self) -> None:
        """Killed while not deferred (mark failed during submit): stop the job too."""
        key = getattr(self, "_running_key", None)
        if key is None or self._verified is None:
            return
        if getattr(self, "_timed_out", False):
            return  # the worker was slow (an outage, a hung command), not the job wrong: the next try re-attaches
        try:
            self.run_plan.remote(self.conn_id).run(self._job("kill", key, "--detach"), timeout=ON_KILL_BUDGET_S)
        except Exception as err:  # best effort: the task is being killed anyway
            self.log.warning("could not kill job %s: %s", key, err)

    def _poll(self, key: str) -> JobPoll:
        argv = self._job("poll", key, "--max-log-bytes", "0", "--stale-after-s", f"{self.run_plan.box.stale_after_s:g}")
        box = self.run_plan.remote(self.conn_id)
        poll: JobPoll = self._riding_out_outages(lambda: box.run(argv, timeout=60)).json(f"polling job {key}")
        return poll


class RemoteJobTrigger(BaseTrigger):
    """Polls a box-side job from the triggerer until it ends; streams its log into the task log."""

    def __init__(
        self,
        *,
        conn_id: str,
        eagle3_argv: list[str],
        jobs_dir: str,
        key: str,
        log_offset: int | None = None,
        poll_interval_s: float = 10.0,
        ssh_grace_s: float = 900.0,
        stale_after_s: float = STALE_AFTER_S,
        stream: str | None = None,
        started_try: int | None = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # BaseTrigger.__init__ has no annotations (Airflow 3.3)
        self.stream = stream  # the Airflow try whose task log this trigger writes: the box keeps its place (poll_job)
        self.started_try = started_try  # the job try the deferring Airflow try started; None: one it re-attached to
        self.conn_id = conn_id
        self.eagle3_argv = list(eagle3_argv)
        self.jobs_dir = jobs_dir
        self.key = key
        self.log_offset = log_offset
        self.poll_interval_s = poll_interval_s
        self.ssh_grace_s = ssh_grace_s
        self.stale_after_s = stale_after_s

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return "eagle3_airflow.remote_job.RemoteJobTrigger", {
            "conn_id": self.conn_id,
            "eagle3_argv": self.eagle3_argv,
            "jobs_dir": self.jobs_dir,
            "key": self.key,
            "log_offset": self.log_offset,
            "poll_interval_s": self.poll_interval_s,
            "ssh_grace_s": self.ssh_grace_s,
            "stale_after_s": self.stale_after_s,
            "stream": self.stream,
            "started_try": self.started_try,
        }

    def _argv(self, command: str, *args: str) -> list[str]:
        return job_argv(self.eagle3_argv, self.jobs_dir, command, self.key, *args)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Poll until the job ends. The task log shows the job's current try only: the job log holds every try,
        so the first poll reads from this try's first line (log_offset None), and each next one from where the
        last stopped; once the job is over, the rest of the log is read to its end before the event goes out.

        The triggerer keeps a trigger's arguments, not its attributes: a trigger rebuilt after a triggerer restart
        starts with log_offset None again. So each poll names the trigger's `stream` (its Airflow try), and the box
        records how far that stream has copied the log (`job poll --stream`); a rebuilt trigger goes on from
        there instead of writing the try's log into the task log a second time."""
        box = box_for(self.conn_id)
        try:
            while True:
                argv = self._argv("poll", *self._log_position(), "--stale-after-s", f"{self.stale_after_s:g}")
                try:
                    async for attempt in AsyncRetrying(**outage_retry(self.conn_id, self.ssh_grace_s, self.log)):
                        with attempt:
                            result = await box.arun(argv, timeout=60)
                except OUTAGE_ERRORS as err:
                    yield TriggerEvent({"status": "unreachable", "key": self.key, "reason": str(err)})
                    return
                poll: JobPoll = result.json(f"polling job {self.key}")
                for line in poll["log"].splitlines():
                    if line.strip():
                        self.log.info("[%s] %s", self.key, line)
                self.log_offset = poll["log_offset"]
                if poll["effective"] in TERMINAL and self.log_offset < poll.get("log_size", 0):
                    continue  # over, but more log than one poll returns: read on at once, then report
                if poll["effective"] in TERMINAL:
                    yield TriggerEvent(
                        {
                            "status": poll["effective"],
                            "key": self.key,
                            "reason": poll.get("reason", ""),
                            "state": poll.get("state"),
                            "log_tail": poll.get("log_tail", []),
                            "started_try": self.started_try,
                        }
                    )
                    return
                await asyncio.sleep(self.poll_interval_s)
        finally:
            await box.aclose()

    def _log_position(self) -> list[str]:
        """Where this poll reads the log from: see run()."""
        stream = ["--stream", self.stream] if self.stream else []
        if self.log_offset is not None:
            return ["--log-offset", str(self.log_offset), *stream]
        return stream or ["--from-try-start"]

    async def on_kill(self) -> None:
        """The user marked the task failed or cleared it: stop the job's whole process group.

        The triggerer cancels on_kill after `[triggerer] on_kill_timeout` (30 s by default), and a whole kill takes
        the stage's grace period and more. So the box is asked only to send the SIGTERM (`job kill --detach`); a
        process on the box that holds the job's lock SIGKILLs what is left after the grace period and records the
        kill, and a new try's `job start` waits for it. The connection and the command together get
        ON_KILL_BUDGET_S."""
        box = box_for(self.conn_id)

        async def kill() -> str:
            try:
                result = await box.arun(self._argv("kill", "--detach"), timeout=ON_KILL_BUDGET_S)
                return result.stdout
            finally:
                await box.aclose()

        try:
            answer = await asyncio.wait_for(kill(), ON_KILL_BUDGET_S)
        except OUTAGE_ERRORS as err:  # (TimeoutError: asyncio.wait_for's too)
            self.log.warning(
                "could not kill job %s within %g s on box %s (%s): it may still run, and the task's next "
                "try re-attaches to it; kill it with `python -m eagle3 job kill --jobs-dir %s --key %s` "
                "on the box",
                self.key,
                ON_KILL_BUDGET_S,
                self.conn_id,
                str(err) or "timed out",
                self.jobs_dir,
                self.key,
            )
            return
        self.log.info("killing job %s: %s", self.key, answer.strip()[:500])
