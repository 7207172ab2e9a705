"""When a run's drafter replaces the lineage's current one: the promotion policy.

Evaluate measures the run's drafter and the lineage's current one on the lineage's pinned prompts in the same run,
and promotes the new one only when its acceptance length at the first of evaluate.draft_lengths beats the current's
by more than evaluate.promote_margin (decide). A drafter with the current's exact bytes (a retried evaluate, or a
rerun on unchanged inputs) is the current one: nothing to compare or switch. Before training, check_inputs tells
the DAG whether anything the drafter is made from changed since the current drafter (training_inputs).

A promotion held for approval (`evaluate --hold-promotion`) writes RUN_DIR/evaluate/proposal.json: the version's
record, the current version it was measured against and every file's digest. `lineage promote --approved-by USER`
makes that switch (promote_held), only with those bytes. The lineage's record itself (versions, `current`, the
pinned set, the copy and its checks) is eagle3.records.lineage.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from pathlib import Path

from eagle3.config import ConfigError, RunConfig
from eagle3.disk.fsutil import UnsafeTree, atomic_write_text, tree_digests
from eagle3.disk.layout import CURRENT, DRAFTER_DIR, MAPPING_D2T, PROPOSAL, REPORT, WEIGHTS, run_samples_path
from eagle3.records.lineage import SHA256_PATTERN, Lineage, PromotionRefused
from eagle3.stages.split import SPLIT_RULE

log = logging.getLogger(__name__)

# Who approved, as Airflow names the user: any printable text, but no control character (it is logged and shown).
APPROVER_PATTERN = re.compile(r"[^\x00-\x1f\x7f]{1,256}")


def stage_output(path: Path, stage: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            path, f"missing, so this run's {stage} stage has not finished", "run it first (clear its task)"
        ) from None


def training_inputs(cfg: RunConfig) -> dict:
    """Everything the drafter is made from, but the code: the run's samples (by id, in its shared store), the
    vocab mapping, the training, drafter and export settings, the seed, the split rule and the pinned evaluation set
    (what it keeps out of training). Two runs with
    equal inputs train the same drafter (training is deterministic). A new version of the pipeline is not a
    new input: an unrelated fix must not retrain a drafter for hours; a user who wants one retrained clears its
    train task (or changes the seed)."""
    samples = hashlib.sha256()
    for shard in range(cfg.extract.num_shards):
        samples.update(stage_output(run_samples_path(cfg.run_dir, shard), "extract"))
    pinned = Lineage(cfg).eval_set()
    kept_out = sorted(pinned["split_keys"]) if pinned else []
    return {
        "store": cfg.store_dir.resolve().name,
        "samples": samples.hexdigest(),
        "vocab": hashlib.sha256(stage_output(cfg.run_dir / MAPPING_D2T, "vocab")).hexdigest(),
        # Not init_from: warm-starting from the current drafter on the data it was trained on is no new work.
        "train": cfg.train.model_dump(mode="json", exclude={"progress_interval_s", "keep_last", "init_from"}),
        "drafter": cfg.drafter.model_dump(mode="json"),
        "export": cfg.export.model_dump(mode="json"),
        "seed": cfg.seed,
        # The split decides which samples train: its rule, and what the pinned set keeps out of training.
        "split": SPLIT_RULE,
        "eval_set": hashlib.sha256(json.dumps([pinned["conversation_ids"], kept_out]).encode()).hexdigest()
        if pinned
        else None,
    }


def inputs_digest(cfg: RunConfig) -> str:
    """The digest of training_inputs."""
    return hashlib.sha256(json.dumps(training_inputs(cfg), sort_keys=True).encode()).hexdigest()


def check_inputs(cfg: RunConfig) -> dict:
    """Has anything the drafter is made from changed since the lineage's current drafter? Runs after vocab: the
    DAG skips training, export and evaluation when not ("nothing changed since run X")."""
    digest = inputs_digest(cfg)
    lineage = Lineage(cfg)
    current = lineage.current()
    record = current.record if current else {}
    unchanged = digest in [record.get("inputs_digest"), *record.get("also_made_from", [])]
    return {
        "changed": not unchanged,
        "inputs_digest": digest,
        "lineage": lineage.key,
        "current": current.name if current else None,
        "unchanged_since": record.get("run") if unchanged else None,
        "current_accept_length": record.get("accept_length") if unchanged else None,
        "current_drafter": str(lineage.dir / CURRENT) if current else None,
    }


def decide(new: dict, current: dict | None, k: int, margin: float) -> tuple[bool, str]:
    """(promote?, why) from the measured acceptance length per k of the new and the current drafter."""
    ours = new[str(k)]["accept_length"]
    if current is None:
        return True, f"the lineage's first drafter (k={k}: {ours:.3f})"
    theirs = current[str(k)]["accept_length"]
    if ours > theirs + margin:
        return True, f"better at k={k}: {ours:.3f} against the current {theirs:.3f} (margin {margin:g})"
    return False, f"not better at k={k} by more than {margin:g}: {ours:.3f} against the current {theirs:.3f}"


# -- promotion held for approval -------------------------------------------------------------------------------


def files_digest(files: dict[str, str]) -> str:
    """One sha256 over a drafter's files and theirs ({path: sha256}): what an approval names (--approved-files)."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def hold_for_approval(cfg: RunConfig, record: dict, expected_current: str | None) -> str:
    """What `promote_held` needs later: the version's record, the current version it was measured against, and the
    digest of every file of the drafter (files_sha256), so that only those bytes are ever promoted. Returns
    files_digest of them, which the report's held promotion carries and the approval covers."""
    drafter_dir = cfg.run_dir / DRAFTER_DIR
    try:
        files = tree_digests(drafter_dir)
    except UnsafeTree as err:
        raise PromotionRefused(drafter_dir, f"{err}; nothing was proposed", "export the drafter again") from None
    if files.get(WEIGHTS) != record["weights_sha256"]:
        raise PromotionRefused(
            drafter_dir,
            f"{WEIGHTS} changed while evaluate measured it (sha256 {files.get(WEIGHTS)}, measured "
            f"{record['weights_sha256']}); nothing was proposed",
            "evaluate again",
        )
    proposal = {"record": record, "expected_current": expected_current, "files_sha256": files}
    atomic_write_text(cfg.run_dir / PROPOSAL, json.dumps(proposal, indent=2) + "\n")
    return files_digest(files)


