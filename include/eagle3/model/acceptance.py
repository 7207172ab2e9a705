"""Acceptance length, counted one way wherever it is figured: from the drafts each verify step (cycle) accepted.

  measured  (eagle3.stages.evaluate)  cycles of real speculative decoding, on the HF target or in a serving engine
  offline   (eagle3.stages.train)     the cycles greedy decoding would run over a stored answer, replayed on its stored
                               states with the drafter's own chains (replay): what picks the best checkpoint
  ceiling                      a drafter that always agrees with the target, on the same answers (ceiling)

Three conventions, each under its own name (docs/decisions/2026-12-07-acceptance-conventions.md):
  accept_length                       the headline: tokens committed per verify step (an answer's tokens after
                                      prefill's first, over its verify steps); a step whose accepted drafts end the
                                      answer commits no bonus token
  sglang_accept_length                SGLang's scheduler metric avg_spec_accept_length: 1 + drafts accepted per verify
                                      step, a bonus token counted every step
  completion_tokens_per_verify_step   N/S, SpecForge's bench_eagle3 and meta_info's spec_accept_length: prefill's
                                      token counted too
They meet on long answers; on short ones the headline is the lowest. The first cycle of an answer (drafted right
after prefill, from the prompt's last token) is shown apart from the later ones, in SGLang's count.

Offline, position t of a stored sample drafts as decoding would after committing token t+1 (the drafter's input at t
is token t+1; draft step j predicts token t+2+j). A cycle can start at t only inside an answer: tokens t+1 and t+2
are both answer tokens (loss_mask). Its chain is the drafter's drafts that agree with the target, step after step,
never past the answer's last token (its end of turn), and at most k long. The next cycle starts at t + accepted + 1,
after the target's bonus token, as in decoding. With the target's own greedy answers stored (generate on) this is
greedy speculative decoding itself, up to the arithmetic of the stored states; every answer position is not a cycle
start, so averaging chains over all of them (or multiplying per-step accuracies) figures something else.
"""

from __future__ import annotations

import math

import numpy as np


def figures(cycles: list[int], first_cycles: list[int], k: int, committed: int) -> dict:
    """Acceptance of one draft length from the drafts accepted in each cycle (`first_cycles`: those of the answers'
    first cycles, also in `cycles`) and the tokens those cycles committed (committed_tokens)."""

    def per_step(accepted: int, steps: int) -> float:
        return 1 + accepted / max(steps, 1)

    reached = [sum(a >= j for a in cycles) for j in range(k + 1)]
    later = (sum(cycles) - sum(first_cycles), len(cycles) - len(first_cycles))
    return {
        "accept_length": committed / max(len(cycles), 1),
        "sglang_accept_length": per_step(sum(cycles), len(cycles)),
        "first_cycle_accept_length": per_step(sum(first_cycles), len(first_cycles)),
        "later_cycles_accept_length": per_step(*later),
        "accept_rate_per_position": [reached[j + 1] / max(reached[j], 1) for j in range(k)],
        "cycles": len(cycles),
    }


def committed_tokens(answer) -> int:
    """Tokens the verify steps over a stored sample commit: each answer token that follows another (an answer's
    first token comes from prefill, or from the step that ended the turn before)."""
    answer = np.asarray(answer, dtype=bool)
    return int((answer[1:] & answer[:-1]).sum())


def answer_tokens_ahead(answer: np.ndarray) -> np.ndarray:
    """For each position t, how many answer tokens follow it without a break (tokens t+1, t+2, ...)."""
    answer = np.append(np.asarray(answer, dtype=bool), False)
    n = len(answer)
    next_break = np.minimum.accumulate(np.where(answer, n, np.arange(n))[::-1])[::-1]  # first non-answer at or after i
    run = next_break - np.arange(n)  # answer tokens from i on
    return run[1:]  # ahead[t] = run[t + 1]


