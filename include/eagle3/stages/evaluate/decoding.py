"""How evaluate decodes: the drafter's chain of k drafts, the verify rules (GreedyRule: the longest prefix that
agrees with the target, then its own next token; SamplingRule: the speculative sampling rule SGLang and vLLM apply),
and one decoding loop with a drafter and one without. Also the run's sampling (answer_sampling) and each answer's seed.
"""

from __future__ import annotations

import math
import zlib
from typing import TYPE_CHECKING

import torch

from eagle3.engines import GREEDY, Sampling, reached_per_step

if TYPE_CHECKING:
    from eagle3.config import RunConfig


def draft_chain(drafter, draft_to_target, aux, next_ids, k: int) -> list[int]:
    """k greedy draft tokens after the context. aux: [n, 3H] target features of positions 0..n-1;
    next_ids: [n] the token after each position (the last one is the target's newest token)."""
    n = len(next_ids)
    ids = torch.as_tensor(next_ids)[None]
    positions = torch.arange(n)[None]
    hidden, cache, drafts = drafter.fc(aux.float()[None]), [], []
    for i in range(k):
        logits, hidden = drafter.step(ids, hidden, positions + i, cache)
        token = int(draft_to_target[logits[0, -1].argmax()])
        drafts.append(token)
        ids = ids.clone()
        ids[0, -1] = token  # only the last position's output is used
    return drafts


class GreedyRule:
    """Greedy verification: the target's token is its likeliest; a draft is accepted where it is that token."""

    def first(self, logits: torch.Tensor) -> int:
        """The target's token after a context, from the last position's logits."""
        return int(logits.argmax())

    def verify(self, logits: torch.Tensor, drafts: list[int], eos: set[int]) -> tuple[int, int | None]:
        """(drafts accepted, the target's own token after them; None when an accepted end of turn ends the answer)
        from the logits after the committed token and after each draft ([k + 1, V])."""
        predictions = logits.argmax(-1).tolist()  # the target's token after each candidate token
        a = 0
        while a < len(drafts) and drafts[a] == predictions[a]:
            a += 1
            if drafts[a - 1] in eos:  # an accepted end of turn is committed, as SGLang does, and ends the answer
                return a, None
        return a, predictions[a]


class SamplingRule:
    """Verification at a temperature, as SGLang (tree_speculative_sampling_target_only) and vLLM (its rejection
    sampler without draft probabilities) verify a chain: a draft is a point mass, so draft j is accepted with the
    target's probability of it, min(1, p/q) with q = 1; the first rejected one is replaced by a token drawn from the
    target's distribution without it, and after k accepted drafts the target's next token is drawn as usual. Each
    answer is then a sample of the target's own sampling (Leviathan et al., 2023), whatever the drafter proposes."""

    def __init__(self, sampling: Sampling, generator: torch.Generator):
        self.sampling, self.generator = sampling, generator

    def draw(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def first(self, logits: torch.Tensor) -> int:
        return self.draw(sampling_probs(logits, self.sampling))

    def verify(self, logits: torch.Tensor, drafts: list[int], eos: set[int]) -> tuple[int, int | None]:
        probs = sampling_probs(logits, self.sampling)
        a = 0
        while a < len(drafts) and float(torch.rand((), generator=self.generator)) < float(probs[a, drafts[a]]):
            a += 1
            if drafts[a - 1] in eos:
                return a, None
        if a == len(drafts):
            return a, self.draw(probs[a])
        rest = probs[a].clone()  # draft a was rejected: the target's token comes from the rest of its distribution
        rest[drafts[a]] = 0.0
        return a, self.draw(rest)


def speculative_decode(
    target,
    drafter,
    draft_to_target,
    prompt: list[int],
    k: int,
    max_new: int,
    eos: set[int],
    rule: GreedyRule | SamplingRule,
):
    """Decoding with k-token greedy chain drafts, each verify step judged by `rule`. Returns (new tokens, drafts of
    each cycle that reached them)."""
    seq = list(prompt)
    logits, aux = target.logits_and_aux(seq)
    token = rule.first(logits[-1])
    accepted = []
    while len(seq) - len(prompt) < max_new and token not in eos:
        drafts = draft_chain(drafter, draft_to_target, aux[: len(seq)], seq[1:] + [token], k)
        logits, aux = target.logits_and_aux(seq + [token] + drafts)
        a, following = rule.verify(logits[len(seq) :], drafts, eos)
        seq += [token] + drafts[:a]
        accepted.append(a)
        if following is None:  # an accepted end of turn
            break
        token = following
    else:
        if token in eos and len(seq) - len(prompt) < max_new:
            seq.append(token)
    answer = seq[len(prompt) : len(prompt) + max_new]
    return answer, reached_per_step(accepted, len(answer))  # a last cycle cut at max_new counts what reached it


def plain_decode(target, prompt: list[int], max_new: int, eos: set[int], rule: GreedyRule | SamplingRule) -> list[int]:
    seq = list(prompt)
    while len(seq) - len(prompt) < max_new:
        token = rule.first(target.logits_and_aux(seq)[0][-1])
        seq.append(token)
        if token in eos:
            break
    return seq[len(prompt) :]


GREEDY_RULE = GreedyRule()


def speculative_greedy(target, drafter, draft_to_target, prompt: list[int], k: int, max_new: int, eos: set[int]):
    """speculative_decode with greedy verification (the reference others are compared with: bench, stand-ins)."""
    return speculative_decode(target, drafter, draft_to_target, prompt, k, max_new, eos, GREEDY_RULE)


def plain_greedy(target, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    return plain_decode(target, prompt, max_new, eos, GREEDY_RULE)


def answer_sampling(cfg: RunConfig) -> Sampling:
    """evaluate.sampling: greedy, or the target's serving sampling (generate's, as init resolved it)."""
    if cfg.evaluate.sampling == "greedy":
        return GREEDY
    gen = cfg.generate
    if not gen.temperature:
        return GREEDY
    return Sampling(gen.temperature, gen.top_p, gen.top_k or None)


def sampling_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The distribution the target samples from after each row of logits: temperature, then top_k, then top_p (the
    smallest set of likeliest tokens whose probabilities reach it), as SGLang and vLLM apply them."""
    logits = logits.float() / sampling.temperature
    if sampling.top_k:
        kth = logits.topk(min(sampling.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1:
        ordered, order = probs.sort(dim=-1, descending=True)
        beyond = ordered.cumsum(-1) - ordered >= sampling.top_p  # the tokens after the set already reached top_p
        probs = torch.zeros_like(probs).scatter(-1, order, ordered.masked_fill(beyond, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def answer_seed(cfg: RunConfig, what: str, index: int) -> int:
    """The seed of one sampled answer: the run's seed, what is measured (the baseline, each k: independent draws)
    and the prompt's place, so that a rerun draws the same answers."""
    return (cfg.seed * 1_000_003 + zlib.crc32(what.encode()) * 10_007 + index) % 2**63
