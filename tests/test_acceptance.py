"""Acceptance length counted one way everywhere (eagle3.model.acceptance): hand-computed cycles of greedy speculative
decoding replayed on a stored answer, the ceiling, and the interval over prompts."""

from __future__ import annotations

import numpy as np
import pytest

from eagle3.model.acceptance import ceiling_cycles, committed_tokens, figures, interval95, replay

# A stored sample: a 3-token prompt (0-2), a 6-token answer (3-8, token 8 its end of turn), 2 tokens after it.
ANSWER = np.array([0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0], dtype=bool)


def agreeing(*chains: tuple[int, int]) -> np.ndarray:
    """[7 steps, T] agreement: at each (position, n) the drafter's first n steps agree with the target."""
    agrees = np.zeros((7, len(ANSWER)), dtype=bool)
    for position, n in chains:
        agrees[:n, position] = True
    return agrees


def test_acceptance_figures_in_each_convention():
    # Three answers: cycles accepting (2, 0), (3,), (1, 1, 0) drafts of k=3; the second ends on its third draft (no
    # bonus token), the others on a bonus token: 3 + 1, 3, 2 + 2 + 1 tokens committed after prefill's first.
    result = figures([2, 3, 1, 0, 1, 0], [2, 3, 1], k=3, committed=12)
    assert result["accept_length"] == 12 / 6  # tokens committed per verify step
    assert result["sglang_accept_length"] == 1 + 7 / 6  # SGLang's scheduler count: a bonus token every step
    assert result["first_cycle_accept_length"] == 1 + 6 / 3
    assert result["later_cycles_accept_length"] == 1 + 1 / 3
    assert result["accept_rate_per_position"] == [4 / 6, 2 / 4, 1 / 2]


def test_a_drafter_that_always_agrees_reaches_the_ceiling_and_stops_at_the_end_of_turn():
    """Prefill commits token 3; from position 2 the drafts are tokens 4, 5, 6 and the bonus 7; from position 6 one
    draft is left (the end of turn, token 8): [3, 1], the ceiling of a 6-token answer at k=3. Agreement past the end
    of turn (positions 7, 8) counts for nothing: decoding never drafts there."""
    assert replay(np.ones((7, len(ANSWER)), dtype=bool), ANSWER, 3) == ([3, 1], [3]) == (ceiling_cycles(6, 3), [3])
    assert replay(np.ones((7, len(ANSWER)), dtype=bool), ANSWER, 7) == ([5], [5]) == (ceiling_cycles(6, 7), [5])


def test_a_drafter_that_never_agrees_commits_one_token_a_step():
    assert replay(np.zeros((7, len(ANSWER)), dtype=bool), ANSWER, 3) == ([0, 0, 0, 0, 0], [0])


def test_cycles_start_where_decoding_drafts_next_not_at_every_position():
    """From position 2 two drafts agree (tokens 4, 5), the bonus is token 6: the next cycle drafts from position 5,
    whatever positions 3 and 4 would have drafted. There one draft agrees (token 7), the bonus is the end of turn."""
    cycles, first = replay(agreeing((2, 2), (3, 3), (4, 3), (5, 1)), ANSWER, 3)
    assert (cycles, first) == ([2, 1], [2])
    # From position 5 three drafts agree, but only tokens 7 and 8 are the answer's: the chain stops at its end.
    assert replay(agreeing((2, 2), (5, 3)), ANSWER, 3) == ([2, 2], [2])


def test_each_answer_of_a_sample_has_its_own_first_cycle():
    answer = np.array([0, 1, 1, 0, 0, 1, 1, 1, 0], dtype=bool)
    assert replay(np.ones((7, len(answer)), dtype=bool), answer, 3) == ([1, 2], [1, 2])
    assert committed_tokens(answer) == 1 + 2  # each answer's first token came from prefill


def test_an_answer_that_ends_on_an_accepted_draft_commits_no_bonus_token():
    """The 6-token answer at k=3 with a drafter that always agrees: prefill commits token 3, the first step tokens
    4-7 (3 drafts and a bonus), the second the end of turn alone (its one draft, no bonus: the answer is over). 5
    tokens in 2 steps: 2.5 a step, where SGLang's count says 1 + 4 / 2 = 3."""
    cycles, first = replay(np.ones((7, len(ANSWER)), dtype=bool), ANSWER, 3)
    result = figures(cycles, first, k=3, committed=committed_tokens(ANSWER))
    assert (result["accept_length"], result["sglang_accept_length"]) == (2.5, 3.0)


def test_the_interval_is_a_point_for_identical_prompts_and_holds_the_mean():
    assert interval95([(6, 3)] * 20) == (2.0, 2.0)
    per_prompt = [(committed, 5) for committed in (5, 7, 10, 14, 6, 8, 12, 9)]
    low, high = interval95(per_prompt)
    mean = sum(a for a, _ in per_prompt) / sum(c for _, c in per_prompt)
    assert low < mean < high and high - low < 2
    assert interval95(per_prompt) == (low, high)  # seeded: the same report twice


@pytest.mark.parametrize("length, k, expected", [(1, 3, []), (2, 3, [1]), (5, 3, [3]), (9, 3, [3, 3])])
def test_the_ceiling_commits_k_drafts_and_a_bonus_token_a_step(length, k, expected):
    assert ceiling_cycles(length, k) == expected
