"""Vocab mapping: selection by hand-computed examples, SGLang's d2t offsets, and checked reuse."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eagle3.stages.extract import run_extract
from eagle3.stages.vocab import VocabError, VocabMapping, load_mapping, run_vocab, select_draft_vocab
from tests.conftest import run_eagle3


def test_most_frequent_ids_sorted_ascending_ties_to_the_lower_id():
    counts = np.array([0, 5, 9, 0, 5, 1, 9, 0])
    mapping = select_draft_vocab(counts, 4)
    # 9 (ids 2, 6), then 5 (ids 1, 4): four ids; 5 (count 1) is left out.
    assert mapping.draft_ids.tolist() == [1, 2, 4, 6]
    assert mapping.d2t().tolist() == [1, 1, 2, 3]  # target id = draft id + d2t
    assert mapping.t2d(8).tolist() == [False, True, True, False, True, False, True, False]
    assert mapping.coverage(counts) == pytest.approx(28 / 29)


def test_padded_with_the_lowest_unseen_ids_when_too_few_were_seen():
    counts = np.array([0, 0, 3, 0, 7, 0])
    assert select_draft_vocab(counts, 4).draft_ids.tolist() == [0, 1, 2, 4]


def test_d2t_round_trips_to_the_draft_ids():
    mapping = VocabMapping(np.array([0, 3, 4, 10, 11], dtype=np.int64))
    assert (mapping.d2t() + np.arange(5) == mapping.draft_ids).all()


@pytest.fixture
def extracted(make_config):
    cfg = make_config(run_name="source", vocab={"draft_vocab_size": 128})
    run_extract(cfg)
    return cfg


@pytest.mark.slow
def test_vocab_stage_writes_sglang_mapping_files(extracted):
    meta = run_vocab(extracted)
    out = extracted.run_dir / "vocab_mapping"
    d2t, t2d = np.load(out / "d2t.npy"), np.load(out / "t2d.npy")
    assert d2t.dtype == np.int64 and d2t.shape == (128,)
    assert t2d.dtype == np.bool_ and t2d.shape == (extracted.target.vocab_size,) and t2d.sum() == 128
    assert (np.flatnonzero(t2d) == d2t + np.arange(128)).all()
    assert json.loads((out / "meta.json").read_text()) == meta
    assert 0.9 < meta["coverage"] == meta["fresh_coverage"] <= 1.0
    assert meta["loss_tokens"] > 1000
    assert run_vocab(extracted) == meta  # a retry finds it done


@pytest.mark.slow
def test_reuse_is_checked_against_this_stores_coverage(extracted, make_config, tmp_path):
    run_vocab(extracted)
    source = str(extracted.run_dir / "vocab_mapping")
    ok = make_config(
        run_name="reuse-ok",
        workdir=extracted.run_dir.parents[1],
        vocab={"draft_vocab_size": 128, "reuse_from": source, "min_coverage": 0.5},
    )
    run_extract(ok)
    meta = run_vocab(ok)
    assert meta["reused_from"] == source and meta["coverage"] == meta["fresh_coverage"]

    strict = make_config(
        run_name="reuse-strict",
        workdir=extracted.run_dir.parents[1],
        vocab={"draft_vocab_size": 128, "reuse_from": source, "min_coverage": 0.999999},
    )
    run_extract(strict)
    with pytest.raises(VocabError) as info:
        run_vocab(strict)
    message = str(info.value)
    assert "below vocab.min_coverage (0.999999)" in message and "would cover" in message
    assert "Unset vocab.reuse_from" in message
    assert not (strict.run_dir / "vocab_mapping").exists()


@pytest.mark.slow
def test_reuse_of_a_mapping_with_other_sizes_is_refused(extracted, make_config):
    run_vocab(extracted)
    other = make_config(
        run_name="other-size",
        workdir=extracted.run_dir.parents[1],
        vocab={"draft_vocab_size": 64, "reuse_from": str(extracted.run_dir / "vocab_mapping")},
    )
    run_extract(other)
    with pytest.raises(VocabError, match="maps 128 of .* this run needs 64"):
        run_vocab(other)


@pytest.mark.slow
def test_cli_help_says_the_mapping_is_data_dependent():
    assert "data-dependent" in run_eagle3("vocab", "--help").stdout


@pytest.mark.slow
def test_loaded_mapping_equals_written(extracted):
    run_vocab(extracted)
    mapping, meta = load_mapping(extracted.run_dir / "vocab_mapping")
    assert len(mapping.draft_ids) == meta["draft_vocab_size"] == 128


@pytest.mark.slow
def test_the_draft_vocab_is_counted_on_training_samples_only(make_config):
    """Tokens of validation and evaluation answers are not counted: the draft vocabulary learns nothing from the
    conversations that pick the checkpoint or that evaluate measures."""
    from eagle3.data.store import open_run_store
    from eagle3.stages.split import TRAINING, run_split
    from eagle3.stages.vocab import count_tokens

    cfg = make_config(run_name="held-out", vocab={"draft_vocab_size": 128}, train={"val_fraction": 0.3})
    run_extract(cfg)
    meta = run_vocab(cfg)
    store = open_run_store(cfg)
    parts = run_split(cfg).parts(store.sample_ids)
    assert 0 < meta["training_samples"] == len(parts[TRAINING]) < len(store.sample_ids)
    training, everything = (count_tokens(store, cfg.target.vocab_size, ids) for ids in (parts[TRAINING], None))
    assert meta["loss_tokens"] == training.total < everything.total
    assert meta["source_tokens_digest"] == training.digest
