"""The extract stage end to end on the tiny target: stats, resume, sharding, and kill -9 at random moments."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

from eagle3.config import write_run_config
from eagle3.data import TokenizedSample
from eagle3.extract import plan_batches, run_extract
from eagle3.store import HiddenStateStore, digest, verify
from tests.conftest import run_eagle3


def sample(n: int, sid: str) -> TokenizedSample:
    return TokenizedSample(sid, [0] * n, [1] * n, False)


def test_plan_batches_respects_the_token_budget_and_keeps_every_sample():
    samples = [sample(n, f"{i:016x}") for i, n in enumerate([5, 50, 7, 30, 30, 200, 1, 12])]
    batches = list(plan_batches(samples, batch_tokens=64))
    assert sorted(s.sample_id for b in batches for s in b) == sorted(s.sample_id for s in samples)
    for batch in batches:
        longest = max(len(s.input_ids) for s in batch)
        assert len(batch) == 1 or len(batch) * longest <= 64
    assert [len(s.input_ids) for s in batches[0]] == [200]  # over budget: a batch of its own
    assert batches == list(plan_batches(samples, batch_tokens=64))  # deterministic


def test_extract_stores_every_sample_and_a_rerun_computes_nothing(make_config, caplog):
    caplog.set_level(logging.INFO, logger="eagle3")
    cfg = make_config()
    first = run_extract(cfg)
    progress = [r.getMessage() for r in caplog.records if "samples (" in r.getMessage()]
    assert progress and re.fullmatch(
        r"extract shard 0: \d+/\d+ samples \([\d.]+%\), \d+ tokens/s, [\d.]+ GiB written, "
        r"elapsed \d+m\d\ds, ETA (\d+m\d\ds|\?)", progress[-1]
    ), progress[-1]
    assert first["samples_extracted"] == first["samples_in_shard"] == first["samples_stored"] > 150
    assert first["bad_records"] == 0 and first["rejected_nonfinite"] == 0
    stats = verify(cfg.store_dir)
    assert stats["samples"] == first["samples_stored"] and stats["tokens"] == first["tokens"]
    assert stats["aux_layers"] == [1, 3, 4] and stats["hidden_size"] == 256
    assert 0 < stats["loss_tokens"] < stats["tokens"]

    again = run_extract(cfg)
    assert again["samples_extracted"] == 0 and again["samples_stored_before"] == first["samples_stored"]
    assert json.loads((cfg.store_dir / "shard-00000" / "extract_stats.json").read_text()) == again


def test_shards_partition_the_samples(make_config):
    whole = make_config(run_name="whole")
    run_extract(whole)
    split = make_config(run_name="split", extract={"num_shards": 3})
    counts = [run_extract(split, shard=i)["samples_stored"] for i in range(3)]
    assert all(counts) and sum(counts) == len(HiddenStateStore(whole.store_dir))
    assert sorted(HiddenStateStore(split.store_dir).sample_ids) == sorted(HiddenStateStore(whole.store_dir).sample_ids)
    with pytest.raises(ValueError, match="--shard 3 is out of range for 3 shard"):
        run_extract(split, shard=3)


def chunk_count(manifest) -> int:
    return manifest.read_text().count('"chunk": "') if manifest.exists() else 0


@pytest.mark.slow
def test_kill_9_at_random_moments_loses_nothing_and_duplicates_nothing(make_config):
    """Kill the real extract process (SIGKILL, no cleanup) at random moments, then let it finish:
    the store verifies, and its digest equals an uninterrupted run's."""
    reference = make_config(run_name="uninterrupted", data={"max_samples": 400}, extract={"batch_tokens": 512})
    write_run_config(reference)
    run_eagle3("extract", "--config", str(reference.config_path))
    expected = digest(reference.store_dir)

    victim = make_config(run_name="killed", data={"max_samples": 400}, extract={"batch_tokens": 512})
    write_run_config(victim)
    manifest = victim.store_dir / "shard-00000" / "manifest.jsonl"
    rng = random.Random(20261129)
    chunks_after_kill = []
    while len(chunks_after_kill) < 6:
        before = chunk_count(manifest)
        proc = subprocess.Popen(
            [sys.executable, "-m", "eagle3", "extract", "--config", str(victim.config_path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        # Kill while it works: once it has committed a new chunk, at a random moment after that.
        while chunk_count(manifest) == before and proc.poll() is None:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.4))
        if proc.poll() is not None:
            break  # it finished before we could kill it again
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        chunks_after_kill.append(chunk_count(manifest))
    print(f"kill -9 count: {len(chunks_after_kill)}, chunks recorded after each kill: {chunks_after_kill}")
    assert len(chunks_after_kill) >= 4

    run_eagle3("extract", "--config", str(victim.config_path))
    stats = verify(victim.store_dir)
    assert stats["samples"] == verify(reference.store_dir)["samples"]
    assert digest(victim.store_dir) == expected


def test_bad_records_stop_extract_with_line_numbers(make_config, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                    "not json\n")
    cfg = make_config(data={"path": str(data), "max_samples": None})
    write_run_config(cfg)
    proc = run_eagle3("extract", "--config", str(cfg.config_path), check=False)
    assert proc.returncode == 2
    assert f"error: {data}: 1 bad record(s):\n  line 2: invalid JSON" in proc.stderr

    skipping = make_config(run_name="skip", data={"path": str(data), "max_samples": None, "on_bad_record": "skip"})
    stats = run_extract(skipping)
    assert stats["bad_records"] == 1 and stats["bad_record_lines"] == [2] and stats["samples_stored"] == 1


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs, grown on request: a disk that fills up during extraction, then gets room."""
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("the disk-full drill mounts a tmpfs: CI runs as root")
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], check=True)

    def grow(size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(mount)], check=True)

    try:
        yield mount, grow
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
def test_a_full_disk_is_a_clear_error_keeps_nothing_partial_and_the_rerun_completes(make_config, small_disk):
    mount, grow = small_disk
    reference = make_config(run_name="roomy", data={"max_samples": 80})
    run_extract(reference)

    cfg = make_config(run_name="cramped", workdir=mount / "work", data={"max_samples": 80})
    write_run_config(cfg)
    proc = run_eagle3("extract", "--config", str(cfg.config_path), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    message = proc.stderr.strip().splitlines()[-1]
    print(message)
    assert "no space left on the device" in message and str(cfg.store_dir / "shard-00000") in message
    assert "MiB free of 3.00 MiB" in message and "run the stage again" in message
    shard = cfg.store_dir / "shard-00000"
    assert not [p.name for p in shard.iterdir() if ".tmp-" in p.name], "a partial chunk was left behind"
    stored = verify(cfg.store_dir)["samples"]  # what is recorded is whole and readable
    assert 0 < stored < verify(reference.store_dir)["samples"]

    grow("64m")  # space freed; the task is cleared
    run_eagle3("extract", "--config", str(cfg.config_path))
    assert digest(cfg.store_dir) == digest(reference.store_dir)
