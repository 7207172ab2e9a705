"""The DAG with every SGLang-facing stage on: generate (the target regenerates the answers), extract with the
sglang capture backend (two shards, each on the capture plugin's path: one engine, one prefill) and benchmark
(SGLang serving the drafter against the plain target), in one real `airflow dags test` run through the local
transport.

SGLang cannot run on a CPU machine: EAGLE3_SERVER_LAUNCHER makes generate and benchmark start
tests/fakes/sglang_server.py instead of `python -m sglang.launch_server`, with the same flags (it serves the
tiny target's real greedy generation, and speculative decoding with the exported drafter), and
EAGLE3_SGLANG_ENGINE makes extract use tests/fakes/sglang_engine.py instead of sglang.Engine (it computes the
tiny target's real states the way SGLang returns them, handing them to the capture plugin's writer as the hooked
scheduler method does)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from eagle3.data.samples import read_conversations
from eagle3.data.store import HiddenStateStore
from eagle3.disk.layout import run_stats_path
from tests.airflow_env import dags_test
from tests.dagruns import assert_succeeded, tiny_run
from tests.sshd import free_port
from tests.standin import STAND_IN, stand_in_processes

pytestmark = pytest.mark.slow


def test_generate_and_benchmark_run_in_the_dag(tiny_target, airflow_home, tmp_path):
    port = free_port()
    conf, settings = tiny_run(
        tiny_target,
        tmp_path / "box",
        "with-sglang-stages",
        settings_dir=tmp_path,
        **{
            "data.max_samples": 16,
            "generate.enabled": True,
            "generate.launch_server": True,
            "generate.max_tokens": 32,
            "generate.concurrency": 4,
            "generate.progress_interval_s": 1,
            "server.port": port,
            "server.startup_timeout_s": 120,
            "extract.backend": "sglang",
            "extract.num_shards": 2,
            "train.epochs": 1,
            "train.val_fraction": 0.25,  # 16 conversations: one held out at least
            "train.save_every_steps": 50,
            "benchmark.enabled": True,
            "benchmark.num_prompts": 1,
            "evaluate.num_prompts": 1,
            "benchmark.max_new_tokens": 8,
            "evaluate.max_new_tokens": 8,
        },
    )
    started = time.monotonic()
    engine = Path(__file__).parent / "fakes" / "sglang_engine.py"
    proc = dags_test(
        airflow_home,
        conf,
        env={**settings, "EAGLE3_SERVER_LAUNCHER": str(STAND_IN), "EAGLE3_SGLANG_ENGINE": f"{engine}:FakeSglangEngine"},
    )
    print(f"DAG run with generate and benchmark: {time.monotonic() - started:.1f} s")
    assert_succeeded(proc)
    run_dir = tmp_path / "box" / "runs" / "with-sglang-stages"

    # extract stored the regenerated conversations, not data.path's
    generated = run_dir / "generate" / "conversations.jsonl"
    assert json.loads((run_dir / "generate" / "stats.json").read_text())["regenerated"] == 16
    regenerated_ids = {c.sample_id for c in read_conversations(generated)[0]}
    original_ids = {c.sample_id for c in read_conversations(tiny_target / "prompts.jsonl", max_samples=16)[0]}
    stored_ids = set(HiddenStateStore(run_dir / "hidden_states").sample_ids)
    assert len(regenerated_ids) == 16 and stored_ids == regenerated_ids != original_ids
    for shard in (0, 1):  # one engine, the capture plugin's, one prefill per sample; its sink is gone at the end
        log = (run_dir / "jobs" / f"extract.{shard}" / "log").read_text()
        assert "starting the plugin engine" in log and "capturing through the plugin" in log, log[-2000:]
        assert "starting the last engine" not in log  # no final-state pass: that is the list path's
        stats = json.loads(run_stats_path(run_dir, shard).read_text())
        assert (stats["capture_path"], stats["prefill_passes"]) == ("plugin", 1)
        assert not (run_dir / "capture-sink" / f"shard-{shard:05d}").exists()
        assert not (run_dir / "capture-staging" / f"shard-{shard:05d}").exists()

    benchmark = json.loads((run_dir / "benchmark" / "benchmark.json").read_text())
    assert benchmark["prompts"] == 1
    assert benchmark["baseline"]["output_tokens_per_s"] > 0 and benchmark["eagle3"]["output_tokens_per_s"] > 0
    assert benchmark["eagle3"]["accept_length"] >= 1.0 and "accept_length" not in benchmark["baseline"]
    assert benchmark["speedup"] > 0 and (run_dir / "benchmark" / "benchmark.png").exists()
    assert benchmark["identical_outputs"] == "1/1"  # greedy speculation is lossless
    print(f"stand-in benchmark: accept length {benchmark['accept_length']}, speedup {benchmark['speedup']}")
    assert "'engine': 'sglang'" in proc.stdout + proc.stderr  # the report task's summary carries the benchmark
    # This run's servers only (its port): the other xdist worker may be running stand-ins of its own right now.
    assert not stand_in_processes(port), "a stand-in server outlived its stage"
