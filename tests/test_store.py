"""The hidden-state store: round trip, crash leftovers, rejected samples, locking, verify and digest; bf16 and fp8."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from eagle3.capture import CapturedStates
from eagle3.data.samples import TokenizedSample
from eagle3.data.store import HiddenStateStore, ShardWriter, StoreError, StoreMeta, digest, shard_dir, verify

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


@pytest.mark.parametrize("state_dtype", ["bf16", "fp8_e4m3"])
def test_non_finite_samples_are_rejected_recorded_and_counted(tmp_path, state_dtype):
    """fp8 too, before quantising: a scale would turn inf into a finite payload with an inf scale, or hide a NaN."""
    samples, states = make_samples(6)
    states[2].aux_hidden_states[0, 0] = float("nan")
    states[4].last_hidden_state[1, 1] = float("inf")
    writer = ShardWriter(tmp_path, 0, StoreMeta(hidden_size=H, aux_layers=(1, 3, 4), state_dtype=state_dtype))
    assert writer.add_batch(samples, states) == 2
    writer.close()
    stats = verify(tmp_path)
    assert stats["samples"] == 4 and stats["rejected"] == 2
    reopened = ShardWriter(tmp_path, 0, StoreMeta(hidden_size=H, aux_layers=(1, 3, 4), state_dtype=state_dtype))
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


@pytest.mark.parametrize(
    "chunk",
    ["../../etc/passwd", "/etc/passwd", "chunk-000000.safetensors/../../../x", 7],
    ids=["relative", "absolute", "through-a-chunk", "not-a-name"],
)
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
    assert_refused(
        tmp_path / "store",
        manifest,
        '"chunk" chunk-000000.safetensors is a symlink to',
        str(outside),
        "outside its shard directory",
    )


@pytest.mark.parametrize(
    "change, fragment",
    [
        (set_length(-5), '"samples"[0] (0000000000000000) has length -5, not a non-negative integer'),
        (set_length("12"), "has length '12', not a non-negative integer"),
        (set_length(3.5), "has length 3.5, not a non-negative integer"),
        (set_length(True), "has length True, not a non-negative integer"),  # bool is an int to Python, not here
        (set_field("bytes", -1), '"bytes" is -1, not a non-negative integer'),
        (set_field("bytes", "4096"), "\"bytes\" is '4096', not a non-negative integer"),
        (set_field("samples", {"0000000000000000": 12}), '"samples" is {'),
        (lambda record: record.pop("rejected"), 'the field "rejected" is missing'),
        (set_length(10**9), "less than its"),  # more tokens than the chunk's bytes can hold at hidden_size 16
    ],
    ids=[
        "negative-length",
        "string-length",
        "float-length",
        "bool-length",
        "negative-bytes",
        "string-bytes",
        "samples-not-a-list",
        "missing-field",
        "length-past-the-chunk",
    ],
)
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
    with pytest.raises(
        StoreError,
        match=r"chunk-000000.safetensors: its offsets disagree with the manifest's sample "
        r"lengths; delete the shard directory .* and run extract again",
    ):
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
        with pytest.raises(
            StoreError,
            match=rf"store.json: hidden_size is {re.escape(repr(bad))}, not a positive "
            r"integer; delete the store directory .* and run extract again",
        ):
            HiddenStateStore(tmp_path)
    meta_path.write_text(json.dumps(raw | {"hidden_size": H // 2}))
    with pytest.raises(
        StoreError,
        match=r"aux_hidden_states is BF16 \[\d+, 48\], but .* at hidden_size 8 with 3 "
        r"aux layers make it BF16 \[\d+, 24\]",
    ):
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


# -- fp8 stores (extract.state_dtype fp8_e4m3): a float8_e4m3fn payload with a float32 scale per token and layer ------

FP8_META = StoreMeta(hidden_size=H, aux_layers=(1, 3, 4), state_dtype="fp8_e4m3")


def write_fp8_store(store_dir, samples, states, chunk_bytes=4096, batch=5):
    writer = ShardWriter(store_dir, 0, FP8_META, chunk_bytes=chunk_bytes)
    for i in range(0, len(samples), batch):
        writer.add_batch(samples[i : i + batch], states[i : i + batch])
    writer.close()


def spread_magnitudes(states, seed=0):
    """Each token's layers scaled by factors from 1e-4 to 1e4, chosen apart, and a few rows zeroed: a scale
    shared by more than one token's layer would flush the small rows to zero."""
    gen = torch.Generator().manual_seed(seed)
    for state in states:
        for name in ("aux_hidden_states", "last_hidden_state"):
            rows = getattr(state, name).view(len(state.aux_hidden_states), -1, H)
            rows *= 10.0 ** (torch.rand(rows.shape[:2], generator=gen) * 8 - 4).unsqueeze(-1)
        state.aux_hidden_states[0, H : 2 * H] = 0.0  # one aux layer of one token all zeros
        state.last_hidden_state[-1] = 0.0
    return states


