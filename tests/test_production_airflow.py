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

Besides: every run is late (notify.late_after_h is 4 s), and the DeadlineAlert's mail names the run; the second
worker ran some of the run's tasks; the run's report tab shows the SSH box's plots in chromium; and the settings list
two boxes in box_pools (the loopback sshd under two connection ids), so a second run, undrilled, goes at the same time
on the second box's DAG, each run's GPU tasks in its own box's pool.

The tests below each assert one of these on the record the module's run leaves; the stack's and the tasks' logs go
to test-artifacts/production/ when one fails.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.airflow_env import REPO, expect_report_plots
from tests.celery_stack import BOXES, DAG_ID, DAG_ID_2, WORKER_2_HOSTNAME, CeleryStack, Namespace, StackSshd
from tests.dagruns import job_state, tiny_layers, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("production_airflow")]

RUN_NAME = "prod-run"
RUN_TIMEOUT_S = 600
RUN_POLL_S = 3.0  # as tests/ui/test_web_ui.py: each REST call costs the api server's one worker CPU
ARTIFACTS = REPO / "test-artifacts" / "production"
LATE_AFTER_H = 0.001  # 3.6 s: every run of the module is late


def freezing_python(root: Path) -> Path:
    """A box.python that is this interpreter, except that the first `eagle3 train` it runs stops itself (SIGSTOP)
    before it starts: the drill's frozen job, for certain. Freezing the job once it was seen running raced it: on a
    fast machine the tiny target's training ended between two looks (CI, 2026-12-04: "the run ended before train
    ran"). The job's supervisor has logged its start by then; mkdir makes "first" atomic."""
    wrapper = root / "freezing-python"
    wrapper.write_text(f'#!/bin/sh\nif [ "$4" = train ] && mkdir {root / "train-frozen-once"} 2>/dev/null; then\n'
                       f'  kill -STOP $$\nfi\nexec {sys.executable} "$@"\n')  # argv: python -P -m eagle3 <stage> ...
    wrapper.chmod(0o755)
    return wrapper


def run_conf(tiny_target: Path, box: str = "gpu_box", run_name: str = RUN_NAME) -> dict:
    """The trigger's conf of the UI test's smallest run (tests/ui/test_web_ui.py settings_for) on one SSH box."""
    conf, _ = run_layers(tiny_target)
    return {**conf, "run_name": run_name, "box.conn_ids": [box]}


def run_layers(tiny_target: Path) -> tuple[dict, dict]:
    """That run's conf and the settings' layers it needs, but for what each box has of its own (workdir, python)."""
    conf, layers = tiny_layers(tiny_target, Path("/each/box/its/own"), run_name=RUN_NAME, **{
        "data.max_samples": 30, "extract.num_shards": 1, "train.val_fraction": 0.2, "train.epochs": 1,
        "evaluate.num_prompts": 1, "evaluate.max_new_tokens": 8,
        # The job is frozen through the drills (about a minute): it must not look dead meanwhile.
        "box.stale_after_s": 600,
    })
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
    box.connection = json.dumps({"conn_type": "smtp", "host": "127.0.0.1", "port": controller.port,
                                 "extra": {"disable_tls": True, "disable_ssl": True, "timeout": 10, "retry_limit": 1,
                                           "from_email": "airflow@example.com"}})
    yield box
    controller.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, request, inbox, tiny_target):
    """The stack, with a settings file that allows the SSH box and mails late runs; its logs kept on failure."""
    root = tmp_path_factory.mktemp("production")
    ns = Namespace().create()
    sshd = stack = None
    failed_before = request.session.testsfailed
    try:
        sshd = StackSshd(root / "sshd", ns.host_ip).start()
        settings = root / "dag-settings.json"
        # A DAG and a pool of 8 slots for each box, each box with a workdir of its own; the first box's python
        # freezes the run's first train job (the drills).
        own = {"gpu_box": (root / "box", freezing_python(root)), "gpu_box_2": (root / "box-2", sys.executable)}
        settings.write_text(json.dumps({
            **run_layers(tiny_target)[1], "allowed_boxes": list(BOXES),
            "box_pools": {box: {"gpus": 8, "run": {"workdir": str(own[box][0])}, "box": {"python": str(own[box][1])}}
                          for box in BOXES},
            "params": {"box.conn_ids": ["gpu_box"]}, "retry_delay_s": 1, "retries": 2,
            "notify": {"to": ["oncall@example.com"], "smtp_conn_id": "smtp_test", "late_after_h": LATE_AFTER_H},
            # The Celery workers (one in a network namespace) and the API server share this machine's disk: the
            # default local reports folder is one folder to all of them, which the CeleryExecutor requires saying.
            "reports_shared_disk": True}))
        boxes = {key: value for box in BOXES for key, value in sshd.airflow_env(box).items()}
        stack = CeleryStack(root, ns, {**boxes, "AIRFLOW_CONN_SMTP_TEST": inbox.connection,
                                       "EAGLE3_DAG_SETTINGS": str(settings)})
        try:
            stack.start()
        except BaseException:
            print(f"stack logs: {stack.keep_logs(ARTIFACTS)}")
            raise
        yield stack
        if request.session.testsfailed > failed_before:
            print(f"stack and task logs: {stack.keep_logs(ARTIFACTS)}")
    finally:
        if stack is not None:
            stack.close()
        if sshd is not None:
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
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n"
                                 + "\n".join(tail(log, 20) for log in sorted(stack.logs.glob("*.log"))))
        time.sleep(every_s)


