"""A lineage's drafters: measured on one pinned set, the better one promoted, the current one switched atomically."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.config import write_run_config
from eagle3.data import conversation_id_of
from eagle3.evaluate import run_evaluate
from eagle3.export import run_export
from eagle3.model import build_draft_model
from eagle3.promote import Lineage, check_inputs, promote_held, weights_digest
from eagle3.train import Trainer, checkpoint_dirs, is_validation, load_checkpoint, load_warm_start

EVALUATE = {"num_prompts": 6, "max_new_tokens": 16, "draft_lengths": [3]}


def run_like(trained, make_config, name: str, noise: float = 0.0, **evaluate):
    """A run of the same lineage with the trained run's drafter (its weights disturbed by `noise`: a worse one)."""
    shutil.copytree(trained.run_dir, trained.run_dir.with_name(name),  # all but its config.json, written below
                    ignore=lambda directory, names: ["config.json"] if directory == str(trained.run_dir) else [])
    cfg = make_config(run_name=name, evaluate={**EVALUATE, **evaluate},
                      **{k: trained.model_dump()[k] for k in ("train", "vocab", "extract")})
    write_run_config(cfg)
    if noise:
        weights_file = cfg.run_dir / "drafter" / "model.safetensors"
        weights = load_file(weights_file)
        generator = torch.Generator().manual_seed(0)
        for name_, w in weights.items():
            if w.dim() == 2 and w.is_floating_point():
                weights[name_] = w + noise * w.float().std() * torch.randn(w.shape, generator=generator).to(w.dtype)
        save_file(weights, weights_file, metadata={"format": "pt"})
    return cfg


def test_the_better_drafter_is_promoted_on_the_pinned_set_and_a_worse_one_is_not(trained_config, make_config):
    run_export(trained_config)
    weak = run_like(trained_config, make_config, "weak", noise=3.0)
    first = run_evaluate(weak)["promotion"]
    assert first["promoted"] and "the lineage's first drafter" in first["reason"]
    lineage = Lineage(weak)
    assert lineage.current().name.startswith("weak-")
    pinned = lineage.eval_set()
    assert pinned["pinned_by"] == "weak" and len(pinned["prompts"]) == 6

    again = run_evaluate(weak)["promotion"]  # a retried evaluate: the same weights are the current ones already
    assert not again["promoted"] and "is the current one already" in again["reason"]

    good = run_like(trained_config, make_config, "good", num_prompts=20)  # another num_prompts: the pinned set wins
    report = run_evaluate(good)
    promotion = report["promotion"]
    assert report["prompts"] == 6 and promotion["eval_set_pinned_by"] == "weak"
    assert promotion["promoted"], promotion["reason"]
    assert promotion["current_before"]["version"].startswith("weak-")
    assert promotion["accept_length"]["3"] > promotion["current_before"]["accept_length"]["3"]
    assert lineage.current().name == promotion["version"] and lineage.current().name.startswith("good-")
    assert lineage.current().record["previous"]["version"].startswith("weak-")
    assert (lineage.current().path / "model.safetensors").read_bytes() == \
        (good.run_dir / "drafter" / "model.safetensors").read_bytes()

    # A later run with the same samples, vocab and settings would train this drafter again: nothing changed.
    check = check_inputs(good)
    assert (check["changed"], check["unchanged_since"], check["current"]) == (False, "good", promotion["version"])
    twin = run_like(trained_config, make_config, "twin").model_copy(update={"seed": 7})  # other inputs, same weights
    assert check_inputs(twin)["changed"]
    assert "is the current one already" in run_evaluate(twin)["promotion"]["reason"]
    assert (check_inputs(twin)["changed"], check_inputs(twin)["unchanged_since"]) == (False, "good")

    worse = run_like(trained_config, make_config, "worse", noise=3.0, keep_versions=1)
    promotion = run_evaluate(worse)["promotion"]
    assert not promotion["promoted"] and "not better at k=3" in promotion["reason"]
    assert promotion["current_before"]["accept_length"]["3"] == report["speculative"]["3"]["mean_accept_length"]
    assert lineage.current().name.startswith("good-")

    better_by_a_margin = run_like(trained_config, make_config, "strict", noise=0.01, promote_margin=5.0)
    assert not run_evaluate(better_by_a_margin)["promotion"]["promoted"]  # no drafter is 5 tokens better


