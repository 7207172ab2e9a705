"""The hidden-state store: round trip, crash leftovers, rejected samples, locking, verify and digest."""

from __future__ import annotations

import json
import random

import pytest
import torch

from eagle3.capture import CapturedStates
from eagle3.data import TokenizedSample
from eagle3.store import HiddenStateStore, ShardWriter, StoreError, StoreMeta, digest, shard_dir, verify

H = 16
META = StoreMeta(hidden_size=H, aux_layers=(1, 3, 4))


def make_samples(n: int, seed: int = 0):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    samples, states = [], []
    for i in range(n):
        length = rng.randint(3, 40)
        ids = [rng.randrange(1000) for _ in range(length)]
        mask = [rng.randint(0, 1) for _ in range(length)]
        samples.append(TokenizedSample(f"{i:016x}", ids, mask, False))
        states.append(CapturedStates(torch.randn(length, 3 * H, generator=gen), torch.randn(length, H, generator=gen)))
    return samples, states


def write_store(store_dir, samples, states, chunk_bytes=4096, batch=5, shard=0):
    writer = ShardWriter(store_dir, shard, META, chunk_bytes=chunk_bytes)
    for i in range(0, len(samples), batch):
        writer.add_batch(samples[i : i + batch], states[i : i + batch])
    writer.close()
    return writer


def test_round_trip_random_access_and_shard_iteration(tmp_path):
    samples, states = make_samples(30)
    write_store(tmp_path, samples, states)
    store = HiddenStateStore(tmp_path)
    assert len(store) == 30 and store.num_tokens == sum(len(s.input_ids) for s in samples)
    for sample, state in random.Random(1).sample(list(zip(samples, states)), 10):
        got = store[sample.sample_id]
        assert got["input_ids"].tolist() == sample.input_ids
        assert got["loss_mask"].tolist() == sample.loss_mask
        assert torch.equal(got["aux_hidden_states"], state.aux_hidden_states.bfloat16())
        assert torch.equal(got["last_hidden_state"], state.last_hidden_state.bfloat16())
    assert [sid for sid, _ in store.iter_shard(0)] == [s.sample_id for s in samples]

    stats = verify(tmp_path)
    assert stats["samples"] == 30 and stats["chunks"] > 1 and stats["hidden_size"] == H
    assert stats["aux_layers"] == [1, 3, 4]
    payload = META.bytes_per_token
    assert payload <= stats["bytes_per_token"] < payload * 1.5  # small chunks here: headers weigh more


def test_chunks_hold_whole_batches(tmp_path):
    samples, states = make_samples(20)
    write_store(tmp_path, samples, states, chunk_bytes=1, batch=4)  # every batch overflows a chunk
    records = [json.loads(line) for line in (shard_dir(tmp_path, 0) / "manifest.jsonl").read_text().splitlines()]
    assert [len(r["samples"]) for r in records] == [4] * 5


def test_digest_ignores_chunking_but_not_content(tmp_path):
    samples, states = make_samples(25)
    write_store(tmp_path / "a", samples, states, chunk_bytes=2048, batch=3)
    write_store(tmp_path / "b", samples, states, chunk_bytes=1 << 20, batch=7)
    assert digest(tmp_path / "a") == digest(tmp_path / "b")
    states[7].aux_hidden_states[2, 5] += 1.0
    write_store(tmp_path / "c", samples, states)
    assert digest(tmp_path / "c") != digest(tmp_path / "a")


def test_crash_leftovers_are_ignored_by_readers_and_cleaned_by_the_next_writer(tmp_path):
    samples, states = make_samples(20)
    write_store(tmp_path, samples[:10], states[:10])
    sdir = shard_dir(tmp_path, 0)
    before = digest(tmp_path)
    # What a kill -9 can leave: a temp file mid-write, a renamed chunk whose manifest line never came,
    # and a torn manifest line.
    (sdir / ".chunk-000099.safetensors.tmp-4242").write_bytes(b"partial")
    (sdir / "chunk-000099.safetensors").write_bytes((sdir / "chunk-000000.safetensors").read_bytes())
    with open(sdir / "manifest.jsonl", "a") as f:
        f.write('{"chunk": "chunk-000099.safetensors", "bytes": 12, "sam')

    assert digest(tmp_path) == before and verify(tmp_path)["samples"] == 10  # readers see only the manifest

    writer = ShardWriter(tmp_path, 0, META, chunk_bytes=4096)
    assert not (sdir / "chunk-000099.safetensors").exists()
    assert not list(sdir.glob(".*tmp-*"))
    assert (sdir / "manifest.jsonl").read_text().endswith("\n")
    assert len(writer.done_ids) == 10
    writer.add_batch(samples[10:], states[10:])
    writer.close()
    assert verify(tmp_path)["samples"] == 20


def test_non_finite_samples_are_rejected_recorded_and_counted(tmp_path):
    samples, states = make_samples(6)
    states[2].aux_hidden_states[0, 0] = float("nan")
    states[4].last_hidden_state[1, 1] = float("inf")
    writer = ShardWriter(tmp_path, 0, META)
    assert writer.add_batch(samples, states) == 2
    writer.close()
    stats = verify(tmp_path)
    assert stats["samples"] == 4 and stats["rejected"] == 2
    reopened = ShardWriter(tmp_path, 0, META)
    assert reopened.is_done(samples[2].sample_id)  # a resumed run does not compute it again
    assert reopened.rejected[samples[4].sample_id] == "non-finite hidden state"
    reopened.release()


def test_two_writers_cannot_share_a_shard(tmp_path):
    first = ShardWriter(tmp_path, 0, META)
    with pytest.raises(StoreError, match="another process is writing this shard"):
        ShardWriter(tmp_path, 0, META)
    first.release()
    ShardWriter(tmp_path, 0, META).release()


def test_a_store_for_other_layers_is_refused(tmp_path):
    ShardWriter(tmp_path, 0, META).release()
    with pytest.raises(StoreError, match=r"aux_layers=\[1, 3, 4\].*asks for .*aux_layers=\[1, 2, 4\]"):
        ShardWriter(tmp_path, 0, StoreMeta(H, (1, 2, 4)))


def test_verify_reports_missing_and_damaged_chunks(tmp_path):
    samples, states = make_samples(20)
    write_store(tmp_path, samples, states)
    sdir = shard_dir(tmp_path, 0)
    (sdir / "chunk-000000.safetensors").unlink()
    damaged = sdir / "chunk-000001.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:100])
    with pytest.raises(StoreError) as info:
        verify(tmp_path)
    assert "chunk-000000.safetensors: in the manifest but missing" in str(info.value)
    assert "chunk-000001.safetensors" in str(info.value)


def test_wrong_shapes_are_refused_before_they_reach_disk(tmp_path):
    samples, states = make_samples(1)
    states[0].aux_hidden_states = states[0].aux_hidden_states[:, :H]
    writer = ShardWriter(tmp_path, 0, META)
    with pytest.raises(StoreError, match="do not match hidden_size=16 with 3 aux layers"):
        writer.add_batch(samples, states)
    writer.release()
