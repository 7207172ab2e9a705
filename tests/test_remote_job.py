"""The remote-job trigger against a real sshd: it rides out an SSH outage without touching the job, gives up
only after the grace period, and a user's kill (mark failed / clear) stops the job's whole process group."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time

import psutil
import pytest

from eagle3_airflow.codesync import ensure_code
from eagle3_airflow.remote_job import RemoteJobTrigger, job_argv
from eagle3_airflow.transport import SSHBox
from tests.conftest import CONTEXT, plain_config, run_plan, sealed

pytestmark = pytest.mark.slow


@pytest.fixture
def box(fresh_sshd, monkeypatch, tmp_path):
    """An SSH box with the package synced; returns (box, argv prefix for `python -m eagle3`, jobs dir)."""
    monkeypatch.setenv("AIRFLOW_CONN_GPU_BOX", fresh_sshd.airflow_conn_json())
    ssh_box = SSHBox("gpu_box")
    code = ensure_code(ssh_box, sys.executable, str(tmp_path / "work"))
    return ssh_box, ["env", f"PYTHONPATH={code}", sys.executable, "-m", "eagle3"], str(tmp_path / "work" / "jobs")


def start(box, command: list[str], key: str = "stage") -> dict:
    ssh_box, eagle3, jobs_dir = box
    result = ssh_box.run(job_argv(eagle3, jobs_dir, "start", key, "--heartbeat-s", "0.5", "--", *command))
    return json.loads(result.check("job start").stdout)


def trigger_for(box, key: str = "stage", **kwargs) -> RemoteJobTrigger:
    _, eagle3, jobs_dir = box
    return RemoteJobTrigger(
        conn_id="gpu_box", eagle3_argv=eagle3, jobs_dir=jobs_dir, key=key, poll_interval_s=0.3, **kwargs
    )


async def first_event(trigger: RemoteJobTrigger):
    async for event in trigger.run():
        return event.payload


def test_trigger_round_trips_through_serialize():
    """The triggerer rebuilds a trigger from its serialized arguments: the same trigger."""
    trigger = RemoteJobTrigger(
        conn_id="c", eagle3_argv=["python"], jobs_dir="/w/jobs", key="train", log_offset=7, stream="ti-1"
    )
    classpath, kwargs = trigger.serialize()
    assert classpath == "eagle3_airflow.remote_job.RemoteJobTrigger"
    assert RemoteJobTrigger(**kwargs).serialize() == (classpath, kwargs)


def test_ssh_outage_during_a_job_is_ridden_out_and_the_job_is_not_restarted(box, fresh_sshd):
    job = start(box, [sys.executable, "-c", "import time; time.sleep(6); print('stage done')"])

    async def drill():
        polling = asyncio.create_task(first_event(trigger_for(box, ssh_grace_s=60)))
        await asyncio.sleep(1)
        fresh_sshd.stop()  # open connections drop, new ones are refused
        await asyncio.sleep(4)
        fresh_sshd.start()
        return await asyncio.wait_for(polling, 120)

    event = asyncio.run(drill())
    assert event["status"] == "succeeded"
    assert (event["state"]["pid"], event["state"]["try"]) == (job["pid"], 1)  # the same job, never relaunched


def test_an_outage_longer_than_the_grace_period_ends_the_wait_but_not_the_job(box, fresh_sshd):
    job = start(box, [sys.executable, "-c", "import time; time.sleep(8)"])
    fresh_sshd.stop()
    started = time.monotonic()
    event = asyncio.run(asyncio.wait_for(first_event(trigger_for(box, ssh_grace_s=2)), 60))
    assert event["status"] == "unreachable" and time.monotonic() - started >= 2
    fresh_sshd.start()
    ssh_box, eagle3, jobs_dir = box
    poll = json.loads(ssh_box.run(job_argv(eagle3, jobs_dir, "poll", "stage")).stdout)
    assert poll["effective"] == "running" and poll["state"]["pid"] == job["pid"]  # a retry will re-attach
    ssh_box.run(job_argv(eagle3, jobs_dir, "kill", "stage", "--grace-s", "1"))


def test_user_kill_stops_the_whole_process_group(box, tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    # Written whole or not at all (eagle3.disk.fsutil): open() creates a file before write() fills it, and a poll
    # between the two read an empty file (seen once in the suite under load).
    spawn = (
        f"import subprocess, sys, time; from eagle3.disk.fsutil import atomic_write_text; "
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"atomic_write_text({str(pid_file)!r}, str(p.pid)); time.sleep(60)"
    )
    job = start(box, [sys.executable, "-c", spawn])
    deadline = time.monotonic() + 20
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    grandchild = int(pid_file.read_text())
    asyncio.run(trigger_for(box).on_kill())
    ssh_box, eagle3, jobs_dir = box
    deadline = time.monotonic() + 30  # the kill goes on on the box after on_kill returned (job kill --detach)
    while (poll := json.loads(ssh_box.run(job_argv(eagle3, jobs_dir, "poll", "stage")).stdout))[
        "effective"
    ] != "killed" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert poll["effective"] == "killed"
    for pid in (job["pid"], grandchild):
        assert not running(pid), f"pid {pid} survived the kill"


def running(pid: int) -> bool:
    """True if pid is a live process (a zombie has exited: it only waits for init to reap it)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_workers_job_start_rides_out_an_outage_and_starts_the_job_once(
    box, fresh_sshd, tmp_path, capsys, trust_settings
):
    """`job start` from the worker while sshd is down for 4 s: retried with backoff, not a failed try."""
    import threading
    from types import SimpleNamespace

    from eagle3_airflow.remote_job import RemoteJobOperator

    class SleepingStage(RemoteJobOperator):
        def _stage_argv(self) -> list[str]:
            return [sys.executable, "-c", "import time; time.sleep(1)"]

    work = tmp_path / "work"
    plan = sealed(run_plan(plain_config(work), conn_ids=["gpu_box"], require_gpus=False, ssh_grace_s=60))
    operator = SleepingStage(task_id="train", stage="train", plan=plan)
    context = {**CONTEXT, "ti": SimpleNamespace(task_id="train", map_index=-1)}
    operator.verify_plan(context)  # what execute() does first

    fresh_sshd.stop()
    back = threading.Timer(4, fresh_sshd.start)
    back.start()
    started = time.monotonic()
    key = operator.submit_job(context)
    back.join()
    assert key == "train" and time.monotonic() - started >= 4
    assert "box gpu_box unreachable for 0 s (tolerated for 60 s)" in capsys.readouterr().out  # retries logged
    poll = operator._poll(key)
    assert poll["state"]["try"] == 1  # one job, started once


