"""A lineage's record on disk: its pinned evaluation set, its promoted drafters, and which one is current.

A lineage is a target (its identity: eagle3.data.identity.target_identity) with one drafter geometry (shape, draft
vocabulary size, aux layers): drafters of one lineage are interchangeable in a deployment, so they are compared.
Everything of a lineage lives in {workdir}/drafters/<lineage key>/ (eagle3.disk.layout):

  key.json          what the key covers
  eval_set.json     the pinned evaluation prompts (EVAL_SET_FIELDS): chosen by the lineage's first evaluation and
                    kept, so that every later run measures the same thing; their conversations, and every
                    conversation that opens with one of the set's split keys, are in the evaluation part of every
                    later run's split (eagle3.stages.split)
  versions/<name>/  promoted drafters (the export's files, and promotion.json: figures, run, previous version,
                    lineage, who approved it), named <run_name>-<first 8 hex of the weights' sha256>
  current           a link to the promoted version, switched atomically (a new link renamed over the old)

What is promoted is what was measured: the drafter's regular files are copied (a link or a special file refuses
the promotion) and the copy's digests are checked against those evaluate recorded before `current` switches.
Pruning beyond keep_versions removes only version directories whose promotion.json is this lineage's record of
that very version. When to promote is eagle3.stages.promote's business, not this module's.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3.config import ConfigError, RunConfig
from eagle3.data.identity import capture_key, file_digest, target_identity
from eagle3.disk.fsutil import (
    UnsafeTree,
    atomic_dir,
    atomic_symlink,
    atomic_write_text,
    copy_regular_tree,
    remove_tree_in,
    tree_digests,
)
from eagle3.disk.layout import (
    CURRENT,
    EVAL_SET,
    KEY_RECORD,
    LINEAGE_LOCK,
    PROMOTION_RECORD,
    VERSIONS,
    WEIGHTS,
    lineage_dir_of,
)

log = logging.getLogger(__name__)

# A pinned evaluation set since issue 37: per prompt its conversation, the message it answers (the prompt is the
# conversation up to it, with the generation prompt) and its kind ("first" or "later" user turn); the split keys
# (eagle3.stages.split) every drafter of the lineage is kept from; the split rule; and the prompts' token ids.
EVAL_SET_FIELDS = ("format", "split", "conversation_ids", "turns", "kinds", "split_keys", "prompts")
SHA256_PATTERN = re.compile(r"[0-9a-f]{64}")
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
        raise PromotionRefused(path, "missing, so the version it should describe is unknown", fix) from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise PromotionRefused(path, f"cannot be read as JSON ({err})", fix) from None
    if not (
        isinstance(record, dict)
        and isinstance(record.get("weights_sha256"), str)
        and SHA256_PATTERN.fullmatch(record["weights_sha256"])
        and isinstance(record.get("promoted_at"), str)
    ):
        raise PromotionRefused(
            path,
            f"not a promotion record (a JSON object of at most {RECORD_MAX_BYTES} bytes with weights_sha256 and "
            "promoted_at)",
            fix,
        )
    return record


def lineage_fields(cfg: RunConfig) -> dict:
    return {
        "format": 1,
        "target": target_identity(cfg.target.model_path, cfg.tokenizer_dir),
        # The shape: what decides whether one drafter can take another's place. Its RoPE travels in its config.json
        # (eagle3.stages.export), so drafters with other RoPE still replace one another (and lineages keep their keys).
        "drafter": cfg.drafter.model_dump(mode="json", exclude={"rope_theta", "rope_scaling"}),
        "draft_vocab_size": cfg.vocab.draft_vocab_size,
        "aux_layers": cfg.resolved_aux_layers(),
    }


def weights_digest(drafter_dir: Path) -> str:
    return file_digest(Path(drafter_dir) / WEIGHTS)


@dataclass(frozen=True)
class Version:
    name: str
    path: Path

    @property
    def record(self) -> dict:
        return read_record(self.path / PROMOTION_RECORD)


class Lineage:
    def __init__(self, cfg: RunConfig):
        fields = lineage_fields(cfg)
        self.key = capture_key(fields)
        self.dir = lineage_dir_of(cfg.workdir, self.key)
        self.dir.mkdir(parents=True, exist_ok=True)
        if not (self.dir / KEY_RECORD).exists():
            atomic_write_text(self.dir / KEY_RECORD, json.dumps(fields, indent=2, sort_keys=True) + "\n")

    @contextlib.contextmanager
    def locked(self):
        """One run at a time pins the set or switches `current` (the evaluation itself runs unlocked)."""
        with open(self.dir / LINEAGE_LOCK, "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    # -- the pinned evaluation set ------------------------------------------------------------------------

    def eval_set(self) -> dict | None:
        """The pinned set (EVAL_SET_FIELDS and pinned_by, pinned_at), or None before the first."""
        try:
            return json.loads((self.dir / EVAL_SET).read_text())
        except FileNotFoundError:
            return None

    def pin_eval_set(self, chosen: dict, run_name: str) -> dict:
        """The pinned set: the one already there (its figures are the lineage's), or `chosen`
        (eagle3.stages.evaluate.prompts.eval_set_record: EVAL_SET_FIELDS), pinned now."""
        with self.locked():
            pinned = self.eval_set()
            if pinned is None:
                pinned = {
                    **{key: chosen[key] for key in EVAL_SET_FIELDS},
                    "pinned_by": run_name,
                    "pinned_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                }
                atomic_write_text(self.dir / EVAL_SET, json.dumps(pinned) + "\n")
            return pinned

    # -- versions ------------------------------------------------------------------------------------------

    def current(self) -> Version | None:
        """The promoted version `current` links to; None before the first. A link that leads anywhere but to a
        directory in versions/ is refused: the current drafter is served, warm-started from and measured against."""
        link = self.dir / CURRENT
        if not link.is_symlink():
            return None
        target = link.resolve()
        if target.parent != (self.dir / VERSIONS).resolve() or not target.is_dir():
            raise PromotionRefused(
                link,
                f"leads to {target}, which is not a version directory in {self.dir / VERSIONS}",
                f"point it at one (ln -sfn {VERSIONS}/<name> {link}) or remove it",
            )
        return Version(target.name, target)

    def promote(
        self,
        drafter_dir: Path,
        run_name: str,
        record: dict,
        keep: int,
        expected_current: str | None,
        expected_files: dict[str, str] | None = None,
    ) -> Version | None:
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
                        raise PromotionRefused(
                            drafter_dir,
                            f"{err} (a link would copy its target into {self.dir / VERSIONS}); nothing was promoted",
                            "export the drafter again",
                        ) from None
                    self._check_copy(tmp, drafter_dir, record["weights_sha256"], expected_files)
                    kept = {**record, "version": name, "lineage": self.key}
                    (tmp / PROMOTION_RECORD).write_text(json.dumps(kept, indent=2) + "\n")
            atomic_symlink(self.dir / CURRENT, Path(VERSIONS) / name)
            self._prune(keep, name)
        return Version(name, version)

    @staticmethod
    def _check_copy(copy: Path, drafter_dir: Path, weights_sha256: str, expected_files: dict[str, str] | None) -> None:
        """Refuse (PromotionRefused) a copy whose bytes are not the ones that were measured."""
        try:
            digests = {path: digest for path, digest in tree_digests(copy).items() if path != PROMOTION_RECORD}
        except UnsafeTree as err:
            raise PromotionRefused(
                copy, f"{err}: the version directory was changed by hand", f"remove {copy} and promote again"
            ) from None
        again = "nothing was promoted: export and evaluate again, then approve what that measured"
        if digests.get(WEIGHTS) != weights_sha256:
            raise PromotionRefused(
                drafter_dir,
                f"its weights are not the ones that were measured: {WEIGHTS} has sha256 {digests.get(WEIGHTS)}, "
                f"evaluate measured {weights_sha256}",
                again,
            )
        if expected_files is not None:
            expected = {path: digest for path, digest in expected_files.items() if path != PROMOTION_RECORD}
            changed = sorted(
                path for path in digests.keys() | expected.keys() if digests.get(path) != expected.get(path)
            )
            if changed:
                raise PromotionRefused(
                    drafter_dir,
                    f"{', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''} differ from what evaluate "
                    "measured (files added, removed or changed since)",
                    again,
                )

    def also_made_from(self, version: Version, digest: str) -> None:
        """Record that inputs with `digest` trained `version`'s exact weights too (a run whose drafter was the current
        one already), so that a later run with those inputs is seen as unchanged."""
        with self.locked():
            record = version.record
            if digest != record.get("inputs_digest") and digest not in record.get("also_made_from", []):
                record["also_made_from"] = [*record.get("also_made_from", []), digest]
                atomic_write_text(version.path / PROMOTION_RECORD, json.dumps(record, indent=2) + "\n")

    def version_problem(self, path: Path) -> str | None:
        """Why `path` is not a version directory of this lineage that pruning may remove, or None."""
        if path.is_symlink() or not path.is_dir():
            return "not a directory (a symbolic link, or a file)"
        try:
            record = read_record(path / PROMOTION_RECORD)
        except PromotionRefused as err:
            return str(err)
        if record.get("version") != path.name:
            return f"its {PROMOTION_RECORD} describes version {record.get('version')!r}, not {path.name!r}"
        if record.get("lineage") != self.key:
            return f"its {PROMOTION_RECORD} is of lineage {record.get('lineage')!r}, not {self.key!r}"
        return None

    def _prune(self, keep: int, current: str) -> None:
        """Remove the oldest versions beyond `keep`, never `current`, and only directories that version_problem
        finds nothing wrong with: whatever else is in versions/ stays, with a warning naming it."""
        versions_dir = self.dir / VERSIONS
        if self.dir.is_symlink() or versions_dir.is_symlink():
            log.warning(
                "%s: a symbolic link is on the way (the lineage or its versions/): nothing pruned", versions_dir
            )
            return
        dated = []
        for path in sorted(versions_dir.iterdir()):
            if path.name.startswith("."):  # (atomic_dir's temporary directories)
                continue
            problem = self.version_problem(path)
            if problem:
                log.warning("%s: kept, not pruned: %s", path, problem)
                continue
            dated.append((read_record(path / PROMOTION_RECORD)["promoted_at"], path.name))
        for _, name in sorted(dated, reverse=True)[keep:]:
            if name != current:
                remove_tree_in(versions_dir, name)