def task_log(stack: CeleryStack, run_id: str, task_id: str, try_number: int) -> str:
    """A try's task log as the UI shows it: its events' messages, one a line."""
    content = stack.api(f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}"
                        "?full_content=true")["content"]
    return "\n".join(item.get("event", "") if isinstance(item, dict) else str(item) for item in content)


def job_lines(log: str) -> list[str]:
    """The job log's lines as the trigger streamed them into a task log ("[train] ..."), in order."""
    return re.findall(r"\[train\] (.+?)\s*$", log, flags=re.M)


@pytest.fixture(scope="module")
def drilled_run(stack, tiny_target):
    """The module's one run and what the drills saw (module docstring)."""
    workdir = stack.root / "box"
    run_dir = workdir / "runs" / RUN_NAME
    started = time.monotonic()
    conf = run_conf(tiny_target)
    run = stack.api(f"/dags/{DAG_ID}/dagRuns", {"logical_date": None, "conf": conf})
    run_id = run["dag_run_id"]
    record: dict = {"run_id": run_id, "run_dir": run_dir}
    # The second box's DAG runs at the same time, undrilled, in a work directory of its own.
    record["run_2_id"] = stack.api(f"/dags/{DAG_ID_2}/dagRuns", {
        "logical_date": None, "conf": run_conf(tiny_target, "gpu_box_2", "prod-run-2")},
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

    # 3. Clear train while it is deferred: its trigger's on_kill kills the job; the task runs again.
    stack.api(f"/dags/{DAG_ID}/clearTaskInstances", {
        "dry_run": False, "task_ids": ["train"], "dag_run_id": run_id, "only_failed": False,
        "reset_dag_runs": True, "include_downstream": False, "include_upstream": False})
    wait_for(lambda: job_state(run_dir, "train")["try"] > record["job_before"]["try"], 180,
             "train's job to start its next try after the clear", interval=1)
    poll(stack, lambda: _ended(stack, run_id), f"the run {run_id} to end")
    record["run"] = stack.api(f"/dags/{DAG_ID}/dagRuns/{run_id}")
    record["tis"] = task_instances(stack, run_id)
    record["job_final"] = job_state(run_dir, "train")
    record["log_of_cleared_try"] = task_log(stack, run_id, "train", record["train_try"])
    poll(stack, lambda: _ended(stack, record["run_2_id"], DAG_ID_2), f"the run {record['run_2_id']} to end")
    record["run_2"] = stack.api(f"/dags/{DAG_ID_2}/dagRuns/{record['run_2_id']}")
    record["tis_2"] = task_instances(stack, record["run_2_id"], DAG_ID_2)
    record["seconds"] = time.monotonic() - started
    print(f"the drilled run took {record['seconds']:.0f} s: {record['run']['state']}")
    return record


def _ended(stack: CeleryStack, run_id: str, dag_id: str = DAG_ID) -> bool:
    return stack.api(f"/dags/{dag_id}/dagRuns/{run_id}")["state"] in ("success", "failed")


def test_a_run_triggered_through_the_rest_api_succeeds_on_the_ssh_box(drilled_run, stack):
    run, tis = drilled_run["run"], drilled_run["tis"]
    assert run["state"] == "success", ({task: ti["state"] for task, ti in tis.items()}, run)
    for task in ("validate", "box_reachable", "sync_code", "extract[0]", "vocab", "train", "export", "evaluate",
                 "report"):
        assert tis[task]["state"] == "success", (task, tis[task])
    assert (drilled_run["run_dir"] / "drafter" / "model.safetensors").exists()


def test_a_triggerer_killed_mid_stage_is_replaced_and_the_job_is_reattached_not_restarted(drilled_run):
    before, after = drilled_run["job_before"], drilled_run["job_after_restart"]
    assert (after["pid"], after["try"], after["status"]) == (before["pid"], before["try"], "running"), (before, after)
    # The new triggerer ran the trigger (a second start in the try's log) and it polled the job on the box.
    log = drilled_run["log_after_restart"]
    starts = [match.end() for match in re.finditer(r"/train/-1/\d+ \(ID \d+\) starting", log)]
    assert len(starts) >= 2 and "eagle3 job poll" in log[starts[1]:], log[-3000:]


def test_the_task_log_goes_on_without_replaying_after_a_triggerer_restart(drilled_run):
    lines = job_lines(drilled_run["log_after_restart"])
    streamed = drilled_run["streamed_before_kill"]
    assert streamed and lines[:len(streamed)] == streamed
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
    GPUs; the two runs overlap in time, and every task that holds GPUs holds them in its own box's pool."""
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
