"""A lineage's drafters: a pinned evaluation set, the promoted drafter, and the switch to a better one.

A lineage is a target (its identity: eagle3.identity.target_identity) with one drafter geometry (shape, draft
vocabulary size, aux layers): drafters of one lineage are interchangeable in a deployment, so they are compared.
Everything of a lineage lives in {workdir}/drafters/<lineage key>/:

  key.json          what the key covers
  eval_set.json     the pinned evaluation prompts: chosen by the lineage's first evaluation from the evaluation
                    part of its split (first and later user turns: eagle3.evaluate.held_out) and kept, so that
                    every later run measures the same thing. Their conversations, and every conversation that
                    opens with one of the set's split keys, are in the evaluation part of every later run's split
                    (eagle3.split), so no drafter of the lineage trains on them or picks a checkpoint with them.
                    A set pinned before issue 37 (first turns, by conversation id) is kept as it is, so its
                    figures still compare; its keys are derived from the runs' conversations (note_split_keys)
  versions/<name>/  promoted drafters (the export's files, and promotion.json: figures, run, previous version,
                    lineage, who approved it), named <run_name>-<first 8 hex of the weights' sha256>; the newest
                    evaluate.keep_versions kept
  current           a link to the promoted version, switched atomically (a new link renamed over the old)

Evaluate measures the run's drafter and the current one on the pinned set in the same run, and promotes the
new one only when its acceptance length at the first of evaluate.draft_lengths beats the current's by more
than evaluate.promote_margin. A drafter with the current's exact bytes (a retried evaluate, or a rerun on
unchanged inputs) is the current one: nothing to compare or switch.

What is promoted is what was measured: the drafter's regular files are copied (a symbolic link or a special file
anywhere in it refuses the promotion, naming it: a link would copy its target), and the copy's digests are checked
against those evaluate recorded (the weights' sha256; with a held promotion, every file's) before `current` is
switched. A promotion held for approval (`evaluate --hold-promotion`) is made by `lineage promote --approved-by
USER`, and promotion.json records who approved it. Pruning beyond keep_versions removes only version directories
whose promotion.json is this lineage's record of that very version; anything else in versions/ is kept, and logged.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3.config import ConfigError
from eagle3.fsutil import (
    UnsafeTree,
    atomic_dir,
    atomic_symlink,
    atomic_write_text,
    copy_regular_tree,
    remove_tree_in,
    tree_digests,
)
from eagle3.identity import capture_key, file_digest, target_identity

log = logging.getLogger(__name__)

EVAL_SET = "eval_set.json"
# A pinned evaluation set since issue 37: per prompt its conversation, the message it answers (the prompt is the
# conversation up to it, with the generation prompt) and its kind ("first" or "later" user turn); the split keys
# (eagle3.split) every drafter of the lineage is kept from; the split rule; and the prompts' token ids.
EVAL_SET_FIELDS = ("format", "split", "conversation_ids", "turns", "kinds", "split_keys", "prompts")
PROPOSAL = "proposal.json"  # RUN_DIR/evaluate/: a promotion evaluate decided on and held for approval
CURRENT = "current"
VERSIONS = "versions"
RECORD = "promotion.json"
WEIGHTS = "model.safetensors"
SHA256_PATTERN = re.compile(r"[0-9a-f]{64}")
# Who approved, as Airflow names the user: any printable text, but no control character (it is logged and shown).
APPROVER_PATTERN = re.compile(r"[^\x00-\x1f\x7f]{1,256}")
RECORD_MAX_BYTES = 1 << 20  # a promotion.json is a few hundred bytes; more is not one


class PromotionRefused(ConfigError):
    """A promotion that would not switch to the bytes that were measured, or a lineage file that cannot be trusted;
    the message names the file or directory and the fix. (A ConfigError: the CLI exits 2, a retry cannot help.)"""


def read_record(path: Path) -> dict:
    """A version's promotion.json, checked: a JSON object with the weights' sha256 and the promotion time."""
    fix = "restore it, or remove the version directory it belongs to"
    try:
        with open(path, "rb") as f:
            data = f.read(RECORD_MAX_BYTES + 1)
        record = json.loads(data.decode("utf-8")) if len(data) <= RECORD_MAX_BYTES else None
    except FileNotFoundError:
        raise PromotionRefused(f"{path}: missing, so the version it should describe is unknown; {fix}") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise PromotionRefused(f"{path}: cannot be read as JSON ({err}); {fix}") from None
    if not (isinstance(record, dict) and isinstance(record.get("weights_sha256"), str)
            and SHA256_PATTERN.fullmatch(record["weights_sha256"]) and isinstance(record.get("promoted_at"), str)):
        raise PromotionRefused(f"{path}: not a promotion record (a JSON object of at most {RECORD_MAX_BYTES} bytes "
                               f"with weights_sha256 and promoted_at); {fix}")
    return record


def lineage_fields(cfg) -> dict:
    return {
        "format": 1,
        "target": target_identity(cfg.target.model_path, cfg.tokenizer_dir),
        # The shape: what decides whether one drafter can take another's place. Its RoPE travels in its config.json
        # (eagle3.export), so drafters with other RoPE still replace one another (and lineages keep their keys).
        "drafter": cfg.drafter.model_dump(mode="json", exclude={"rope_theta", "rope_scaling"}),
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
        return read_record(self.path / RECORD)


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
        """The pinned set (EVAL_SET_FIELDS and pinned_by, pinned_at), or None before the first. A set pinned before
        issue 37 has conversation_ids and prompts only (first turns), and derived_split_keys once a run found its
        conversations' keys (note_split_keys)."""
        try:
            return json.loads((self.dir / EVAL_SET).read_text())
        except FileNotFoundError:
            return None

    def pin_eval_set(self, chosen: dict, run_name: str) -> dict:
        """The pinned set: the one already there (whatever its format: its figures are the lineage's), or `chosen`
        (eagle3.evaluate.eval_set_record: EVAL_SET_FIELDS), pinned now."""
        with self.locked():
            pinned = self.eval_set()
            if pinned is None:
                pinned = {**{key: chosen[key] for key in EVAL_SET_FIELDS}, "pinned_by": run_name,
                          "pinned_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
                atomic_write_text(self.dir / EVAL_SET, json.dumps(pinned) + "\n")
            return pinned

    def note_split_keys(self, found: dict[str, str], run_name: str) -> dict[str, str]:
        """Record the split keys of a set pinned before issue 37 ({conversation id: key}, as a run's conversations
        give them: eagle3.split.pinned_set), merged with those recorded before; returns them all. Its prompts stay as
        they are: only what training leaves out grows."""
        with self.locked():
            pinned = self.eval_set()
            derived = {**pinned.get("derived_split_keys", {}), **found}
            if derived != pinned.get("derived_split_keys"):
                pinned = {**pinned, "derived_split_keys": derived, "split_keys_derived_by": run_name}
                atomic_write_text(self.dir / EVAL_SET, json.dumps(pinned) + "\n")
            return derived

    # -- versions ------------------------------------------------------------------------------------------

    def current(self) -> Version | None:
        """The promoted version `current` links to; None before the first. A link that leads anywhere but to a
        directory in versions/ is refused: the current drafter is served, warm-started from and measured against."""
        link = self.dir / CURRENT
        if not link.is_symlink():
            return None
        target = link.resolve()
        if target.parent != (self.dir / VERSIONS).resolve() or not target.is_dir():
            raise PromotionRefused(f"{link}: leads to {target}, which is not a version directory in "
                                   f"{self.dir / VERSIONS}; point it at one (ln -sfn {VERSIONS}/<name> {link}) or "
                                   "remove it")
        return Version(target.name, target)

    def promote(self, drafter_dir: Path, run_name: str, record: dict, keep: int,
                expected_current: str | None, expected_files: dict[str, str] | None = None) -> Version | None:
        """Copy the drafter into versions/, check that the copy holds the weights the record's weights_sha256
        names (and, given `expected_files`, exactly those files with those digests), switch `current` to it, drop
        the oldest versions beyond `keep`. None, and nothing switched, if `current` is no longer `expected_current`
        (the version it was measured against). Raises PromotionRefused, switching nothing, for a drafter that holds a
        link or a special file, or whose bytes are not the ones measured."""
        name = f"{run_name}-{record['weights_sha256'][:8]}"
        version = self.dir / VERSIONS / name
        with self.locked():
            now = self.current()
            if (now.name if now else None) != expected_current:
                return None
            if version.is_symlink() or version.exists():  # an earlier try's copy, made before it could switch
                self._check_copy(version, drafter_dir, record["weights_sha256"], expected_files)
            else:
                with atomic_dir(version) as tmp:
                    try:
                        copy_regular_tree(drafter_dir, tmp)
                    except UnsafeTree as err:
                        raise PromotionRefused(f"{err} (a link would copy its target into {self.dir / VERSIONS}); "
                                               "nothing was promoted. Export the drafter again") from None
                    self._check_copy(tmp, drafter_dir, record["weights_sha256"], expected_files)
                    (tmp / RECORD).write_text(json.dumps({**record, "version": name, "lineage": self.key}, indent=2)
                                              + "\n")
            atomic_symlink(self.dir / CURRENT, Path(VERSIONS) / name)
            self._prune(keep, name)
        return Version(name, version)

    @staticmethod
    def _check_copy(copy: Path, drafter_dir: Path, weights_sha256: str, expected_files: dict[str, str] | None) -> None:
        """Refuse (PromotionRefused) a copy whose bytes are not the ones that were measured."""
        try:
            digests = {path: digest for path, digest in tree_digests(copy).items() if path != RECORD}
        except UnsafeTree as err:
            raise PromotionRefused(f"{err}; the version directory was changed by hand: remove {copy} and promote "
                                   "again") from None
        again = "Nothing was promoted: export and evaluate again, then approve what that measured"
        if digests.get(WEIGHTS) != weights_sha256:
            raise PromotionRefused(
                f"{drafter_dir}: its weights are not the ones that were measured: {WEIGHTS} has sha256 "
                f"{digests.get(WEIGHTS)}, evaluate measured {weights_sha256}. {again}")
        if expected_files is not None:
            expected = {path: digest for path, digest in expected_files.items() if path != RECORD}
            changed = sorted(path for path in digests.keys() | expected.keys()
                             if digests.get(path) != expected.get(path))
            if changed:
                raise PromotionRefused(
                    f"{drafter_dir}: {', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''} differ from what "
                    f"evaluate measured (files added, removed or changed since). {again}")

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

    def version_problem(self, path: Path) -> str | None:
        """Why `path` is not a version directory of this lineage that pruning may remove, or None."""
        if path.is_symlink() or not path.is_dir():
            return "not a directory (a symbolic link, or a file)"
        try:
            record = read_record(path / RECORD)
        except PromotionRefused as err:
            return str(err)
        if record.get("version") != path.name:
            return f"its {RECORD} describes version {record.get('version')!r}, not {path.name!r}"
        if record.get("lineage", self.key) != self.key:  # (records from before the lineage was written have none)
            return f"its {RECORD} is of lineage {record['lineage']!r}, not {self.key!r}"
        return None

    def _prune(self, keep: int, current: str) -> None:
        """Remove the oldest versions beyond `keep`, never `current`, and only directories that version_problem
        finds nothing wrong with: whatever else is in versions/ stays, with a warning naming it."""
        versions_dir = self.dir / VERSIONS
        if self.dir.is_symlink() or versions_dir.is_symlink():
            log.warning("%s: a symbolic link is on the way (the lineage or its versions/): nothing pruned",
                        versions_dir)
            return
        dated = []
        for path in sorted(versions_dir.iterdir()):
            if path.name.startswith("."):  # (atomic_dir's temporary directories)
                continue
            problem = self.version_problem(path)
            if problem:
                log.warning("%s: kept, not pruned: %s", path, problem)
                continue
            dated.append((read_record(path / RECORD)["promoted_at"], path.name))
        for _, name in sorted(dated, reverse=True)[keep:]:
            if name != current:
                remove_tree_in(versions_dir, name)


def training_inputs(cfg) -> dict:
    """Everything the drafter is made from, but the code: the run's samples (by id, in its shared store), the
    vocab mapping, the training, drafter and export settings, the seed, the split rule and the pinned evaluation set
    (what it keeps out of training). Two runs with
    equal inputs train the same drafter (training is deterministic). A new version of the pipeline is not a
    new input: an unrelated fix must not retrain a drafter for hours; a user who wants one retrained clears its
    train task (or changes the seed)."""
    from eagle3.runlayout import run_samples_path
    from eagle3.split import SPLIT_RULE

    samples = hashlib.sha256()
    for shard in range(cfg.extract.num_shards):
        samples.update(run_samples_path(cfg.run_dir, shard).read_bytes())
    pinned = Lineage(cfg).eval_set()
    kept_out = sorted(pinned.get("split_keys", pinned.get("derived_split_keys", {}).values())) if pinned else []
    return {
        "store": cfg.store_dir.resolve().name,
        "samples": samples.hexdigest(),
        "vocab": hashlib.sha256((cfg.run_dir / "vocab_mapping" / "d2t.npy").read_bytes()).hexdigest(),
        # Not init_from: warm-starting from the current drafter on the data it was trained on is no new work.
        "train": cfg.train.model_dump(mode="json", exclude={"progress_interval_s", "keep_last", "init_from"}),
        "drafter": cfg.drafter.model_dump(mode="json"),
        "export": cfg.export.model_dump(mode="json"),
        "seed": cfg.seed,
        # The split decides which samples train: its rule, and what the pinned set keeps out of training.
        "split": SPLIT_RULE,
        "eval_set": hashlib.sha256(json.dumps([pinned["conversation_ids"], kept_out]).encode()).hexdigest()
        if pinned else None,
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
    """What `promote_held` needs later: the version's record, the current version it was measured against, and the
    digest of every file of the drafter (files_sha256), so that only those bytes are ever promoted."""
    from eagle3.export import DRAFTER_DIR

    drafter_dir = cfg.run_dir / DRAFTER_DIR
    try:
        files = tree_digests(drafter_dir)
    except UnsafeTree as err:
        raise PromotionRefused(f"{err}; nothing was proposed. Export the drafter again") from None
    if files.get(WEIGHTS) != record["weights_sha256"]:
        raise PromotionRefused(f"{drafter_dir}: {WEIGHTS} changed while evaluate measured it (sha256 "
                               f"{files.get(WEIGHTS)}, measured {record['weights_sha256']}); nothing was proposed. "
                               "Evaluate again")
    proposal = {"record": record, "expected_current": expected_current, "files_sha256": files}
    atomic_write_text(cfg.run_dir / "evaluate" / PROPOSAL, json.dumps(proposal, indent=2) + "\n")


def check_approver(approved_by: object) -> str:
    if not isinstance(approved_by, str) or not APPROVER_PATTERN.fullmatch(approved_by) or not approved_by.strip():
        raise ConfigError(f"--approved-by {str(approved_by)[:80]!r}: name the user who approved the promotion (1 to "
                          "256 characters, no control characters)")
    return approved_by


def promote_held(cfg, approved_by: str) -> dict:
    """`lineage promote --approved-by USER`: make the switch evaluate decided on and held (`evaluate
    --hold-promotion`), once USER approved it (the caller verified that: the DAG's approval task), and rewrite the
    report's promotion. Only the drafter's bytes evaluate measured are promoted (Lineage.promote checks the copy
    against the proposal's digests); promotion.json records approved_by. Safe to retry: a try that died after the
    switch finds this run's drafter current and only rewrites the report, and one after a finished promotion
    reports it "already current". If another run promoted a drafter meanwhile, nothing is switched: this one was
    measured against a drafter that is no longer current."""
    from eagle3.export import DRAFTER_DIR

    approved_by = check_approver(approved_by)
    report_path = cfg.run_dir / "evaluate" / "report.json"
    report = json.loads(report_path.read_text())
    promotion = report["promotion"]
    if promotion.get("promoted"):
        current = Lineage(cfg).current()
        if current is not None and current.name == promotion.get("version"):
            return {**promotion, "already_current": True, "reason": f"{promotion['reason']}; already current"}
        return {**promotion, "already_current": False,
                "reason": f"{promotion['reason']}; since replaced: the current drafter is "
                f"{current.name if current else 'none'}"}
    if not promotion.get("pending_approval"):
        raise ConfigError(f"{report_path}: evaluate held no promotion for approval ({promotion.get('reason')}); "
                          "nothing to promote")
    proposal = json.loads((cfg.run_dir / "evaluate" / PROPOSAL).read_text())
    record = {**proposal["record"], "approved": True, "approved_by": approved_by,
              "promoted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    lineage = Lineage(cfg)
    current = lineage.current()
    if current is not None and current.record["weights_sha256"] == record["weights_sha256"]:
        version = current  # switched by a try that died before it rewrote the report
    else:
        version = lineage.promote(cfg.run_dir / DRAFTER_DIR, cfg.run_name, record, cfg.evaluate.keep_versions,
                                  expected_current=proposal["expected_current"],
                                  expected_files=proposal.get("files_sha256"))  # (none: held before they were)
    if version is None:
        outcome = {**promotion, "pending_approval": False,
                   "reason": f"{promotion['reason']}; approved, but another run promoted a drafter since this one "
                   "was measured: evaluate again to compare with it"}
    else:
        outcome = {**promotion, "promoted": True, "pending_approval": False, "version": version.name,
                   "approved_by": approved_by, "reason": f"{promotion['reason']}; approved"}
    report["promotion"] = outcome
    atomic_write_text(report_path, json.dumps(report, indent=2) + "\n")
    return outcome
