"""Measure acceptance length with real speculative decoding: offline on the HF target, or in the serving engine.

    python -m eagle3 evaluate --config RUN_DIR/config.json

For each draft length k in evaluate.draft_lengths, on held-out prompts (the evaluation part of the run's split by
first user prompt, eagle3.split; first and later user turns: held_out): greedy chain drafting of k tokens with the
EXPORTED drafter (RUN_DIR/drafter), verification by the target, accept the longest agreeing prefix plus the target's
own next token. With evaluate.sampling "serving" the answers are drawn at the target's serving temperature instead,
and each draft is accepted by the speculative sampling rule (SamplingRule), as SGLang and vLLM verify it. Where
(evaluate.backend):
  hf      in this process, the target in transformers, the drafter loaded as SGLang would (the export plus the
          target's embedding): the reference, for targets that fit one device
  server  in the serving engine (server.engine: SGLang on a GPU box, vLLM wherever it runs), started once without
          the drafter (greedy) and once per k with it, the prompts sent one at a time: what users get, and the only
          way for targets transformers cannot hold (Kimi-K2.5). Every engine counts the drafts of each verify step
          that reached the output (eagle3.engines), as the hf path does.
Writes {run dir}/evaluate/:
  report.json   per k: mean acceptance length (tokens committed per verify step: SGLang's scheduler metric
                avg_spec_accept_length, which benchmark reports too), the same for the first cycle of each
                answer (drafted right after prefill) and for the later ones, completion tokens per verify
                step (meta_info's spec_accept_length, labelled), the acceptance rate of each draft
                position (where the engine reports steps: not SGLang), a 95% interval over prompts, the ceiling
                (a drafter that always agrees with the target, on the same answers) and the share of it reached
                (eagle3.acceptance); beside them the offline figure training picked the checkpoint by (decoding
                replayed on the validation split); and whether every speculative output equalled plain greedy
                decoding (of the same target in the same backend) token for token (it must: verification makes
                speculation lossless); sampled, a permutation test's p-value that they follow plain sampling's
                distribution (eagle3.acceptance.same_distribution_p). public_sets: the same figures per public set
                (evaluate.benchmarks) at each published configuration, "3" (3 steps / topk 1 / 4 draft tokens)
                and "7" (7 / 1 / 8), with the published Kimi drafters' own figures at k=3 beside them
                (eagle3.public_sets)
  acceptance.png  acceptance rate per draft position, one line per k

Public sets (evaluate.benchmarks, none by default) are loaded and rendered before anything is measured, and ride on
the same engine starts: the greedy one answers them too (an MT-Bench second turn after the target's own answer to
the first), and the start at k = 3 and at k = 7 measures them with the drafter, so draft lengths [3, 7] cost no
start more. On the hf path the same loop measures them, chains of k: what SGLang serves as k steps, topk 1, k + 1
draft tokens. Only this run's drafter is measured on them; the lineage's current one, on the held-out prompts alone.

The prompts are the lineage's pinned evaluation set (eagle3.lineage: chosen by its first evaluation, the same for
every run since), and the lineage's current drafter is measured on them too, by the same backend in the same run;
this run's is promoted if better.

On the hf path the drafter runs at the last position with the training-time-test pattern: step 0 over the context
(target features at t, token t+1), then each further draft step feeds its own output hidden state and the token it
just drafted, RoPE position advanced by one. No KV cache: each cycle recomputes, which is simple and fast enough for
evaluation-sized targets.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from eagle3 import acceptance
from eagle3.data import SampleTokenizer, read_conversations
from eagle3.engines import GREEDY, Completion, Sampling, Speculation, engine_for, reached_per_step
from eagle3.export import load_exported_drafter
from eagle3.fsutil import atomic_write_text
from eagle3.lineage import Lineage, weights_digest
from eagle3.model import LM_HEAD_KEYS, load_target_tensor
from eagle3.progress import ProgressLog
from eagle3.promote import decide, hold_for_approval, inputs_digest
from eagle3.public_sets import PUBLISHED_CONFIGURATIONS, LoadedSet, ask_turn_by_turn, load_public_sets
from eagle3.runlayout import (
    ACCEPTANCE_PLOT,
    CURRENT,
    DRAFTER_DIR,
    EVALUATE_DIR,
    EXPORT_RECORD,
    REPORT,
    run_stats_path,
)
from eagle3.server import ServerError, serving
from eagle3.split import EVALUATION, SPLIT_RULE, TRAINING, prompt_key, run_split
from eagle3.store import open_run_store
from eagle3.train import started_from

if TYPE_CHECKING:
    from eagle3.config import RunConfig

log = logging.getLogger(__name__)


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


def speculative_decode(target, drafter, draft_to_target, prompt: list[int], k: int, max_new: int, eos: set[int],
                       rule: GreedyRule | SamplingRule):
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


LATER_TURN_SHARE = 0.5  # of evaluate.num_prompts, at most: prompts that end at a later user turn


@dataclass(frozen=True)
class HeldOutPrompt:
    conversation_id: str
    turn: int  # the assistant message it prompts: the prompt is the conversation's messages before it
    kind: str  # "first" (the first user turn) or "later"
    keys: tuple[str, ...]  # split keys (eagle3.split) a drafter must never have trained on for it to be held out
    prompt: list[int]  # token ids: those messages through the chat template, generation prompt added


def held_out(cfg: RunConfig, tokenizing, limit: int | None = None) -> list[HeldOutPrompt]:
    """Prompts training never saw, from the conversations of the evaluation part of the run's split (eagle3.split:
    no conversation that opens with their first prompt trains or validates): up to `limit` (evaluate.num_prompts),
    each the conversation up to a user turn that an assistant turn answers, rendered with the generation prompt.
    At most LATER_TURN_SHARE of them end at a later user turn (the conversation before it as context, as the server
    is sent it), the rest at the first; when one kind runs short the other fills in. A later turn whose user message,
    normalised, opens a training or validation conversation is left out: that text's continuation was trained, if
    without this context. Deterministic, and independent of the file's order: first turns by (split key,
    conversation id), later ones by (which user turn, split key, conversation id). `tokenizing` is the run's
    eagle3.data.SampleTokenizer."""
    # The conversations training split on (the regenerated ones, with generate on).
    conversations, _ = read_conversations(cfg.conversations_path, "skip", None, cfg.conversations_missing_hint)
    split = run_split(cfg, conversations)
    seen_outside = {key for cid, key in split.keys.items() if split.part_of_conversation(cid) != EVALUATION}
    firsts, laters = [], []
    for conversation in conversations:
        if split.part_of_conversation(conversation.sample_id) != EVALUATION:
            continue
        key, messages, answered = split.keys[conversation.sample_id], conversation.messages, 0
        for i in range(1, len(messages)):
            if messages[i]["role"] != "assistant" or messages[i - 1]["role"] != "user":
                continue  # (an answer to a tool result, or an assistant turn right after another)
            if answered == 0:  # the first user turn that is answered: what opens the conversation
                firsts.append(((key, conversation.sample_id), conversation, i, (key,)))
            elif (turn_key := prompt_key(messages[i - 1]["content"])) not in seen_outside:
                laters.append(((answered, key, conversation.sample_id), conversation, i, (key, turn_key)))
            answered += 1
    wanted = limit or cfg.evaluate.num_prompts
    later = min(len(laters), int(wanted * LATER_TURN_SHARE))
    first = min(len(firsts), wanted - later)
    later = min(len(laters), wanted - first)
    chosen = [("first", c) for c in sorted(firsts, key=lambda c: c[0])[:first]] + \
             [("later", c) for c in sorted(laters, key=lambda c: c[0])[:later]]
    return [HeldOutPrompt(conversation.sample_id, turn, kind, keys,
                          tokenizing.prompt_ids(conversation.messages[:turn], conversation.tools))
            for kind, (_, conversation, turn, keys) in chosen]


def held_out_prompts(cfg: RunConfig, tokenizing, limit: int | None = None) -> list[list[int]]:
    return [held.prompt for held in held_out(cfg, tokenizing, limit)]


def eval_set_record(chosen: list[HeldOutPrompt]) -> dict:
    """The evaluation set a lineage pins (eagle3.lineage.EVAL_SET_FIELDS) from held_out's prompts."""
    return {"format": 2, "split": SPLIT_RULE, "conversation_ids": [h.conversation_id for h in chosen],
            "turns": [h.turn for h in chosen], "kinds": [h.kind for h in chosen],
            "split_keys": sorted({key for h in chosen for key in h.keys}), "prompts": [h.prompt for h in chosen]}


