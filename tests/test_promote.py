"""A lineage's drafters: measured on one pinned set, the better one promoted, the current one switched atomically."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.config import ConfigError, write_run_config
from eagle3.data.samples import conversation_id_of
from eagle3.model.drafter import build_draft_model
from eagle3.records.checkpoint import checkpoint_dirs, load_checkpoint
from eagle3.records.lineage import Lineage, PromotionRefused, weights_digest
from eagle3.stages.evaluate import run_evaluate
from eagle3.stages.export import run_export
from eagle3.stages.promote import check_inputs, promote_held
from eagle3.stages.split import SPLIT_RULE
from eagle3.stages.train import Trainer, load_warm_start
from tests.conftest import run_eagle3

EVALUATE = {"num_prompts": 6, "max_new_tokens": 16, "draft_lengths": [3]}


def run_like(trained, make_config, name: str, noise: float = 0.0, **evaluate):
    """A run of the same lineage with the trained run's drafter (its weights disturbed by `noise`: a worse one)."""
    shutil.copytree(
        trained.run_dir,
        trained.run_dir.with_name(name),
        symlinks=True,  # all but its config.json
        ignore=lambda directory, names: ["config.json"] if directory == str(trained.run_dir) else [],
    )
    cfg = make_config(
        run_name=name,
        evaluate={**EVALUATE, **evaluate},
        **{k: trained.model_dump()[k] for k in ("train", "vocab", "extract")},
    )
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


@pytest.mark.slow
def test_the_better_drafter_is_promoted_on_the_pinned_set_and_a_worse_one_is_not(trained_config, make_config):
    run_export(trained_config)
    weak = run_like(trained_config, make_config, "weak", noise=3.0)
    first = run_evaluate(weak)["promotion"]
    assert first["promoted"] and "the lineage's first drafter" in first["reason"]
    lineage = Lineage(weak)
    assert lineage.current().name.startswith("weak-")
    pinned = lineage.eval_set()
    assert pinned["pinned_by"] == "weak" and len(pinned["prompts"]) == 6
    # Held-out prompts come from the whole data file (evaluate reads it all, not data.max_samples): the tiny
    # target's 6000 prompts at val_fraction 0.02 hold out enough later turns for half the set.
    assert pinned["kinds"] == ["first"] * 3 + ["later"] * 3 and pinned["split"] == SPLIT_RULE

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
    assert (lineage.current().path / "model.safetensors").read_bytes() == (
        good.run_dir / "drafter" / "model.safetensors"
    ).read_bytes()

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
    assert promotion["current_before"]["accept_length"]["3"] == report["speculative"]["3"]["accept_length"]
    assert lineage.current().name.startswith("good-")

    better_by_a_margin = run_like(trained_config, make_config, "strict", noise=0.01, promote_margin=5.0)
    assert not run_evaluate(better_by_a_margin)["promotion"]["promoted"]  # no drafter is 5 tokens better


@pytest.mark.slow
def test_a_promotion_held_for_approval_switches_only_when_promoted_and_never_over_a_newer_drafter(
    trained_config, make_config
):
    """The deployment's approve_promotion: `evaluate --hold-promotion` decides but switches nothing; `lineage promote`
    (after the approval) switches and rewrites the report, and a retry of it changes nothing. A held promotion whose
    measured-against drafter was replaced meanwhile is not made: it no longer compares with what is current."""
    run_export(trained_config)
    first = run_like(trained_config, make_config, "first", noise=3.0)
    lineage = Lineage(first)
    held = run_evaluate(first, hold_promotion=True)["promotion"]
    assert (held["promoted"], held["pending_approval"]) == (False, True) and lineage.current() is None
    promoted = promote_held(first, "alice", approved(first))
    assert promoted["promoted"] and promoted["reason"].endswith("; approved") and promoted["approved_by"] == "alice"
    assert lineage.current().name == promoted["version"] and lineage.current().record["approved"] is True
    assert lineage.current().record["approved_by"] == "alice"
    report = json.loads((first.run_dir / "evaluate" / "report.json").read_text())
    assert report["promotion"] == promoted
    again = promote_held(first, "alice", approved(first))  # a retried promote task
    assert again == {**promoted, "already_current": True, "reason": promoted["reason"] + "; already current"}
    assert json.loads((first.run_dir / "evaluate" / "report.json").read_text()) == report

    good = run_like(trained_config, make_config, "good")
    assert run_evaluate(good, hold_promotion=True)["promotion"]["pending_approval"]
    other = run_like(trained_config, make_config, "other", noise=0.5)  # measured and promoted while good waits
    assert run_evaluate(other)["promotion"]["promoted"]
    late = promote_held(good, "alice", approved(good))
    assert not late["promoted"] and "another run promoted a drafter since" in late["reason"]
    assert lineage.current().name.startswith("other-")
    with pytest.raises(ValueError, match="held no promotion for approval"):  # settled: nothing is pending any more
        promote_held(good, "alice", approved(good))


