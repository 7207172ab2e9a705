"""The DAG on Airflow as a team deploys it (tests/celery_stack.py): CeleryExecutor, Redis, PostgreSQL, a separate
api-server, scheduler, dag-processor, triggerer and two Celery workers (the second on another address, in a network
namespace), the box being the loopback sshd. Everything goes through the REST API, as a user's client would.

One run on the tiny target carries the drills, in the order a bad day brings them (one run: each costs minutes on
2 cores):

1. Trigger it; `train`'s first job stops itself as it starts (the run's box.python, freezing_python: a slow box, so
   that it cannot finish under the drills), and the drill waits until the task is deferred and the job's log streams
   into the task log.
2. SIGKILL the triggerer, start another: the new triggerer takes the trigger over and re-attaches to the job on the
   box (same pid, same try), and the task log goes on without replaying what it showed.
3. Clear `train` while it is deferred: the trigger's on_kill kills the job's process group, the task runs again
   and starts the job's next try, which resumes training; the run succeeds.

Besides: the drilled run is late (notify.late_after_h is 90 s until the cron tick below) and the DeadlineAlert's
mail names it, while the schedule tick's run, failed within seconds, gets no lateness mail; the second worker ran
some of the run's tasks; the run's report tab shows the SSH box's plots in chromium.

Two boxes on one shared disk (issue 43, item 4). Each box is an sshd of its own on this machine (gpu_box: box A,
gpu_box_2: box B) whose sessions name another host to the box code: EAGLE3_HOST_ID_FILE stands in for the machine id,
and box B's EAGLE3_BOOT_ID_FILE for its kernel's boot id (box B cannot tell box A's processes from dead ones, as a
second machine could not). Both boxes' settings name one work directory, as two boxes mounting one disk would.
- The stack starts with box A alone in box_pools. Once the drilled run is triggered, box B is added to the settings
  file and the dag-processor re-parses it (the REST API's "Reparse DAG"; the operator's create-pool makes its pool):
  eagle3_drafter keeps its id and its run in flight, and eagle3_drafter__gpu_box_2 appears. Box B's run (run 2, with
  a preset of its own: its store and lineage are its own, so neither run waits on the other's store or competes
  with its drafter) then goes at the same time, each run's GPU tasks in its own box's pool.
- keep_runs is 1: run 2 ends, retention included, while the drilled train job is frozen on box A, so box B's
  retention meets box A's older run with a live job.
- After the drills, one event on the settings' schedule Asset (fired through the REST API, as an upstream DAG's
  update would be) starts exactly one run, on eagle3_drafter.
- Then the settings' `schedule` becomes a cron of one minute a year, about a minute ahead, and the DAG file is
  re-parsed: the scheduler's tick of it makes exactly one scheduled run, on eagle3_drafter.
- Then box A runs `shared-run` and its extract job freezes as it starts; box B is triggered with the same run name by
  the same user (a rerun, which takes the run directory over), and its extract stage meets box A's live job.
- Last, clear must always resume (issue 51): box B's run `cleared-run` has its train killed on every try until its
  retries are spent and the run fails; its lateness deadline (an hour since the cron tick's settings) still ahead,
  train and what follows are cleared through the REST API, and train resumes from the checkpoint.

The tests below each assert one of these on the record the module's runs leave; the stack's and the tasks' logs go
to test-artifacts/production/ when one fails.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import urllib.error
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psutil
import pytest

from tests.airflow_env import REPO, expect_report_plots
from tests.celery_stack import BOXES, DAG_ID, DAG_ID_2, WORKER_2_HOSTNAME, CeleryStack, Namespace, StackSshd
from tests.dagruns import job_state, killing_python, tiny_layers, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("production_airflow")]

RUN_NAME = "prod-run"
RUN_TIMEOUT_S = 600
RUN_POLL_S = 3.0  # as tests/ui/test_web_ui.py: each REST call costs the api server's one worker CPU
ARTIFACTS = REPO / "test-artifacts" / "production"
# Until the cron tick, a run is late 90 s after it was first queued: the drilled run is (its train is frozen for
# minutes), the schedule tick's run is not (it is marked failed within seconds). From the cron tick on, an hour: the
# last run is cleared inside its deadline.
LATE_AFTER_H = 1 / 40
LATE_AFTER_H_FROM_CRON = 1.0
RUN_2_NAME = "prod-run-2"
SCHEDULE_ASSET = "eagle3-test-prompts"  # the settings' schedule_assets
KEEP_RUNS = 1  # box B's retention meets box A's older run (the module docstring)
# Run 2's recipe: another store (data.max_length is in the capture key) and another lineage (draft_vocab_size is in
# its key), so that run 2 neither waits on run 1's store (StoreBusy) nor decides whether run 1's drafter is promoted.
RUN_2_PRESET = "box-2-recipe"
SHARED_RUN = "shared-run"  # box A's run that box B is triggered on too
CRON_LEAD_S = 20  # the cron's tick: the first whole minute at least this long after the settings gain it
FREEZE_EXTRACT = "freeze-extract"  # while this file is in the stack's root, box A's extract jobs stop as they start
CLEARED_RUN = "cleared-run"  # box B's run whose train dies on every try, then is cleared inside its deadline
KILL_TRAIN = "kill-train"  # while this file is in the stack's root, box B's train jobs die (killing_python)


def freezing_python(root: Path) -> Path:
    """A box.python that is this interpreter, except that the first `eagle3 train` it runs stops itself (SIGSTOP)
    before it starts: the drill's frozen job, for certain. Freezing the job once it was seen running raced it: on a
    fast machine the tiny target's training ended between two looks (CI, 2026-12-04: "the run ended before train
    ran"). The job's supervisor has logged its start by then; mkdir makes "first" atomic. Likewise every `eagle3
    extract` while root/FREEZE_EXTRACT exists: box A's live job that box B meets."""
    wrapper = root / "freezing-python"
    wrapper.write_text(
        f'#!/bin/sh\nif [ "$4" = train ] && mkdir {root / "train-frozen-once"} 2>/dev/null; then\n'
        f'  kill -STOP $$\nfi\nif [ "$4" = extract ] && [ -e {root / FREEZE_EXTRACT} ]; then\n'
        f'  kill -STOP $$\nfi\nexec {sys.executable} "$@"\n'
    )  # argv: python -P -m eagle3 <stage> ...
    wrapper.chmod(0o755)
    return wrapper


def run_conf(tiny_target: Path, box: str = "gpu_box", run_name: str = RUN_NAME, **fields) -> dict:
    """The trigger's conf of the UI test's smallest run (tests/ui/test_web_ui.py settings_for) on one SSH box."""
    conf, _ = run_layers(tiny_target)
    return {**conf, "run_name": run_name, "box.conn_ids": [box], **fields}


def run_layers(tiny_target: Path) -> tuple[dict, dict]:
    """That run's conf and the settings' layers it needs, but for what each box has of its own (workdir, python)."""
    conf, layers = tiny_layers(
        tiny_target,
        Path("/each/box/its/own"),
        run_name=RUN_NAME,
        **{
            "data.max_samples": 30,
            "extract.num_shards": 1,
            "train.val_fraction": 0.2,
            "train.epochs": 1,
            "evaluate.num_prompts": 1,
            "evaluate.max_new_tokens": 8,
            # The job is frozen through the drills and until run 2 has ended (minutes): it must not look dead meanwhile.
            "box.stale_after_s": 1800,
        },
    )
    del layers["run"]["workdir"], layers["box"]["python"]
    return conf, layers


@pytest.fixture(scope="module")
def inbox():
    """A loopback SMTP server (aiosmtpd) and the Airflow connection to it."""
    from aiosmtpd.controller import Controller

    from tests.sshd import free_port
    from tests.test_notify import Inbox

    box = Inbox()
    controller = Controller(box, hostname="127.0.0.1", port=free_port())
    controller.start()
    box.connection = json.dumps(
        {
            "conn_type": "smtp",
            "host": "127.0.0.1",
            "port": controller.port,
            "extra": {
                "disable_tls": True,
                "disable_ssl": True,
                "timeout": 10,
                "retry_limit": 1,
                "from_email": "airflow@example.com",
            },
        }
    )
    yield box
    controller.stop()


def deployment_settings(
    root: Path, tiny_target: Path, boxes: tuple[str, ...], late_after_h: float = LATE_AFTER_H
) -> dict:
    """The stack's settings file with `boxes` in box_pools: a DAG and a pool of 8 slots for each, all of them on the
    one shared work directory; box A's python freezes jobs (freezing_python), box B's kills CLEARED_RUN's train
    (killing_python). The form's defaults make a valid run, for the schedule (one Asset); runs late by
    `late_after_h` are mailed; keep_runs KEEP_RUNS."""
    conf, layers = run_layers(tiny_target)
    python = {
        "gpu_box": str(freezing_python(root)),
        "gpu_box_2": str(
            killing_python(
                root / "killing-python",
                root / KILL_TRAIN,
                root / "box" / "runs" / CLEARED_RUN / "train" / "checkpoints",
            )
        ),
    }
    settings = {
        **layers,
        "allowed_boxes": list(boxes),
        "box_pools": {
            box: {"gpus": 8, "run": {"workdir": str(root / "box")}, "box": {"python": python[box]}} for box in boxes
        },
        "params": {
            "box.conn_ids": ["gpu_box"],
            "target.model_path": conf["target.model_path"],
            "data.path": conf["data.path"],
        },
        "presets": {RUN_2_PRESET: {"data.max_length": 2048, "vocab.draft_vocab_size": 256}},
        "schedule_assets": [SCHEDULE_ASSET],
        "keep_runs": KEEP_RUNS,
        "retry_delay_s": 1,
        "retries": 2,
        "notify": {"to": ["oncall@example.com"], "smtp_conn_id": "smtp_test", "late_after_h": late_after_h},
        # The Celery workers (one in a network namespace) and the API server share this machine's disk: the default
        # local reports folder is one folder to all of them, which the CeleryExecutor requires the settings to say.
        "reports_shared_disk": True,
    }
    return settings


@pytest.fixture(scope="module")
def stack(tmp_path_factory, request, inbox, tiny_target):
    """The stack with box A alone in its settings (box B's connection is there already: the drilled run adds the box
    to the settings), each box an sshd of its own that is another host to the box code; logs kept on failure."""
    root = tmp_path_factory.mktemp("production")
    ns = Namespace().create()
    sshds: list[StackSshd] = []
    stack = None
    failed_before = request.session.testsfailed
    try:
        # Each box's identity, as the box code reads it: the host id of each, and box B's kernel's boot id.
        host_ids = {box: f"{box}-host-{uuid.uuid4().hex[:8]}" for box in BOXES}
        for box, host_id in host_ids.items():
            (root / f"{box}.host-id").write_text(host_id + "\n")
        (root / "gpu_box_2.boot-id").write_text(f"{uuid.uuid4()}\n")
        identity = {
            "gpu_box": {"EAGLE3_HOST_ID_FILE": str(root / "gpu_box.host-id")},
            "gpu_box_2": {
                "EAGLE3_HOST_ID_FILE": str(root / "gpu_box_2.host-id"),
                "EAGLE3_BOOT_ID_FILE": str(root / "gpu_box_2.boot-id"),
            },
        }
        connections = {}
        for index, box in enumerate(BOXES):
            sshds.append(
                StackSshd(root / ("sshd" if index == 0 else f"sshd-{index + 1}"), ns.host_ip, env=identity[box]).start()
            )
            connections.update(sshds[-1].airflow_env(box))
        settings = root / "dag-settings.json"
        settings.write_text(json.dumps(deployment_settings(root, tiny_target, BOXES[:1])))
        stack = CeleryStack(
            root, ns, {**connections, "AIRFLOW_CONN_SMTP_TEST": inbox.connection, "EAGLE3_DAG_SETTINGS": str(settings)}
        )
        stack.settings_file, stack.host_ids = settings, host_ids
        try:
            stack.start(dag_ids=(DAG_ID,))
        except BaseException:
            print(f"stack logs: {stack.keep_logs(ARTIFACTS)}")
            raise
        yield stack
        if request.session.testsfailed > failed_before:
            print(f"stack and task logs: {stack.keep_logs(ARTIFACTS)}")
    finally:
        if stack is not None:
            stack.close()
        for sshd in sshds:
            sshd.close()
        ns.delete()


def task_instances(stack: CeleryStack, run_id: str, dag_id: str = DAG_ID) -> dict[str, dict]:
    """task id (with [map index] for a mapped one) -> its task instance, as the REST API gives it."""
    tis = stack.api(f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances")["task_instances"]
    return {ti["task_id"] if ti["map_index"] == -1 else f"{ti['task_id']}[{ti['map_index']}]": ti for ti in tis}


def poll(stack: CeleryStack, ready, what: str, timeout: float = RUN_TIMEOUT_S, every_s: float = RUN_POLL_S):
    """Ask the REST API every `every_s` until ready() holds; fail with the components' logs."""
    from tests.celery_stack import tail

    deadline = time.monotonic() + timeout
    while not ready():
        for name, proc in stack.procs.items():
            assert proc.poll() is None, f"{name} exited ({proc.returncode})\n{tail(stack.logs / f'{name}.log')}"
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout:.0f} s waiting for {what}\n"
                + "\n".join(tail(log, 20) for log in sorted(stack.logs.glob("*.log")))
            )
        time.sleep(every_s)


def task_log(
    stack: CeleryStack, run_id: str, task_id: str, try_number: int, dag_id: str = DAG_ID, map_index: int = -1
) -> str:
    """A try's task log as the UI shows it (AirflowClient.task_log)."""
    return stack.task_log(dag_id, run_id, task_id, try_number, map_index)


def job_lines(log: str) -> list[str]:
    """The job log's lines as the trigger streamed them into a task log ("[train] ..."), in order."""
    return re.findall(r"\[train\] (.+?)\s*$", log, flags=re.M)


def read(stack: CeleryStack, path: str, tries: int = 4) -> dict:
    """GET a REST path, again when the API server's one worker did not answer in time (2 cores, the components and
    the runs' tasks all busy: a read is safe to repeat)."""
    for attempt in range(tries):
        try:
            return stack.api(path)
        except (TimeoutError, urllib.error.URLError) as err:
            if isinstance(err, urllib.error.HTTPError) or attempt == tries - 1:
                raise
            time.sleep(2)
    raise AssertionError("unreachable")


def drafter_dags(stack: CeleryStack) -> dict[str, dict]:
    """The drafter DAGs the API server lists: dag id -> the DAG."""
    return {dag["dag_id"]: dag for dag in read(stack, f"/dags?dag_id_pattern={DAG_ID}&limit=100")["dags"]}


def dag_runs(stack: CeleryStack, dag_id: str) -> dict[str, dict]:
    """run id -> the DAG run, every run of `dag_id`."""
    return {run["dag_run_id"]: run for run in read(stack, f"/dags/{dag_id}/dagRuns?limit=100")["dag_runs"]}


def add_second_box(stack: CeleryStack, tiny_target: Path, run_id: str) -> dict:
    """Box B added to the settings file while eagle3_drafter has `run_id` in flight, as an operator adds a box: the
    file changed, create-pool for its pool, the DAG file re-parsed. What the REST API lists before and after."""
    started = time.monotonic()
    seen = {"dags_before": drafter_dags(stack), "runs_before": dag_runs(stack, DAG_ID)}
    stack.settings_file.write_text(json.dumps(deployment_settings(stack.root, tiny_target, BOXES)))
    stack.create_pools()
    stack.reparse(DAG_ID)
    stack.wait_serialized((DAG_ID_2,), timeout=RUN_TIMEOUT_S)
    seen.update(
        dags_after=drafter_dags(stack),
        runs_after=dag_runs(stack, DAG_ID),
        run_state_after=read(stack, f"/dags/{DAG_ID}/dagRuns/{run_id}")["state"],
    )
    print(f"box B added, its DAG serialized, in {time.monotonic() - started:.0f} s")
    return seen


def xcom(stack: CeleryStack, dag_id: str, run_id: str, task_id: str):
    """A task's return value, as the REST API gives it."""
    value = read(stack, f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/return_value")["value"]
    return json.loads(value) if isinstance(value, str) else value


@pytest.fixture(scope="module")
def box_b_added(stack, tiny_target):
    """The drilled run triggered on eagle3_drafter while box A is the settings' only box; then box B added to the
    settings (add_second_box) while that run is in flight."""
    started = time.monotonic()
    run_id = stack.api(f"/dags/{DAG_ID}/dagRuns", {"logical_date": None, "conf": run_conf(tiny_target)})["dag_run_id"]
    return {"run_id": run_id, "started": started, **add_second_box(stack, tiny_target, run_id)}


@pytest.fixture(scope="module")
def drilled_run(stack, tiny_target, box_b_added):
    """The module's one run and what the drills saw, and box B's run beside it (module docstring)."""
    workdir = stack.root / "box"
    run_dir = workdir / "runs" / RUN_NAME
    started, run_id = box_b_added["started"], box_b_added["run_id"]
    record: dict = {"run_id": run_id, "run_dir": run_dir}
    # Box B's run 2 goes at the same time, undrilled, once run 1 has written its config.json (retention orders run
    # directories by it: run 2's is the newer).
    wait_for(lambda: (run_dir / "config.json").exists(), RUN_TIMEOUT_S, "run 1's config.json", interval=0.5)
    record["run_2_id"] = stack.api(
        f"/dags/{DAG_ID_2}/dagRuns",
        {"logical_date": None, "conf": run_conf(tiny_target, "gpu_box_2", RUN_2_NAME, preset=RUN_2_PRESET)},
    )["dag_run_id"]

    # 1. train's job stopped itself as it started (freezing_python); once its log has its header, the drill freezes
    # its whole process group, the supervisor too: a slow box.
    state_file = run_dir / "jobs" / "train" / "state.json"

    def job_running() -> bool:
        if not state_file.exists():
            return False
        state = json.loads(state_file.read_text())
        return state["status"] == "running" and Path(state["log"]).exists() and Path(state["log"]).stat().st_size > 0

    asked = time.monotonic()
    deadline = asked + RUN_TIMEOUT_S
    while not job_running():  # the file every 0.1 s, the REST API every RUN_POLL_S
        if time.monotonic() - asked > RUN_POLL_S:
            asked = time.monotonic()
            assert not _ended(stack, run_id), f"the run ended before train ran: {task_instances(stack, run_id)}"
        assert time.monotonic() < deadline, f"train's job did not start in {RUN_TIMEOUT_S} s"
        time.sleep(0.1)
    record["job_before"] = job_state(run_dir, "train")
    os.killpg(record["job_before"]["pgid"], signal.SIGSTOP)

    def train_streaming() -> bool:
        """train deferred (its trigger in the triggerer) and the job's log reaching the task log."""
        ti = task_instances(stack, run_id)["train"]
        return ti["state"] == "deferred" and bool(job_lines(task_log(stack, run_id, "train", ti["try_number"])))

    poll(stack, train_streaming, "train to be deferred with its job's log streaming", timeout=180, every_s=1)
    ti = task_instances(stack, run_id)["train"]
    assert ti["state"] == "deferred", (ti, stack.api(f"/dags/{DAG_ID}/dagRuns/{run_id}"))
    record["train_try"] = ti["try_number"]
    # The box keeps a trigger's place in the log as of its last poll (`job poll --stream`): the lines of an answer
    # the trigger never acknowledged with its next poll may come again, by design. Two polls more (1 s apart) and
    # every line the task log shows is acknowledged: none of them may come again.
    time.sleep(3)
    record["streamed_before_kill"] = job_lines(task_log(stack, run_id, "train", ti["try_number"]))

    # 2. The triggerer dies (SIGKILL: no cleanup); another one starts.
    old_triggerer = ti.get("triggerer_job") or {}
    triggerer = stack.procs.pop("triggerer")
    os.killpg(triggerer.pid, signal.SIGKILL)
    triggerer.wait(30)
    stack.start_triggerer("triggerer-2")

    def taken_over() -> bool:
        job = task_instances(stack, run_id)["train"].get("triggerer_job") or {}
        return bool(job) and job.get("id") != old_triggerer.get("id")

    poll(stack, taken_over, "the new triggerer to take train's trigger over", timeout=180)
    time.sleep(5)  # its first polls of the job (box.poll_interval_s 1)
    record["job_after_restart"] = job_state(run_dir, "train")
    record["log_after_restart"] = task_log(stack, run_id, "train", record["train_try"])

    # Box B's run 2 ends, its retention included, while train's job still runs on box A (frozen, and run 1's
    # directory the older of the two): the retention that keep_runs 1 gives meets another host's live job.
    poll(stack, lambda: _ended(stack, record["run_2_id"], DAG_ID_2), f"the run {record['run_2_id']} to end")
    record["run_2"] = stack.api(f"/dags/{DAG_ID_2}/dagRuns/{record['run_2_id']}")
    record["tis_2"] = task_instances(stack, record["run_2_id"], DAG_ID_2)
    record["retention_2"] = (
        xcom(stack, DAG_ID_2, record["run_2_id"], "retention")
        if record["tis_2"]["retention"]["state"] == "success"
        else None
    )
    record["run_dir_after_retention_2"] = (run_dir / "config.json").exists()
    record["job_after_retention_2"] = job_state(run_dir, "train") if record["run_dir_after_retention_2"] else None
    assert record["job_after_retention_2"], (
        f"box B's retention removed run 1's directory from under its live train job: {record['retention_2']}"
    )

    # 3. Clear train while it is deferred: its trigger's on_kill kills the job; the task runs again.
    stack.api(
        f"/dags/{DAG_ID}/clearTaskInstances",
        {
            "dry_run": False,
            "task_ids": ["train"],
            "dag_run_id": run_id,
            "only_failed": False,
            "reset_dag_runs": True,
            "include_downstream": False,
            "include_upstream": False,
        },
    )
    wait_for(
        lambda: job_state(run_dir, "train")["try"] > record["job_before"]["try"],
        180,
        "train's job to start its next try after the clear",
        interval=1,
    )
    poll(stack, lambda: _ended(stack, run_id), f"the run {run_id} to end")
    record["run"] = stack.api(f"/dags/{DAG_ID}/dagRuns/{run_id}")
    record["tis"] = task_instances(stack, run_id)
    record["job_final"] = job_state(run_dir, "train")
    record["log_of_cleared_try"] = task_log(stack, run_id, "train", record["train_try"])
    record["seconds"] = time.monotonic() - started
    print(f"the drilled run took {record['seconds']:.0f} s: {record['run']['state']}")
    return record


def _ended(stack: CeleryStack, run_id: str, dag_id: str = DAG_ID) -> bool:
    return stack.api(f"/dags/{dag_id}/dagRuns/{run_id}")["state"] in ("success", "failed")


def test_a_run_triggered_through_the_rest_api_succeeds_on_the_ssh_box(drilled_run, stack):
    run, tis = drilled_run["run"], drilled_run["tis"]
    assert run["state"] == "success", ({task: ti["state"] for task, ti in tis.items()}, run)
    for task in (
        "validate",
        "box_reachable",
        "sync_code",
        "extract[0]",
        "vocab",
        "train",
        "export",
        "evaluate",
        "report",
    ):
        assert tis[task]["state"] == "success", (task, tis[task])
    assert (drilled_run["run_dir"] / "drafter" / "model.safetensors").exists()


def test_a_triggerer_killed_mid_stage_is_replaced_and_the_job_is_reattached_not_restarted(drilled_run):
    before, after = drilled_run["job_before"], drilled_run["job_after_restart"]
    assert (after["pid"], after["try"], after["status"]) == (before["pid"], before["try"], "running"), (before, after)
    # The new triggerer ran the trigger (a second start in the try's log) and it polled the job on the box.
    log = drilled_run["log_after_restart"]
    starts = [match.end() for match in re.finditer(r"/train/-1/\d+ \(ID \d+\) starting", log)]
    assert len(starts) >= 2 and "eagle3 job poll" in log[starts[1] :], log[-3000:]


def test_the_task_log_goes_on_without_replaying_after_a_triggerer_restart(drilled_run):
    lines = job_lines(drilled_run["log_after_restart"])
    streamed = drilled_run["streamed_before_kill"]
    assert streamed and lines[: len(streamed)] == streamed
    replayed = [line for line in set(lines) if lines.count(line) > 1]
    assert not replayed, f"the task log shows these job log lines more than once: {replayed[:5]}"


def test_a_train_cleared_while_deferred_has_its_job_killed_then_runs_again_and_the_run_succeeds(drilled_run):
    before, final, tis = drilled_run["job_before"], drilled_run["job_final"], drilled_run["tis"]
    assert tis["train"]["try_number"] > drilled_run["train_try"] and tis["train"]["state"] == "success"
    # The triggerer cancelled the cleared try's trigger and its on_kill ran `job kill` on the box.
    log = drilled_run["log_of_cleared_try"]
    assert "Trigger cancelled by user action, invoking on_kill" in log and "eagle3 job kill" in log, log[-3000:]
    # The frozen job was killed (its process group is gone), and the next try is a new job that succeeded.
    assert not psutil.pid_exists(before["pid"]) or psutil.Process(before["pid"]).status() == psutil.STATUS_ZOMBIE
    assert final["try"] == before["try"] + 1 and final["pid"] != before["pid"] and final["status"] == "succeeded"


def test_a_cleared_train_runs_again_in_one_try_without_spending_a_retry(drilled_run):
    assert drilled_run["tis"]["train"]["try_number"] == drilled_run["train_try"] + 1, drilled_run["tis"]["train"]


def test_a_late_run_is_mailed_naming_the_run(drilled_run, inbox):
    subjects = [message["Subject"] for message in inbox.messages]
    assert f"[eagle3] {DAG_ID}: run {drilled_run['run_id']} is late" in subjects, subjects


def test_a_second_celery_worker_on_another_address_runs_tasks(drilled_run):
    hosts = {task: ti["hostname"] for task, ti in drilled_run["tis"].items() if ti["state"] == "success"}
    print(f"the hosts the tasks last ran on: {hosts}")
    assert WORKER_2_HOSTNAME in hosts.values(), hosts
    assert set(hosts.values()) - {WORKER_2_HOSTNAME}, f"every task ran on {WORKER_2_HOSTNAME}: {hosts}"


def test_the_report_tab_shows_the_ssh_boxs_plots_in_a_real_browser(drilled_run, stack):
    """The run's EAGLE-3 report tab, opened in Debian's chromium from the run's page, shows its plots. The run's box is
    the SSH box: the tab used to SSH to it from the API server, which in a deployment holds no box key, and answered
    500; now the worker's report task publishes the report and plots (eagle3_airflow.published) and the tab serves
    them from the reports store."""
    from playwright.sync_api import expect, sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=["--disable-gpu"])
        page = browser.new_context(viewport={"width": 1400, "height": 1000}, reduced_motion="reduce").new_page()
        page.set_default_timeout(60_000)
        try:
            page.goto(f"{stack.url}/dags/{DAG_ID}/runs/{drilled_run['run_id']}")
            page.get_by_label("Username").fill("admin")
            page.get_by_label("Password").fill(stack.password_of())
            page.get_by_role("button", name="Sign in").click()
            page.get_by_role("link", name="EAGLE-3 report", exact=True).click()
            report = page.frame_locator("iframe")
            expect(report.locator("#acceptance")).to_contain_text("acceptance length")
            expect_report_plots(report)
            page.screenshot(path=ARTIFACTS / "report-tab-ssh-box.png")
        except Exception:
            page.screenshot(path=ARTIFACTS / "report-tab-failure.png")
            raise
        finally:
            browser.close()


def test_two_boxes_run_two_runs_at_once_each_holding_its_own_pool(drilled_run):
    """Issue 36: a box is a resource. With two boxes in box_pools, each has a DAG and a pool whose slots are its
    GPUs; the two runs overlap in time, and every task that holds GPUs holds them in its own box's pool. (Box B is
    another sshd on this machine, a host of its own to the box code; both boxes share the work directory.)"""
    runs = {DAG_ID: (drilled_run["run"], drilled_run["tis"]), DAG_ID_2: (drilled_run["run_2"], drilled_run["tis_2"])}
    for (run, tis), box in zip(runs.values(), BOXES):
        assert run["state"] == "success", ({task: ti["state"] for task, ti in tis.items()}, run)
        assert (tis["train"]["pool"], tis["train"]["pool_slots"]) == (f"eagle3_box_{box}", 8), tis["train"]
        assert (tis["extract[0]"]["pool"], tis["extract[0]"]["pool_slots"]) == (f"eagle3_box_{box}", 1)
        assert tis["validate"]["pool"] == "default_pool"
    (first, first_tis), (second, second_tis) = runs.values()
    print(f"run 1 {first['start_date']} .. {first['end_date']}; run 2 {second['start_date']} .. {second['end_date']}")
    assert first["start_date"] < second["end_date"] and second["start_date"] < first["end_date"]
    # The GPU stages themselves overlapped: run 2's train ran while run 1 was still going.
    assert first["start_date"] < second_tis["train"]["end_date"] < first["end_date"]


# -- two boxes on one schedule and one shared disk (issue 43, item 4) ----------------------------------------------


def test_a_box_added_to_the_settings_renames_no_dag_and_keeps_its_runs(box_b_added):
    """Real: the settings file gains box B while eagle3_drafter has the drilled run in flight; the operator's
    create-pool; the dag-processor re-parses the DAG file on the REST API's request. eagle3_drafter keeps its id, its
    run (listed in flight under it; that it then succeeds, test_a_run_triggered_... asserts) and its schedule; box
    B's DAG is added beside it, named after the box. Before box_pools kept the default box's DAG id, adding a second
    box renamed it eagle3_drafter__gpu_box, orphaning history, FAB permissions and runs in flight."""
    seen, run_id = box_b_added, box_b_added["run_id"]
    assert set(seen["dags_before"]) == {DAG_ID}, sorted(seen["dags_before"])
    assert set(seen["dags_after"]) == {DAG_ID, DAG_ID_2}, sorted(seen["dags_after"])
    assert not seen["dags_after"][DAG_ID]["is_stale"] and not seen["dags_after"][DAG_ID]["is_paused"]
    assert run_id in seen["runs_before"] and run_id in seen["runs_after"], (sorted(seen["runs_after"]), run_id)
    assert seen["run_state_after"] in ("queued", "running"), seen["run_state_after"]
    # The schedule stays with eagle3_drafter; box B's DAG is triggered only.
    assert seen["dags_after"][DAG_ID]["timetable_summary"] == seen["dags_before"][DAG_ID]["timetable_summary"]
    assert seen["dags_after"][DAG_ID_2]["timetable_summary"] in (None, "None"), seen["dags_after"][DAG_ID_2]


def test_box_bs_retention_keeps_box_as_older_run_while_its_job_is_live(drilled_run):
    """Real: box B's run 2 ran its retention task (keep_runs 1, `eagle3 runs prune` over box B's sshd) on the shared
    work directory while box A's train job of the older run prod-run was live (frozen for the drills, its heartbeat
    old; box B sees box A's host id in its state.json). Box B cannot see box A's processes (another boot id stands
    in for another machine), so without the host in the job's record the job looked dead and its run was removed
    from under it. It keeps it, saying why, and the job is the same one after."""
    outcome = drilled_run["retention_2"]
    assert outcome is not None, drilled_run["tis_2"]["retention"]
    assert RUN_NAME not in outcome["removed"], outcome
    assert "runs on another host" in outcome["kept_beyond_keep"].get(RUN_NAME, ""), outcome
    assert drilled_run["run_dir_after_retention_2"]
    before, after = drilled_run["job_before"], drilled_run["job_after_retention_2"]
    assert (after["pid"], after["try"], after["status"]) == (before["pid"], before["try"], "running"), (before, after)


@pytest.fixture(scope="module")
def schedule_tick(stack, drilled_run):
    """One event on the schedule's Asset through the REST API (as an upstream DAG's update, or a person's "Create
    Asset Event", makes one) once neither box's DAG has a run in flight; the runs it made on each box's DAG. Its run is
    then marked failed: it would run the whole pipeline on the form's defaults."""
    started = time.monotonic()
    asset = read(stack, f"/assets?name_pattern={SCHEDULE_ASSET}")["assets"][0]
    before = {dag_id: set(dag_runs(stack, dag_id)) for dag_id in (DAG_ID, DAG_ID_2)}
    stack.api("/assets/events", {"asset_id": asset["id"]})

    def new_runs() -> dict[str, list[dict]]:
        return {
            dag_id: [run for run_id, run in dag_runs(stack, dag_id).items() if run_id not in before[dag_id]]
            for dag_id in (DAG_ID, DAG_ID_2)
        }

    poll(stack, lambda: new_runs()[DAG_ID], "the Asset event's run", timeout=120, every_s=1)
    # The scheduler creates the runs of every DAG an event is queued for in one pass; a few more passes, and what
    # is still queued for box B's DAG (an Asset event it would be waiting on), show that none more comes.
    time.sleep(5)
    made = new_runs()
    try:
        queued_2 = read(stack, f"/dags/{DAG_ID_2}/assets/queuedEvents")["queued_events"]
    except urllib.error.HTTPError as err:
        if err.code != 404:
            raise
        queued_2 = []
    for run in made[DAG_ID] + made[DAG_ID_2]:
        stack.api(f"/dags/{run['dag_id']}/dagRuns/{run['dag_run_id']}", {"state": "failed"}, method="PATCH")
    print(f"the schedule tick took {time.monotonic() - started:.0f} s")
    return {"runs": made, "queued_2": queued_2, "asset": read(stack, f"/assets/{asset['id']}")}


def test_one_schedule_tick_makes_one_run_on_the_default_boxs_dag_alone(schedule_tick):
    """Real: the scheduler, with two boxes in the settings, each box's DAG parsed by the dag-processor; one event on
    the settings' schedule_assets Asset created through the REST API (a cron's tick: the next test). One run, on
    eagle3_drafter; box B's DAG neither runs nor waits on the event. Every box's DAG used to get the schedule: one
    tick, a run per box, all of them in one run directory."""
    runs = schedule_tick["runs"]
    assert [run["run_type"] for run in runs[DAG_ID]] == ["asset_triggered"], runs[DAG_ID]
    assert runs[DAG_ID_2] == [] and schedule_tick["queued_2"] == [], (runs[DAG_ID_2], schedule_tick["queued_2"])
    assert [dag["dag_id"] for dag in schedule_tick["asset"]["scheduled_dags"]] == [DAG_ID], schedule_tick["asset"]


def one_minute_a_year(after: datetime) -> tuple[datetime, str]:
    """The first whole minute at or after `after` (UTC), and the cron of that minute of that day of the year: the
    one tick a test can wait for, with the next a year away."""
    tick = (after + timedelta(seconds=59)).replace(second=0, microsecond=0)
    return tick, f"{tick.minute} {tick.hour} {tick.day} {tick.month} *"


@pytest.fixture(scope="module")
def cron_tick(stack, tiny_target, schedule_tick):
    """The settings' `schedule` made a cron of one minute a year (one_minute_a_year, CRON_LEAD_S from now), both
    boxes in box_pools, and the DAG file re-parsed once neither box's DAG has a run in flight (max_active_runs 1
    would hold the tick back); the runs the scheduler made on each box's DAG by that tick. The DAG's catchup is off:
    the scheduler makes a run of the latest tick alone, this one whether the parse lands before it (the scheduler
    waits for it) or after (it makes the missed tick's run at once), so exactly one run is expected; no run of the
    module is scheduled before (the last scheduled run would be the tick's reference). The run is then marked failed:
    it would run the whole pipeline on the form's defaults. The cron stays in the settings: its next tick is a year
    away. From these settings on, a run is late an hour after it was first queued (LATE_AFTER_H_FROM_CRON)."""
    started = time.monotonic()
    before = {dag_id: set(dag_runs(stack, dag_id)) for dag_id in (DAG_ID, DAG_ID_2)}
    tick, cron = one_minute_a_year(datetime.now(UTC) + timedelta(seconds=CRON_LEAD_S))
    settings = {**deployment_settings(stack.root, tiny_target, BOXES, LATE_AFTER_H_FROM_CRON), "schedule": cron}
    stack.settings_file.write_text(json.dumps(settings))
    stack.reparse(DAG_ID)
    poll(
        stack,
        lambda: cron in (drafter_dags(stack)[DAG_ID]["timetable_summary"] or ""),
        f"the DAG file re-parsed with the schedule {cron!r}",
        timeout=180,
        every_s=1,
    )
    parsed, dags = datetime.now(UTC), drafter_dags(stack)

    def new_runs() -> dict[str, list[dict]]:
        return {
            dag_id: [run for run_id, run in dag_runs(stack, dag_id).items() if run_id not in before[dag_id]]
            for dag_id in (DAG_ID, DAG_ID_2)
        }

    poll(
        stack,
        lambda: new_runs()[DAG_ID],
        f"the run of the tick at {tick:%H:%M} UTC",
        timeout=max(0.0, (tick - datetime.now(UTC)).total_seconds()) + 90,
        every_s=1,
    )
    # The scheduler makes the runs of every DAG due at a tick in one pass; a few passes more: none more comes.
    time.sleep(5)
    made = new_runs()
    for run in made[DAG_ID] + made[DAG_ID_2]:
        stack.api(f"/dags/{run['dag_id']}/dagRuns/{run['dag_run_id']}", {"state": "failed"}, method="PATCH")
    print(
        f"the cron tick took {time.monotonic() - started:.0f} s; the DAG file was parsed "
        f"{(tick - parsed).total_seconds():.0f} s before the tick"
    )
    return {"tick": tick, "cron": cron, "dags": dags, "runs": made}


def test_one_cron_tick_makes_one_scheduled_run_on_the_default_boxs_dag_alone(cron_tick):
    """Real: the scheduler's own clock, the settings' `schedule` a cron (beside schedule_assets: Airflow's
    AssetOrTimeSchedule), two boxes in box_pools, each box's DAG parsed by the dag-processor and unpaused. At the tick,
    one scheduled run, of that tick, on eagle3_drafter; box B's DAG has no time schedule (no next run) and no run. Every
    box's DAG used to get the schedule: one tick, a run per box, all of them in one run directory."""
    dags, runs, tick = cron_tick["dags"], cron_tick["runs"], cron_tick["tick"]
    assert not dags[DAG_ID]["is_paused"] and not dags[DAG_ID_2]["is_paused"], dags
    assert dags[DAG_ID]["timetable_summary"] == f"Asset or {cron_tick['cron']}", dags[DAG_ID]
    assert [(run["run_type"], datetime.fromisoformat(run["run_after"])) for run in runs[DAG_ID]] == [
        ("scheduled", tick)
    ], runs[DAG_ID]
    assert runs[DAG_ID_2] == [], runs[DAG_ID_2]
    assert dags[DAG_ID_2]["timetable_summary"] in (None, "None"), dags[DAG_ID_2]
    assert dags[DAG_ID_2]["next_dagrun_run_after"] is None, dags[DAG_ID_2]


def deadlines(stack: CeleryStack, dag_id: str, run_id: str) -> list[dict]:
    """A run's deadlines, as the UI's run page reads them (its private /ui API: the public one has none)."""
    return json.loads(stack.request(f"/ui/dags/{dag_id}/dagRuns/{run_id}/deadlines", token=stack.token))["deadlines"]


def test_a_run_that_failed_before_its_deadline_gets_no_lateness_mail(stack, inbox, schedule_tick, cron_tick):
    """Real: the schedule tick's run was marked failed within seconds of being queued, its lateness deadline
    (LATE_AFTER_H) still ahead. Airflow misses a failed run's deadline all the same (it drops a deadline only when
    its run succeeds in time), and the triggerer runs the callback, which sends nothing for a run that is not
    running. It used to mail that the failed run "is not done"."""
    (run,) = schedule_tick["runs"][DAG_ID]
    run_id = run["dag_run_id"]
    ended = datetime.fromisoformat(read(stack, f"/dags/{DAG_ID}/dagRuns/{run_id}")["end_date"])
    (deadline,) = deadlines(stack, DAG_ID, run_id)
    assert ended < datetime.fromisoformat(deadline["deadline_time"]), (run, deadline)
    poll(
        stack,
        lambda: all(deadline["missed"] for deadline in deadlines(stack, DAG_ID, run_id)),
        f"the scheduler to miss {run_id}'s deadline",
        timeout=180,
        every_s=2,
    )
    skipped = f"{run_id} is failed, not late"
    poll(
        stack,
        lambda: any(skipped in log.read_text(errors="replace") for log in stack.logs.glob("triggerer*.log")),
        "the triggerer to run the lateness callback",
        timeout=120,
        every_s=2,
    )
    subjects = [message["Subject"] for message in inbox.messages]
    assert not [subject for subject in subjects if run_id in subject], subjects


@pytest.fixture(scope="module")
def foreign_job(stack, tiny_target, cron_tick):
    """Box A's run SHARED_RUN, its extract job frozen as it starts (FREEZE_EXTRACT); then box B's run with the same
    run name, triggered by the same user (so it takes the run directory over: a rerun from another box after the
    Airflow side lost sight of box A's), to its end. What box A's job and box B's tasks were before and after."""
    started = time.monotonic()
    run_dir = stack.root / "box" / "runs" / SHARED_RUN
    (stack.root / FREEZE_EXTRACT).touch()
    run_a = stack.api(
        f"/dags/{DAG_ID}/dagRuns", {"logical_date": None, "conf": run_conf(tiny_target, "gpu_box", SHARED_RUN)}
    )["dag_run_id"]

    def job_live() -> bool:
        try:
            state = job_state(run_dir, "extract.0")
        except (OSError, ValueError):
            return False
        return state["status"] == "running" and Path(state["log"]).exists()

    asked, deadline = time.monotonic(), time.monotonic() + RUN_TIMEOUT_S
    while not job_live():
        if time.monotonic() - asked > RUN_POLL_S:
            asked = time.monotonic()
            assert not _ended(stack, run_a), f"box A's run ended before its extract ran: {task_instances(stack, run_a)}"
        assert time.monotonic() < deadline, f"box A's extract job did not start in {RUN_TIMEOUT_S} s"
        time.sleep(0.2)
    record = {"run_a": run_a, "run_dir": run_dir, "job_before": job_state(run_dir, "extract.0")}
    record["run_b"] = stack.api(
        f"/dags/{DAG_ID_2}/dagRuns", {"logical_date": None, "conf": run_conf(tiny_target, "gpu_box_2", SHARED_RUN)}
    )["dag_run_id"]
    poll(stack, lambda: _ended(stack, record["run_b"], DAG_ID_2), f"box B's run {record['run_b']} to end")
    record["tis_b"] = tis = task_instances(stack, record["run_b"], DAG_ID_2)
    record["extract_b_log"] = (
        task_log(stack, record["run_b"], "extract", tis["extract[0]"]["try_number"], DAG_ID_2, map_index=0)
        if "extract[0]" in tis
        else ""
    )
    record["owners"] = json.loads((run_dir / "owner.json").read_text())["runs"]
    record["job_after"] = job_state(run_dir, "extract.0")
    record["extract_a"] = task_instances(stack, run_a)["extract[0]"]
    print(f"box A's live job and box B's run on it took {time.monotonic() - started:.0f} s")
    return record


def test_box_bs_stage_meets_box_as_live_job_as_foreign_and_starts_nothing(foreign_job, stack):
    """Real: both boxes' DAGs, runs, workers and triggerer; box A's extract job live (its stage stopped as it started,
    its supervisor heartbeating) in the shared work directory; box B's run with the same run name, which takes the
    directory over at init (the same user's rerun). Box B's extract finds the job recorded on box A's host: it ends
    naming that host and starts nothing (the same pid, the same try, still running, box A's task still waiting on
    it). Before job records named their host, box B judged box A's job by its own boot id and pids, took it for dead
    and started a second extract beside it in one run directory."""
    tis, before, after = foreign_job["tis_b"], foreign_job["job_before"], foreign_job["job_after"]
    assert before["host_id"] == stack.host_ids["gpu_box"], before
    # Box B got as far as the stage: the directory is its run's now, and its extract task ran and failed there.
    assert [owner["dag_id"] for owner in foreign_job["owners"]] == [DAG_ID, DAG_ID_2], foreign_job["owners"]
    assert tis["write_config"]["state"] == "success", tis["write_config"]
    assert tis["extract[0]"]["state"] == "failed", {task: ti["state"] for task, ti in tis.items()}
    log = foreign_job["extract_b_log"]
    assert "running on another host" in log and stack.host_ids["gpu_box"] in log, log[-3000:]
    assert (after["pid"], after["try"], after["status"], after["host_id"]) == (
        before["pid"],
        before["try"],
        "running",
        before["host_id"],
    ), (before, after)
    assert psutil.pid_exists(before["pid"])
    assert foreign_job["extract_a"]["state"] == "deferred", foreign_job["extract_a"]


# -- clear must always resume, inside the lateness deadline too (issue 51) --------------------------------------


@pytest.fixture(scope="module")
def cleared_inside_deadline(stack, tiny_target, foreign_job):
    """Box B's run CLEARED_RUN (seed 1: inputs new to the lineage, so it trains), its train killed on every try while
    KILL_TRAIN is in the stack's root (box B's python, killing_python), until its retries are spent and the run
    fails; then, the run's lateness deadline (LATE_AFTER_H_FROM_CRON) still ahead, train and what follows cleared
    through the REST API as the UI's clear dialog does; the run to its end. What the REST API answered and showed."""
    started = time.monotonic()
    run_dir = stack.root / "box" / "runs" / CLEARED_RUN
    (stack.root / KILL_TRAIN).touch()
    run_id = stack.api(
        f"/dags/{DAG_ID_2}/dagRuns",
        {"logical_date": None, "conf": run_conf(tiny_target, "gpu_box_2", CLEARED_RUN, seed=1)},
    )["dag_run_id"]
    poll(stack, lambda: _ended(stack, run_id, DAG_ID_2), f"the run {run_id} to fail at train")
    record = {
        "run_id": run_id,
        "run_dir": run_dir,
        "failed_run": stack.api(f"/dags/{DAG_ID_2}/dagRuns/{run_id}"),
        "failed_train": task_instances(stack, run_id, DAG_ID_2)["train"],
        "checkpoints": sorted(path.name for path in (run_dir / "train" / "checkpoints").glob("step-*")),
        "deadlines": deadlines(stack, DAG_ID_2, run_id),
        "cleared_at": datetime.now(UTC),
    }
    (stack.root / KILL_TRAIN).unlink()
    try:
        answer = stack.request(
            f"/api/v2/dags/{DAG_ID_2}/clearTaskInstances",
            {
                "dry_run": False,
                "dag_run_id": run_id,
                "task_ids": ["train"],
                "only_failed": False,
                "include_downstream": True,
                "include_upstream": False,
                "reset_dag_runs": True,
            },
            token=stack.token,
        )
        record["clear"] = (200, json.loads(answer))
    except urllib.error.HTTPError as err:
        record["clear"] = (err.code, err.read().decode(errors="replace"))
    print(f"the clear of {run_id}'s failed train answered HTTP {record['clear'][0]}")
    if record["clear"][0] == 200:
        poll(stack, lambda: _ended(stack, run_id, DAG_ID_2), f"the cleared run {run_id} to end")
    record["run"] = stack.api(f"/dags/{DAG_ID_2}/dagRuns/{run_id}")
    record["train"] = train = task_instances(stack, run_id, DAG_ID_2)["train"]
    record["train_log"] = task_log(stack, run_id, "train", train["try_number"], DAG_ID_2)
    print(f"the failed train's clear inside its deadline took {time.monotonic() - started:.0f} s")
    return record


def test_a_failed_train_cleared_inside_its_lateness_deadline_resumes_from_its_checkpoint(cleared_inside_deadline):
    """Real: box B's SSH box, the Celery workers, the triggerer, the REST API. Train died on its three tries, after a
    checkpoint; the run failed an hour before its lateness deadline. The REST clear of train and its downstream
    answers 200 (Airflow 3.3's DAGRUN_QUEUED_AT: HTTP 500, apache/airflow#70368), train's next try resumes from the
    checkpoint the dead tries left, and the run succeeds."""
    record = cleared_inside_deadline
    failed_train, (deadline,) = record["failed_train"], record["deadlines"]
    assert (record["failed_run"]["state"], failed_train["state"], failed_train["try_number"]) == (
        "failed",
        "failed",
        3,
    ), (record["failed_run"], failed_train)
    assert not deadline["missed"] and datetime.fromisoformat(deadline["deadline_time"]) > record["cleared_at"]
    status, answer = record["clear"]
    assert status == 200, answer
    assert record["checkpoints"], "the dead tries left no checkpoint"
    resumed = f"train: resumed from {record['run_dir'] / 'train' / 'checkpoints' / record['checkpoints'][-1]}"
    assert resumed in record["train_log"], record["train_log"][-3000:]
    assert (record["run"]["state"], record["train"]["state"]) == ("success", "success"), (
        record["run"],
        record["train"],
    )