def target_greedy_accuracy(cfg: RunConfig, lm_head: torch.Tensor, max_tokens: int = 100_000) -> float | None:
    """Of the held-out samples' trained tokens (the first `max_tokens`), the share the target itself predicts
    greedily: what explains an acceptance length. Drafts are accepted only where they equal the target's own
    next token, so data the target would not have written (generate off) caps what a drafter learns from it;
    with generate on it is near 1. `lm_head`: the target's [vocab, hidden] output weights, on any device."""
    store = open_run_store(cfg)
    split = run_split(cfg)
    lm_head = lm_head.float()
    hits = total = 0
    for sample_id in sorted(s for s in store.sample_ids if split.part(s) != TRAINING):
        if total >= max_tokens:
            break
        sample = store[sample_id]
        answered = sample["loss_mask"][1:].bool()  # token t+1 is trained: the target predicted it at t
        states = sample["last_hidden_state"][:-1][answered].to(lm_head.device).float()
        predicted = (states @ lm_head.T).argmax(-1).cpu()
        hits += int((predicted == sample["input_ids"][1:][answered].long()).sum())
        total += int(answered.sum())
    return hits / total if total else None


def run_evaluate(cfg: RunConfig, hold_promotion: bool = False) -> dict:
    started = time.monotonic()
    (cfg.run_dir / EVALUATE_DIR).mkdir(parents=True, exist_ok=True)
    drafter_dir = cfg.run_dir / DRAFTER_DIR
    digest = weights_digest(drafter_dir)  # before measuring: a drafter changed while it is measured is not promoted
    tokenizing = SampleTokenizer.for_run(cfg)
    candidates = held_out(cfg, tokenizing)
    if not candidates:
        raise ValueError("no held-out prompts: raise train.val_fraction or evaluate on more data")
    public = load_public_sets(cfg, tokenizing)  # before anything runs: a bad file or record stops the stage now
    # Every run of the lineage measures the prompts its first evaluation pinned, so that figures compare.
    lineage = Lineage(cfg)
    pinned = lineage.pin_eval_set(eval_set_record(candidates), cfg.run_name)
    prompts = pinned["prompts"]
    kinds = pinned["kinds"]
    turns = {"first": kinds.count("first"), "later": kinds.count("later")}
    log.info("evaluate: %d prompts (%d first user turns, %d later ones) of lineage %s's evaluation set (pinned by "
             "run %s)", len(prompts), turns["first"], turns["later"], lineage.key, pinned["pinned_by"])
    measurer = (HfMeasurer if cfg.evaluate.backend == "hf" else EngineMeasurer)(cfg)
    held = HeldOutSet(prompts)

    with torch.no_grad():
        answer_without_drafter(cfg, measurer, held, public, tokenizing)
        results, on_public = measure_drafter(cfg, measurer, drafter_dir, held, public)
        promotion = compare_and_promote(
            cfg, lineage, pinned, results, digest,
            lambda current_dir: measure_drafter(cfg, measurer, current_dir, held, (), "current drafter, ")[0],
            hold=hold_promotion)
    export = json.loads((drafter_dir / EXPORT_RECORD).read_text())
    report = {
        "backend": measurer.name,
        "prompts": len(prompts),
        "prompt_turns": turns,
        "max_new_tokens": cfg.evaluate.max_new_tokens,
        # evaluate.sampling: greedy, or the target's serving sampling (verified by the speculative sampling rule)
        "sampling": {"temperature": measurer.sampling.temperature, "top_p": measurer.sampling.top_p,
                     "top_k": measurer.sampling.top_k},
        "generated_tokens": sum(len(b) for b in held.baseline),
        "speculative": results,
        # per public set (evaluate.benchmarks), per published configuration k: the same figures (eagle3.public_sets)
        "public_sets": public_sets_report(cfg, public, on_public, tokenizing),
        # per k, decoding replayed on the validation split's stored states (eagle3.train): training's prediction
        "offline_accept_length": {k: figures["mean_accept_length"] for k, figures in
                                  (export.get("val_offline") or {}).items()},
        "target_greedy_accuracy_held_out": target_greedy_accuracy(cfg, *measurer.lm_head()),
        "val_acc_per_position": export["val_acc"],
        "hidden_states": extraction_summary(cfg),
        "engines": export.get("engines"),  # the engines the exported drafter serves, and the layers each reads
        "promotion": promotion,
        "seconds": round(time.monotonic() - started, 1),
    }
    atomic_write_text(cfg.run_dir / REPORT, json.dumps(report, indent=2) + "\n")
    plot_acceptance(report, cfg.run_dir / ACCEPTANCE_PLOT)
    return report


