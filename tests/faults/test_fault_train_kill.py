"""Fault drill 6: kill -9 training at random steps, then run it again (what clearing the task does: the job
relaunches `python -m eagle3 train`); the result must be bit-identical to an uninterrupted run. One process,
and torchrun with 2 gloo ranks. Figure printed: the steps killed at, the checkpoints the reruns resumed from,
the pids, and the durations."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eagle3.records.checkpoint import load_checkpoint
from tests.dagruns import copy_through_vocab, sha256

pytestmark = pytest.mark.slow


def prepare(baseline: Path, workdir: Path, **train) -> Path:
    """A run directory with the baseline's store and vocab mapping and the baseline's config, but for the
    workdir, a progress line per step (so a kill can aim at a step; it changes no figure) and `train`."""
    run_dir = copy_through_vocab(baseline, workdir)
    config = json.loads((baseline / "config.json").read_text())
    config["workdir"] = str(workdir)
    config["train"].update(progress_interval_s=0.001, **train)
    (run_dir / "config.json").write_text(json.dumps(config))
    return run_dir


def train_command(run_dir: Path) -> list[str]:
    """What the train job runs; with train.nproc_per_node 2 it becomes torchrun with 2 gloo ranks."""
    return [sys.executable, "-m", "eagle3", "train", "--config", str(run_dir / "config.json")]


def logged_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "train" / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    return max((json.loads(line)["step"] for line in lines if line.endswith("}")), default=0)


def assert_no_process_left(config_path: Path, timeout: float = 10.0) -> None:
    """No rank of a killed run may live on (torchrun puts ranks in sessions of their own)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for proc_dir in Path("/proc").glob("[0-9]*"):
            try:
                cmdline = (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                status = (proc_dir / "status").read_text()
            except OSError:
                continue
            if str(config_path) in cmdline and "State:\tZ" not in status:
                alive.append(proc_dir.name)
        if not alive:
            return
        assert time.monotonic() < deadline, f"processes of a killed run still alive: {alive}"
        time.sleep(0.1)


def kill_at_steps(run_dir: Path, steps: list[int]) -> list[dict]:
    """Run training, SIGKILL its whole process group once it has logged each of `steps`, rerun; then let the
    last rerun finish. Returns what each try did."""
    tries = []
    for kill_step in [*steps, None]:
        proc = subprocess.Popen(
            train_command(run_dir), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        resumed_from = (
            sorted(p.name for p in (run_dir / "train" / "checkpoints").glob("step-*"))[-1:]
            if (run_dir / "train" / "checkpoints").exists()
            else []
        )
        if kill_step is None:
            _, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, err.decode()[-3000:]
            tries.append({"pid": proc.pid, "resumed_from": resumed_from, "finished": True})
            break
        while logged_step(run_dir) < kill_step:
            assert proc.poll() is None, f"training ended before step {kill_step}: {proc.stderr.read().decode()}"
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGKILL)  # the stage and (torchrun) every rank, no chance to clean up
        proc.wait()
        proc.stderr.close()
        assert_no_process_left(run_dir / "config.json")
        tries.append({"pid": proc.pid, "resumed_from": resumed_from, "killed_at_step": logged_step(run_dir)})
    return tries


def assert_same_training(got: dict, expected: dict) -> None:
    assert got["step"] == expected["step"]
    for name, tensor in expected["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    for index, moments in expected["optimizer"]["state"].items():
        for key, value in moments.items():
            assert torch.equal(torch.as_tensor(got["optimizer"]["state"][index][key]), torch.as_tensor(value))


def final_checkpoint(run_dir: Path) -> Path:
    return sorted((run_dir / "train" / "checkpoints").glob("step-*"))[-1]


def assert_metrics_not_duplicated(run_dir: Path) -> None:
    """The metrics of the steps a killed run did past its checkpoint were dropped, not duplicated."""
    records = [json.loads(line) for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == sorted(set(steps))


def test_kill_9_at_random_steps_and_rerun_gives_the_baselines_drafter_bit_for_bit(baseline_run, tmp_path):
    """One process, the baseline's training (24 steps, a checkpoint every 4): SIGKILLed at 2 random steps (one in
    steps 5-11, one in 13-22: each past a checkpoint, so each rerun has something to resume), run again after
    each. Proves: the final weights and AdamW
    moments equal the uninterrupted baseline run's bit for bit, the exported drafter's file is byte-identical
    to the baseline's, and the metrics hold each step once. Fails on any drift in resume (data position, RNG,
    scheduler, optimizer state) or a kill that leaves a torn checkpoint behind."""
    started = time.monotonic()
    run_dir = prepare(baseline_run, tmp_path / "box")
    rng = random.Random(20261129)
    steps = [rng.randint(5, 11), rng.randint(13, 22)]  # each after a checkpoint
    tries = kill_at_steps(run_dir, steps)
    subprocess.run(
        [sys.executable, "-m", "eagle3", "export", "--config", str(run_dir / "config.json")],
        check=True,
        capture_output=True,
    )
    print(
        f"\ndrill 6 (train kill -9, 1 process): aimed at steps {steps}; tries {tries}; "
        f"{time.monotonic() - started:.0f} s"
    )
    assert_same_training(load_checkpoint(final_checkpoint(run_dir)), load_checkpoint(final_checkpoint(baseline_run)))
    assert sha256(run_dir / "drafter" / "model.safetensors") == sha256(baseline_run / "drafter" / "model.safetensors")
    assert_metrics_not_duplicated(run_dir)
    assert [t.get("killed_at_step", 0) >= s for t, s in zip(tries, steps)] == [True, True]
    assert tries[1]["resumed_from"] and tries[2]["resumed_from"], "a rerun did not resume from a checkpoint"


def test_kill_9_of_torchrun_with_2_ranks_at_a_random_step_and_rerun_is_bit_identical(baseline_run, tmp_path):
    """torchrun with 2 gloo ranks on the baseline's data (one epoch, 12 steps): SIGKILL the process group (torchrun
    and both ranks) at a random step after the first checkpoint, check no rank survives, run it again. Proves:
    weights and AdamW moments equal an uninterrupted 2-rank run's bit for bit (and the checkpoint records
    world size 2)."""
    started = time.monotonic()
    reference = prepare(baseline_run, tmp_path / "reference", nproc_per_node=2, epochs=1)
    subprocess.run(train_command(reference), check=True, capture_output=True)
    expected = load_checkpoint(final_checkpoint(reference))
    assert json.loads((final_checkpoint(reference) / "meta.json").read_text())["world_size"] == 2

    victim = prepare(baseline_run, tmp_path / "victim", nproc_per_node=2, epochs=1)
    step = random.Random(2).randint(5, 10)
    tries = kill_at_steps(victim, [step])
    print(
        f"\ndrill 6 (train kill -9, torchrun 2 ranks): aimed at step {step}; tries {tries}; "
        f"{time.monotonic() - started:.0f} s"
    )
    assert_same_training(load_checkpoint(final_checkpoint(victim)), expected)
    assert_metrics_not_duplicated(victim)
    assert tries[0]["killed_at_step"] >= step and tries[1]["resumed_from"]