TRY_SCRIPT = """
import pathlib, sys
marker = pathlib.Path(sys.argv[1])
if marker.exists():  # the second try: three lines, success
    for i in range(3):
        print(f"try-2 line {i}")
else:  # the first try: about 300 KB of log, more than one poll returns, then a failure
    marker.touch()
    for i in range(5000):
        print(f"try-1 line {i:05d} " + "x" * 48)
    sys.exit(1)
"""


def test_each_try_streams_its_own_log_lines_and_all_of_them(tmp_path, caplog):
    """Through the local transport. Try 1 writes about 300 KB and fails; its trigger streams every one of its lines
    (the log is drained to the end before the event, not left after the first 64 KiB). Try 2 prints three lines;
    its trigger streams exactly those, none of try 1's, although the job log holds both tries."""
    from eagle3_airflow.transport import LocalBox

    eagle3, jobs_dir = [sys.executable, "-m", "eagle3"], str(tmp_path / "jobs")
    command = [sys.executable, "-c", TRY_SCRIPT, str(tmp_path / "first-try-done")]

    def run_try() -> list[str]:
        LocalBox().run(job_argv(eagle3, jobs_dir, "start", "stage", "--heartbeat-s", "0.5", "--", *command)).check(
            "job start"
        )
        trigger = RemoteJobTrigger(
            conn_id="local", eagle3_argv=eagle3, jobs_dir=jobs_dir, key="stage", poll_interval_s=0.2
        )
        trigger._log = logging.getLogger("test.trigger")  # (the triggerer's structlog logger writes past caplog)
        caplog.clear()
        with caplog.at_level("INFO", logger="test.trigger"):
            event = asyncio.run(first_event(trigger))
        streamed = [
            r.getMessage().removeprefix("[stage] ") for r in caplog.records if r.getMessage().startswith("[stage] ")
        ]
        return event["status"], streamed

    status, streamed = run_try()
    assert status == "failed"
    assert [line for line in streamed if line.startswith("try-1")] == [
        f"try-1 line {i:05d} " + "x" * 48 for i in range(5000)
    ]
    assert "try 1 failed" in streamed[-1]

    status, streamed = run_try()
    assert status == "succeeded"
    assert [line for line in streamed if not line.startswith("====")] == [f"try-2 line {i}" for i in range(3)]
    assert "try 2 started" in streamed[0] and "try 2 succeeded" in streamed[-1]
    assert len(streamed) == 5