@dataclass
class HeldOutSet:
    """The pinned held-out prompts, and the target's answer to each without a drafter (greedy, or sampled)."""

    prompts: list[list[int]]
    baseline: list[list[int]] | None = None


def answer_without_drafter(cfg: RunConfig, measurer, held: HeldOutSet, public: list[LoadedSet], tokenizing) -> None:
    """The baselines (greedy, or sampled at evaluate.sampling), in one start of the engine: the held-out prompts',
    then each public set's, turn by turn (an MT-Bench second turn follows the target's own answer to the first)."""
    end_ids = set(tokenizing.tokenizer.convert_tokens_to_ids(list(tokenizing.end_tokens)))
    kind = "greedy" if measurer.sampling.greedy else "sampled"
    with measurer.session("server-greedy.log") as complete:
        held.baseline = [c.output_ids for c in complete(held.prompts, f"{kind} baseline", cfg.evaluate.max_new_tokens)]
        for loaded in public:
            def ask(prompts, turn, title=loaded.spec.title):
                return [c.output_ids for c in complete(prompts, f"{title}: {kind} baseline, turn {turn}",
                                                       cfg.evaluate.benchmark_max_new_tokens)]
            ask_turn_by_turn(loaded, ask, tokenizing, end_ids)


def measure_drafter(cfg: RunConfig, measurer, drafter_dir, held: HeldOutSet, public: list[LoadedSet] | tuple = (),
                    label: str = "") -> tuple[dict, dict]:
    """Speculative decoding with the drafter in `drafter_dir`, one start of the engine per draft length: the
    held-out prompts at each of evaluate.draft_lengths, the public sets at each published configuration (a chain of
    k = num_steps). Returns ({k: figures}, {set: {k: figures}})."""
    lengths = list(cfg.evaluate.draft_lengths)
    served = lengths + [k for k in PUBLISHED_CONFIGURATIONS if public and k not in lengths]
    results, on_public = {}, {loaded.spec.name: {} for loaded in public}
    for k in served:
        log_name = f"server-{'current-' if label else ''}k{k}.log"
        with measurer.session(log_name, Speculation(drafter_dir, k)) as complete:
            if k in lengths:
                answers = complete(held.prompts, f"{label}k={k} speculative", cfg.evaluate.max_new_tokens)
                results[str(k)] = figures_of_completions(answers, held.baseline, k, label, measurer.sampling)
            for loaded in public if k in PUBLISHED_CONFIGURATIONS else ():
                title = loaded.spec.title
                answers = complete(loaded.prompts, f"{title}: k={k} speculative", cfg.evaluate.benchmark_max_new_tokens)
                steps, topk, tokens = PUBLISHED_CONFIGURATIONS[k]
                on_public[loaded.spec.name][str(k)] = {
                    "configuration": {"num_steps": steps, "eagle_topk": topk, "num_draft_tokens": tokens},
                    **figures_of_completions(answers, loaded.baseline, k, f"{title}, ", measurer.sampling)}
    return results, on_public


