"""The hidden-state store: round trip, crash leftovers, rejected samples, locking, verify and digest."""

from __future__ import annotations

import json
import random
import re

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


# -- hostile stores: each file goes in as an attacker or a bad disk would leave it, and must be refused -----------


def tamper_manifest(store_dir, change):
    """Rewrite the first record of shard 0's manifest with `change(record)` applied; returns the manifest."""
    manifest = shard_dir(store_dir, 0) / "manifest.jsonl"
    first, *rest = manifest.read_text().splitlines()
    record = json.loads(first)
    change(record)
    manifest.write_text("".join(line + "\n" for line in [json.dumps(record), *rest]))
    return manifest


def set_field(name, value):
    return lambda record: record.update({name: value})


def set_length(value):
    def change(record):
        record["samples"][0][1] = value
    return change


def assert_refused(store_dir, manifest, *fragments):
    """Reader and writer both refuse the store, naming the manifest, the line, the field and the fix."""
    for open_store in (lambda: HiddenStateStore(store_dir), lambda: ShardWriter(store_dir, 0, META).release()):
        with pytest.raises(StoreError) as info:
            open_store()
        message = str(info.value)
        assert message.startswith(f"{manifest}: line 1: "), message
        assert f"delete the shard directory {manifest.parent} and run extract again" in message
        for fragment in fragments:
            assert fragment in message, message


@pytest.mark.parametrize("chunk", ["../../etc/passwd", "/etc/passwd", "chunk-000000.safetensors/../../../x", 7],
                         ids=["relative", "absolute", "through-a-chunk", "not-a-name"])
def test_a_manifest_naming_a_chunk_outside_its_shard_is_refused(tmp_path, chunk):
    """Attack: a manifest whose chunk is a path out of the store (relative, absolute, through a chunk's name) or
    not a name at all. Followed, it would mmap any file on the box as hidden states."""
    samples, states = make_samples(10)
    write_store(tmp_path, samples, states)
    manifest = tamper_manifest(tmp_path, set_field("chunk", chunk))
    assert_refused(tmp_path, manifest, f'"chunk" is {chunk!r}', "chunk-NNNNNN.safetensors")


def test_a_chunk_that_is_a_symlink_out_of_the_store_is_refused(tmp_path):
    """Attack: the manifest is intact, but its chunk file was replaced by a symlink to a file elsewhere."""
    samples, states = make_samples(10)
    write_store(tmp_path / "store", samples, states)
    chunk = shard_dir(tmp_path / "store", 0) / "chunk-000000.safetensors"
    outside = tmp_path / "elsewhere.safetensors"
    chunk.rename(outside)
    chunk.symlink_to(outside)
    manifest = chunk.parent / "manifest.jsonl"
    assert_refused(tmp_path / "store", manifest, '"chunk" chunk-000000.safetensors is a symlink to',
                   str(outside), "outside its shard directory")


@pytest.mark.parametrize("change, fragment", [
    (set_length(-5), '"samples"[0] (0000000000000000) has length -5, not a non-negative integer'),
    (set_length("12"), "has length '12', not a non-negative integer"),
    (set_length(3.5), "has length 3.5, not a non-negative integer"),
    (set_length(True), "has length True, not a non-negative integer"),  # bool is an int to Python, not here
    (set_field("bytes", -1), '"bytes" is -1, not a non-negative integer'),
    (set_field("bytes", "4096"), "\"bytes\" is '4096', not a non-negative integer"),
    (set_field("samples", {"0000000000000000": 12}), '"samples" is {'),
    (lambda record: record.pop("rejected"), 'the field "rejected" is missing'),
    (set_length(10**9), "less than its"),  # more tokens than the chunk's bytes can hold at hidden_size 16
], ids=["negative-length", "string-length", "float-length", "bool-length", "negative-bytes", "string-bytes",
        "samples-not-a-list", "missing-field", "length-past-the-chunk"])
def test_a_manifest_with_bad_counts_is_refused(tmp_path, change, fragment):
    """Attack: negative, fractional, string and boolean lengths and byte counts, a missing field, and a length
    the chunk cannot hold. Trusted, they would slice samples short, shifted or past the chunk."""
    samples, states = make_samples(10)
    write_store(tmp_path, samples, states)
    assert_refused(tmp_path, tamper_manifest(tmp_path, change), fragment)


def test_lengths_moved_between_samples_are_refused_when_the_chunk_is_read(tmp_path):
    """Attack: the manifest's lengths shuffled so the total still matches the chunk; the file's offsets are the
    witness, checked when the chunk is first opened (a digest would otherwise hash shifted samples silently)."""
    samples, states = make_samples(10)
    write_store(tmp_path, samples, states, chunk_bytes=1 << 20)

    def move_a_token(record):
        record["samples"][0][1] += 1
        record["samples"][1][1] -= 1

    tamper_manifest(tmp_path, move_a_token)
    store = HiddenStateStore(tmp_path)  # the manifest alone is consistent
    with pytest.raises(StoreError, match=r"chunk-000000.safetensors: its offsets disagree with the manifest's sample "
                                         r"lengths; delete the shard directory .* and run extract again"):
        store[samples[0].sample_id]
    with pytest.raises(StoreError, match="offsets disagree"):
        digest(tmp_path)


def test_a_store_json_that_lies_about_the_hidden_size_is_refused(tmp_path):
    """Attack: store.json's hidden_size rewritten (a string, a negative number, a smaller size). The first two
    are refused on open; the third by the chunk's tensor shapes when it is read, never reinterpreted."""
    samples, states = make_samples(5)
    write_store(tmp_path, samples, states)
    meta_path = tmp_path / "store.json"
    raw = json.loads(meta_path.read_text())
    for bad in ("16", -16, True):
        meta_path.write_text(json.dumps(raw | {"hidden_size": bad}))
        with pytest.raises(StoreError, match=rf"store.json: hidden_size is {re.escape(repr(bad))}, not a positive "
                                             r"integer; delete the store directory .* and run extract again"):
            HiddenStateStore(tmp_path)
    meta_path.write_text(json.dumps(raw | {"hidden_size": H // 2}))
    with pytest.raises(StoreError, match=r"aux_hidden_states is BF16 \[\d+, 48\], but .* at hidden_size 8 with 3 "
                                         r"aux layers make it BF16 \[\d+, 24\]"):
        HiddenStateStore(tmp_path)[samples[0].sample_id]


def test_a_refused_store_is_exit_2_with_one_line_of_error(tmp_path, capsys):
    """Attack, end to end: `store digest` on a store whose manifest escapes it prints the refusal, no traceback."""
    from eagle3.__main__ import main

    samples, states = make_samples(5)
    write_store(tmp_path, samples, states)
    manifest = tamper_manifest(tmp_path, set_field("chunk", "../../etc/passwd"))
    assert main(["store", "digest", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"error: {manifest}: line 1: \"chunk\" is '../../etc/passwd'" in err and "Traceback" not in err