def test_a_trigger_rebuilt_after_a_triggerer_restart_streams_only_the_new_lines(tmp_path, caplog):
    """The triggerer keeps a trigger's serialized arguments, not how far it got: after a restart it builds the
    trigger again from the arguments of the deferral. That trigger streams the lines the first one had not, and
    none of those it had (the box keeps the stream's place: job poll --stream)."""
    from eagle3_airflow.transport import LocalBox

    eagle3, jobs_dir, go_on = [sys.executable, "-m", "eagle3"], str(tmp_path / "jobs"), tmp_path / "go-on"
    script = (
        "import os, sys, time\nfor i in range(3):\n    print(f'before {i}', flush=True)\n"
        "while not os.path.exists(sys.argv[1]):\n    time.sleep(0.05)\n"
        "for i in range(3):\n    print(f'after {i}', flush=True)\n"
    )
    LocalBox().run(
        job_argv(
            eagle3, jobs_dir, "start", "stage", "--heartbeat-s", "0.5", "--", sys.executable, "-c", script, str(go_on)
        )
    ).check("job start")
    _, deferred = RemoteJobTrigger(
        conn_id="local", eagle3_argv=eagle3, jobs_dir=jobs_dir, key="stage", poll_interval_s=0.2, stream="ti-0193a1b2"
    ).serialize()  # as the deferral stored it

    def streamed() -> list[str]:
        return [
            r.getMessage().removeprefix("[stage] ") for r in caplog.records if r.getMessage().startswith("[stage] ")
        ]

    def rebuilt() -> RemoteJobTrigger:
        trigger = RemoteJobTrigger(**deferred)
        trigger._log = logging.getLogger("test.trigger")  # (the triggerer's structlog logger writes past caplog)
        return trigger

    async def until_restart() -> None:
        polling = asyncio.create_task(first_event(rebuilt()))
        while "before 2" not in streamed():
            await asyncio.sleep(0.05)
        await asyncio.sleep(1)  # a few more polls, none with new lines
        polling.cancel()  # the triggerer stops
        with contextlib.suppress(asyncio.CancelledError):
            await polling

    with caplog.at_level("INFO", logger="test.trigger"):
        asyncio.run(until_restart())
        assert streamed()[1:] == ["before 0", "before 1", "before 2"]  # (after the try's "started" line)
        caplog.clear()
        go_on.touch()
        event = asyncio.run(first_event(rebuilt()))
    assert event["status"] == "succeeded"
    assert streamed()[:3] == ["after 0", "after 1", "after 2"] and "try 1 succeeded" in streamed()[3]
    assert len(streamed()) == 4


def test_the_triggers_kill_ends_well_inside_the_triggerers_on_kill_timeout(tmp_path):
    """The triggerer cancels a trigger's on_kill after [triggerer] on_kill_timeout (30 s by default) and says
    nothing more. Against a stage that ignores SIGTERM (whose whole kill takes the 20 s grace period and more), the
    trigger's on_kill still returns within seconds: the box finishes the kill on its own and records it."""
    from airflow.configuration import conf

    from eagle3.jobs import job
    from eagle3_airflow.remote_job import ON_KILL_BUDGET_S
    from eagle3_airflow.transport import LocalBox

    assert ON_KILL_BUDGET_S <= conf.getint("triggerer", "on_kill_timeout") - 5
    eagle3, jobs_dir = [sys.executable, "-m", "eagle3"], str(tmp_path / "jobs")
    stubborn = (
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ignoring', flush=True)\n"
        "time.sleep(60)\n"
    )
    started = json.loads(
        LocalBox()
        .run(job_argv(eagle3, jobs_dir, "start", "stage", "--heartbeat-s", "0.5", "--", sys.executable, "-c", stubborn))
        .check("job start")
        .stdout
    )
    deadline = time.monotonic() + 20
    while "ignoring" not in job.poll_job(jobs_dir, "stage")["log"] and time.monotonic() < deadline:
        time.sleep(0.1)
    began = time.monotonic()
    asyncio.run(RemoteJobTrigger(conn_id="local", eagle3_argv=eagle3, jobs_dir=jobs_dir, key="stage").on_kill())
    assert time.monotonic() - began < 10
    # (The box's own SIGKILL would come after the grace period; this test does not wait for it.)
    os.killpg(started["pgid"], signal.SIGKILL)
    deadline = time.monotonic() + 20
    while job.poll_job(jobs_dir, "stage")["effective"] != "killed" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert job.poll_job(jobs_dir, "stage")["effective"] == "killed"  # recorded by the box's detached kill