def public_sets_report(cfg: RunConfig, public: list[LoadedSet], on_public: dict, tokenizing) -> dict:
    """report.json's public_sets: per set where it came from, what was asked, and the figures per published
    configuration, with the published drafters' own figures at k=3 beside them."""
    end_ids = set(tokenizing.tokenizer.convert_tokens_to_ids(list(tokenizing.end_tokens)))
    max_new = cfg.evaluate.benchmark_max_new_tokens
    report = {}
    for loaded in public:
        spec = loaded.spec
        report[spec.name] = {
            "title": spec.title, "source": loaded.source, "records": len(loaded.chats), "prompts": len(loaded.prompts),
            "max_new_tokens": max_new, "generated_tokens": sum(len(b) for b in loaded.baseline),
            "answers_cut_at_max_new_tokens": sum(len(b) >= max_new and b[-1] not in end_ids for b in loaded.baseline),
            "speculative": on_public[spec.name],
            "published_k3": spec.published_k3,  # acceptance length at 3 steps / topk 1 / 4 draft tokens
        }
        for k, figures in on_public[spec.name].items():
            low, high = figures["accept_length_interval95"]
            published = ", ".join(f"{who} {value:.2f}" for who, value in spec.published_k3.items()) if k == "3" else ""
            log.info("evaluate: %s at %s: acceptance length %.3f (95%% interval %.3f-%.3f) on %d prompts%s", spec.title,
                     "{} steps / topk {} / {} draft tokens".format(*PUBLISHED_CONFIGURATIONS[int(k)]),
                     figures["mean_accept_length"], low, high, len(loaded.prompts),
                     f"; published: {published}" if published else "")
    return report