def test_a_promotion_held_for_approval_switches_only_when_promoted_and_never_over_a_newer_drafter(
        trained_config, make_config):
    """The deployment's approve_promotion: `evaluate --hold-promotion` decides but switches nothing; `lineage promote`
    (after the approval) switches and rewrites the report, and a retry of it changes nothing. A held promotion whose
    measured-against drafter was replaced meanwhile is not made: it no longer compares with what is current."""
    run_export(trained_config)
    first = run_like(trained_config, make_config, "first", noise=3.0)
    lineage = Lineage(first)
    held = run_evaluate(first, hold_promotion=True)["promotion"]
    assert (held["promoted"], held["pending_approval"]) == (False, True) and lineage.current() is None
    promoted = promote_held(first)
    assert promoted["promoted"] and promoted["reason"].endswith("; approved")
    assert lineage.current().name == promoted["version"] and lineage.current().record["approved"] is True
    report = json.loads((first.run_dir / "evaluate" / "report.json").read_text())
    assert report["promotion"] == promoted
    assert promote_held(first) == promoted  # a retried promote task

    good = run_like(trained_config, make_config, "good")
    assert run_evaluate(good, hold_promotion=True)["promotion"]["pending_approval"]
    other = run_like(trained_config, make_config, "other", noise=0.5)  # measured and promoted while good waits
    assert run_evaluate(other)["promotion"]["promoted"]
    late = promote_held(good)
    assert not late["promoted"] and "another run promoted a drafter since" in late["reason"]
    assert lineage.current().name.startswith("other-")
    with pytest.raises(ValueError, match="held no promotion for approval"):  # settled: nothing is pending any more
        promote_held(good)


def test_old_versions_beyond_keep_versions_are_removed(trained_config, make_config):
    run_export(trained_config)
    lineage = Lineage(trained_config)
    run_evaluate(run_like(trained_config, make_config, "old", noise=3.0, keep_versions=1))
    assert [p.name.split("-")[0] for p in (lineage.dir / "versions").iterdir()] == ["old"]
    assert run_evaluate(run_like(trained_config, make_config, "new", keep_versions=1))["promotion"]["promoted"]
    assert [p.name.split("-")[0] for p in (lineage.dir / "versions").iterdir()] == ["new"]
    assert lineage.current().name.startswith("new-") and (lineage.current().path / "model.safetensors").exists()


def test_training_leaves_the_pinned_evaluation_prompts_out(trained_config, make_config):
    """Pinned from a wide validation split, then trained with a narrow one: the pinned prompts stay untrained."""
    run_export(trained_config)
    wide = run_like(trained_config, make_config, "wide-split", num_prompts=12)
    wide = wide.model_copy(update={"train": wide.train.model_copy(update={"val_fraction": 0.5})})
    run_evaluate(wide)
    pinned = set(Lineage(wide).eval_set()["conversation_ids"])
    assert any(not is_validation(sid, trained_config.train.val_fraction) for sid in pinned)  # else nothing to test
    trained_ids = {conversation_id_of(sid) for sid, _ in Trainer(trained_config).train_ids}
    assert trained_ids and not trained_ids & pinned


