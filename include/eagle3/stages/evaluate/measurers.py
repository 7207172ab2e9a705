"""The measurers: the target answers each pinned prompt without the drafter, then with it at each k, in this process
(HfMeasurer: transformers, the drafter loaded as SGLang loads it) or in the serving engine (EngineMeasurer)."""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

import torch

from eagle3.data.public_sets import PUBLISHED_CONFIGURATIONS, LoadedSet, ask_turn_by_turn
from eagle3.disk.layout import (
    EVALUATE_DIR,
)
from eagle3.engines import Completion, Speculation, engine_for
from eagle3.engines.server import ServerError, serving
from eagle3.jobs.progress import ProgressLog
from eagle3.model.drafter import LM_HEAD_KEYS, load_target_tensor
from eagle3.stages.evaluate.decoding import (
    GREEDY_RULE,
    GreedyRule,
    SamplingRule,
    answer_sampling,
    answer_seed,
    confirmed_greedy_rows,
    plain_decode,
    speculative_decode_rows,
)
from eagle3.stages.evaluate.figures import figures_of_completions
from eagle3.stages.evaluate.prompts import HeldOutSet
from eagle3.stages.export import load_exported_drafter

if TYPE_CHECKING:
    from eagle3.config import RunConfig


log = logging.getLogger(__name__)

# Prompts the hf path decodes together: 32 short prompts took a sixth of the time of one at a time on 2 CPU cores,
# with the same answers and acceptance.
DECODE_ROWS = 32


def answer_without_drafter(cfg: RunConfig, measurer, held: HeldOutSet, public: list[LoadedSet], tokenizing) -> None:
    """The baselines (greedy, or sampled at evaluate.sampling), in one start of the engine: the held-out prompts'
    (unless the measurer confirms greedy answers: then measure_drafter does), then each public set's, turn by turn (an
    MT-Bench second turn follows the target's own answer to the first)."""
    end_ids = set(tokenizing.tokenizer.convert_tokens_to_ids(list(tokenizing.end_tokens)))
    kind = "greedy" if measurer.sampling.greedy else "sampled"
    with measurer.session("server-greedy.log") as complete:
        if not measurer.confirms_greedy:
            answers = complete(held.prompts, f"{kind} baseline", cfg.evaluate.max_new_tokens)
            held.baseline = [c.output_ids for c in answers]
        for loaded in public:

            def ask(prompts, turn, title=loaded.spec.title):
                return [
                    c.output_ids
                    for c in complete(
                        prompts, f"{title}: {kind} baseline, turn {turn}", cfg.evaluate.benchmark_max_new_tokens
                    )
                ]

            ask_turn_by_turn(loaded, ask, tokenizing, end_ids)


def measure_drafter(
    cfg: RunConfig, measurer, drafter_dir, held: HeldOutSet, public: list[LoadedSet] | tuple = (), label: str = ""
) -> tuple[dict, dict]:
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
                if held.baseline is None:  # a measurer that confirms greedy answers: these are the proposals
                    held.baseline = measurer.confirm_greedy(held.prompts, [c.output_ids for c in answers])
                results[str(k)] = figures_of_completions(answers, held.baseline, k, label, measurer.sampling)
            for loaded in public if k in PUBLISHED_CONFIGURATIONS else ():
                title = loaded.spec.title
                answers = complete(loaded.prompts, f"{title}: k={k} speculative", cfg.evaluate.benchmark_max_new_tokens)
                steps, topk, tokens = PUBLISHED_CONFIGURATIONS[k]
                on_public[loaded.spec.name][str(k)] = {
                    "configuration": {"num_steps": steps, "eagle_topk": topk, "num_draft_tokens": tokens},
                    **figures_of_completions(answers, loaded.baseline, k, f"{title}, ", measurer.sampling),
                }
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
            "title": spec.title,
            "source": loaded.source,
            "records": len(loaded.chats),
            "prompts": len(loaded.prompts),
            "max_new_tokens": max_new,
            "generated_tokens": sum(len(b) for b in loaded.baseline),
            "answers_cut_at_max_new_tokens": sum(len(b) >= max_new and b[-1] not in end_ids for b in loaded.baseline),
            "speculative": on_public[spec.name],
            "published_k3": spec.published_k3,  # acceptance length at 3 steps / topk 1 / 4 draft tokens
        }
        for k, figures in on_public[spec.name].items():
            low, high = figures["accept_length_interval95"]
            published = ", ".join(f"{who} {value:.2f}" for who, value in spec.published_k3.items()) if k == "3" else ""
            log.info(
                "evaluate: %s at %s: acceptance length %.3f (95%% interval %.3f-%.3f) on %d prompts%s",
                spec.title,
                "{} steps / topk {} / {} draft tokens".format(*PUBLISHED_CONFIGURATIONS[int(k)]),
                figures["accept_length"],
                low,
                high,
                len(loaded.prompts),
                f"; published: {published}" if published else "",
            )
    return report