class HfMeasurer:
    """Speculative decoding in this process: the target in transformers (eagle3.capture.hf), the drafter as SGLang
    would load it from the export."""

    name = "hf"

    def __init__(self, cfg: RunConfig):
        # Imported here: transformers is loaded only by this backend (an engine-served evaluation never needs it).
        from transformers import AutoConfig

        from eagle3.capture.hf import HfCapture

        eos = AutoConfig.from_pretrained(cfg.target.model_path,
                                         trust_remote_code=cfg.target.trust_remote_code).eos_token_id
        self.cfg, self.eos = cfg, set(eos if isinstance(eos, list) else [eos])
        self.target = HfCapture(cfg)
        self.sampling = answer_sampling(cfg)

    @contextlib.contextmanager
    def session(self, log_name: str, speculation: Speculation | None = None):
        """Yields complete(prompts, what, max_new) -> a Completion per prompt, greedy or sampled (self.sampling; each
        answer seeded by answer_seed), with the drafter of `speculation` (greedy chains of its draft length) or
        without. `log_name` is the engine's (no server here)."""
        drafter, draft_to_target = (load_exported_drafter(speculation.drafter, self.cfg.target.model_path)
                                    if speculation else (None, None))

        def complete(prompts: list[list[int]], what: str, max_new: int) -> list[Completion]:
            answers, counting = [], progress_log(self.cfg, what, len(prompts))
            for index, prompt in enumerate(prompts):
                rule = GREEDY_RULE if self.sampling.greedy else SamplingRule(
                    self.sampling, torch.Generator().manual_seed(answer_seed(self.cfg, what, index)))
                if speculation is None:
                    answers.append(Completion(plain_decode(self.target, prompt, max_new, self.eos, rule)))
                    counting.update(1, len(answers[-1].output_ids))
                    continue
                tokens, accepted = speculative_decode(self.target, drafter, draft_to_target, prompt,
                                                      speculation.draft_length, max_new, self.eos, rule)
                answers.append(Completion(tokens, len(accepted), accepted, sum(accepted)))
                counting.update(1, len(answers[-1].output_ids))
            counting.emit()
            return answers

        yield complete

    def lm_head(self) -> tuple[torch.Tensor, int]:
        """The target's output weights, and how many held-out tokens to judge with them."""
        return self.target.lm_head.weight.detach().cpu(), 100_000


