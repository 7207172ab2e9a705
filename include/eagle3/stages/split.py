"""Which samples train, which choose the checkpoint, which are evaluated: a split keyed on every user turn.

A conversation's split keys are prompt_key of each of its user messages (its own id when it has none); every sample
of the conversation (its own and its per-turn "<id>.<turn>") takes its part. The key's text (normalise_prompt) is
NFKC, case folded, whitespace collapsed: it merges spellings of one question and no more (punctuation and digits
stay; the system prompt and tools are left out, as they barely change the answer).

Three disjoint parts, by each key's bucket (its 64 bits mod BUCKETS) against train.val_fraction:
  evaluation  bucket < val_fraction / 2: evaluate's and benchmark's prompts (eagle3.stages.evaluate.prompts)
  validation  val_fraction / 2 <= bucket < val_fraction: the trainer's validation, which picks the best checkpoint
  training    the rest: training, and the draft vocabulary's token counts (eagle3.stages.vocab)
A conversation takes the most held-out part of its keys' (evaluation, then validation): a user turn whose bucket is
evaluation is never trained, whichever turn of whichever conversation asks it. A conversation of the lineage's pinned
evaluation set (eagle3.records.lineage), by id or by any of its keys, is in evaluation whatever its buckets. A part
depends only on the keys and the pinned set: new data never moves a conversation. A sample whose conversation has no
keys (the file changed since extract read it) raises SplitError.

RUN_DIR/split/keys.json caches the keys of cfg.conversations_path (the regenerated ones when generate is on) with
SPLIT_RULE and the file's size and mtime; it is rebuilt when either changes, used as is when the file is gone, and
written atomically.

Why: docs/decisions/2026-12-07-split-by-every-user-turn.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3.data.overlap import normalise as normalise_prompt  # the text a split key is taken of
from eagle3.data.samples import conversation_id_of, read_conversations
from eagle3.disk.fsutil import atomic_write_text
from eagle3.disk.layout import SPLIT_KEYS
from eagle3.records.lineage import Lineage

if TYPE_CHECKING:
    from eagle3.config import RunConfig

log = logging.getLogger(__name__)

# Bump when the key or the parts change: the pinned sets and the training inputs' digest record it.
SPLIT_RULE = "every-user-turn:nfkc-casefold-whitespace:2"
BUCKETS = 10_000
EVALUATION, VALIDATION, TRAINING = "evaluation", "validation", "training"
HELD_OUT_FIRST = (EVALUATION, VALIDATION, TRAINING)


class SplitError(ValueError):
    """A sample the split cannot place; the message names the sample, the file and the fix."""


def prompt_key(text: str) -> str:
    """16 hex digits (64 bits) of the sha256 of the normalised text."""
    return hashlib.sha256(normalise_prompt(text).encode("utf-8")).hexdigest()[:16]


def split_keys(conversation) -> list[str]:
    """The keys of a conversation (an eagle3.data.samples.Conversation): its user messages', in order and each once,
    or its own id if it has none (nothing prompts it, so it shares no prompt)."""
    keys = [prompt_key(m["content"]) for m in conversation.messages if m["role"] == "user"]
    return list(dict.fromkeys(keys)) or [conversation.sample_id]


def part_of_key(key: str, val_fraction: float) -> str:
    bucket = int(key, 16) % BUCKETS
    if bucket < val_fraction / 2 * BUCKETS:
        return EVALUATION
    return VALIDATION if bucket < val_fraction * BUCKETS else TRAINING


def part_of_keys(keys, val_fraction: float) -> str:
    """The most held-out part of the keys' buckets."""
    return min((part_of_key(key, val_fraction) for key in keys), key=HELD_OUT_FIRST.index)


