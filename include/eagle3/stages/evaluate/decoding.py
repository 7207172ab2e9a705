"""How evaluate decodes: the drafter's chain of k drafts, the verify rules (GreedyRule: the longest prefix that
agrees with the target, then its own next token; SamplingRule: the speculative sampling rule SGLang and vLLM apply),
one decoding loop with a drafter and one without, and the greedy answer confirmed from a proposed one. Also the run's
sampling (answer_sampling) and each answer's seed.
"""

from __future__ import annotations

import math
import zlib
from typing import TYPE_CHECKING

import torch

from eagle3.engines import GREEDY, Sampling, reached_per_step

if TYPE_CHECKING:
    from eagle3.config import RunConfig


def draft_chains(drafter, draft_to_target, auxes: list, nexts: list[list[int]], k: int) -> list[list[int]]:
    """k greedy draft tokens after each context, the contexts drafted together right-padded (the drafter's attention
    is causal, so a row never reads its padding). auxes[i]: [n_i, 3H] target features of positions 0..n_i-1;
    nexts[i]: [n_i] the token after each position (the last one is the target's newest token)."""
    lengths = torch.tensor([len(n) for n in nexts])
    width, rows = int(lengths.max()), torch.arange(len(nexts))
    ids = torch.zeros(len(nexts), width, dtype=torch.long)
    aux = torch.zeros(len(nexts), width, auxes[0].shape[-1])
    for row, (features, next_ids) in enumerate(zip(auxes, nexts, strict=True)):
        ids[row, : len(next_ids)] = torch.as_tensor(next_ids)
        aux[row, : len(next_ids)] = features.float()
    positions = torch.arange(width)[None].expand(len(nexts), width)
    hidden, cache, last, drafts = drafter.fc(aux), [], lengths - 1, []
    for i in range(k):
        logits, hidden = drafter.step(ids, hidden, positions + i, cache)
        tokens = draft_to_target[logits[rows, last].argmax(-1)]
        drafts.append(tokens.tolist())
        ids = ids.clone()
        ids[rows, last] = tokens  # only each row's last position's output is used
    return [list(chain) for chain in zip(*drafts)]


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


class Answer:
    """One prompt's speculative decoding so far: the sequence, the target's token not yet committed, each verify
    step's accepted drafts."""

    def __init__(self, prompt: list[int], rule: GreedyRule | SamplingRule):
        self.prompt, self.seq, self.rule, self.accepted = prompt, list(prompt), rule, []
        self.token, self.aux, self.ended = -1, None, False

    def new_tokens(self) -> int:
        return len(self.seq) - len(self.prompt)

    def running(self, max_new: int, eos: set[int]) -> bool:
        """Whether another verify step is due: the token not yet committed neither ends the turn nor fills
        max_new (an engine stops there, before a step whose drafts could not reach the answer)."""
        return not self.ended and self.new_tokens() + 1 < max_new and self.token not in eos


def speculative_decode_rows(
    target,
    drafter,
    draft_to_target,
    prompts: list[list[int]],
    k: int,
    max_new: int,
    eos: set[int],
    rules: list[GreedyRule | SamplingRule],
) -> list[tuple[list[int], list[int]]]:
    """Decoding with k-token greedy chain drafts, each verify step judged by the prompt's rule, the prompts drafted
    and verified together (target.logits_and_aux_rows: one forward pass for all of them). Each answer is what
    decoding its prompt alone gives. Returns (new tokens, drafts of each verify step that reached them) per prompt."""
    answers = [Answer(prompt, rule) for prompt, rule in zip(prompts, rules, strict=True)]
    for answer, (logits, aux) in zip(answers, target.logits_and_aux_rows(prompts)):
        answer.token, answer.aux = answer.rule.first(logits[-1]), aux
    while running := [a for a in answers if a.running(max_new, eos)]:
        contexts = [a.aux[: len(a.seq)] for a in running]
        chains = draft_chains(drafter, draft_to_target, contexts, [a.seq[1:] + [a.token] for a in running], k)
        verified = target.logits_and_aux_rows([a.seq + [a.token] + drafts for a, drafts in zip(running, chains)])
        for answer, drafts, (logits, aux) in zip(running, chains, verified):
            accepted, following = answer.rule.verify(logits[len(answer.seq) :], drafts, eos)
            answer.seq += [answer.token] + drafts[:accepted]
            answer.accepted.append(accepted)
            answer.aux = aux
            if following is None:  # an accepted end of turn
                answer.ended = True
            else:
                answer.token = following
    results = []
    for answer in answers:
        if not answer.ended and answer.new_tokens() < max_new:  # the last token committed: an end of turn, or the cut
            answer.seq.append(answer.token)
        tokens = answer.seq[len(answer.prompt) : len(answer.prompt) + max_new]
        results.append((tokens, reached_per_step(answer.accepted, len(tokens))))  # a cut last step counts what reached
    return results


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
    """speculative_decode_rows for one prompt: (new tokens, drafts of each verify step that reached them)."""
    return speculative_decode_rows(target, drafter, draft_to_target, [prompt], k, max_new, eos, [rule])[0]


def plain_decode(target, prompt: list[int], max_new: int, eos: set[int], rule: GreedyRule | SamplingRule) -> list[int]:
    seq = list(prompt)
    while len(seq) - len(prompt) < max_new:
        token = rule.first(target.logits_and_aux(seq)[0][-1])
        seq.append(token)
        if token in eos:
            break
    return seq[len(prompt) :]


def confirmed_greedy_rows(
    target, prompts: list[list[int]], proposals: list[list[int]], max_new: int, eos: set[int]
) -> list[list[int]]:
    """The target's greedy answer to each prompt, from a proposed one (a speculative answer): one forward pass over
    every prompt + proposal checks that each proposed token is the target's likeliest after those before it, and
    plain decoding goes on from the first that is not, or from a proposal that stops short of an end of turn and
    max_new. Where the proposals are right this costs one pass instead of one per token."""
    proposed = []
    for proposal in proposals:
        ends = next((i + 1 for i, token in enumerate(proposal) if token in eos), len(proposal))
        proposed.append(proposal[: min(ends, max_new)])
    checked = iter(target.logits_and_aux_rows([p + a for p, a in zip(prompts, proposed, strict=True) if a]))
    answers = []
    for prompt, answer in zip(prompts, proposed):
        if answer:
            predictions = next(checked)[0][len(prompt) - 1 :].argmax(-1).tolist()
            agreed = next((j for j, token in enumerate(answer) if predictions[j] != token), len(answer))
            if agreed == len(answer) and (answer[-1] in eos or len(answer) == max_new):
                answers.append(answer)
                continue
            answer = answer[:agreed]
        answers.append(answer + plain_decode(target, prompt + answer, max_new - len(answer), eos, GREEDY_RULE))
    return answers


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