class EngineMeasurer:
    """Speculative decoding in the serving engine (server.engine, eagle3.engines), started on this box: once without
    the drafter, for the greedy baseline, and once per draft length with it. Prompts go one at a time, as token ids:
    acceptance is a property of each answer, and batching could flip a near-tie between the runs."""

    def __init__(self, cfg: RunConfig):
        self.cfg, self.engine = cfg, engine_for(cfg)
        self.name = f"server ({self.engine.name})"
        self.sampling = answer_sampling(cfg)

    @contextlib.contextmanager
    def session(self, log_name: str, speculation: Speculation | None = None):
        """Starts the engine (with the drafter of `speculation`), yields complete(prompts, what, max_new) -> a
        Completion per prompt, stops it."""
        import asyncio

        import httpx

        log_path = self.cfg.run_dir / EVALUATE_DIR / log_name

        async def one_at_a_time(base_url: str, prompts: list[list[int]], what: str, max_new: int) -> list:
            answers, counting = [], progress_log(self.cfg, f"{what} in {self.engine.name}", len(prompts))
            async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0, connect=30.0)) as client:
                for index, prompt in enumerate(prompts):
                    answers.append(await self.engine.complete(client, base_url, prompt, max_new, self.sampling,
                                                              answer_seed(self.cfg, what, index)))
                    counting.update(1, len(answers[-1].output_ids))
            counting.emit()
            return answers

        with serving(self.cfg, log_path, speculation) as base_url:
            def complete(prompts: list[list[int]], what: str, max_new: int) -> list[Completion]:
                completions = asyncio.run(one_at_a_time(base_url, prompts, what, max_new))
                if speculation is not None and all(c.verify_steps is None for c in completions) and \
                        any(len(c.output_ids) > 1 for c in completions):
                    raise ServerError(f"{self.engine.name} reported no speculation with the drafter "
                                      f"{speculation.drafter} at k={speculation.draft_length}: was it loaded? See "
                                      f"{log_path}")
                return completions

            yield complete

    def lm_head(self) -> tuple[torch.Tensor, int]:
        """The target's output weights alone, read from its safetensors; on a GPU where the box has one (the servers
        are stopped by now), else judged on fewer tokens: Kimi-K2.5's is 163,840 x 7,168."""
        weights = load_target_tensor(self.cfg.target.model_path, LM_HEAD_KEYS)
        if torch.cuda.is_available():
            return weights.cuda(), 100_000
        return weights, 10_000


def progress_log(cfg: RunConfig, what: str, total: int) -> ProgressLog:
    return ProgressLog(f"evaluate: {what}", total, 0, cfg.evaluate.progress_interval_s, log, unit="prompts",
                       track_bytes=False)


def lossless(outputs: list[list[int]], baseline: list[list[int]], sampling: Sampling) -> tuple[dict, str]:
    """Whether speculation changed the answers, as report figures and a phrase for the log. Greedy: every answer must
    equal the plain one token for token. Sampled: the answers must follow plain sampling's distribution
    (acceptance.same_distribution_p; a p-value under 0.01 is logged as a warning)."""
    if sampling.greedy:
        identical = f"{sum(tokens == expected for tokens, expected in zip(outputs, baseline))}/{len(baseline)}"
        return {"identical_to_greedy": identical}, f"{identical} outputs equal greedy"
    p_value = acceptance.same_distribution_p(baseline, outputs)
    if p_value < 0.01:
        log.warning("evaluate: the answers with the drafter do not follow plain sampling's distribution (p=%.4f): the "
                    "verification is not exact", p_value)
    return ({"identical_to_greedy": None, "same_distribution_as_plain_p": p_value},
            f"answers vs plain sampling: p={p_value:.3f} (same distribution)")


def figures_of(answers: list[tuple[list[int], list[int]]], baseline: list[list[int]], k: int, label: str,
               sampling: Sampling = GREEDY) -> dict:
    """Acceptance figures of one draft length from (answer, drafts of each verify step that reached it) per prompt,
    and whether the answers are those of plain decoding (lossless)."""
    cycles = [a for _, accepted in answers for a in accepted]
    first_cycles = [accepted[0] for _, accepted in answers if accepted]
    checked, checked_text = lossless([tokens for tokens, _ in answers], baseline, sampling)
    figures = acceptance.figures(cycles, first_cycles, k)
    # meta_info's spec_accept_length: completion tokens (prefill's first one too) / verify steps
    figures["completion_tokens_per_verify_step"] = sum(len(tokens) for tokens, _ in answers) / max(len(cycles), 1)
    figures.update(noise_and_ceiling([(sum(accepted), len(accepted)) for _, accepted in answers], baseline, k,
                                     figures["mean_accept_length"]))
    figures.update(checked)
    log.info("evaluate: %sk=%d: mean acceptance length %.3f %s over %d cycles (first cycle %.3f); %s; %s", label, k,
             figures["mean_accept_length"], interval_text(figures), len(cycles), figures["first_cycle_accept_length"],
             ceiling_text(figures), checked_text)
    return figures


