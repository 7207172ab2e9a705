"""Which samples train, which choose the checkpoint, which are evaluated: a split by the first user prompt.

A conversation's split key is prompt_key of its first user message, or its own id when it has none; every sample of
the conversation (its own and its per-turn "<id>.<turn>") takes its part, so no first prompt is on two sides. The
key's text (normalise_prompt) is NFKC, case folded, whitespace collapsed: it merges spellings of one question and no
more (punctuation and digits stay; the system prompt and tools are left out, as they barely change the answer).

Three disjoint parts, by the key's bucket (its 64 bits mod BUCKETS) against train.val_fraction:
  evaluation  bucket < val_fraction / 2: evaluate's and benchmark's prompts (eagle3.stages.evaluate.prompts)
  validation  val_fraction / 2 <= bucket < val_fraction: the trainer's validation, which picks the best checkpoint
  training    the rest: training, and the draft vocabulary's token counts (eagle3.stages.vocab)
A conversation of the lineage's pinned evaluation set (eagle3.records.lineage), by id or split key, is in evaluation
whatever its bucket. A part depends only on the key and the pinned set: new data never moves a conversation. A
sample whose conversation has no key (the file changed since extract read it) raises SplitError.

RUN_DIR/split/keys.json caches the keys of cfg.conversations_path (the regenerated ones when generate is on) with
SPLIT_RULE and the file's size and mtime; it is rebuilt when either changes, used as is when the file is gone, and
written atomically.

Why: docs/decisions/2026-12-04-split-by-first-prompt.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3.data.samples import conversation_id_of, read_conversations
from eagle3.disk.fsutil import atomic_write_text
from eagle3.disk.layout import SPLIT_KEYS
from eagle3.records.lineage import Lineage

if TYPE_CHECKING:
    from eagle3.config import RunConfig

log = logging.getLogger(__name__)

# Bump when the key or the parts change: the pinned sets and the training inputs' digest record it.
SPLIT_RULE = "first-user-prompt:nfkc-casefold-whitespace:1"
BUCKETS = 10_000
EVALUATION, VALIDATION, TRAINING = "evaluation", "validation", "training"


class SplitError(ValueError):
    """A sample the split cannot place; the message names the sample, the file and the fix."""


def normalise_prompt(text: str) -> str:
    """The text a split key is taken of (see the module docstring for why this much and no more)."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def prompt_key(text: str) -> str:
    """16 hex digits (64 bits) of the sha256 of the normalised text."""
    return hashlib.sha256(normalise_prompt(text).encode("utf-8")).hexdigest()[:16]


def split_key(conversation) -> str:
    """The key of a conversation (an eagle3.data.samples.Conversation): its first user message's, or its own id
    if it has none (nothing prompts it, so it shares no prompt)."""
    first = next((m["content"] for m in conversation.messages if m["role"] == "user"), None)
    return prompt_key(first) if first is not None else conversation.sample_id


def part_of_key(key: str, val_fraction: float) -> str:
    bucket = int(key, 16) % BUCKETS
    if bucket < val_fraction / 2 * BUCKETS:
        return EVALUATION
    return VALIDATION if bucket < val_fraction * BUCKETS else TRAINING


@dataclass(frozen=True)
class Split:
    """The run's split: keys of its conversations, train.val_fraction, and the lineage's pinned evaluation set."""

    keys: dict[str, str]  # conversation id -> split key
    val_fraction: float
    pinned_ids: frozenset[str] = frozenset()
    pinned_keys: frozenset[str] = frozenset()
    source: Path | None = field(default=None, compare=False)  # the conversations file (named in errors)

    def part_of_conversation(self, conversation_id: str) -> str:
        try:
            key = self.keys[conversation_id]
        except KeyError:
            raise SplitError(
                f"conversation {conversation_id} is in the run's samples but not in {self.source}: the file changed "
                "since extract read it. Restore it, or run extract again (clear the run's extract tasks)"
            ) from None
        if conversation_id in self.pinned_ids or key in self.pinned_keys:
            return EVALUATION
        return part_of_key(key, self.val_fraction)

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
            self.part_of_conversation(c) == EVALUATION != part_of_key(self.keys[c], self.val_fraction)
            for c in map(conversation_id_of, sample_ids)
        )


def source_stamp(path: Path) -> dict:
    stat = Path(path).stat()
    return {"path": str(Path(path).resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def conversation_keys(cfg: RunConfig, conversations=None) -> dict[str, str]:
    """{conversation id: split key} of every conversation of cfg.conversations_path, from RUN_DIR/split/keys.json
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
    keys = {c.sample_id: split_key(c) for c in conversations}
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