@pytest.mark.slow
def test_old_versions_beyond_keep_versions_are_removed(trained_config, make_config):
    run_export(trained_config)
    lineage = Lineage(trained_config)
    run_evaluate(run_like(trained_config, make_config, "old", noise=3.0, keep_versions=1))
    assert [p.name.split("-")[0] for p in (lineage.dir / "versions").iterdir()] == ["old"]
    assert run_evaluate(run_like(trained_config, make_config, "new", keep_versions=1))["promotion"]["promoted"]
    assert [p.name.split("-")[0] for p in (lineage.dir / "versions").iterdir()] == ["new"]
    assert lineage.current().name.startswith("new-") and (lineage.current().path / "model.safetensors").exists()


@pytest.mark.slow
def test_training_and_validation_leave_the_pinned_evaluation_prompts_out(trained_config, make_config):
    """Pinned from a wide split (first and later user turns), then trained with a narrow one: the pinned conversations,
    and every conversation that asks a pinned prompt, neither train nor pick the checkpoint."""
    from eagle3.data.samples import read_conversations
    from eagle3.stages.split import part_of_keys, run_split

    run_export(trained_config)
    wide = run_like(trained_config, make_config, "wide-split", num_prompts=12)
    wide = wide.model_copy(update={"train": wide.train.model_copy(update={"val_fraction": 0.5})})
    report = run_evaluate(wide)
    pinned = Lineage(wide).eval_set()
    assert pinned["format"] == 2 and report["prompts"] == len(pinned["prompts"]) == 12
    assert report["prompt_turns"] == {"first": pinned["kinds"].count("first"), "later": 6}
    keys = run_split(trained_config).keys
    narrow = trained_config.train.val_fraction
    assert any(part_of_keys(keys[sid], narrow) == "training" for sid in pinned["conversation_ids"])  # else no test
    conversations, _ = read_conversations(trained_config.conversations_path)
    asking = {c.sample_id for c in conversations if set(keys[c.sample_id]) & set(pinned["split_keys"])}
    assert set(pinned["conversation_ids"]) <= asking
    trainer = Trainer(trained_config)
    for ids in (trainer.train_ids, trainer.val_ids):
        assert ids and not {conversation_id_of(sid) for sid, _ in ids} & asking


