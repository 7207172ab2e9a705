"""Runs with the same capture share one hidden-state store: a rerun extracts only what the store lacks.

Scheduled reruns see last week's conversations again; their states are computed once, in
{workdir}/stores/<capture key>/, and every run reads only its own samples of it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from eagle3.config import ConfigError, write_run_config
from eagle3.data.identity import attach_store
from eagle3.data.samples import read_conversations
from eagle3.data.store import HiddenStateStore, StoreError, digest, open_run_store, verify
from eagle3.disk.layout import run_samples_path
from eagle3.stages.extract import run_extract
from tests.conftest import chunk_count, run_eagle3


def conversation_ids(cfg) -> list[str]:
    return [c.sample_id for c in read_conversations(cfg.data.path, max_samples=cfg.data.max_samples)[0]]


@pytest.mark.slow
def test_a_rerun_extracts_nothing_and_grown_data_extracts_exactly_the_new_samples(make_config):
    first = make_config(run_name="week-1", data={"max_samples": 40})
    week1 = run_extract(first)
    assert week1["samples_extracted"] == week1["samples_stored"] == len(conversation_ids(first))
    assert week1["samples_stored_before"] == 0

    same = make_config(run_name="week-2", data={"max_samples": 40})
    rerun = run_extract(same)
    assert (rerun["samples_extracted"], rerun["samples_stored_before"]) == (0, week1["samples_stored"])
    assert (
        same.store_dir.resolve()
        == first.store_dir.resolve()
        == first.store_dir.parent.parent.parent / "stores" / week1["store"]
    )

    grown = make_config(run_name="week-3", data={"max_samples": 44})  # 10 % more conversations
    new_ids = set(conversation_ids(grown)) - set(conversation_ids(first))
    week3 = run_extract(grown)
    assert len(new_ids) == 4 and week3["samples_extracted"] == 4
    assert week3["samples_stored_before"] == week1["samples_stored"] and week3["samples_stored"] == 44

    # Each run reads its own samples of the shared store, however it grows afterwards.
    assert set(open_run_store(first).sample_ids) == set(open_run_store(same).sample_ids) == set(conversation_ids(first))
    assert set(open_run_store(grown).sample_ids) == set(conversation_ids(grown))
    assert len(HiddenStateStore(grown.store_dir)) == verify(grown.store_dir)["samples"] == 44  # stored once


@pytest.mark.slow
def test_a_change_to_what_decides_the_states_starts_another_store(make_config):
    base = make_config(run_name="base", data={"max_samples": 12})
    run_extract(base)
    for i, change in enumerate(
        [
            {"extract": {"aux_layers": [2, 3, 4]}},
            {"data": {"max_samples": 12, "max_length": 64}},
            {"extract": {"state_dtype": "fp8_e4m3"}},
            {"extract": {"num_shards": 2}},
        ]
    ):
        other = make_config(run_name=f"other-{i}", **{"data": {"max_samples": 12}, **change})
        stats = run_extract(other, 0)
        assert other.store_dir.resolve() != base.store_dir.resolve(), change
        assert stats["samples_stored_before"] == 0 and stats["samples_extracted"] > 0, change
    # What a store's key covers is written beside it, for a person deciding what to delete.
    assert '"aux_layers": [\n    1,\n    3,\n    4\n  ]' in (base.store_dir / "key.json").read_text()


@pytest.mark.timeout(60)
def test_a_store_key_reads_the_generation_template_as_the_stages_do(make_config, tmp_path):
    """init keys the store by the template's bytes: a template in /proc (pagemap is a "regular file" that never
    ends) is refused there, naming the field, where a plain read would hang init; a plain file keys as its bytes."""
    from eagle3.data.identity import capture_fields
    from eagle3.data.samples import DataError

    cfg = make_config(data={"generation_chat_template": "/proc/self/pagemap"})
    with pytest.raises(DataError, match=r"^data.generation_chat_template: /proc/self/pagemap: a file in /proc"):
        capture_fields(cfg)
    template = tmp_path / "template.jinja"
    template.write_text("{{ messages }}")
    cfg = make_config(data={"generation_chat_template": str(template)})
    assert capture_fields(cfg)["generation_chat_template"] == hashlib.sha256(b"{{ messages }}").hexdigest()


@pytest.mark.slow
def test_a_run_whose_target_changed_after_it_started_is_refused(make_config, tiny_target, tmp_path):
    """A new checkpoint dropped into the model directory mid-run would mix two targets' states in one store."""
    model = tmp_path / "target"
    shutil.copytree(tiny_target, model)
    cfg = make_config(target={"model_path": str(model)}, data={"max_samples": 8})
    run_extract(cfg)
    (model / "config.json").write_text((model / "config.json").read_text() + "\n")  # "another checkpoint"
    with pytest.raises(ConfigError) as refused:
        run_extract(cfg)
    assert refused.value.where == str(cfg.run_dir / "hidden_states") and "run_name" in refused.value.fix
    fresh = make_config(run_name="new-checkpoint", target={"model_path": str(model)}, data={"max_samples": 8})
    assert attach_store(fresh) != cfg.store_dir.resolve()


