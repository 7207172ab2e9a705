"""How much of one set of texts another already holds: verbatim (after normalisation) and near-duplicate (MinHash over
word 4-grams, banded for candidates), at the cost of one pass over each text, so it scales to a Kimi run's answers.

Used by evaluate on the held-out answers against the training answers: a drafter measured on answers it trained on
word for word measures memory, not drafting (issue 53's demo: 758 of 758)."""

from __future__ import annotations

import hashlib
import unicodedata
from collections import defaultdict

import numpy as np

SHINGLE_WORDS = 4
HASHES, BANDS = 32, 8  # 8 bands of 4 rows: pairs near 0.6 Jaccard and above become candidates
NEAR = 0.8  # estimated Jaccard of the word 4-grams at or above which two texts are near-duplicates
_MIX = np.random.default_rng(20261207).integers(1, 2**63, size=(2, HASHES), dtype=np.uint64) | np.uint64(1)


def normalise(text: str) -> str:
    """NFKC, case folded, whitespace collapsed: spellings of one text merge, and no more (punctuation and digits
    stay). Also the text a split key is taken of (eagle3.stages.split)."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def signature(text: str) -> np.ndarray:
    """MinHash of the text's word 4-grams (the whole text when it is shorter): [HASHES] uint64."""
    words = normalise(text).split()
    grams = {" ".join(words[i : i + SHINGLE_WORDS]) for i in range(max(len(words) - SHINGLE_WORDS + 1, 1))}
    shingles = np.array([_hash64(g) for g in grams], dtype=np.uint64)
    with np.errstate(over="ignore"):  # multiply-add modulo 2**64: a family of universal hashes
        return (shingles[None, :] * _MIX[0][:, None] + _MIX[1][:, None]).min(axis=1)


def overlap(held: list[str], seen: list[str]) -> dict:
    """Of the `held` texts: how many `seen` holds verbatim (normalised), and how many more it holds a near-duplicate
    of (estimated Jaccard >= NEAR)."""
    seen_texts = {normalise(text) for text in seen}
    verbatim = [normalise(text) in seen_texts for text in held]
    rows = HASHES // BANDS
    buckets: dict[tuple[int, bytes], list[np.ndarray]] = defaultdict(list)
    for text in seen:
        sig = signature(text)
        for band in range(BANDS):
            buckets[band, sig[band * rows : (band + 1) * rows].tobytes()].append(sig)
    near = 0
    for text, exact in zip(held, verbatim):
        if exact:
            continue
        sig = signature(text)
        candidates = (
            c for band in range(BANDS) for c in buckets.get((band, sig[band * rows : (band + 1) * rows].tobytes()), ())
        )
        near += any(np.mean(c == sig) >= NEAR for c in candidates)
    return {
        "answers": len(held),
        "verbatim": sum(verbatim),
        "verbatim_share": sum(verbatim) / max(len(held), 1),
        "near_duplicates": near,
    }
