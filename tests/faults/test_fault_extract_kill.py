"""Fault drill 1: kill -9 the extract job at 10 random moments during a real DAG run; every kill is retried by
Airflow and the job resumes. Figure printed: each kill (shard, try, what was killed, pid, chunks stored at
that moment), then samples expected/stored, lost, duplicated, the two digests and the durations.

The drill stores fp8 states (extract.state_dtype fp8_e4m3): resume must give the same payload bits AND the same
per-token scales. bf16 stores are resumed by the other extract tests and the demo (one drill: the suite's time)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import psutil
import pytest

from eagle3.config import write_run_config
from eagle3.data.store import read_manifest
from tests.airflow_env import dags_test
from tests.conftest import chunk_count, run_eagle3
from tests.dagruns import BOX_CHECKS, assert_succeeded, job_state, tiny_run

pytestmark = pytest.mark.slow

KILLS = 10
SHARDS = 2
MAX_KILLS_PER_SHARD = 5  # Airflow's retry delay doubles per try (1, 2, 4, 8, 16 s): spread the kills
STATE_DTYPE = "fp8_e4m3"
SAMPLES = 640  # about 9 one-MiB fp8 chunks per shard (13 in bf16): room for 5 kills each (a late kill eats up to 3)
# Only extraction is under test: Airflow marks the box checks and the later stages successful instead of running
# them.
NOT_UNDER_TEST = f"{BOX_CHECKS}|vocab|inputs_changed|train|export|evaluate|benchmark|report|promoted"


def manifest_entries(store: Path, shard: int) -> list[str]:
    """Every sample id the shard's manifest records, duplicates included."""
    records, _ = read_manifest(store / f"shard-{shard:05d}" / "manifest.jsonl")
    return [sid for record in records if record["chunk"] for sid, _ in record["samples"]]


def started_at(state: dict) -> float:
    return datetime.fromisoformat(state["started_at"].replace("Z", "+00:00")).timestamp()