@pytest.mark.slow
def test_a_run_whose_extract_has_not_finished_is_not_read(make_config):
    cfg = make_config(data={"max_samples": 8})
    run_extract(cfg)
    run_samples_path(cfg.run_dir, 0).unlink()  # as if the shard's extract had been killed before its end
    with pytest.raises(StoreError, match="extract shard 0 of this run has not finished"):
        open_run_store(cfg)


# `python -m eagle3 extract` as the job runs it, except that it waits for a file to appear before it loads the target:
# the first writer holds the shard's lock (taken before the model loads) until the test lets it go on.
HELD_EXTRACT = """
import os, sys, time
from eagle3 import capture
open_backend = capture.open_backend
def open_when_told(*args, **kwargs):
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.05)
    return open_backend(*args, **kwargs)
capture.open_backend = open_when_told
from eagle3.__main__ import main
sys.exit(main(["extract", "--config", sys.argv[1]]))
"""


@pytest.mark.slow
def test_a_run_that_finds_another_writing_its_shard_waits_for_it_and_finds_its_samples_stored(
    make_config, tmp_path, monkeypatch, caplog
):
    """Two runs of one capture extract the same shard of the shared store at once (on two boxes sharing the disk, or
    one): the second waits for the first's lock instead of failing (a retry came back refused while the first wrote
    for hours, until the retries ran out), naming the holder in its log and beating progress meanwhile, so the job's
    stall watch does not take it for hung. Once the first is done, the second finds its samples stored: it computes
    none and loads no target, and it gives the stage the first-progress allowance again for what follows."""
    import threading

    from eagle3.data import store
    from eagle3.data.store import read_holder, shard_dir
    from eagle3.jobs.supervisor import FIRST_PROGRESS_VAR

    first = make_config(run_name="first", data={"max_samples": 8})
    second = make_config(run_name="second", data={"max_samples": 8})
    for cfg in (first, second):
        write_run_config(cfg)
        attach_store(cfg)
    assert first.store_dir.resolve() == second.store_dir.resolve()
    go_on = tmp_path / "go-on"
    env = {name: value for name, value in os.environ.items() if not name.startswith("EAGLE3_")}
    holder = subprocess.Popen(
        [sys.executable, "-c", HELD_EXTRACT, str(first.config_path), str(go_on)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lock = shard_dir(first.store_dir, 0) / ".lock"
        deadline = time.monotonic() + 120
        while read_holder(lock).get("pid") != holder.pid:
            assert holder.poll() is None, holder.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the first writer did not take the shard's lock"
            time.sleep(0.05)
        beats = tmp_path / "progress.json"
        monkeypatch.setenv("EAGLE3_PROGRESS_FILE", str(beats))  # as the job's supervisor gives its stage
        monkeypatch.setenv(FIRST_PROGRESS_VAR, "3600")
        monkeypatch.setattr(store, "LOCK_POLL_MAX_S", 0.2)
        from eagle3.jobs import progress
        from eagle3.stages import extract

        allowances = []  # (line, allowance_s) of the stage's beats that announce a silence
        monkeypatch.setattr(
            extract,
            "beat",
            lambda line, allowance_s=None: (
                allowance_s is not None and allowances.append((line, allowance_s)),
                progress.beat(line, allowance_s),
            ),
        )
        caplog.set_level("INFO", logger="eagle3.stages.extract")
        outcome = {}
        waiter = threading.Thread(target=lambda: outcome.update(run_extract(second)))
        waiter.start()
        while "waiting for the shard" not in (beats.read_text() if beats.exists() else ""):
            assert waiter.is_alive() and time.monotonic() < deadline, outcome
            time.sleep(0.05)
        assert f"pid {holder.pid} on host" in beats.read_text() and "run first" in beats.read_text()
        time.sleep(1)
        assert waiter.is_alive()  # still waiting, not failed
        go_on.touch()
        waiter.join(300)
        assert holder.wait(60) == 0, holder.stderr.read()[-3000:]
    finally:
        go_on.touch()
        holder.kill()
        holder.wait()
    assert not waiter.is_alive()
    stored = len(conversation_ids(first))
    assert (outcome["samples_extracted"], outcome["samples_stored_before"]) == (0, stored)
    assert outcome["samples_stored"] == stored and outcome["capture_path"] is None  # no target loaded
    logged = caplog.text
    assert f"extract shard 0: waiting for the shard, which another writer holds (pid {holder.pid} on host " in logged
    assert "the shard is free after waiting about" in logged
    # the target's load comes next, as at a stage's start: the first-progress limit again, not the one between beats
    assert [allowance for line, allowance in allowances if "the shard is free after waiting" in line] == [3600]
    assert set(open_run_store(second).sample_ids) == set(conversation_ids(second))


@pytest.mark.slow
def test_a_writer_that_does_not_wait_gets_store_busy_naming_the_holder_and_is_retried(make_config):
    """ShardWriter without on_busy (the default) refuses a busy shard at once; `python -m eagle3` exits 1 for it (a
    retry may do). A shard this very process holds is refused even by a writer that waits: it would wait forever."""
    from eagle3.__main__ import exit_code_for
    from eagle3.data.store import ShardWriter, StoreBusy, read_meta

    first = make_config(run_name="first", data={"max_samples": 8})
    run_extract(first)
    writing = ShardWriter(first.store_dir, 0, read_meta(first.store_dir), writer="run first")
    try:
        with pytest.raises(
            StoreBusy,
            match=rf"another process is writing this shard \(pid {os.getpid()} on host "
            r".*'run first'",
        ) as refused:
            ShardWriter(first.store_dir, 0, read_meta(first.store_dir))
        assert exit_code_for(refused.value) == 1
        with pytest.raises(StoreBusy, match="holds the shard's lock already, in a writer it has not released"):
            run_extract(make_config(run_name="second", data={"max_samples": 8}))
    finally:
        writing.release()
    assert run_extract(make_config(run_name="third", data={"max_samples": 8}))["samples_extracted"] == 0


@pytest.mark.slow
def test_kill_9_during_an_incremental_extraction_leaves_the_store_a_clean_one_would(make_config, tmp_path):
    """Week 1 stored 180 conversations; week 2's data has 10 % more, and its extraction (`python -m eagle3 extract`,
    as the job runs it) is SIGKILLed right after it stored its first new chunk, then run again. The shared store
    then holds what the same two weeks without the kill leave (`store digest`), every sample once, and week 2 computed
    exactly the new samples over its two tries."""
    week1 = make_config(run_name="week-1", workdir=tmp_path / "clean", data={"max_samples": 180})
    run_extract(week1)
    shutil.copytree(tmp_path / "clean", tmp_path / "killed", symlinks=True)  # the same week 1 in both workdirs
    clean = make_config(run_name="week-2", workdir=tmp_path / "clean", data={"max_samples": 198})
    new = len(set(conversation_ids(clean)) - set(conversation_ids(week1)))
    assert run_extract(clean)["samples_extracted"] == new == 18

    killed = make_config(run_name="week-2", workdir=tmp_path / "killed", data={"max_samples": 198})
    write_run_config(killed)
    attach_store(killed)
    before = chunk_count(killed.store_dir)
    extraction = subprocess.Popen(
        [sys.executable, "-m", "eagle3", "extract", "--config", str(killed.config_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while chunk_count(killed.store_dir) == before:
            assert extraction.poll() is None, extraction.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no new chunk within 300 s"
            time.sleep(0.005)
        os.killpg(extraction.pid, signal.SIGKILL)
    finally:
        extraction.wait(30)
    first_try = chunk_count(killed.store_dir) - before
    second_try = json.loads(run_eagle3("extract", "--config", str(killed.config_path)).stdout)

    print(
        f"\nincremental extraction killed after {first_try} new chunk(s); the rerun extracted "
        f"{second_try['samples_extracted']} of the {new} new samples, reused {second_try['samples_stored_before']}"
    )
    assert 0 < second_try["samples_extracted"] < new  # the kill landed mid-run: both tries did some of the work
    assert second_try["samples_stored"] == 198
    assert verify(killed.store_dir)["samples"] == verify(clean.store_dir)["samples"] == 198  # each sample once
    assert digest(killed.store_dir) == digest(clean.store_dir)
    assert run_samples_path(killed.run_dir, 0).read_bytes() == run_samples_path(clean.run_dir, 0).read_bytes()