@dataclass(frozen=True)
class Split:
    """The run's split: keys of its conversations, train.val_fraction, and the lineage's pinned evaluation set."""

    keys: dict[str, list[str]]  # conversation id -> its split keys
    val_fraction: float
    pinned_ids: frozenset[str] = frozenset()
    pinned_keys: frozenset[str] = frozenset()
    source: Path | None = field(default=None, compare=False)  # the conversations file (named in errors)

    def part_of_conversation(self, conversation_id: str) -> str:
        try:
            keys = self.keys[conversation_id]
        except KeyError:
            raise SplitError(
                f"conversation {conversation_id} is in the run's samples but not in {self.source}: the file changed "
                "since extract read it. Restore it, or run extract again (clear the run's extract tasks)"
            ) from None
        if conversation_id in self.pinned_ids or not self.pinned_keys.isdisjoint(keys):
            return EVALUATION
        return part_of_keys(keys, self.val_fraction)

    def part(self, sample_id: str) -> str:
        return self.part_of_conversation(conversation_id_of(sample_id))

    def parts(self, sample_ids) -> dict[str, list[str]]:
        """{part: its sample ids, sorted}."""
        out: dict[str, list[str]] = {TRAINING: [], VALIDATION: [], EVALUATION: []}
        for sample_id in sorted(sample_ids):
            out[self.part(sample_id)].append(sample_id)
        return out

    def pinned_out(self, sample_ids) -> int:
        """How many of these samples the pinned set takes out of the part their bucket gives them."""
        return sum(
            self.part_of_conversation(c) == EVALUATION != part_of_keys(self.keys[c], self.val_fraction)
            for c in map(conversation_id_of, sample_ids)
        )


def source_stamp(path: Path) -> dict:
    stat = Path(path).stat()
    return {"path": str(Path(path).resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def conversation_keys(cfg: RunConfig, conversations=None) -> dict[str, list[str]]:
    """{conversation id: split keys} of every conversation of cfg.conversations_path, from RUN_DIR/split/keys.json
    while it was made by this rule from the file as it is (or the file is gone: a conversation id is a hash of the
    conversation, so a key recorded for it is never wrong, at most missing); else computed (from `conversations`,
    when the caller has read them already) and written there."""
    path = Path(cfg.conversations_path)
    cache = cfg.run_dir / SPLIT_KEYS
    stamp = {"rule": SPLIT_RULE, "source": source_stamp(path) if path.exists() else None}
    try:
        cached = json.loads(cache.read_text())
    except (FileNotFoundError, ValueError):
        cached = None
    if (
        isinstance(cached, dict)
        and cached.get("rule") == SPLIT_RULE
        and (stamp["source"] is None or cached.get("source") == stamp["source"])
    ):
        if stamp["source"] is None:
            log.info("split: %s is gone; the keys recorded in %s are used", path, cache)
        return cached["keys"]
    if conversations is None:
        # "skip": a stage that trains on the file has already refused it if its bad lines are errors.
        conversations, _ = read_conversations(path, "skip", None, cfg.conversations_missing_hint)
    keys = {c.sample_id: split_keys(c) for c in conversations}
    if stamp["source"] is not None:
        atomic_write_text(cache, json.dumps({**stamp, "keys": keys}) + "\n")
    return keys


def pinned_set(cfg: RunConfig) -> tuple[frozenset[str], frozenset[str]]:
    """(conversation ids, keys) of the lineage's pinned evaluation set; empty before its first run pins one."""
    pinned = Lineage(cfg).eval_set()
    if pinned is None:
        return frozenset(), frozenset()
    return frozenset(pinned["conversation_ids"]), frozenset(pinned["split_keys"])


def run_split(cfg: RunConfig, conversations=None) -> Split:
    """The run's split, with the lineage's pinned evaluation set as it stands now."""
    keys = conversation_keys(cfg, conversations)
    pinned_ids, pinned_keys = pinned_set(cfg)
    return Split(keys, cfg.train.val_fraction, pinned_ids, pinned_keys, Path(cfg.conversations_path))