def figures_of_totals(completions: list, baseline: list[list[int]], k: int, label: str,
                      sampling: Sampling = GREEDY) -> dict:
    """The same from each answer's totals (drafts that reached it, verify steps): no per-position rates, no first
    cycle."""
    steps = sum(c.verify_steps or 0 for c in completions)
    tokens = sum(len(c.output_ids) for c in completions)
    checked, checked_text = lossless([c.output_ids for c in completions], baseline, sampling)
    figures = {"mean_accept_length": 1 + sum(c.accepted or 0 for c in completions) / max(steps, 1),
               "first_cycle_accept_length": None, "later_cycles_accept_length": None,
               "completion_tokens_per_verify_step": tokens / max(steps, 1), "accept_rate_per_position": None,
               "cycles": steps, **checked}
    figures.update(noise_and_ceiling([(c.accepted or 0, c.verify_steps or 0) for c in completions], baseline, k,
                                     figures["mean_accept_length"]))
    log.info("evaluate: %sk=%d: mean acceptance length %.3f %s over %d cycles (the engine reports totals: no first "
             "cycle or per-position rates); %s; %s", label, k, figures["mean_accept_length"], interval_text(figures),
             steps, ceiling_text(figures), checked_text)
    return figures


def figures_of_completions(completions: list[Completion], baseline: list[list[int]], k: int, label: str,
                           sampling: Sampling = GREEDY) -> dict:
    """Acceptance figures of one draft length from the answers with the drafter: per verify step where the backend
    reports steps (hf, vLLM), from each answer's totals where it reports only those (SGLang)."""
    if all(c.accepted_per_step is not None or not c.verify_steps for c in completions):
        return figures_of([(c.output_ids, c.accepted_per_step or []) for c in completions], baseline, k, label,
                          sampling)
    return figures_of_totals(completions, baseline, k, label, sampling)


def noise_and_ceiling(per_prompt: list[tuple[int, int]], baseline: list[list[int]], k: int, measured: float) -> dict:
    """Beside a measured acceptance length: its 95% interval over prompts (another set of prompts of the same size
    would differ by about that much), and the ceiling, what a drafter that always agrees with the target would
    reach on the same greedy answers (eagle3.acceptance.ceiling_cycles), with the share of it reached."""
    ceiling = [acceptance.ceiling_cycles(len(answer), k) for answer in baseline]
    ceiling_length = 1 + sum(map(sum, ceiling)) / max(sum(map(len, ceiling)), 1)
    return {"accept_length_interval95": list(acceptance.interval95(per_prompt)),
            "ceiling_accept_length": ceiling_length, "share_of_ceiling": measured / ceiling_length}


def interval_text(figures: dict) -> str:
    low, high = figures["accept_length_interval95"]
    return f"(95% interval over prompts {low:.3f}-{high:.3f})"


def ceiling_text(figures: dict) -> str:
    return f"{figures['share_of_ceiling']:.0%} of the ceiling {figures['ceiling_accept_length']:.3f}"


def compare_and_promote(cfg: RunConfig, lineage, pinned: dict, results: dict, ours: str, measure_drafter,
                        hold: bool = False) -> dict:
    """Measure the lineage's current drafter (`measure_drafter(its dir)`) on the same prompts, and promote this
    run's (`ours`: its weights' sha256, taken before it was measured) if it is better by evaluate.promote_margin
    (eagle3.promote). `hold`: decide, but leave the switch to `lineage promote`, which the DAG runs once a person
    approved (the deployment's approve_promotion)."""
    k = cfg.evaluate.draft_lengths[0]
    figures = {key: value["mean_accept_length"] for key, value in results.items()}
    outcome = {"lineage": lineage.key, "lineage_dir": str(lineage.dir), "eval_set_prompts": len(pinned["prompts"]),
               "eval_set_pinned_by": pinned["pinned_by"], "accept_length": figures, "current_before": None}
    if not cfg.evaluate.promote:
        return {**outcome, "promoted": False, "reason": "evaluate.promote is off"}
    current = lineage.current()
    theirs = None
    if current is not None:
        record = current.record
        outcome["current_before"] = {"version": current.name, "run": record["run"]}
        if record["weights_sha256"] == ours:  # a retried evaluate, or a rerun whose inputs had not changed
            lineage.also_made_from(current, inputs_digest(cfg))  # the next run with these inputs skips training
            return {**outcome, "promoted": False, "current": str(lineage.dir / CURRENT),
                    "reason": f"this drafter is the current one already ({current.name}, the same weights)"}
        theirs = measure_drafter(current.path)
        outcome["current_before"]["accept_length"] = {key: v["mean_accept_length"] for key, v in theirs.items()}
    promote, reason = decide(results, theirs, k, cfg.evaluate.promote_margin)
    log.info("evaluate: %s %s", "promoting this run's drafter:" if promote else "not promoted:", reason)
    if not promote:
        return {**outcome, "promoted": False, "reason": reason, "current": str(lineage.dir / CURRENT)}
    record = {"run": cfg.run_name, "run_dir": str(cfg.run_dir), "weights_sha256": ours, "accept_length": figures,
              "inputs_digest": inputs_digest(cfg),  # a later run with the same inputs skips training
              "started_from": started_from(cfg),  # train.init_from current: the version it was warm-started from
              "promoted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "reason": reason,
              "previous": outcome["current_before"], "eval_set_prompts": len(pinned["prompts"])}
    if hold:  # the approval covers these digests: `lineage promote` switches to no other bytes
        files = hold_for_approval(cfg, record, expected_current=current.name if current else None)
        return {**outcome, "promoted": False, "pending_approval": True, "reason": reason,
                "current": str(lineage.dir / CURRENT), "weights_sha256": ours, "drafter_files_sha256": files}
    version = lineage.promote(cfg.run_dir / DRAFTER_DIR, cfg.run_name, record, cfg.evaluate.keep_versions,
                              expected_current=current.name if current else None)
    if version is None:
        return {**outcome, "promoted": False, "reason": "another run promoted a drafter while this one was measured; "
                "evaluate again to compare with it"}
    return {**outcome, "promoted": True, "reason": reason, "current": str(lineage.dir / CURRENT),
            "version": version.name}