class HfMeasurer:
    """Speculative decoding in this process: the target in transformers (eagle3.capture.hf), the drafter as SGLang
    would load it from the export."""

    name = "hf"

    def __init__(self, cfg: RunConfig):
        # Imported here: transformers is loaded only by this backend (an engine-served evaluation never needs it).
        from transformers import AutoConfig

        from eagle3.capture.hf import HfCapture

        eos = AutoConfig.from_pretrained(
            cfg.target.model_path, trust_remote_code=cfg.target.trust_remote_code
        ).eos_token_id
        self.cfg, self.eos = cfg, set(eos if isinstance(eos, list) else [eos])
        self.target = HfCapture(cfg)
        self.sampling = answer_sampling(cfg)
        # Greedy, the baseline is each speculative answer confirmed by one forward pass (decoding.confirmed_greedy_rows)
        # instead of decoded a token at a time: the same answers, in about a seventh of the passes here.
        self.confirms_greedy = self.sampling.greedy

    def rule(self, what: str, index: int) -> GreedyRule | SamplingRule:
        """How the answer to prompt `index` of `what` is verified and drawn (seeded by answer_seed when sampled)."""
        if self.sampling.greedy:
            return GREEDY_RULE
        return SamplingRule(self.sampling, torch.Generator().manual_seed(answer_seed(self.cfg, what, index)))

    def confirm_greedy(self, prompts: list[list[int]], proposals: list[list[int]]) -> list[list[int]]:
        """The target's greedy answer to each prompt, from the proposed one (decoding.confirmed_greedy_rows)."""
        max_new, counting = self.cfg.evaluate.max_new_tokens, progress_log(self.cfg, "greedy baseline", len(prompts))
        answers = []
        for start in range(0, len(prompts), DECODE_ROWS):
            rows = slice(start, start + DECODE_ROWS)
            answers += confirmed_greedy_rows(self.target, prompts[rows], proposals[rows], max_new, self.eos)
            counting.update(len(prompts[rows]), sum(map(len, answers[rows])))
        counting.emit()
        return answers

    @contextlib.contextmanager
    def session(self, log_name: str, speculation: Speculation | None = None):
        """Yields complete(prompts, what, max_new) -> a Completion per prompt, greedy or sampled (self.sampling; each
        answer seeded by answer_seed), with the drafter of `speculation` (greedy chains of its draft length) or
        without. `log_name` is the engine's (no server here)."""
        drafter, draft_to_target = (
            load_exported_drafter(speculation.drafter, self.cfg.target.model_path) if speculation else (None, None)
        )

        def complete(prompts: list[list[int]], what: str, max_new: int) -> list[Completion]:
            rules = [self.rule(what, index) for index in range(len(prompts))]
            answers, counting = [Completion([])] * len(prompts), progress_log(self.cfg, what, len(prompts))
            if speculation is None:
                for index, (prompt, rule) in enumerate(zip(prompts, rules)):
                    answers[index] = Completion(plain_decode(self.target, prompt, max_new, self.eos, rule))
                    counting.update(1, len(answers[index].output_ids))
            else:
                order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths: less padding
                for start in range(0, len(order), DECODE_ROWS):
                    rows = order[start : start + DECODE_ROWS]
                    decoded = speculative_decode_rows(
                        self.target,
                        drafter,
                        draft_to_target,
                        [prompts[i] for i in rows],
                        speculation.draft_length,
                        max_new,
                        self.eos,
                        [rules[i] for i in rows],
                    )
                    for index, (tokens, accepted) in zip(rows, decoded):
                        answers[index] = Completion(tokens, len(accepted), accepted, sum(accepted))
                        counting.update(1, len(tokens))
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

    confirms_greedy = False  # the engine's own greedy decoding is the baseline: batching or kernels could differ

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
                    answers.append(
                        await self.engine.complete(
                            client, base_url, prompt, max_new, self.sampling, answer_seed(self.cfg, what, index)
                        )
                    )
                    counting.update(1, len(answers[-1].output_ids))
            counting.emit()
            return answers

        with serving(self.cfg, log_path, speculation) as base_url:

            def complete(prompts: list[list[int]], what: str, max_new: int) -> list[Completion]:
                completions = asyncio.run(one_at_a_time(base_url, prompts, what, max_new))
                if (
                    speculation is not None
                    and all(c.verify_steps is None for c in completions)
                    and any(len(c.output_ids) > 1 for c in completions)
                ):
                    raise ServerError(
                        f"{self.engine.name} reported no speculation with the drafter "
                        f"{speculation.drafter} at k={speculation.draft_length}: was it loaded? See "
                        f"{log_path}"
                    )
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
    return ProgressLog(
        f"evaluate: {what}", total, 0, cfg.evaluate.progress_interval_s, log, unit="prompts", track_bytes=False
    )
