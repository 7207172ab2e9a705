"""Held-out answers against training answers: verbatim after normalisation, near-duplicates by MinHash, and texts
that only share words counted as neither."""

from __future__ import annotations

import random

from eagle3.data.overlap import overlap


def test_verbatim_and_near_duplicate_answers_are_counted_apart_and_unrelated_ones_not_at_all():
    rng = random.Random(0)
    words = [f"w{i}" for i in range(500)]
    seen = [" ".join(rng.choices(words, k=40)) for _ in range(300)]
    verbatim = [seen[3].upper(), "  ".join(seen[7].split())]  # case and spacing do not hide a copy
    near = [seen[11] + " and one more word", " ".join(seen[12].split()[1:])]  # one word added, one removed
    unrelated = [" ".join(rng.choices(words, k=40)) for _ in range(20)]  # the same vocabulary, another order
    shuffled = [" ".join(rng.sample(seen[20].split(), 40))]  # the same words, none of their 4-grams
    figures = overlap(verbatim + near + unrelated + shuffled, seen)
    assert figures == {"answers": 25, "verbatim": 2, "verbatim_share": 2 / 25, "near_duplicates": 2}


def test_short_answers_are_compared_whole():
    assert overlap(["12 13 14.", "yes"], ["12 13 14 15.", "Yes"])["verbatim"] == 1
    assert overlap(["12 13 14."], ["12 13 14 15."])["near_duplicates"] == 0
