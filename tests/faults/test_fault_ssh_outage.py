"""Fault drill 3: the box's sshd stopped for 60 s while training runs over SSH, in the DAG run that also checks
the SSH transport end to end (its drafter must equal the local baseline's). Figure printed: the outage's
length, the train job's pid and try before and after, the trigger's outage warnings and the durations."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from tests.dagruns import job_state, sha256, start_dag_run, tiny_run, wait_for

pytestmark = pytest.mark.slow

OUTAGE_S = 60
GRACE_S = 300  # box.ssh_grace_s for the run: longer than the outage (the default, 900 s, is too)


def test_ssh_run_over_two_boxes_rides_out_a_60_s_sshd_outage_and_matches_the_local_run(
    tiny_target, airflow_home, fresh_sshd, baseline_run, tmp_path
):
    """Through a real sshd on loopback with the host key pinned: shard 0 and every later stage go over SSH,
    shard 1 through the local transport (two "boxes" sharing one workdir). As soon as the train job runs, the
    sshd is stopped (listener killed, open connections dropped) for 60 s, then started again on the same port.

    Proves: (1) the SSH transport end to end: same data and seed, so the drafter is bit-identical to the local
    baseline's; (2) an SSH outage shorter than box.ssh_grace_s neither fails the task nor restarts the job:
    the trigger logs the outage and keeps polling, the train job keeps its pid and stays at try 1, and the DAG
    run succeeds. Training (about 12 s here) ends during the outage; the trigger learns it once sshd is back."""
    conf, settings = tiny_run(
        tiny_target,
        tmp_path / "box",
        settings_dir=tmp_path,
        **{"box.conn_ids": ["gpu_box", "local"], "box.ssh_grace_s": GRACE_S},
    )
    run_dir = tmp_path / "box" / "runs" / "baseline"
    train_state = run_dir / "jobs" / "train" / "state.json"
    output = tmp_path / "dag-run.log"
    started = time.monotonic()
    dag_run = start_dag_run(airflow_home, conf, output, env={**settings, **fresh_sshd.airflow_env("gpu_box")})
    try:

        def training() -> bool:
            """The train job runs and the task is deferred: its trigger streams the job's log into the task log.
            (An outage during `job start` itself would fail that try: its SSH session dies before it answers.)"""
            assert dag_run.poll() is None, "the DAG run ended before training started:\n" + output.read_text()[-6000:]
            return (
                train_state.exists()
                and json.loads(train_state.read_text())["status"] == "running"
                and "[train] ==== eagle3 job train try 1" in output.read_text(errors="replace")
            )

        wait_for(training, 600, "the train job to run and its trigger to poll it", interval=0.05)
        before = job_state(run_dir, "train")
        fresh_sshd.stop()
        down_at = time.monotonic()
        time.sleep(OUTAGE_S)
        assert dag_run.poll() is None, "the DAG run ended during the outage:\n" + output.read_text()[-6000:]
        fresh_sshd.start()
        outage_s = time.monotonic() - down_at
        dag_run.wait(600)
    finally:
        if dag_run.poll() is None:
            os.killpg(dag_run.pid, signal.SIGKILL)
    log = output.read_text(errors="replace")
    assert dag_run.returncode == 0, log[-6000:]
    after = job_state(run_dir, "train")
    warnings = re.findall(r"box gpu_box unreachable for (\d+) s", log)
    print(
        f"\ndrill 3 (SSH outage): sshd down {outage_s:.0f} s while training ran; train pid {before['pid']} try "
        f"{before['try']} before, pid {after['pid']} try {after['try']} ({after['status']}, ended "
        f"{after['ended_at']}) after; {len(warnings)} outage warnings from the trigger (last at "
        f"{warnings[-1] if warnings else '-'} s); DAG run finished {time.monotonic() - down_at - outage_s:.0f} s "
        f"after sshd was back, {time.monotonic() - started:.0f} s in all"
    )
    assert "started extract job extract.0 on gpu_box" in log
    assert "started train job train on gpu_box" in log
    assert warnings, "the trigger never noticed the outage"
    assert "unreachable for more than" not in log  # the task did not fail over it
    assert (after["status"], after["try"], after["pid"]) == ("succeeded", 1, before["pid"])
    assert sha256(run_dir / "drafter" / "model.safetensors") == sha256(baseline_run / "drafter" / "model.safetensors")
