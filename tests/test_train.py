"""Training: the objective's shifts and metrics by hand, then real runs on the tiny target's store, killed
with SIGKILL and resumed, in one process and as 2 gloo ranks under torchrun."""

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

import eagle3.train as train
from eagle3.config import write_run_config
from eagle3.train import load_checkpoint, make_teachers, simulated_accept_length
from tests.conftest import run_eagle3


def perfect_target(input_ids: torch.Tensor, vocab: int):
    """A target whose final state at t predicts exactly the next token of the data (one-hot lm_head)."""
    next_ids = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)
    return torch.nn.functional.one_hot(next_ids, vocab).float() * 10, torch.eye(vocab)


def test_targets_are_shifted_exactly_once():
    """At position t the drafter reads token t+1 and must predict what the target predicts after it:
    token t+2. One shift too many (SpecForge once shipped that) or too few fails here."""
    ids = torch.tensor([[3, 7, 1, 9, 4, 6, 2, 8]])
    last, lm_head = perfect_target(ids, 10)
    t = make_teachers(ids, torch.ones_like(ids), last, lm_head, torch.arange(10), torch.ones(10, dtype=torch.bool))
    assert t.input_ids[0, :7].tolist() == ids[0, 1:].tolist()  # token t+1
    assert t.teacher[0, :6].tolist() == ids[0, 2:].tolist()  # token t+2
    assert t.loss_mask[0].tolist() == [True] * 7 + [False]  # not shifted; last position off


def test_teachers_outside_the_draft_vocab_are_masked_from_the_loss():
    ids = torch.tensor([[3, 7, 1, 9, 4, 6, 2, 8]])
    last, lm_head = perfect_target(ids, 10)
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[1, 4, 9]] = True
    t = make_teachers(ids, torch.ones_like(ids), last, lm_head, torch.tensor([1, 4, 9]), t2d)
    assert t.position_mask[0].tolist() == [True, True, True, False, False, False, False, False]
    assert t.p.shape == (1, 8, 3)  # only the draft vocab's columns
    assert torch.allclose(t.p.sum(-1), torch.ones(1, 8))


def test_full_vocab_argmax_in_chunks_equals_the_whole(monkeypatch):
    torch.manual_seed(0)
    ids, last, lm_head = torch.randint(0, 50, (2, 9)), torch.randn(2, 9, 16), torch.randn(50, 16)
    args = (ids, torch.ones_like(ids), last, lm_head, torch.arange(0, 50, 2), torch.ones(50, dtype=torch.bool))
    whole = make_teachers(*args)
    monkeypatch.setattr(train, "LOGIT_CHUNK", 4)
    assert torch.equal(make_teachers(*args).teacher, whole.teacher)


def test_simulated_accept_length():
    assert simulated_accept_length([]) == 1.0
    assert simulated_accept_length([0.5, 0.5, 0.5]) == pytest.approx(1.875)
    assert simulated_accept_length([1.0] * 7) == 8.0


def final_state(cfg):
    checkpoints = sorted((cfg.run_dir / "train" / "checkpoints").glob("step-*"))
    return load_checkpoint(checkpoints[-1])


def copy_run(cfg, make_config, name, ranks=1):
    """The same run in another run directory, sharing the store and vocab mapping (symlinked)."""
    sections = {k: cfg.model_dump()[k] for k in ("train", "vocab", "extract")}
    sections["train"]["nproc_per_node"] = ranks
    other = make_config(run_name=name, **sections)
    other.run_dir.mkdir(parents=True)
    for part in ("hidden_states", "vocab_mapping"):
        (other.run_dir / part).symlink_to(cfg.run_dir / part)
    write_run_config(other)
    return other


def assert_no_process_left(config_path, timeout: float = 10.0) -> None:
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


def train_command(cfg) -> list[str]:
    """What a user (or the DAG) runs, whatever the rank count: with train.nproc_per_node 2 it becomes
    torchrun with 2 gloo ranks."""
    return [sys.executable, "-m", "eagle3", "train", "--config", str(cfg.config_path)]


def test_a_short_run_learns_and_leaves_checkpoints_metrics_and_plots(train_config):
    summary = json.loads(run_eagle3("train", "--config", str(train_config.config_path)).stdout)
    out = train_config.run_dir / "train"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    val = [r for r in records if "val_acc" in r]
    assert losses[-1] < losses[0] * 0.7
    assert len(val[-1]["val_acc"]) == 7 and val[-1]["val_accept_length"] > 1.5
    assert (out / "loss.png").stat().st_size > 10_000 and (out / "accuracy.png").stat().st_size > 10_000
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    best = f"step-{summary['best']['step']:06d}"
    assert best in kept and len(kept) <= 3  # keep_last 2, plus the best
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    state = final_state(train_config)
    assert "embed_tokens.weight" not in state["model"] and state["step"] == summary["steps"]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert {"loss", "ploss/position_6", "acc/position_0", "acc/position_6", "val_accept_length", "lr"} <= set(
        events.Tags()["scalars"]
    )
    assert [e.value for e in events.Scalars("loss")] == pytest.approx(losses)


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_kill_9_and_resume_gives_bit_identical_weights(train_config, make_config, ranks):
    """SIGKILL the real training (torchrun with 2 gloo ranks too) at random moments after checkpoints,
    rerun it each time; the final weights and optimizer state equal an uninterrupted run's bit for bit."""
    reference = copy_run(train_config, make_config, f"reference-{ranks}", ranks)
    subprocess.run(train_command(reference), check=True, capture_output=True)
    expected = final_state(reference)
    last = sorted((reference.run_dir / "train" / "checkpoints").glob("step-*"))[-1]
    assert json.loads((last / "meta.json").read_text())["world_size"] == ranks

    victim = copy_run(train_config, make_config, f"victim-{ranks}", ranks)
    checkpoints = victim.run_dir / "train" / "checkpoints"
    rng = random.Random(ranks)
    kills = []
    while len(kills) < 3:
        before = len(list(checkpoints.glob("step-*"))) if checkpoints.exists() else 0
        proc = subprocess.Popen(train_command(victim), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        while proc.poll() is None and (len(list(checkpoints.glob("step-*"))) if checkpoints.exists() else 0) == before:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.3))
        if proc.poll() is not None:
            break
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun (and, with it, its ranks), no chance to clean up
        proc.wait()
        assert_no_process_left(victim.config_path)
        kills.append(sorted(p.name for p in checkpoints.glob("step-*"))[-1])
    print(f"ranks {ranks}: killed after {kills}")
    assert kills
    subprocess.run(train_command(victim), check=True, capture_output=True)
    got = final_state(victim)
    assert got["step"] == expected["step"]
    for name, tensor in expected["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    for index, moments in expected["optimizer"]["state"].items():
        for key, value in moments.items():
            assert torch.equal(torch.as_tensor(got["optimizer"]["state"][index][key]), torch.as_tensor(value))
    # The metrics of the steps a killed run did past its checkpoint were dropped, not duplicated.
    metrics = (victim.run_dir / "train" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in metrics if "loss" in json.loads(line)]
    assert steps == sorted(set(steps))