def layer_rows(tensor):
    return tensor.float().reshape(len(tensor), -1, H)


def test_fp8_round_trip_is_within_half_a_step_of_each_token_layers_amax(tmp_path):
    """Every value comes back within e4m3's half step at the top of the range (16 of 448, 1/28) of its token
    layer's amax, as float32; zero rows come back as zeros, not NaN; ids and masks are exact; shard iteration
    reads what random access reads."""
    samples, states = make_samples(30)
    spread_magnitudes(states)
    write_fp8_store(tmp_path, samples, states)
    store = HiddenStateStore(tmp_path)
    worst = 0.0
    for sample, state in zip(samples, states):
        got = store[sample.sample_id]
        assert got["input_ids"].tolist() == sample.input_ids and got["loss_mask"].tolist() == sample.loss_mask
        for name in ("aux_hidden_states", "last_hidden_state"):
            want = layer_rows(getattr(state, name).bfloat16())  # what the capture hands over, in bf16
            assert got[name].dtype == torch.float32 and got[name].shape == getattr(state, name).shape
            error = (layer_rows(got[name]) - want).abs().amax(-1)
            amax = want.abs().amax(-1)
            assert torch.isfinite(layer_rows(got[name])).all()
            assert torch.all(error[amax == 0] == 0), "a zero row must dequantize to zeros"
            worst = max(worst, float((error[amax > 0] / amax[amax > 0]).max()))
    assert 0 < worst <= 1 / 28 + 1e-6, worst
    by_id = dict(store.iter_shard(0))
    assert list(by_id) == [s.sample_id for s in samples]
    for sample in samples[:5]:
        for name, tensor in store[sample.sample_id].items():
            assert torch.equal(by_id[sample.sample_id][name], tensor), name


def test_fp8_chunks_hold_the_payload_and_one_scale_per_token_and_layer(tmp_path):
    """The on-disk contract: float8_e4m3fn states, float32 scales [N, 3] and [N, 1], each layer's largest |value|
    stored as +-448, store.json naming the dtype, verify's stats naming it too."""
    samples, states = make_samples(10)
    spread_magnitudes(states)
    write_fp8_store(tmp_path, samples, states)
    assert json.loads((tmp_path / "store.json").read_text())["dtype"] == "float8_e4m3fn"
    store = HiddenStateStore(tmp_path)
    assert store.meta == FP8_META
    stored = store.stored(samples[3].sample_id)
    n = len(samples[3].input_ids)
    assert stored["aux_hidden_states"].dtype == stored["last_hidden_state"].dtype == torch.float8_e4m3fn
    assert stored["aux_scales"].dtype == stored["last_scale"].dtype == torch.float32
    assert stored["aux_scales"].shape == (n, 3) and stored["last_scale"].shape == (n, 1)
    top = layer_rows(stored["aux_hidden_states"]).abs().amax(-1)
    nonzero = layer_rows(states[3].aux_hidden_states).abs().amax(-1) > 0
    assert torch.all(top[nonzero] == 448) and torch.all(stored["aux_scales"] > 0)
    stats = verify(tmp_path)
    assert stats["state_dtype"] == "fp8_e4m3" and stats["samples"] == 10
    assert FP8_META.bytes_per_token <= stats["bytes_per_token"] < FP8_META.bytes_per_token * 1.5