def promote_by_hand(cfg, drafter_dir, run_name: str, expected_current: str | None):
    """Make `drafter_dir` the lineage's current drafter without measuring it (the warm-start tests' setup)."""
    record = {"run": run_name, "weights_sha256": weights_digest(drafter_dir), "accept_length": {},
              "promoted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    return Lineage(cfg).promote(drafter_dir, run_name, record, keep=5, expected_current=expected_current)


def test_a_warm_start_begins_from_the_current_drafter_and_every_try_from_the_same_one(trained_config, make_config):
    """train.init_from current: training starts from the lineage's promoted drafter (its first step's loss is
    already far below a fresh start's), and the weights it starts from are the ones its first try pinned: a try
    that found no checkpoint after `current` moved on trains the same drafter bit for bit."""
    run_export(trained_config)
    current = promote_by_hand(trained_config, trained_config.run_dir / "drafter", "train", None)
    warm = run_like(trained_config, make_config, "warm")
    for made_by_the_trained_run in ("train", "drafter"):
        shutil.rmtree(warm.run_dir / made_by_the_trained_run)
    warm = warm.model_copy(update={"train": warm.train.model_copy(update={"init_from": "current", "epochs": 1})})

    summary = Trainer(warm).run()
    assert summary["started_from"] == current.name
    pinned = json.loads((warm.run_dir / "train" / "init" / "init.json").read_text())
    assert pinned["version"] == current.name and pinned["weights_sha256"] == weights_digest(current.path)

    def first_loss(run_dir):
        return next(r["loss"] for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()
                    if "loss" in (r := json.loads(line)))

    scratch, warmed = first_loss(trained_config.run_dir), first_loss(warm.run_dir)
    print(f"first step's loss: {scratch:.3f} from scratch, {warmed:.3f} warm-started from {current.name}")
    assert warmed < 0.7 * scratch
    finished = load_checkpoint(checkpoint_dirs(warm.run_dir / "train" / "checkpoints")[-1])["model"]

    # A crash before the first checkpoint, and meanwhile another drafter was promoted: the retry starts over from
    # the pinned weights, not from the new current drafter.
    other = run_like(trained_config, make_config, "other", noise=3.0)
    assert promote_by_hand(trained_config, other.run_dir / "drafter", "other", current.name) is not None
    for made_by_the_first_try in ("checkpoints", "metrics.jsonl", "summary.json", "tensorboard"):
        path = warm.run_dir / "train" / made_by_the_first_try
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    assert Trainer(warm).run()["started_from"] == current.name
    again = load_checkpoint(checkpoint_dirs(warm.run_dir / "train" / "checkpoints")[-1])["model"]
    assert all(torch.equal(finished[key], again[key]) for key in finished)


def test_a_warm_start_takes_each_draft_vocab_row_by_the_token_it_stands_for(trained_config):
    """A rebuilt vocab mapping may hold other tokens, in other rows: lm_head rows follow their tokens, and a token
    new to the draft vocabulary keeps its fresh row; every other weight is copied as it is."""
    run_export(trained_config)
    exported = load_file(trained_config.run_dir / "drafter" / "model.safetensors")
    old_ids = exported["d2t"] + torch.arange(len(exported["d2t"]))
    unused = sorted(set(range(trained_config.target.vocab_size)) - set(old_ids.tolist()))[:3]
    new_ids = torch.tensor(sorted([*old_ids.tolist()[3:], *unused]))  # three tokens out, three new ones in
    draft = build_draft_model(trained_config.target.model_path, trained_config.vocab.draft_vocab_size,
                              trained_config.resolved_aux_layers(), trained_config.drafter.model_dump())
    fresh = draft.lm_head.weight.detach().clone()

    taken = load_warm_start(draft, exported, new_ids)
    assert taken == len(new_ids) - 3
    old_row = {int(token): row for row, token in enumerate(old_ids)}
    for row, token in enumerate(new_ids.tolist()):
        expected = exported["lm_head.weight"][old_row[token]].float() if token in old_row else fresh[row]
        assert torch.equal(draft.lm_head.weight[row], expected), (row, token)
    assert torch.equal(draft.fc.weight, exported["fc.weight"].float())
