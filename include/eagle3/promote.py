"""A lineage's drafters: a pinned evaluation set, the promoted drafter, and the switch to a better one.

A lineage is a target (its identity: eagle3.identity.target_identity) with one drafter geometry (shape, draft
vocabulary size, aux layers): drafters of one lineage are interchangeable in a deployment, so they are compared.
Everything of a lineage lives in {workdir}/drafters/<lineage key>/:

  key.json          what the key covers
  eval_set.json     the pinned evaluation prompts: chosen by the lineage's first evaluation from its held-out
                    split and kept, so that every later run measures the same thing; training leaves their
                    conversations out (Trainer), so no drafter of the lineage ever trains on them
  versions/<name>/  promoted drafters (the export's files, and promotion.json: figures, run, previous version),
                    named <run_name>-<first 8 hex of the weights' sha256>; the newest evaluate.keep_versions kept
  current           a link to the promoted version, switched atomically (a new link renamed over the old)

Evaluate measures the run's drafter and the current one on the pinned set in the same run, and promotes the
new one only when its acceptance length at the first of evaluate.draft_lengths beats the current's by more
than evaluate.promote_margin. A drafter with the current's exact bytes (a retried evaluate, or a rerun on
unchanged inputs) is the current one: nothing to compare or switch.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3.fsutil import atomic_dir, atomic_symlink, atomic_write_text
from eagle3.identity import capture_key, file_digest, target_identity

EVAL_SET = "eval_set.json"
PROPOSAL = "proposal.json"  # RUN_DIR/evaluate/: a promotion evaluate decided on and held for approval
CURRENT = "current"
VERSIONS = "versions"
RECORD = "promotion.json"


def lineage_fields(cfg) -> dict:
    return {
        "format": 1,
        "target": target_identity(cfg.target.model_path, cfg.tokenizer_dir),
        "drafter": cfg.drafter.model_dump(mode="json"),
        "draft_vocab_size": cfg.vocab.draft_vocab_size,
        "aux_layers": cfg.resolved_aux_layers(),
    }


def weights_digest(drafter_dir: Path) -> str:
    return file_digest(Path(drafter_dir) / "model.safetensors")


@dataclass(frozen=True)
class Version:
    name: str
    path: Path

    @property
    def record(self) -> dict:
        return json.loads((self.path / RECORD).read_text())


class Lineage:
    def __init__(self, cfg):
        fields = lineage_fields(cfg)
        self.key = capture_key(fields)
        self.dir = Path(cfg.workdir) / "drafters" / self.key
        self.dir.mkdir(parents=True, exist_ok=True)
        if not (self.dir / "key.json").exists():
            atomic_write_text(self.dir / "key.json", json.dumps(fields, indent=2, sort_keys=True) + "\n")

    @contextlib.contextmanager
    def locked(self):
        """One run at a time pins the set or switches `current` (the evaluation itself runs unlocked)."""
        with open(self.dir / ".lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    # -- the pinned evaluation set ------------------------------------------------------------------------

    def eval_set(self) -> dict | None:
        """{"conversation_ids": [...], "prompts": [[token ids], ...], "pinned_by": run} or None before the first."""
        try:
            return json.loads((self.dir / EVAL_SET).read_text())
        except FileNotFoundError:
            return None

    def pin_eval_set(self, conversation_ids: list[str], prompts: list[list[int]], run_name: str) -> dict:
        """The pinned set: the one already there, or these prompts, pinned now."""
        with self.locked():
            pinned = self.eval_set()
            if pinned is None:
                pinned = {"conversation_ids": conversation_ids, "prompts": prompts, "pinned_by": run_name,
                          "pinned_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
                atomic_write_text(self.dir / EVAL_SET, json.dumps(pinned) + "\n")
            return pinned

    # -- versions ------------------------------------------------------------------------------------------

    def current(self) -> Version | None:
        link = self.dir / CURRENT
        if not link.is_symlink():
            return None
        return Version(Path(link.readlink()).name, link.resolve())

    def promote(self, drafter_dir: Path, run_name: str, record: dict, keep: int,
                expected_current: str | None) -> Version | None:
        """Copy the drafter into versions/, switch `current` to it, drop the oldest versions beyond `keep`. None,
        and nothing switched, if `current` is no longer `expected_current` (the version it was measured against)."""
        name = f"{run_name}-{weights_digest(drafter_dir)[:8]}"
        version = self.dir / VERSIONS / name
        with self.locked():
            now = self.current()
            if (now.name if now else None) != expected_current:
                return None
            if not version.exists():
                with atomic_dir(version) as tmp:
                    for f in sorted(Path(drafter_dir).iterdir()):
                        shutil.copy2(f, tmp / f.name)
                    (tmp / RECORD).write_text(json.dumps({**record, "version": name}, indent=2) + "\n")
            atomic_symlink(self.dir / CURRENT, Path(VERSIONS) / name)
            self._prune(keep, name)
        return Version(name, version)

    def also_made_from(self, version: Version, digest: str | None) -> None:
        """Record that inputs with `digest` trained `version`'s exact weights too (a run whose drafter was the current
        one already), so that a later run with those inputs is seen as unchanged."""
        if digest is None:
            return
        with self.locked():
            record = version.record
            if digest != record.get("inputs_digest") and digest not in record.get("also_made_from", []):
                record["also_made_from"] = [*record.get("also_made_from", []), digest]
                atomic_write_text(version.path / RECORD, json.dumps(record, indent=2) + "\n")

    def _prune(self, keep: int, current: str) -> None:
        versions = sorted((p for p in (self.dir / VERSIONS).iterdir() if not p.name.startswith(".")),
                          key=lambda p: json.loads((p / RECORD).read_text())["promoted_at"], reverse=True)
        for old in versions[keep:]:
            if old.name != current:
                shutil.rmtree(old)


def training_inputs(cfg) -> dict:
    """Everything the drafter is made from, but the code: the run's samples (by id, in its shared store), the
    vocab mapping, the training, drafter and export settings, the seed, the pinned evaluation set. Two runs with
    equal inputs train the same drafter (training is deterministic). A new version of the pipeline is not a
    new input: an unrelated fix must not retrain a drafter for hours; a user who wants one retrained clears its
    train task (or changes the seed)."""
    from eagle3.runlayout import run_samples_path

    samples = hashlib.sha256()
    for shard in range(cfg.extract.num_shards):
        samples.update(run_samples_path(cfg.run_dir, shard).read_bytes())
    pinned = Lineage(cfg).eval_set()
    return {
        "store": cfg.store_dir.resolve().name,
        "samples": samples.hexdigest(),
        "vocab": hashlib.sha256((cfg.run_dir / "vocab_mapping" / "d2t.npy").read_bytes()).hexdigest(),
        # Not init_from: warm-starting from the current drafter on the data it was trained on is no new work.
        "train": cfg.train.model_dump(mode="json", exclude={"progress_interval_s", "keep_last", "init_from"}),
        "drafter": cfg.drafter.model_dump(mode="json"),
        "export": cfg.export.model_dump(mode="json"),
        "seed": cfg.seed,
        "eval_set": hashlib.sha256(json.dumps(pinned["conversation_ids"]).encode()).hexdigest() if pinned else None,
    }


def inputs_digest(cfg) -> str | None:
    """The digest of training_inputs; None for a run directory from before stores were shared (it lists no
    samples), which is never taken as unchanged."""
    try:
        inputs = training_inputs(cfg)
    except FileNotFoundError:
        return None
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def check_inputs(cfg) -> dict:
    """Has anything the drafter is made from changed since the lineage's current drafter? Runs after vocab: the
    DAG skips training, export and evaluation when not ("nothing changed since run X")."""
    digest = inputs_digest(cfg)
    lineage = Lineage(cfg)
    current = lineage.current()
    record = current.record if current else {}
    unchanged = digest is not None and digest in [record.get("inputs_digest"), *record.get("also_made_from", [])]
    return {
        "changed": not unchanged,
        "inputs_digest": digest,
        "lineage": lineage.key,
        "current": current.name if current else None,
        "unchanged_since": record.get("run") if unchanged else None,
        "current_accept_length": record.get("accept_length") if unchanged else None,
        "current_drafter": str(lineage.dir / CURRENT) if current else None,
    }


def pinned_conversation_ids(cfg) -> set[str]:
    """The conversations of the lineage's pinned evaluation set: never trained on."""
    pinned = Lineage(cfg).eval_set()
    return set(pinned["conversation_ids"]) if pinned else set()