def check_approver(approved_by: object) -> str:
    if not isinstance(approved_by, str) or not APPROVER_PATTERN.fullmatch(approved_by) or not approved_by.strip():
        raise ConfigError(
            "--approved-by",
            f"{str(approved_by)[:80]!r} is not a user name",
            "name the user who approved the promotion (1 to 256 characters, no control characters)",
        )
    return approved_by


def promote_held(cfg: RunConfig, approved_by: str, approved_files: str) -> dict:
    """`lineage promote --approved-by USER --approved-files SHA256`: make the switch evaluate decided on and held
    (`evaluate --hold-promotion`), once USER approved it (the caller verified that: the DAG's approval task), and
    rewrite the report's promotion. Only the bytes USER approved are promoted: proposal.json's files must be the ones
    `approved_files` names (files_digest, from the held promotion the approval covered), and Lineage.promote checks
    the copy against them; promotion.json records approved_by. Safe to retry: a try that died after the
    switch finds this run's drafter current and only rewrites the report, and one after a finished promotion
    reports it "already current". If another run promoted a drafter meanwhile, nothing is switched: this one was
    measured against a drafter that is no longer current."""
    approved_by = check_approver(approved_by)
    if not isinstance(approved_files, str) or not SHA256_PATTERN.fullmatch(approved_files):
        raise ConfigError(
            "--approved-files",
            f"{str(approved_files)[:80]!r} is not a sha256",
            "give the sha256 of the drafter files the approval named (64 lowercase hex digits: the held "
            "promotion's drafter_files_sha256)",
        )
    report_path = cfg.run_dir / REPORT
    report = json.loads(report_path.read_text())
    promotion = report["promotion"]
    if promotion.get("promoted"):
        current = Lineage(cfg).current()
        if current is not None and current.name == promotion.get("version"):
            return {**promotion, "already_current": True, "reason": f"{promotion['reason']}; already current"}
        return {
            **promotion,
            "already_current": False,
            "reason": f"{promotion['reason']}; since replaced: the current drafter is "
            f"{current.name if current else 'none'}",
        }
    if not promotion.get("pending_approval"):
        raise ConfigError(
            report_path,
            f"evaluate held no promotion for approval ({promotion.get('reason')})",
            "nothing to promote; evaluate with approvals required to hold one",
        )
    proposal = json.loads((cfg.run_dir / PROPOSAL).read_text())
    if files_digest(proposal.get("files_sha256") or {}) != approved_files:
        raise PromotionRefused(
            cfg.run_dir / PROPOSAL,
            f"its drafter files are not the ones approved (files digest "
            f"{files_digest(proposal.get('files_sha256') or {})}, approved {approved_files}): the proposal was "
            "changed after the approval",
            "nothing was promoted; evaluate again and ask for a new approval",
        )
    record = {
        **proposal["record"],
        "approved": True,
        "approved_by": approved_by,
        "promoted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    lineage = Lineage(cfg)
    current = lineage.current()
    if current is not None and current.record["weights_sha256"] == record["weights_sha256"]:
        version = current  # switched by a try that died before it rewrote the report
    else:
        version = lineage.promote(
            cfg.run_dir / DRAFTER_DIR,
            cfg.run_name,
            record,
            cfg.evaluate.keep_versions,
            expected_current=proposal["expected_current"],
            expected_files=proposal.get("files_sha256"),
        )  # (none: held before they were)
    if version is None:
        outcome = {
            **promotion,
            "pending_approval": False,
            "reason": f"{promotion['reason']}; approved, but another run promoted a drafter since this one "
            "was measured: evaluate again to compare with it",
        }
    else:
        outcome = {
            **promotion,
            "promoted": True,
            "pending_approval": False,
            "version": version.name,
            "approved_by": approved_by,
            "reason": f"{promotion['reason']}; approved",
        }
    report["promotion"] = outcome
    atomic_write_text(report_path, json.dumps(report, indent=2) + "\n")
    return outcome


def compare_and_promote(
    cfg: RunConfig,
    lineage,
    pinned: dict,
    results: dict,
    ours: str,
    measure_drafter,
    started_from: str | None,
    hold: bool = False,
) -> dict:
    """Measure the lineage's current drafter (`measure_drafter(its dir)`) on the same prompts, and promote this
    run's (`ours`: its weights' sha256, taken before it was measured; `started_from`: the version its training was
    warm-started from, or None) if it is better by evaluate.promote_margin (decide). `hold`: decide, but leave the
    switch to `lineage promote`, which the DAG runs once a person approved (the deployment's approve_promotion)."""
    k = cfg.evaluate.draft_lengths[0]
    figures = {key: value["accept_length"] for key, value in results.items()}
    outcome = {
        "lineage": lineage.key,
        "lineage_dir": str(lineage.dir),
        "eval_set_prompts": len(pinned["prompts"]),
        "eval_set_pinned_by": pinned["pinned_by"],
        "accept_length": figures,
        "current_before": None,
    }
    if not cfg.evaluate.promote:
        return {**outcome, "promoted": False, "reason": "evaluate.promote is off"}
    current = lineage.current()
    theirs = None
    if current is not None:
        record = current.record
        outcome["current_before"] = {"version": current.name, "run": record["run"]}
        if record["weights_sha256"] == ours:  # a retried evaluate, or a rerun whose inputs had not changed
            lineage.also_made_from(current, inputs_digest(cfg))  # the next run with these inputs skips training
            return {
                **outcome,
                "promoted": False,
                "current": str(lineage.dir / CURRENT),
                "reason": f"this drafter is the current one already ({current.name}, the same weights)",
            }
        theirs = measure_drafter(current.path)
        outcome["current_before"]["accept_length"] = {key: v["accept_length"] for key, v in theirs.items()}
    promote, reason = decide(results, theirs, k, cfg.evaluate.promote_margin)
    log.info("evaluate: %s %s", "promoting this run's drafter:" if promote else "not promoted:", reason)
    if not promote:
        return {**outcome, "promoted": False, "reason": reason, "current": str(lineage.dir / CURRENT)}
    record = {
        "run": cfg.run_name,
        "run_dir": str(cfg.run_dir),
        "weights_sha256": ours,
        "accept_length": figures,
        "inputs_digest": inputs_digest(cfg),  # a later run with the same inputs skips training
        "started_from": started_from,  # train.init_from current: the version it was warm-started from
        "promoted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "reason": reason,
        "previous": outcome["current_before"],
        "eval_set_prompts": len(pinned["prompts"]),
    }
    if hold:  # the approval covers these digests: `lineage promote` switches to no other bytes
        files = hold_for_approval(cfg, record, expected_current=current.name if current else None)
        return {
            **outcome,
            "promoted": False,
            "pending_approval": True,
            "reason": reason,
            "current": str(lineage.dir / CURRENT),
            "weights_sha256": ours,
            "drafter_files_sha256": files,
        }
    version = lineage.promote(
        cfg.run_dir / DRAFTER_DIR,
        cfg.run_name,
        record,
        cfg.evaluate.keep_versions,
        expected_current=current.name if current else None,
    )
    if version is None:
        return {
            **outcome,
            "promoted": False,
            "reason": "another run promoted a drafter while this one was measured; evaluate again to compare with it",
        }
    return {
        **outcome,
        "promoted": True,
        "reason": reason,
        "current": str(lineage.dir / CURRENT),
        "version": version.name,
    }
