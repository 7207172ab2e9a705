"""Fault drill 2: a simulated VM reboot while training runs in a real DAG run. Figure printed: the killed pids,
what was wiped, the boot ids, the tries, the step training resumed from and the durations."""

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

from eagle3.job import group_members
from tests.dagruns import (
    LATER_STAGES,
    conf_for,
    copy_through_vocab,
    job_state,
    sha256,
    start_dag_run,
    wait_for,
)

pytestmark = pytest.mark.slow


def box_python(tmp_path: Path, box_tmp: Path) -> Path:
    """`box.python` for the drill: this interpreter with TMPDIR set to `box_tmp`, so that every process of the
    "box" (job supervisors, stages, their torch and Python temp files) uses `box_tmp` as its /tmp. The test
    cannot wipe the machine's real /tmp (other tests use it); `box_tmp` is the box's /tmp in this drill."""
    wrapper = tmp_path / "box-python"
    wrapper.write_text(f'#!/bin/sh\nTMPDIR={box_tmp}\nexport TMPDIR\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def test_a_box_reboot_mid_train_is_survived_by_the_retry(tiny_target, airflow_home, settings, baseline_run, tmp_path):
    """A simulated VM reboot after training's first checkpoint: every process of the job SIGKILLed, the box's
    /tmp (its TMPDIR, see box_python) wiped, the synced code directory removed, a new boot id (EAGLE3_BOOT_ID_FILE
    stands in for the kernel's). Proves: the trigger sees the job dead, the task fails, its retry syncs the code
    again, relaunches the job (try 2, new boot id), training resumes from the checkpoint (not from step 0), the DAG
    run succeeds, and the drafter is bit-identical to the uninterrupted baseline's.

    Starts from a copy of the baseline's run directory with extract and vocab done (their jobs succeeded: the
    DAG re-attaches to them at once); the drill is about training. Evaluate and report are marked successful:
    the drafter (export) is what the drill compares."""
    workdir = tmp_path / "box"
    run_dir = copy_through_vocab(baseline_run, workdir)
    box_tmp = tmp_path / "box-tmp"
    box_tmp.mkdir()
    conf = conf_for(tiny_target, workdir, **{"box.python": str(box_python(tmp_path, box_tmp))})
    train_state = run_dir / "jobs" / "train" / "state.json"
    boot_id = tmp_path / "boot_id"
    boot_id.write_text("boot-before-the-crash\n")
    output = tmp_path / "dag-run.log"
    started = time.monotonic()
    dag_run = start_dag_run(airflow_home, conf, output, env={**settings, "EAGLE3_BOOT_ID_FILE": str(boot_id)},
                            mark_success=LATER_STAGES)
    try:
        def first_checkpoint() -> bool:
            assert dag_run.poll() is None, "the DAG run ended before training wrote a checkpoint"
            return train_state.exists() and bool(list((run_dir / "train" / "checkpoints").glob("step-*")))

        wait_for(first_checkpoint, 600, "the first training checkpoint", interval=0.05)
        state = json.loads(train_state.read_text())
        assert state["status"] == "running", "training finished before it could be killed; make it longer"
        pids, killed_pid = group_members(state["pgid"]), state["pid"]
        os.killpg(state["pgid"], signal.SIGKILL)  # the VM goes down: every process of the job, no cleanup ...
        crashed_at = time.monotonic()
        wiped = sorted(str(p.relative_to(box_tmp)) for p in box_tmp.rglob("*"))
        shutil.rmtree(box_tmp)  # ... and comes back with an empty /tmp,
        box_tmp.mkdir()
        code_dirs = list((workdir / "code").iterdir())
        for code in code_dirs:
            shutil.rmtree(code)  # without the code dir (reimaged, or it lived on /tmp),
        boot_id.write_text("boot-after-the-crash\n")  # and with a new boot id
        dag_run.wait(600)
    finally:
        if dag_run.poll() is None:
            os.killpg(dag_run.pid, signal.SIGKILL)
    log = output.read_text(errors="replace")
    assert dag_run.returncode == 0, log[-6000:]
    state = job_state(run_dir, "train")
    resumed = (run_dir / "jobs" / "train" / "log").read_text().split("try 2 started")[1]
    resumed_at = re.search(r"train: resumed from \S+ \(step (\d+)/(\d+)\)", resumed)
    print(f"\ndrill 2 (reboot mid-train): killed the job's pids {pids} (try 1 supervisor {killed_pid}); wiped "
          f"the box's /tmp ({len(wiped)} entries: {wiped[:4]}) and code dirs {[c.name for c in code_dirs]}; "
          f"boot id now {state['boot_id']!r}; train try {state['try']} pid {state['pid']} "
          f"{resumed_at.group(0) if resumed_at else 'did not resume'}; the retry finished "
          f"{time.monotonic() - crashed_at:.0f} s after the crash; DAG run {time.monotonic() - started:.0f} s")
    assert (state["status"], state["try"], state["boot_id"]) == ("succeeded", 2, "boot-after-the-crash")
    assert all(code.is_dir() for code in code_dirs), "the retry did not sync the code again"
    assert resumed_at is not None and int(resumed_at.group(1)) >= 4, resumed[:2000]  # from a checkpoint, not 0
    assert sha256(run_dir / "drafter" / "model.safetensors") == sha256(baseline_run / "drafter" / "model.safetensors")