class ExtractKiller(threading.Thread):
    """SIGKILLs the running extract job, once per try, in four kinds taken in turn:
    what:  the stage process alone (child_pid: the supervisor records the signal, the task fails), or the job's
           whole process group (supervisor too: nobody records anything, the job is dead);
    when:  0-0.3 s after the try has stored a chunk of its own (mid-batch, mid-write: where resume can go
           wrong), or at a random moment 0.3-2.5 s into the try (imports, tokenizing, model load: a kill before
           any progress must cost nothing but time). A try stores its first chunk about 3 s in on 2 cores, so
           both kinds land however fast the extraction itself is."""

    def __init__(self, run_dir: Path, seed: int):
        super().__init__(daemon=True)
        self.run_dir, self.rng = run_dir, random.Random(seed)
        self.kills: list[dict] = []
        self.done = threading.Event()
        self.error: BaseException | None = None

    def state(self, shard: int) -> dict | None:
        try:
            return job_state(self.run_dir, f"extract.{shard}")
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as err:  # noqa: BLE001 - reported by the test
            self.error = err

    def _run(self) -> None:
        handled: set[tuple[int, int]] = set()
        store = self.run_dir / "hidden_states"
        while len(self.kills) < KILLS and not self.done.is_set():
            for shard in range(SHARDS):
                if sum(k["shard"] == shard for k in self.kills) >= MAX_KILLS_PER_SHARD:
                    continue
                state = self.state(shard)
                if not state or state["status"] != "running" or not state.get("child_pid"):
                    continue
                if (shard, state["try"]) in handled:
                    continue
                handled.add((shard, state["try"]))
                self._kill_after_progress(shard, state, store)
            time.sleep(0.02)

    def _kill_after_progress(self, shard: int, state: dict, store: Path) -> None:
        before = chunk_count(store, shard)
        after_chunk = (len(self.kills) // 2) % 2 == 0  # two of each in turn
        if after_chunk:
            while True:  # wait for the try to store a chunk of its own
                now = self.state(shard)
                if not now or now["try"] != state["try"] or now["status"] != "running":
                    return  # it ended (finished) before it could be killed
                if chunk_count(store, shard) > before:
                    break
                time.sleep(0.01)
            time.sleep(self.rng.uniform(0.0, 0.3))
        else:
            time.sleep(self.rng.uniform(0.3, 2.5))
        now = self.state(shard)
        if not now or now["try"] != state["try"] or now["status"] != "running":
            return
        i = len(self.kills)
        whole_group = (i + i // 2) % 2 == 1  # with the shards taking turns, each shard gets both kinds
        target = state["pgid"] if whole_group else state["child_pid"]
        process = psutil.Process(state["child_pid"])  # still our stage? (pids are reused)
        assert "extract" in process.cmdline(), process.cmdline()
        if whole_group:
            os.killpg(target, signal.SIGKILL)
        else:
            process.kill()
        self.kills.append(
            {
                "shard": shard,
                "try": state["try"],
                "killed": "job group" if whole_group else "stage",
                "when": "after a fresh chunk" if after_chunk else "at random",
                "pid": target,
                "chunks_new_this_try": chunk_count(store, shard) - before,
                "seconds_into_try": round(time.time() - started_at(state), 1),
            }
        )


def test_extract_killed_10_times_in_a_dag_run_loses_nothing_and_duplicates_nothing(
    tiny_target, airflow_home, make_config, tmp_path
):
    """10 SIGKILLs of the extract job (stage process or whole job; half of them right after the try stored a
    chunk of its own, half at a random moment early in the try) during one `airflow dags test` run with retries
    on: each kill fails the task, Airflow retries it, the job relaunches and resumes after the
    stored chunks. Proves: the DAG run succeeds, the store verifies, `python -m eagle3 store digest` equals an
    uninterrupted extraction's (same config, same shards), and counting the manifests' records, no sample is
    lost and none is stored twice. Fails if a kill is not retried, if a resumed try redoes or skips a batch, or
    if a torn chunk survives."""
    started = time.monotonic()
    # The reference: the same two shard commands the DAG's jobs run, uninterrupted, in the background while
    # Airflow starts up.
    reference = make_config(
        run_name="uninterrupted",
        data={"max_samples": SAMPLES},
        extract={"batch_tokens": 512, "num_shards": SHARDS, "state_dtype": STATE_DTYPE},
    )
    write_run_config(reference)
    reference_jobs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "eagle3",
                "extract",
                "--config",
                str(reference.config_path),
                "--shard",
                str(shard),
                "--num-shards",
                str(SHARDS),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for shard in range(SHARDS)
    ]

    conf, env = tiny_run(
        tiny_target,
        tmp_path / "box",
        "killed",
        settings_dir=tmp_path,
        settings={"retry_delay_s": 1, "retry_exponential_backoff": False, "retries": MAX_KILLS_PER_SHARD + 2},
        **{"data.max_samples": SAMPLES, "extract.batch_tokens": 512, "extract.state_dtype": STATE_DTYPE},
    )
    run_dir = tmp_path / "box" / "runs" / "killed"
    killer = ExtractKiller(run_dir, seed=20261129)
    killer.start()
    proc = dags_test(airflow_home, conf, env=env, mark_success=NOT_UNDER_TEST)
    dag_seconds = time.monotonic() - started
    killer.done.set()
    killer.join(10)
    for job in reference_jobs:
        _, err = job.communicate(timeout=600)
        assert job.returncode == 0, err.decode()[-3000:]
    assert killer.error is None, killer.error
    assert_succeeded(proc)

    store = run_dir / "hidden_states"
    stats = json.loads(run_eagle3("store", "verify", str(store)).stdout)  # raises unless every chunk checks out
    reference_stats = json.loads(run_eagle3("store", "verify", str(reference.store_dir)).stdout)
    got = run_eagle3("store", "digest", str(store)).stdout.strip()
    expected = run_eagle3("store", "digest", str(reference.store_dir)).stdout.strip()
    entries = [sid for shard in range(SHARDS) for sid in manifest_entries(store, shard)]
    wanted = {sid for shard in range(SHARDS) for sid in manifest_entries(reference.store_dir, shard)}
    lost, duplicated = len(wanted - set(entries)), len(entries) - len(set(entries))
    tries = {shard: job_state(run_dir, f"extract.{shard}")["try"] for shard in range(SHARDS)}

    print(f"\ndrill 1 (extract kill -9 in a DAG run): {len(killer.kills)} kills")
    for kill in killer.kills:
        print(f"  kill: {kill}")
    print(
        f"  samples: {len(wanted)} expected, {stats['samples']} stored ({stats['chunks']} {stats['state_dtype']} "
        f"chunks), lost {lost}, duplicated {duplicated}; tries per shard {tries}"
    )
    print(f"  store digest {got[:16]}..., uninterrupted {expected[:16]}...; DAG run {dag_seconds:.0f} s")

    assert len(killer.kills) == KILLS, f"only {len(killer.kills)} kills landed: {killer.kills}"
    assert sum(tries.values()) == KILLS + SHARDS  # every kill cost exactly one retry
    assert all(job_state(run_dir, f"extract.{s}")["status"] == "succeeded" for s in range(SHARDS))
    assert (lost, duplicated) == (0, 0)
    assert stats["samples"] == len(wanted) > 600
    assert stats["state_dtype"] == reference_stats["state_dtype"] == STATE_DTYPE  # the digests compare fp8 stores
    assert got == expected
