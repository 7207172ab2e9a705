"""Preflight sensors: the checks the seed run did by hand ("GPUs at 0 MiB?", "4.6 TB free?").

The measuring happens on the box (`python -m eagle3 box gpus|disk`, include/eagle3/box/facts.py), which prints JSON; the
checks below decide, and say in the task log exactly what they saw.

Deferrable by default: a sensor checks once from the worker (most of the time the box is ready and the task is
done in seconds), then hands the waiting to the triggerer (BoxCheckTrigger), which runs the same check over one
SSH connection kept for the whole wait (the async transport), every poke_interval. No worker slot waits on a box,
and there is no SSH handshake per poke: reschedule mode, the old default, freed the slot but logged in again on
every poke for up to 12 hours. `deferrable=False` gives the classic poking sensor (mode "reschedule").
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

from airflow.sdk import BaseSensorOperator
from airflow.sdk.exceptions import AirflowFailException
from airflow.triggers.base import BaseTrigger, TriggerEvent

from eagle3_airflow.plan import RunPlan, verified_plan
from eagle3_airflow.transport import Box, BoxUnreachable, CommandResult

if TYPE_CHECKING:
    from airflow.sdk import Context

# (conn_id, argv, timeout) -> the command's result on that box: the worker's blocking transport wrapped, or the
# triggerer's asyncssh one.
RunOnBox = Callable[[str, list[str], float], Awaitable[CommandResult]]


class Log(Protocol):
    """What the checks write to: the sensor's log, or the trigger's (Airflow's loggers)."""

    def info(self, event: str, *args: object) -> object: ...

    def warning(self, event: str, *args: object) -> object: ...

    def error(self, event: str, *args: object) -> object: ...


class CannotWaitThisOut(Exception):
    """What the check found cannot change by waiting (too few GPUs): the task fails at once."""


# -- the checks, shared by the worker's poke and the triggerer ---------------------------------------------------


async def boxes_reachable(plan: RunPlan, run: RunOnBox, log: Log) -> bool:
    """Every box answers over SSH (a rebooting VM, a box still being provisioned)."""
    for conn_id in plan.box.conn_ids:
        try:
            (await run(conn_id, ["true"], 30)).check("true")
        except BoxUnreachable as err:
            log.info("waiting for box %s: %s", conn_id, err)
            return False
        log.info("box %s answers", conn_id)
    return True


async def gpus_idle(plan: RunPlan, run: RunOnBox, log: Log) -> bool:
    """No GPU on any box holds memory or compute processes that are not this run's (GpuIdleSensor)."""
    from eagle3.box.facts import judge_gpus

    if not plan.box.require_gpus:
        log.info("GPU check off (box.require_gpus is false: a CPU run)")
        return True
    idle = True
    for conn_id in plan.box.conn_ids:
        await _stop_services(plan, conn_id, run, log)
        argv = plan.eagle3("box", "gpus", "--jobs-dir", plan.jobs_dir)
        report = (await run(conn_id, argv, 900)).json("python -m eagle3 box gpus")
        needed, for_what = plan.gpus_needed(conn_id)
        if report["gpus"] and len(report["gpus"]) < needed:
            raise CannotWaitThisOut(
                f"{conn_id} has {len(report['gpus'])} GPUs, this run needs {needed} there for {for_what}; "
                "lower those settings or add boxes (box.conn_ids), then trigger again"
            )
        ours = [p for p in report["processes"] if p.get("job")]
        for process in ours:
            log.info(
                "%s: pid %s %s (%s MiB) belongs to this run's job %s: not foreign",
                conn_id,
                process["pid"],
                process["name"],
                process["used_mib"],
                process["job"],
            )
        box_idle, problems = judge_gpus(report, plan.box.gpu_max_used_mib, [p["pid"] for p in ours])
        for gpu in report.get("gpus", []):
            log.info(
                "%s GPU %s %s: %s of %s MiB used",
                conn_id,
                gpu.get("index"),
                gpu.get("name"),
                gpu.get("memory_used_mib"),
                gpu.get("memory_total_mib"),
            )
        for problem in problems:
            log.warning("%s: %s", conn_id, problem)
        idle = idle and box_idle
    return idle


async def _stop_services(plan: RunPlan, conn_id: str, run: RunOnBox, log: Log) -> None:
    for unit in plan.box.stop_services:
        # "--": the unit is a name, never an option, whatever it looks like (validate allows only the
        # deployment's units, and none starts with '-').
        if (await run(conn_id, ["systemctl", "is-active", "--quiet", "--", unit], 60)).returncode != 0:
            continue
        result = await run(conn_id, ["systemctl", "stop", "--", unit], 300)
        if result.returncode == 0:
            log.warning("%s: stopped service %s, which was running", conn_id, unit)
        else:
            log.error(
                "%s: could not stop service %s (exit %s): %s; the SSH user needs the right to stop it "
                "(root, or a polkit/sudo rule)",
                conn_id,
                unit,
                result.returncode,
                result.stderr.strip(),
            )


async def disk_enough(plan: RunPlan, run: RunOnBox, log: Log) -> bool:
    """The work directory's filesystem has room for what this run will still write (DiskSpaceSensor)."""
    argv = plan.eagle3("box", "disk", "--config", plan.config_path, "--margin", f"{plan.box.disk_margin:g}")
    estimate = (await run(plan.box.conn_ids[0], argv, 900)).json("python -m eagle3 box disk")
    (log.info if estimate["enough"] else log.warning)("disk: %s", estimate["message"])
    return bool(estimate["enough"])


CHECKS = {"reachable": boxes_reachable, "gpus": gpus_idle, "disk": disk_enough}


# -- the sensors ---------------------------------------------------------------------------------------------


class _BoxSensor(BaseSensorOperator):
    template_fields = ("plan",)
    check: str  # a key of CHECKS

    # plan: validate's XComArg, a dict once rendered (verified_plan checks it); kwargs: BaseSensorOperator's
    def __init__(self, *, plan: Any, deferrable: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("mode", "reschedule")  # when not deferrable: no slot held between pokes either
        kwargs.setdefault("poke_interval", 60)
        super().__init__(**kwargs)
        self.plan = plan
        self.deferrable = deferrable

    def poke(self, context: Context) -> bool:
        plan = verified_plan(self.plan, context.get("dag_run"))  # XCom, which the USER role may edit: checked first

        async def run(conn_id: str, argv: list[str], timeout: float) -> CommandResult:
            return plan.remote(conn_id).run(argv, timeout=timeout)

        try:
            return asyncio.run(CHECKS[self.check](plan, run, self.log))
        except CannotWaitThisOut as err:
            raise AirflowFailException(str(err)) from None

    def execute(self, context: Context) -> object:  # (not deferrable: what BaseSensorOperator.execute returns)
        if not self.deferrable:
            return super().execute(context)
        if self.poke(context):  # the usual case: ready now, no deferral
            return None
        self.log.info(
            "not ready; waiting in the triggerer, checking every %s s for up to %s",
            self.poke_interval,
            timedelta(seconds=self.timeout),
        )
        self.defer(
            trigger=BoxCheckTrigger(check=self.check, plan=self.plan, poke_interval_s=self.poke_interval),
            method_name="execute_complete",
            timeout=timedelta(seconds=self.timeout),
        )

    def execute_complete(self, context: Context, event: dict[str, Any]) -> None:
        if event["status"] == "failed":
            raise AirflowFailException(event["message"])
        self.log.info("%s: ready", self.task_id)


class BoxReachableSensor(_BoxSensor):
    """Waits until every box answers over SSH (a rebooting VM, a box still being provisioned)."""

    check = "reachable"


class GpuIdleSensor(_BoxSensor):
    """Waits until no GPU on any box holds memory or compute processes that are not ours.

    `box.stop_services` (systemd units, e.g. a vLLM server that starts at boot and grabs every GPU)
    are stopped first. Foreign processes are named in the log with pid, name and MiB, so the person on
    call knows what to kill. Runs before extraction and again after it (the GPUs must be released
    before training starts). A box with fewer GPUs than the run will use there (extraction shards x
    GPUs per shard, training's GPUs, the serving engine's tp_size) fails the task at once: waiting
    cannot add GPUs, and finding out when extraction starts may be hours of generation later.
    """

    check = "gpus"


class DiskSpaceSensor(_BoxSensor):
    """Waits until the work directory's filesystem has room for the hidden states this run will write.

    Estimate (computed on the box from the run config and the data): tokens x (aux layers + 1) x
    hidden size x bytes per value (extract.state_dtype) x margin, minus what the store already holds, so a
    resumed run asks only for what is still to come.
    """

    check = "disk"


class BoxCheckTrigger(BaseTrigger):
    """Runs one of the sensors' checks from the triggerer every `poke_interval_s` until it passes, over one
    connection per box for the whole wait; its log lines go to the task log."""

    def __init__(self, *, check: str, plan: dict[str, Any], poke_interval_s: float = 60.0) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # BaseTrigger.__init__ has no annotations (Airflow 3.3)
        self.check = check
        self.plan = plan
        self.poke_interval_s = poke_interval_s

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return "eagle3_airflow.sensors.BoxCheckTrigger", {
            "check": self.check,
            "plan": self.plan,
            "poke_interval_s": self.poke_interval_s,
        }

    async def run(self) -> AsyncIterator[TriggerEvent]:
        plan = RunPlan.from_trusted(self.plan)  # the plan the sensor verified before it deferred
        boxes: dict[str, Box] = {}

        async def run(conn_id: str, argv: list[str], timeout: float) -> CommandResult:
            if conn_id not in boxes:
                boxes[conn_id] = plan.remote(conn_id)
            return await boxes[conn_id].arun(argv, timeout=timeout)

        try:
            while True:
                try:
                    ready = await CHECKS[self.check](plan, run, self.log)
                except CannotWaitThisOut as err:
                    yield TriggerEvent({"status": "failed", "message": str(err)})
                    return
                except BoxUnreachable as err:  # a box that drops out during a long wait: the sensor's timeout rules
                    self.log.warning("%s; checking again in %s s", err, self.poke_interval_s)
                    ready = False
                if ready:
                    yield TriggerEvent({"status": "ready"})
                    return
                await asyncio.sleep(self.poke_interval_s)
        finally:
            for box in boxes.values():
                await box.aclose()
