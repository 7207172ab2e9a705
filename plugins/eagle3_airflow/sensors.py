"""Preflight sensors: the checks the seed run did by hand ("GPUs at 0 MiB?", "4.6 TB free?").

All run in reschedule mode by default: between pokes they hold no worker slot. The measuring happens
on the box (`python -m eagle3 box gpus|disk`, include/eagle3/boxinfo.py), which prints JSON; these
sensors decide, and say in the task log exactly what they saw.
"""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseSensorOperator
from airflow.sdk.exceptions import AirflowFailException

from eagle3_airflow.plan import RunPlan
from eagle3_airflow.transport import BoxUnreachable


class _BoxSensor(BaseSensorOperator):
    template_fields = ("plan",)

    def __init__(self, *, plan: Any, **kwargs):
        kwargs.setdefault("mode", "reschedule")
        kwargs.setdefault("poke_interval", 60)
        super().__init__(**kwargs)
        self.plan = plan

    @property
    def run_plan(self) -> RunPlan:
        return RunPlan.from_xcom(self.plan)

    def _eagle3_json(self, conn_id: str, *args: str) -> dict:
        result = self.run_plan.box(conn_id).run(self.run_plan.eagle3(*args), timeout=900)
        return result.json("python -m eagle3 " + " ".join(args[:2]))


class BoxReachableSensor(_BoxSensor):
    """Waits until every box answers over SSH (a rebooting VM, a box still being provisioned)."""

    def poke(self, context) -> bool:
        for conn_id in self.run_plan.conn_ids:
            try:
                self.run_plan.box(conn_id).run(["true"], timeout=30).check("true")
            except BoxUnreachable as err:
                self.log.info("waiting for box %s: %s", conn_id, err)
                return False
            self.log.info("box %s answers", conn_id)
        return True


class GpuIdleSensor(_BoxSensor):
    """Waits until no GPU on any box holds memory or compute processes that are not ours.

    `box.stop_services` (systemd units, e.g. a vLLM server that starts at boot and grabs every GPU)
    are stopped first. Foreign processes are named in the log with pid, name and MiB, so the person on
    call knows what to kill. Runs before extraction and again after it (the GPUs must be released
    before training starts). A box with fewer GPUs than the run will use there (extraction shards x
    GPUs per shard, training's GPUs, the SGLang servers' tp_size) fails the task at once: waiting
    cannot add GPUs, and finding out when extraction starts may be hours of generation later.
    """

    def poke(self, context) -> bool:
        from eagle3.boxinfo import judge_gpus

        plan = self.run_plan
        if not plan.require_gpus:
            self.log.info("GPU check off (box.require_gpus is false: a CPU run)")
            return True
        idle = True
        for conn_id in plan.conn_ids:
            self._stop_services(conn_id)
            report = self._eagle3_json(conn_id, "box", "gpus", "--jobs-dir", plan.jobs_dir)
            needed, for_what = plan.gpus_needed(conn_id)
            if report["gpus"] and len(report["gpus"]) < needed:
                raise AirflowFailException(
                    f"{conn_id} has {len(report['gpus'])} GPUs, this run needs {needed} there for {for_what}; "
                    "lower those settings or add boxes (box.conn_ids), then trigger again"
                )
            ours = [p for p in report["processes"] if p.get("job")]
            for process in ours:
                self.log.info("%s: pid %s %s (%s MiB) belongs to this run's job %s: not foreign", conn_id,
                              process["pid"], process["name"], process["used_mib"], process["job"])
            box_idle, problems = judge_gpus(report, plan.gpu_max_used_mib, [p["pid"] for p in ours])
            for gpu in report.get("gpus", []):
                self.log.info("%s GPU %s %s: %s of %s MiB used", conn_id, gpu.get("index"), gpu.get("name"),
                              gpu.get("memory_used_mib"), gpu.get("memory_total_mib"))
            for problem in problems:
                self.log.warning("%s: %s", conn_id, problem)
            idle = idle and box_idle
        return idle

    def _stop_services(self, conn_id: str) -> None:
        box = self.run_plan.box(conn_id)
        for unit in self.run_plan.stop_services:
            # "--": the unit is a name, never an option, whatever it looks like (validate allows only the
            # deployment's units, and none starts with '-').
            if box.run(["systemctl", "is-active", "--quiet", "--", unit], timeout=60).returncode != 0:
                continue
            result = box.run(["systemctl", "stop", "--", unit], timeout=300)
            if result.returncode == 0:
                self.log.warning("%s: stopped service %s, which was running", conn_id, unit)
            else:
                self.log.error("%s: could not stop service %s (exit %s): %s; the SSH user needs the right to "
                               "stop it (root, or a polkit/sudo rule)", conn_id, unit, result.returncode,
                               result.stderr.strip())


class DiskSpaceSensor(_BoxSensor):
    """Waits until the work directory's filesystem has room for the hidden states this run will write.

    Estimate (computed on the box from the run config and the data): tokens x (aux layers + 1) x
    hidden size x 2 bytes x margin, minus what the store already holds, so a resumed run asks only for
    what is still to come.
    """

    def poke(self, context) -> bool:
        plan = self.run_plan
        estimate = self._eagle3_json(plan.conn_ids[0], "box", "disk", "--config", plan.config_path,
                                     "--margin", f"{plan.disk_margin:g}")
        log = self.log.info if estimate["enough"] else self.log.warning
        log("disk: %s", estimate["message"])
        return bool(estimate["enough"])