@pytest.mark.parametrize("existing, asked", [("bf16", "fp8_e4m3"), ("fp8_e4m3", "bf16")])
def test_a_store_of_the_other_dtype_is_refused_never_mixed(tmp_path, existing, asked):
    samples, states = make_samples(5)
    writer = ShardWriter(tmp_path, 0, StoreMeta(H, (1, 3, 4), existing))
    writer.add_batch(samples, states)
    writer.close()
    before = digest(tmp_path)
    for shard in (0, 1):  # the shard it wrote, and one not begun yet
        with pytest.raises(StoreError) as info:
            ShardWriter(tmp_path, shard, StoreMeta(H, (1, 3, 4), asked))
        message = str(info.value)
        assert message.startswith(f"{tmp_path}: holds {existing} hidden states"), message
        assert f"extract.state_dtype is {asked}" in message and "never mixes two dtypes" in message
        assert f"Set extract.state_dtype back to {existing}" in message and f"delete {tmp_path}" in message
    assert digest(tmp_path) == before and verify(tmp_path)["state_dtype"] == existing
    assert not shard_dir(tmp_path, 1).joinpath("manifest.jsonl").exists()


def rewrite_chunk(path, change):
    """Rewrite a chunk with `change(tensors)` applied, keeping its metadata (and so its size): a bad disk or a hand
    that edits the bytes, the manifest none the wiser."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
        metadata = f.metadata()
    change(tensors)
    save_file(tensors, str(path), metadata=metadata)


def set_value(name, value, at=(2, 1)):
    def change(tensors):
        if tensors[name].dtype == torch.float8_e4m3fn:  # e4m3fn's NaN is the bit pattern 0x7f
            tensors[name].view(torch.uint8)[at] = value
        else:
            tensors[name][at] = value

    return change


@pytest.mark.parametrize(
    "change, fragment",
    [
        (set_value("aux_scales", 0.0), "aux_scales has 1 scale(s) not finite and > 0 (first: token 2, layer 1: 0.0)"),
        (set_value("aux_scales", -0.5), "aux_scales has 1 scale(s) not finite and > 0 (first: token 2, layer 1: -0.5)"),
        (
            set_value("last_scale", float("nan"), (4, 0)),
            "last_scale has 1 scale(s) not finite and > 0 (first: token 4, layer 0: nan)",
        ),
        (set_value("last_scale", float("inf"), (0, 0)), "last_scale has 1 scale(s) not finite and > 0 (first: token 0"),
        (set_value("aux_hidden_states", 0x7F), "aux_hidden_states has NaN"),
        (
            lambda tensors: tensors.pop("last_scale"),
            "tensors ['aux_hidden_states', 'aux_scales', 'input_ids', "
            "'last_hidden_state', 'loss_mask', 'offsets'], expected [",
        ),
        (
            lambda tensors: tensors.update(aux_scales=tensors["aux_scales"][:, :2].contiguous()),
            "shapes do not agree with",
        ),
        (
            lambda tensors: tensors.update(aux_scales=tensors["aux_scales"].double()),
            "aux_scales is torch.float64, expected torch.float32",
        ),
    ],
    ids=[
        "zero-scale",
        "negative-scale",
        "nan-scale",
        "inf-scale",
        "nan-payload",
        "scales-missing",
        "scales-short",
        "scales-float64",
    ],
)
def test_verify_checks_the_fp8_scales_and_payload(tmp_path, change, fragment):
    samples, states = make_samples(10)
    write_fp8_store(tmp_path, samples, states, chunk_bytes=1 << 20)
    chunk = shard_dir(tmp_path, 0) / "chunk-000000.safetensors"
    verify(tmp_path)
    rewrite_chunk(chunk, change)
    with pytest.raises(StoreError) as info:
        verify(tmp_path)
    assert f"{chunk}: {fragment}" in str(info.value), str(info.value)


@pytest.mark.slow
def test_fp8_digest_covers_payload_and_scales_and_ignores_chunking(tmp_path):
    samples, states = make_samples(25)
    write_fp8_store(tmp_path / "a", samples, states, chunk_bytes=2048, batch=3)
    write_fp8_store(tmp_path / "b", samples, states, chunk_bytes=1 << 20, batch=7)
    write_store(tmp_path / "bf16", samples, states)
    assert digest(tmp_path / "a") == digest(tmp_path / "b") != digest(tmp_path / "bf16")
    chunk = shard_dir(tmp_path / "b", 0) / "chunk-000000.safetensors"

    def double_a_scale(tensors):  # still a valid scale: only the digest can tell
        tensors["last_scale"][3, 0] *= 2

    rewrite_chunk(chunk, double_a_scale)
    verify(tmp_path / "b")
    assert digest(tmp_path / "b") != digest(tmp_path / "a")


def test_fp8_store_resumed_after_a_kill_9_has_the_digest_of_an_uninterrupted_one(tmp_path):
    """What a kill -9 leaves (a batch pending in memory, a temp file mid-write, a renamed chunk whose manifest line
    never came, a torn line), then a new writer that recovers the shard and writes the batches not recorded, as
    extract does: the digest, payload bits and scales alike, equals an uninterrupted store's, chunked otherwise.
    (tests/faults/test_fault_extract_kill.py kills real fp8 extract jobs.)"""
    samples, states = make_samples(40)
    spread_magnitudes(states)
    batches = [(samples[i : i + 5], states[i : i + 5]) for i in range(0, 40, 5)]
    killed = ShardWriter(tmp_path / "killed", 0, FP8_META, chunk_bytes=1)  # a chunk per batch
    for batch in batches[:3]:
        killed.add_batch(*batch)
    killed.chunk_tokens = 1 << 30  # the fourth batch is still pending when the process dies
    killed.add_batch(*batches[3])
    killed.release()
    sdir = shard_dir(tmp_path / "killed", 0)
    (sdir / ".chunk-000003.safetensors.tmp-4242").write_bytes(b"partial")
    (sdir / "chunk-000003.safetensors").write_bytes((sdir / "chunk-000000.safetensors").read_bytes())
    with open(sdir / "manifest.jsonl", "a") as f:
        f.write('{"chunk": "chunk-000003.safetensors", "bytes": 12, "sam')

    writer = ShardWriter(tmp_path / "killed", 0, FP8_META, chunk_bytes=1)
    assert len(writer.done_ids) == 15
    for batch in batches:
        if not all(writer.is_done(s.sample_id) for s in batch[0]):
            writer.add_batch(*batch)
    writer.close()
    write_fp8_store(tmp_path / "clean", samples, states, chunk_bytes=1 << 20, batch=5)
    assert verify(tmp_path / "killed")["samples"] == 40
    assert digest(tmp_path / "killed") == digest(tmp_path / "clean")


def test_fp8_takes_about_half_the_bytes_of_bf16_at_kimi_width(tmp_path):
    """At hidden size 7168 (Kimi-K2.5, DeepSeek-V3), from the chunks' real sizes on disk: (4H + 16 + 5) / (8H + 5)
    is 0.5003 per token; headers add a little to both."""
    h = 7168
    gen = torch.Generator().manual_seed(0)
    samples = [TokenizedSample(f"{i:016x}", list(range(40)), [1] * 40, False) for i in range(4)]
    states = [CapturedStates(torch.randn(40, 3 * h, generator=gen), torch.randn(40, h, generator=gen)) for _ in samples]
    sizes = {}
    for dtype in ("bf16", "fp8_e4m3"):
        writer = ShardWriter(tmp_path / dtype, 0, StoreMeta(h, (1, 3, 4), dtype), chunk_bytes=1 << 30)
        writer.add_batch(samples, states)
        writer.close()
        stats = verify(tmp_path / dtype)
        assert stats["tokens"] == 160 and stats["chunks"] == 1
        sizes[dtype] = stats["bytes"]
    ratio = sizes["fp8_e4m3"] / sizes["bf16"]
    assert 0.5 < ratio <= 0.51, (ratio, sizes)