def extraction_summary(cfg: RunConfig) -> dict:
    """What extract did for this run: how many samples it computed, how many it found in the shared store."""
    shards = [json.loads(path.read_text()) for shard in range(cfg.extract.num_shards)
              if (path := run_stats_path(cfg.run_dir, shard)).exists()]
    def total(key: str, part: str | None = None) -> int:
        return sum(s[key][part] if part else s[key] for s in shards)

    def per_reason(key: str) -> dict[str, int]:
        return dict(sum((Counter(s[key]) for s in shards), Counter()))

    turns, tokens = total("assistant_turns"), total("turn_tokens")
    dropped_turns, dropped_tokens = per_reason("turns_dropped"), per_reason("turn_tokens_dropped")
    return {
        "store": str(cfg.store_dir.resolve()),
        "samples": sum(s["samples_stored"] for s in shards),
        "extracted": sum(s["samples_extracted"] for s in shards),
        "reused": sum(s["samples_stored_before"] for s in shards),
        # Assistant turns trained as the target generated them, and the ones dropped, per reason (eagle3.turns).
        "turns": {"assistant": turns, "trained": total("turns_trained"), "derived": total("turns_derived"),
                  "dropped": dropped_turns},
        "turn_tokens": {"assistant": tokens, "dropped": dropped_tokens},
        "untrained_fraction": {"turns": round(sum(dropped_turns.values()) / max(turns, 1), 6),
                               "tokens": round(sum(dropped_tokens.values()) / max(tokens, 1), 6)},
        "trained_tokens": total("trained_tokens"),
        "reasoning_tokens_trained": total("reasoning_tokens_trained"),
        "turns_cut_at_max_tokens": total("turns_cut_at_max_tokens"),
        "context_cut": {"samples": total("context_cut", "samples"), "tokens": total("context_cut", "tokens")},
        "turn_cut": {"samples": total("turn_cut", "samples"), "tokens": total("turn_cut", "tokens")},
    }


def plot_acceptance(report: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    offline = report.get("offline_accept_length") or {}
    for k, result in report["speculative"].items():
        rates = result["accept_rate_per_position"] or []  # None: an engine that reports totals only
        low, high = result.get("accept_length_interval95") or (math.nan, math.nan)
        ax.plot(range(1, len(rates) + 1), rates, marker="o",
                label=f"k={k}: accept length {result['mean_accept_length']:.2f} [{low:.2f}, {high:.2f}] of "
                f"{result.get('ceiling_accept_length', math.nan):.2f} possible; offline {offline.get(k, math.nan):.2f}"
                + ("" if rates else " (per position: not reported)"))
    ax.set(xlabel="draft position", ylabel="acceptance rate (given the earlier ones)", ylim=(0, 1.05),
           title=f"speculative decoding ({report.get('backend', 'hf')}) on {report['prompts']} held-out prompts")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
