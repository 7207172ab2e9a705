"""Fault drill: the whole Airflow side (worker and its in-line triggerer) SIGKILLed while training runs on the
box; a new DAG run re-attaches to the live job. Figure printed: the job's pid before and after, how long the
job was frozen waiting for the new attempt, and the durations."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.dagruns import LATER_STAGES, conf_for, copy_through_vocab, job_state, sha256, start_dag_run, wait_for

pytestmark = pytest.mark.slow


def test_worker_killed_mid_job_reattaches_to_the_same_remote_process(tiny_target, airflow_home, settings,
                                                                      baseline_run, tmp_path):
    """Kill -9 the Airflow process group while training runs; the job outlives it. Training is then frozen
    (SIGSTOP: a slow box) so that it is certainly still running when the new DAG run for the same logical
    date reaches the train task, and thawed once that run says it attached. Proves: the new attempt attaches
    to the live job (no second copy: same pid, try 1), the job finishes, and the drafter is bit-identical to
    the uninterrupted baseline's. Fails if the new attempt relaunched training or lost the job.

    Starts from a copy of the baseline's run directory with extract and vocab done (see copy_through_vocab);
    evaluate and report are marked successful: the drafter is what the drill compares."""
    workdir = tmp_path / "box"
    run_dir = copy_through_vocab(baseline_run, workdir)
    conf = conf_for(tiny_target, workdir)
    train_state = run_dir / "jobs" / "train" / "state.json"
    logical_date = "2026-03-01T00:00:00+00:00"
    first_log, second_log = tmp_path / "first-run.log", tmp_path / "second-run.log"
    started = time.monotonic()
    first = start_dag_run(airflow_home, conf, first_log, logical_date=logical_date, env=settings,
                          mark_success=LATER_STAGES)
    second = None
    try:
        def training() -> bool:
            assert first.poll() is None, "the DAG run ended before training started:\n" + first_log.read_text()
            return train_state.exists() and json.loads(train_state.read_text())["status"] == "running"

        wait_for(training, 600, "the train job to start", interval=0.05)
        os.killpg(first.pid, signal.SIGKILL)  # the worker dies: no on_kill, no cleanup
        first.wait(30)
        state = job_state(run_dir, "train")
        os.killpg(state["pgid"], signal.SIGSTOP)  # the job lives on, frozen until the new attempt has attached
        frozen_at = time.monotonic()
        second = start_dag_run(airflow_home, conf, second_log, logical_date=logical_date, env=settings,
                               mark_success=LATER_STAGES)

        def attached() -> bool:
            assert second.poll() is None, "the second DAG run ended early:\n" + second_log.read_text()[-6000:]
            return "attached to train job train" in second_log.read_text(errors="replace")

        wait_for(attached, 600, "the new attempt to attach to the train job")
        frozen_s = time.monotonic() - frozen_at
        os.killpg(state["pgid"], signal.SIGCONT)
        second.wait(600)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert second.returncode == 0, second_log.read_text()[-6000:]
    after = job_state(run_dir, "train")
    print(f"\nworker-kill drill: train job pid {state['pid']} (try {state['try']}) before the kill, pid "
          f"{after['pid']} (try {after['try']}, {after['status']}) after; frozen {frozen_s:.0f} s until the new "
          f"attempt attached; both DAG runs {time.monotonic() - started:.0f} s")
    assert (after["status"], after["try"], after["pid"]) == ("succeeded", 1, state["pid"])
    assert sha256(run_dir / "drafter" / "model.safetensors") == sha256(baseline_run / "drafter" / "model.safetensors")
