"""Draft/target vocabulary mapping: which target tokens the drafter can propose.

    python -m eagle3 vocab --config RUN_DIR/config.json

The drafter's lm_head covers only `vocab.draft_vocab_size` tokens: the ones the target's assistant
turns use most, counted over THIS run's training samples (loss-masked positions; the training part of the
split, eagle3.stages.split: tokens of held-out answers are not counted, so the draft vocabulary learns nothing from the
prompts it is evaluated on). The mapping is therefore data-dependent: one built for other data covers this data less
well, which is why reusing one is allowed only after its coverage of this run's training samples is measured.

On disk ({run dir}/vocab_mapping/, written as a whole: temp dir, fsync, rename):
  d2t.npy    int64 [draft_vocab]   offsets: target id of draft id i = i + d2t[i]   (SGLang's convention)
  t2d.npy    bool  [target_vocab]  True where a target id is in the draft vocab
  meta.json  sizes, tokenizer fingerprint, token counts, digest of the counted tokens, coverage
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from eagle3.data.identity import TOKENIZER_FILES
from eagle3.data.store import open_run_store
from eagle3.disk.fsutil import atomic_dir
from eagle3.disk.layout import D2T_FILE, MAPPING_DIR, MAPPING_META, T2D_FILE
from eagle3.stages.split import TRAINING, run_split

if TYPE_CHECKING:
    from eagle3.config import RunConfig

log = logging.getLogger(__name__)


class VocabError(ValueError):
    """A mapping that cannot be built or reused; the message gives the figures and the fix."""


@dataclass(frozen=True)
class TokenCounts:
    counts: np.ndarray  # int64 [target_vocab]: occurrences at loss-masked positions
    digest: str  # sha256 over the counted (input_ids, loss_mask) of every sample, in sample-id order

    @property
    def total(self) -> int:
        return int(self.counts.sum())


@dataclass(frozen=True)
class VocabMapping:
    draft_ids: np.ndarray  # int64 [draft_vocab], ascending target ids

    def d2t(self) -> np.ndarray:
        return self.draft_ids - np.arange(len(self.draft_ids), dtype=np.int64)

    def t2d(self, target_vocab: int) -> np.ndarray:
        mask = np.zeros(target_vocab, dtype=bool)
        mask[self.draft_ids] = True
        return mask

    def coverage(self, counts: np.ndarray) -> float:
        """Share of loss-masked tokens whose id the draft vocab holds."""
        total = counts.sum()
        return float(counts[self.draft_ids].sum() / total) if total else 0.0


def count_tokens(store, target_vocab: int, sample_ids=None) -> TokenCounts:
    """Count target ids at loss-masked positions over `sample_ids` (default: the whole store); reads ids and
    masks only."""
    counts = np.zeros(target_vocab, dtype=np.int64)
    digest = hashlib.sha256()
    for sample_id in sorted(store.sample_ids if sample_ids is None else sample_ids):
        sample = store[sample_id]
        ids = sample["input_ids"].numpy()
        mask = sample["loss_mask"].numpy()
        if ids.size and ids.max() >= target_vocab:
            raise VocabError(f"sample {sample_id}: token id {ids.max()} >= the target's vocab size {target_vocab}")
        counts += np.bincount(ids[mask.astype(bool)], minlength=target_vocab)
        digest.update(sample_id.encode())
        digest.update(ids.tobytes())
        digest.update(mask.tobytes())
    return TokenCounts(counts, digest.hexdigest())


def select_draft_vocab(counts: np.ndarray, draft_vocab_size: int) -> VocabMapping:
    """The draft_vocab_size most frequent ids (ties: lower id first), padded with the lowest unseen ids
    when fewer were seen, sorted ascending."""
    if draft_vocab_size > len(counts):
        raise VocabError(f"vocab.draft_vocab_size {draft_vocab_size} exceeds the target vocab ({len(counts)})")
    by_frequency = np.lexsort((np.arange(len(counts)), -counts))  # last key is primary: count desc, then id
    seen = by_frequency[counts[by_frequency] > 0][:draft_vocab_size]
    if len(seen) < draft_vocab_size:
        unseen = np.flatnonzero(counts == 0)[: draft_vocab_size - len(seen)]
        seen = np.concatenate([seen, unseen])
    return VocabMapping(np.sort(seen).astype(np.int64))


def tokenizer_fingerprint(tokenizer_dir: str | Path) -> str:
    h = hashlib.sha256()
    found = []
    for name in TOKENIZER_FILES:
        path = Path(tokenizer_dir) / name
        if path.exists():
            found.append(name)
            h.update(name.encode())
            h.update(path.read_bytes())
    if not found:
        raise VocabError(f"{tokenizer_dir}: none of {TOKENIZER_FILES} found; cannot fingerprint the tokenizer")
    return h.hexdigest()


def load_mapping(directory: str | Path) -> tuple[VocabMapping, dict]:
    directory = Path(directory)
    try:
        meta = json.loads((directory / MAPPING_META).read_text())
        d2t = np.load(directory / D2T_FILE, allow_pickle=False)
    except FileNotFoundError as err:
        raise VocabError(f"{directory}: not a vocab mapping ({err.filename} missing)") from None
    return VocabMapping(d2t + np.arange(len(d2t), dtype=np.int64)), meta


def write_mapping(directory: Path, mapping: VocabMapping, target_vocab: int, meta: dict) -> None:
    """Write the three files into a temp dir, fsync them, rename the dir into place."""
    with atomic_dir(directory) as tmp:
        np.save(tmp / D2T_FILE, mapping.d2t())
        np.save(tmp / T2D_FILE, mapping.t2d(target_vocab))
        (tmp / MAPPING_META).write_text(json.dumps(meta, indent=2) + "\n")


def run_vocab(cfg: RunConfig) -> dict:
    """Build the run's mapping from its training samples, or reuse `vocab.reuse_from` if it covers them well
    enough."""
    out_dir = cfg.run_dir / MAPPING_DIR
    target_vocab, draft_vocab = cfg.target.vocab_size, cfg.vocab.draft_vocab_size
    fingerprint = tokenizer_fingerprint(cfg.tokenizer_dir)
    store = open_run_store(cfg)
    training = run_split(cfg).parts(store.sample_ids)[TRAINING]
    counts = count_tokens(store, target_vocab, training)
    if counts.total == 0:
        raise VocabError(
            f"{cfg.store_dir}: no loss-masked tokens in the run's {len(training)} training samples (of "
            f"{len(store.sample_ids)}); run extract first, or lower train.val_fraction"
        )

    if out_dir.exists():  # a retried task: done, if it was made from the same tokens
        _, meta = load_mapping(out_dir)
        if meta["source_tokens_digest"] != counts.digest:
            raise VocabError(
                f"{out_dir} was built from other samples than the run's training samples now are (the store, or the "
                "lineage's pinned evaluation set, changed since); delete it to build it again"
            )
        log.info("vocab: %s already built from this store; nothing to do", out_dir)
        return meta

    fresh = select_draft_vocab(counts.counts, draft_vocab)
    meta = {
        "target_vocab_size": target_vocab,
        "draft_vocab_size": draft_vocab,
        "tokenizer_fingerprint": fingerprint,
        "training_samples": len(training),
        "loss_tokens": counts.total,
        "distinct_tokens_seen": int((counts.counts > 0).sum()),
        "source_tokens_digest": counts.digest,
        "fresh_coverage": round(fresh.coverage(counts.counts), 6),
    }
    if cfg.vocab.reuse_from:
        mapping = check_reuse(
            cfg.vocab.reuse_from,
            fingerprint,
            target_vocab,
            draft_vocab,
            counts.counts,
            cfg.vocab.min_coverage,
            meta["fresh_coverage"],
        )
        meta |= {"reused_from": cfg.vocab.reuse_from, "coverage": round(mapping.coverage(counts.counts), 6)}
    else:
        mapping = fresh
        meta["coverage"] = meta["fresh_coverage"]
    write_mapping(out_dir, mapping, target_vocab, meta)
    log.info(
        "vocab: %d of %d target ids cover %.2f%% of %d loss-masked tokens -> %s",
        draft_vocab,
        target_vocab,
        100 * meta["coverage"],
        counts.total,
        out_dir,
    )
    return meta


def check_reuse(reuse_from, fingerprint, target_vocab, draft_vocab, counts, min_coverage, fresh_coverage):
    mapping, meta = load_mapping(reuse_from)
    if meta.get("tokenizer_fingerprint") != fingerprint:
        raise VocabError(f"vocab.reuse_from: {reuse_from} was built for another tokenizer; unset reuse_from")
    if (meta.get("target_vocab_size"), len(mapping.draft_ids)) != (target_vocab, draft_vocab):
        raise VocabError(
            f"vocab.reuse_from: {reuse_from} maps {len(mapping.draft_ids)} of {meta.get('target_vocab_size')} ids, "
            f"this run needs {draft_vocab} of {target_vocab}; unset reuse_from or match vocab.draft_vocab_size"
        )
    coverage = mapping.coverage(counts)
    if coverage < min_coverage:
        raise VocabError(
            f"vocab.reuse_from: {reuse_from} covers {coverage:.2%} of this run's loss-masked tokens, below "
            f"vocab.min_coverage ({min_coverage}); a mapping built from this data would cover "
            f"{fresh_coverage:.2%}. Unset vocab.reuse_from to build one (or lower vocab.min_coverage if you "
            "accept the loss)"
        )
    return mapping
