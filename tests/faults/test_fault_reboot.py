"""Fault drill 2, preceded by the worker-kill drill, in one sequence of two real DAG runs while training runs:
the Airflow side dies (the job lives on and the next attempt re-attaches to it), then the box "reboots" (every
job process killed, its /tmp wiped, the code dir removed, a new boot id) and the retry relaunches and resumes.
Figure printed: the pids, how long the job waited frozen for the new attempt, what was killed and wiped, the boot
ids, the tries, the step training resumed from and the durations."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from eagle3.jobs.processes import group_members
from tests.dagruns import (
    BOX_CHECKS,
    LATER_STAGES,
    copy_through_vocab,
    job_state,
    sha256,
    start_dag_run,
    tiny_run,
    wait_for,
)

pytestmark = pytest.mark.slow


def box_python(tmp_path: Path, box_tmp: Path) -> Path:
    """`box.python` for the drill: this interpreter with TMPDIR set to `box_tmp`, so that every process of the
    "box" (job supervisors, stages, Python's and torch's temp files) uses `box_tmp` as its /tmp. The test cannot
    wipe the machine's real /tmp (other tests and the Airflow side use it); `box_tmp` is the box's /tmp here."""
    wrapper = tmp_path / "box-python"
    wrapper.write_text(f'#!/bin/sh\nTMPDIR={box_tmp}\nexport TMPDIR\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def test_worker_kill_then_box_reboot_mid_train(tiny_target, airflow_home, baseline_run, tmp_path):
    """1. Worker kill: once training has written its first checkpoint, SIGKILL the whole Airflow side (`airflow
    dags test` and its in-line triggerer: no on_kill, no cleanup). The job lives on; it is then frozen (SIGSTOP:
    a slow box) so that it is certainly still running when a new DAG run for the same logical date reaches the
    train task. Proves: the new attempt attaches to that live job (same pid, try 1), not a second copy.

    2. Reboot, right after that attach: every process of the job SIGKILLed, the box's /tmp (its TMPDIR, see
    box_python) wiped, the synced code directory removed, a new boot id (EAGLE3_BOOT_ID_FILE stands in for the
    kernel's). Proves: the trigger sees the job dead, the task fails, its retry syncs the code again and
    relaunches the job (try 2, new boot id), training resumes from the checkpoint (not from step 0), the DAG run
    succeeds, and the drafter is bit-identical to the uninterrupted baseline's.

    Starts from a copy of the baseline's run directory with extract and vocab done (their jobs succeeded: the
    DAG re-attaches to them at once; the drill is about training); the box checks, evaluate, benchmark and
    report are marked successful: the drafter (export) is what the drill compares."""
    workdir = tmp_path / "box"
    run_dir = copy_through_vocab(baseline_run, workdir)
    box_tmp = tmp_path / "box-tmp"
    box_tmp.mkdir()
    python = str(box_python(tmp_path, box_tmp))
    conf, settings = tiny_run(
        tiny_target,
        workdir,
        settings_dir=tmp_path,
        **{"box.python": python},
        settings={"retry_delay_s": 1, "retries": 2, "allowed_boxes": ["local", "gpu_box"], "allowed_pythons": [python]},
    )  # the dagruns settings, the drill's python
    train_state = run_dir / "jobs" / "train" / "state.json"
    boot_id = tmp_path / "boot_id"
    boot_id.write_text("boot-before-the-crash\n")
    env = {**settings, "EAGLE3_BOOT_ID_FILE": str(boot_id)}
    logical_date = "2026-03-01T00:00:00+00:00"
    first_log, second_log = tmp_path / "first-run.log", tmp_path / "second-run.log"
    started = time.monotonic()
    first = start_dag_run(
        airflow_home, conf, first_log, logical_date=logical_date, env=env, mark_success=f"{BOX_CHECKS}|{LATER_STAGES}"
    )
    second = None
    try:

        def first_checkpoint() -> bool:
            assert first.poll() is None, "the DAG run ended before training wrote a checkpoint"
            return train_state.exists() and bool(list((run_dir / "train" / "checkpoints").glob("step-*")))

        wait_for(first_checkpoint, 600, "the first training checkpoint", interval=0.05)
        os.killpg(first.pid, signal.SIGKILL)  # 1. the worker dies
        first.wait(30)
        state = job_state(run_dir, "train")
        assert state["status"] == "running", "training finished before the worker could be killed"
        os.killpg(state["pgid"], signal.SIGSTOP)  # the job lives on, frozen until the new attempt has attached
        frozen_at = time.monotonic()
        second = start_dag_run(
            airflow_home,
            conf,
            second_log,
            logical_date=logical_date,
            env=env,
            mark_success=f"{BOX_CHECKS}|{LATER_STAGES}",
        )

        def attach_line() -> str | None:
            assert second.poll() is None, "the second DAG run ended early:\n" + second_log.read_text()[-6000:]
            found = re.search(
                r"(attached to|started) train job train on local: try (\d+), pid (\d+)",
                second_log.read_text(errors="replace"),
            )
            return found

        wait_for(attach_line, 600, "the new attempt to reach the train job")
        attached = attach_line()
        frozen_s = time.monotonic() - frozen_at
        # The new attempt is deferred once its trigger streams the job's log (from the start) into the task log.
        wait_for(
            lambda: "[train] ==== eagle3 job train try 1" in second_log.read_text(errors="replace"),
            120,
            "the new attempt's trigger to poll the job",
        )
        # 2. the VM goes down: every process of the job (frozen or not, SIGKILL ends it), no cleanup ...
        pids = group_members(state["pgid"])
        os.killpg(state["pgid"], signal.SIGKILL)
        crashed_at = time.monotonic()
        wiped = sorted(str(p.relative_to(box_tmp)) for p in box_tmp.rglob("*"))
        shutil.rmtree(box_tmp)  # ... and comes back with an empty /tmp,
        box_tmp.mkdir()
        code_dirs = list((workdir / "code").iterdir())
        for code in code_dirs:
            shutil.rmtree(code)  # without the code dir (reimaged, or it lived on /tmp),
        boot_id.write_text("boot-after-the-crash\n")  # and with a new boot id
        second.wait(600)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert second.returncode == 0, second_log.read_text(errors="replace")[-6000:]
    after = job_state(run_dir, "train")
    resumed = (run_dir / "jobs" / "train" / "log").read_text().split("try 2 started")[1]
    resumed_at = re.search(r"train: resumed from \S+ \(step (\d+)/(\d+)\)", resumed)
    print(
        f"\nworker-kill drill: train job pid {state['pid']} (try {state['try']}) when the Airflow side was killed; "
        f"the new attempt: {attached.group(0)!r}, after the job had waited {frozen_s:.0f} s frozen"
    )
    print(
        f"drill 2 (reboot mid-train): killed the job's pids {pids}; wiped the box's /tmp ({len(wiped)} entries: "
        f"{wiped[:4]}) and code dirs {[c.name for c in code_dirs]}; boot id now {after['boot_id']!r}; train try "
        f"{after['try']} pid {after['pid']} {resumed_at.group(0) if resumed_at else 'did not resume'}; the retry "
        f"finished {time.monotonic() - crashed_at:.0f} s after the crash; both DAG runs "
        f"{time.monotonic() - started:.0f} s"
    )
    assert (attached.group(1), int(attached.group(2)), int(attached.group(3))) == ("attached to", 1, state["pid"])
    assert (after["status"], after["try"], after["boot_id"]) == ("succeeded", 2, "boot-after-the-crash")
    assert after["pid"] != state["pid"]
    assert all(code.is_dir() for code in code_dirs), "the retry did not sync the code again"
    assert resumed_at is not None and int(resumed_at.group(1)) >= 4, resumed[:2000]  # from a checkpoint, not 0
    assert sha256(run_dir / "drafter" / "model.safetensors") == sha256(baseline_run / "drafter" / "model.safetensors")
    assert json.loads((run_dir / "drafter" / "config.json").read_text())