def promote_by_hand(cfg, drafter_dir, run_name: str, expected_current: str | None):
    """Make `drafter_dir` the lineage's current drafter without measuring it (the warm-start tests' setup)."""
    record = {
        "run": run_name,
        "weights_sha256": weights_digest(drafter_dir),
        "accept_length": {},
        "promoted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    return Lineage(cfg).promote(drafter_dir, run_name, record, keep=5, expected_current=expected_current)


@pytest.mark.slow
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
        return next(
            r["loss"]
            for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()
            if "loss" in (r := json.loads(line))
        )

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


@pytest.mark.slow
def test_a_warm_start_takes_each_draft_vocab_row_by_the_token_it_stands_for(trained_config):
    """A rebuilt vocab mapping may hold other tokens, in other rows: lm_head rows follow their tokens, and a token
    new to the draft vocabulary keeps its fresh row; every other weight is copied as it is."""
    run_export(trained_config)
    exported = load_file(trained_config.run_dir / "drafter" / "model.safetensors")
    old_ids = exported["d2t"] + torch.arange(len(exported["d2t"]))
    unused = sorted(set(range(trained_config.target.vocab_size)) - set(old_ids.tolist()))[:3]
    new_ids = torch.tensor(sorted([*old_ids.tolist()[3:], *unused]))  # three tokens out, three new ones in
    draft = build_draft_model(
        trained_config.target.model_path,
        trained_config.vocab.draft_vocab_size,
        trained_config.resolved_aux_layers(),
        trained_config.drafter.model_dump(),
    )
    fresh = draft.lm_head.weight.detach().clone()

    taken = load_warm_start(draft, exported, new_ids)
    assert taken == len(new_ids) - 3
    old_row = {int(token): row for row, token in enumerate(old_ids)}
    for row, token in enumerate(new_ids.tolist()):
        expected = exported["lm_head.weight"][old_row[token]].float() if token in old_row else fresh[row]
        assert torch.equal(draft.lm_head.weight[row], expected), (row, token)
    assert torch.equal(draft.fc.weight, exported["fc.weight"].float())


# -- promotion as an attack: no approval, other bytes than were measured, links, foreign versions --------------------
# (No training needed: a promotion copies bytes, so a drafter of a few bytes and a hand-held proposal stand in.)


def held_drafter(cfg, files: dict[str, bytes] | None = None) -> Path:
    """RUN_DIR/drafter with `files`, measured and held for approval as `evaluate --hold-promotion` leaves it."""
    from eagle3.stages.promote import hold_for_approval

    drafter = cfg.run_dir / "drafter"
    for name, data in (files or {"config.json": b"{}", "model.safetensors": b"the measured weights"}).items():
        (drafter / name).parent.mkdir(parents=True, exist_ok=True)
        (drafter / name).write_bytes(data)
    record = {
        "run": cfg.run_name,
        "run_dir": str(cfg.run_dir),
        "weights_sha256": weights_digest(drafter),
        "accept_length": {"3": 2.5},
        "promoted_at": "2026-12-01T00:00:00Z",
        "reason": "first",
    }
    files = hold_for_approval(cfg, record, expected_current=None)
    report = {
        "promotion": {
            "promoted": False,
            "pending_approval": True,
            "reason": "the lineage's first drafter",
            "weights_sha256": record["weights_sha256"],
            "drafter_files_sha256": files,
        }
    }
    (cfg.run_dir / "evaluate" / "report.json").write_text(json.dumps(report))
    return drafter


def approved(cfg) -> str:
    """The drafter files an approval of the run's held promotion names (what the promotion DAG passes)."""
    return json.loads((cfg.run_dir / "evaluate" / "report.json").read_text())["promotion"]["drafter_files_sha256"]


@pytest.mark.slow
def test_lineage_promote_without_an_approver_is_refused_naming_the_flag(make_config):
    """Attack: `lineage promote` switched the lineage's drafter with no approval recorded at all."""
    cfg = make_config()
    write_run_config(cfg)
    held_drafter(cfg)
    proc = run_eagle3("lineage", "promote", "--config", str(cfg.config_path), check=False)
    assert proc.returncode == 2 and "the following arguments are required: --approved-by" in proc.stderr
    assert "--approved-files" in proc.stderr
    assert Lineage(cfg).current() is None
    with pytest.raises(ConfigError) as refused:
        promote_held(cfg, "eve\n", approved(cfg))  # a control character: not a user name Airflow gives
    assert refused.value.where == "--approved-by"
    assert Lineage(cfg).current() is None

    proc = run_eagle3(
        "lineage",
        "promote",
        "--config",
        str(cfg.config_path),
        "--approved-by",
        "alice",
        "--approved-files",
        approved(cfg),
    )
    assert json.loads(proc.stdout)["approved_by"] == "alice"
    assert Lineage(cfg).current().record["approved_by"] == "alice"


@pytest.mark.slow
def test_a_drafter_changed_after_it_was_measured_is_not_promoted(make_config):
    """Attack: the drafter's weights were swapped after evaluate measured them; promotion copied the drafter as it was
    then, while promotion.json kept the measured digest. Refused, naming the drafter and both digests; nothing
    switched, nothing left in versions/."""
    cfg = make_config()
    write_run_config(cfg)
    drafter = held_drafter(cfg)
    measured = weights_digest(drafter)
    (drafter / "model.safetensors").write_bytes(b"other weights, never measured")
    proc = run_eagle3(
        "lineage",
        "promote",
        "--config",
        str(cfg.config_path),
        "--approved-by",
        "alice",
        "--approved-files",
        approved(cfg),
        check=False,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (
        f"error: {drafter}: its weights are not the ones that were measured: model.safetensors has sha256 "
        f"{weights_digest(drafter)}, evaluate measured {measured}; nothing was promoted"
    ) in proc.stderr
    lineage = Lineage(cfg)
    assert lineage.current() is None and list((lineage.dir / "versions").iterdir()) == []

    # The weights put back, but another file of the drafter changed: every file's digest was held, not only the
    # weights'.
    (drafter / "model.safetensors").write_bytes(b"the measured weights")
    (drafter / "config.json").write_text('{"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}')
    with pytest.raises(
        PromotionRefused,
        match=rf"^{re.escape(str(drafter))}: config.json differ from what evaluate "
        "measured",
    ):
        promote_held(cfg, "alice", approved(cfg))
    assert lineage.current() is None


def test_a_proposal_rewritten_after_the_approval_is_not_promoted(make_config):
    """Attack (issue 43): after the Approve, the run's drafter/ and proposal.json were rewritten together, so that
    the copy matched the proposal and promoted other bytes as approved. The approval names the drafter's files
    (the held promotion's drafter_files_sha256, which its seal covers): a proposal of other files is refused."""
    cfg = make_config()
    write_run_config(cfg)
    drafter = held_drafter(cfg)
    approved_files = approved(cfg)
    held_drafter(cfg, {"config.json": b"{}", "model.safetensors": b"weights nobody approved"})  # drafter + proposal
    with pytest.raises(PromotionRefused, match="its drafter files are not the ones approved"):
        promote_held(cfg, "alice", approved_files)
    assert Lineage(cfg).current() is None
    with pytest.raises(ConfigError) as refused:
        promote_held(cfg, "alice", "x")
    assert refused.value.where == "--approved-files"
    assert (drafter / "model.safetensors").read_bytes() == b"weights nobody approved"


@pytest.mark.slow
def test_a_link_in_the_drafter_refuses_the_promotion_and_copies_nothing_it_points_at(make_config, tmp_path):
    """Attack: a link in the drafter directory (here in an engine's subdirectory) had its target, any file this user
    may read, copied into versions/ for everyone who deploys the lineage."""
    secret = tmp_path / "secret"
    secret.write_text("the box's private key")
    cfg = make_config()
    drafter = held_drafter(cfg, {"config.json": b"{}", "model.safetensors": b"weights", "vllm/config.json": b"{}"})
    (drafter / "vllm" / "tokenizer.json").symlink_to(secret)  # after evaluate measured it
    with pytest.raises(PromotionRefused) as refused:
        promote_held(cfg, "alice", approved(cfg))
    assert refused.value.where == str(drafter)
    assert refused.value.fact.startswith(f"{drafter / 'vllm' / 'tokenizer.json'}: a symbolic link")
    lineage = Lineage(cfg)
    assert lineage.current() is None and list((lineage.dir / "versions").iterdir()) == []

    (drafter / "vllm" / "tokenizer.json").unlink()
    os.mkfifo(drafter / "vllm" / "tokenizer.json")  # a FIFO would hang the copy; a device would copy its contents
    with pytest.raises(PromotionRefused) as refused:
        promote_held(cfg, "alice", approved(cfg))
    assert refused.value.fact.startswith(f"{drafter / 'vllm' / 'tokenizer.json'}: not a regular file")
    (drafter / "vllm" / "tokenizer.json").unlink()
    (drafter / "vllm" / "tokenizer.json").symlink_to(secret)

    # Measured with the link in place: not even proposed.
    with pytest.raises(PromotionRefused, match="a symbolic link"):
        held_drafter(cfg, {"config.json": b"{}", "model.safetensors": b"weights"})

    (drafter / "vllm" / "tokenizer.json").unlink()  # regular files in subdirectories are copied
    promoted = promote_held(cfg, "alice", approved(cfg))
    assert (lineage.current().path / "vllm" / "config.json").read_bytes() == b"{}"
    assert sorted(p.name for p in lineage.current().path.iterdir()) == [
        "config.json",
        "model.safetensors",
        "promotion.json",
        "vllm",
    ]
    assert promoted["version"] == lineage.current().name


def test_keep_versions_removes_only_this_lineages_own_versions(make_config, tmp_path, caplog):
    """Attack: whatever lay in versions/ was pruned (and a folder without promotion.json, or with a bad one, ended
    pruning with a traceback). Only directories whose promotion.json is this lineage's record of that very version
    go; the rest stay, each named in a warning."""
    cfg = make_config()
    lineage = Lineage(cfg)
    versions = lineage.dir / "versions"
    drafter = held_drafter(cfg)

    def promote_dated(run_name: str, promoted_at: str, expected_current: str | None):
        record = {"run": run_name, "weights_sha256": weights_digest(drafter), "promoted_at": promoted_at}
        return lineage.promote(drafter, run_name, record, keep=1, expected_current=expected_current)

    old = promote_dated("old", "2026-11-01T00:00:00Z", None)
    elsewhere = tmp_path / "elsewhere"  # a directory of someone's, reached through a link in versions/
    elsewhere.mkdir()
    (elsewhere / "promotion.json").write_text(json.dumps({**old.record, "version": "linked"}))
    (versions / "linked").symlink_to(elsewhere)
    strangers = {
        "no-record": None,
        "bad-record": "{not json",
        "foreign": json.dumps({**old.record, "version": "foreign", "lineage": "0123456789abcdef"}),
        "misnamed": json.dumps(old.record),
    }  # (its record names version old-...)
    for name, text in strangers.items():
        (versions / name).mkdir()
        if text is not None:
            (versions / name / "promotion.json").write_text(text)

    (drafter / "model.safetensors").write_bytes(b"newer weights")
    caplog.set_level("WARNING", logger="eagle3.records.lineage")
    new = promote_dated("new", "2026-12-01T00:00:00Z", old.name)  # keep_versions 1: the old one goes
    assert sorted(p.name for p in versions.iterdir()) == sorted([new.name, "linked", *strangers])
    assert (elsewhere / "promotion.json").exists()
    for name in ["linked", *strangers]:
        assert f"{versions / name}: kept, not pruned" in caplog.text
    assert "is of lineage '0123456789abcdef'" in caplog.text and f"describes version {old.name!r}" in caplog.text


def test_a_current_link_that_leads_out_of_versions_is_refused(make_config, tmp_path):
    """Attack: `current` pointed at a directory outside versions/, which train would warm-start from, evaluate
    measure against and a deployment serve."""
    cfg = make_config()
    lineage = Lineage(cfg)
    (lineage.dir / "current").symlink_to(tmp_path)
    with pytest.raises(
        PromotionRefused,
        match=f"^{re.escape(str(lineage.dir / 'current'))}: leads to {tmp_path}, which is not a version directory",
    ):
        lineage.current()