def replay(agrees: np.ndarray, answer: np.ndarray, k: int) -> tuple[list[int], list[int]]:
    """(drafts accepted per cycle, those of first cycles) of greedy decoding with chains of k drafts over one stored
    sample. agrees: [steps, T] bool, whether draft step j at position t equals the target's token t+2+j (the
    training-time-test unroll of the stored states); answer: [T] bool, the answer tokens (the sample's loss_mask).
    Chains longer than the unrolled steps are cut at them."""
    ahead = answer_tokens_ahead(answer)
    steps = min(k, len(agrees))
    leading = np.cumprod(np.asarray(agrees[:steps], dtype=np.int64), axis=0).sum(0)
    chain = np.minimum(leading, ahead - 1)  # not past the answer's last token
    cycles, first_cycles, next_start = [], [], 0
    for t in np.flatnonzero(ahead >= 2):  # tokens t+1 and t+2 are the answer's: decoding drafts from t
        if t < next_start:
            continue
        accepted = int(chain[t])
        cycles.append(accepted)
        if not answer[t]:  # token t is the prompt's last: the answer's first token came from prefill
            first_cycles.append(accepted)
        next_start = t + accepted + 1
    return cycles, first_cycles


def ceiling_cycles(answer_length: int, k: int) -> list[int]:
    """Drafts accepted per cycle by a drafter that always agrees with the target, on an answer of `answer_length`
    tokens: prefill commits the first, each cycle k drafts and a bonus token, the last cycle only what is left."""
    cycles, committed = [], 1
    while committed < answer_length:
        cycles.append(min(k, answer_length - committed))
        committed += k + 1
    return cycles


def interval95(per_prompt: list[tuple[int, int]], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95% bootstrap interval (percentiles) of the acceptance length sum(committed) / sum(verify steps), from each
    prompt's (tokens committed, verify steps): prompts are resampled, as another set of the same size drawn from the
    same source would differ."""
    if not per_prompt:
        return math.nan, math.nan
    counts = np.asarray(per_prompt, dtype=np.int64)
    drawn = counts[np.random.default_rng(seed).integers(0, len(counts), size=(resamples, len(counts)))]
    means = drawn[..., 0].sum(1) / np.maximum(drawn[..., 1].sum(1), 1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def same_distribution_p(
    plain: list[list[int]],
    drawn: list[list[int]],
    positions: range = range(1, 9),
    permutations: int = 2000,
    seed: int = 0,
) -> float:
    """Whether answers sampled with a drafter follow plain sampling's distribution, from one answer of each per prompt
    (the same prompts, drawn independently): the p-value of a paired permutation test. Statistic: at each answer
    position in `positions` (prefill's token 0 is left out: no drafter decides it), the total variation distance
    between the two sides' token histograms (an answer that ended counts as "ended"), summed. Under the null a
    prompt's two answers are exchangeable, so swapping them leaves the statistic's distribution as it is; the
    p-value is the share of random swaps that reach the observed statistic, counting the observation itself.
    A small p-value says the two differ: a lossy verification rule, or an engine that is not exact."""
    n = len(plain)
    if n == 0 or len(drawn) != n:
        raise ValueError(f"need one answer of each kind per prompt, got {n} plain and {len(drawn)} drawn")
    rng = np.random.default_rng(seed)
    signs = np.vstack([np.ones(n), rng.choice([-1.0, 1.0], size=(permutations, n))])  # row 0: as observed
    rows = np.arange(len(signs))[:, None]
    statistic = np.zeros(len(signs))
    for j in positions:
        tokens = [a[j] if j < len(a) else -1 for a in plain] + [a[j] if j < len(a) else -1 for a in drawn]
        _, category = np.unique(np.asarray(tokens), return_inverse=True)
        categories = int(category.max()) + 1
        ours, theirs = (rows * categories + category[:n]).ravel(), (rows * categories + category[n:]).ravel()
        weights = np.broadcast_to(signs, signs.shape).ravel()
        size = len(signs) * categories
        difference = np.bincount(ours, weights, size) - np.bincount(theirs, weights, size)
        statistic += 0.5 * np.abs(difference.reshape(len(signs), categories)).sum(1) / n
    return float((1 + np.sum(statistic[1:] >= statistic[0] - 1e-12)) / (1 + permutations))