def decide(new: dict, current: dict | None, k: int, margin: float) -> tuple[bool, str]:
    """(promote?, why) from the measured acceptance length per k of the new and the current drafter."""
    ours = new[str(k)]["mean_accept_length"]
    if current is None:
        return True, f"the lineage's first drafter (k={k}: {ours:.3f})"
    theirs = current[str(k)]["mean_accept_length"]
    if ours > theirs + margin:
        return True, f"better at k={k}: {ours:.3f} against the current {theirs:.3f} (margin {margin:g})"
    return False, f"not better at k={k} by more than {margin:g}: {ours:.3f} against the current {theirs:.3f}"


# -- promotion held for approval -------------------------------------------------------------------------------

def hold_for_approval(cfg, record: dict, expected_current: str | None) -> None:
    """What `promote_held` needs later: the version's record, and the current version it was measured against."""
    proposal = {"record": record, "expected_current": expected_current}
    atomic_write_text(cfg.run_dir / "evaluate" / PROPOSAL, json.dumps(proposal, indent=2) + "\n")


def promote_held(cfg) -> dict:
    """`lineage promote`: make the switch evaluate decided on and held (`evaluate --hold-promotion`), once a person
    approved it, and rewrite the report's promotion. Safe to retry: a try that died after the switch finds this
    run's drafter current and only rewrites the report. If another run promoted a drafter meanwhile, nothing is
    switched: this one was measured against a drafter that is no longer current."""
    from eagle3.config import ConfigError
    from eagle3.export import DRAFTER_DIR

    report_path = cfg.run_dir / "evaluate" / "report.json"
    report = json.loads(report_path.read_text())
    promotion = report["promotion"]
    if promotion.get("promoted"):
        return promotion
    if not promotion.get("pending_approval"):
        raise ConfigError(f"{report_path}: evaluate held no promotion for approval ({promotion.get('reason')}); "
                          "nothing to promote")
    proposal = json.loads((cfg.run_dir / "evaluate" / PROPOSAL).read_text())
    record = {**proposal["record"], "approved": True,
              "promoted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    lineage = Lineage(cfg)
    current = lineage.current()
    if current is not None and current.record["weights_sha256"] == record["weights_sha256"]:
        version = current  # switched by a try that died before it rewrote the report
    else:
        version = lineage.promote(cfg.run_dir / DRAFTER_DIR, cfg.run_name, record, cfg.evaluate.keep_versions,
                                  expected_current=proposal["expected_current"])
    if version is None:
        outcome = {**promotion, "pending_approval": False,
                   "reason": f"{promotion['reason']}; approved, but another run promoted a drafter since this one "
                   "was measured: evaluate again to compare with it"}
    else:
        outcome = {**promotion, "promoted": True, "pending_approval": False, "version": version.name,
                   "reason": f"{promotion['reason']}; approved"}
    report["promotion"] = outcome
    atomic_write_text(report_path, json.dumps(report, indent=2) + "\n")
    return outcome
