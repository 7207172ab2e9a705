"""Measure acceptance length with real speculative decoding: offline on the HF target, or in the serving engine.

    python -m eagle3 evaluate --config RUN_DIR/config.json

For each draft length k in evaluate.draft_lengths, on held-out prompts (the evaluation part of the run's split by
user turn, eagle3.stages.split; first and later user turns: held_out): greedy chain drafting of k tokens with
the EXPORTED drafter (RUN_DIR/drafter), verification by the target, accept the longest agreeing prefix plus the target's
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
  report.json   per k: the acceptance length (accept_length: tokens committed per verify step), SGLang's
                scheduler count (sglang_accept_length) and N/S (completion_tokens_per_verify_step: SpecForge's
                bench, meta_info's spec_accept_length) beside it, SGLang's count for the first cycle of each
                answer (drafted right after prefill) and for the later ones, the acceptance rate of each draft
                position (where the engine reports steps: not SGLang), a 95% interval over prompts, the ceiling
                (a drafter that always agrees with the target, on the same answers, in the headline's count) and
                the share of it reached (eagle3.model.acceptance); the held-out answers training holds verbatim
                or nearly (eagle3.data.overlap); beside them the offline figure training picked the checkpoint by
                (decoding replayed on the validation split); and whether every speculative output equalled plain greedy
                decoding (of the same target in the same backend; on hf the first k's answers confirmed by one
                forward pass each, decoding.confirmed_greedy_rows) token for token (it must: verification makes
                speculation lossless); sampled, a permutation test's p-value that they follow plain sampling's
                distribution (eagle3.model.acceptance.same_distribution_p). public_sets: the same figures per public set
                (evaluate.benchmarks) at each published configuration, "3" (3 steps / topk 1 / 4 draft tokens)
                and "7" (7 / 1 / 8), with the published Kimi drafters' own figures at k=3 beside them
                (eagle3.data.public_sets)
  acceptance.png  acceptance rate per draft position, one line per k

Public sets (evaluate.benchmarks, none by default) are loaded and rendered before anything is measured, and ride on
the same engine starts: the greedy one answers them too (an MT-Bench second turn after the target's own answer to
the first), and the start at k = 3 and at k = 7 measures them with the drafter, so draft lengths [3, 7] cost no
start more. On the hf path the same loop measures them, chains of k: what SGLang serves as k steps, topk 1, k + 1
draft tokens. Only this run's drafter is measured on them; the lineage's current one, on the held-out prompts alone.

The prompts are the lineage's pinned evaluation set (eagle3.records.lineage: chosen by its first evaluation, the same
for every run since), and the lineage's current drafter is measured on them too, by the same backend in the same run;
this run's is promoted if better.

On the hf path the drafter runs at the last position with the training-time-test pattern: step 0 over the context
(target features at t, token t+1), then each further draft step feeds its own output hidden state and the token it
just drafted, RoPE position advanced by one. No KV cache: each cycle recomputes, which is simple and fast enough for
evaluation-sized targets; measurers.DECODE_ROWS prompts are drafted and verified together, right-padded (each answer
is the one its prompt gets alone).
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING

import torch

from eagle3.data.public_sets import load_public_sets
from eagle3.data.samples import SampleTokenizer
from eagle3.data.store import open_run_store
from eagle3.disk.fsutil import atomic_write_text
from eagle3.disk.layout import ACCEPTANCE_PLOT, DRAFTER_DIR, EVALUATE_DIR, EXPORT_RECORD, REPORT, run_stats_path
from eagle3.records.lineage import Lineage, weights_digest
from eagle3.stages.evaluate.figures import plot_acceptance
from eagle3.stages.evaluate.measurers import (
    EngineMeasurer,
    HfMeasurer,
    answer_without_drafter,
    measure_drafter,
    public_sets_report,
)
from eagle3.stages.evaluate.prompts import HeldOutSet, answers_seen_in_training, eval_set_record, held_out
from eagle3.stages.promote import compare_and_promote
from eagle3.stages.split import TRAINING, run_split
from eagle3.stages.train import started_from

if TYPE_CHECKING:
    from eagle3.config import RunConfig


log = logging.getLogger(__name__)


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
    log.info(
        "evaluate: %d prompts (%d first user turns, %d later ones) of lineage %s's evaluation set (pinned by run %s)",
        len(prompts),
        turns["first"],
        turns["later"],
        lineage.key,
        pinned["pinned_by"],
    )
    measurer = (HfMeasurer if cfg.evaluate.backend == "hf" else EngineMeasurer)(cfg)
    held = HeldOutSet(prompts)

    with torch.no_grad():
        answer_without_drafter(cfg, measurer, held, public, tokenizing)
        results, on_public = measure_drafter(cfg, measurer, drafter_dir, held, public)
        promotion = compare_and_promote(
            cfg,
            lineage,
            pinned,
            results,
            digest,
            lambda current_dir: measure_drafter(cfg, measurer, current_dir, held, (), "current drafter, ")[0],
            started_from(cfg),
            hold=hold_promotion,
        )
    export = json.loads((drafter_dir / EXPORT_RECORD).read_text())
    report = {
        "backend": measurer.name,
        "prompts": len(prompts),
        "prompt_turns": turns,
        "max_new_tokens": cfg.evaluate.max_new_tokens,
        # evaluate.sampling: greedy, or the target's serving sampling (verified by the speculative sampling rule)
        "sampling": {
            "temperature": measurer.sampling.temperature,
            "top_p": measurer.sampling.top_p,
            "top_k": measurer.sampling.top_k,
        },
        "generated_tokens": sum(len(b) for b in held.baseline),
        # the held-out answers that training holds word for word, or nearly (eagle3.data.overlap): measuring those
        # measures memory
        "held_out_answers_in_training": answers_seen_in_training(cfg, pinned),
        "speculative": results,
        # per public set (evaluate.benchmarks), per published configuration k: the same figures
        # (eagle3.data.public_sets)
        "public_sets": public_sets_report(cfg, public, on_public, tokenizing),
        # per k, decoding replayed on the validation split's stored states (eagle3.stages.train): training's prediction
        "offline_accept_length": {k: figures["accept_length"] for k, figures in export["val_offline"].items()},
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


def extraction_summary(cfg: RunConfig) -> dict:
    """What extract did for this run: how many samples it computed, how many it found in the shared store."""
    shards = [
        json.loads(path.read_text())
        for shard in range(cfg.extract.num_shards)
        if (path := run_stats_path(cfg.run_dir, shard)).exists()
    ]

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
        # Assistant turns trained as the target generated them, and the ones dropped, per reason
        # (eagle3.data.turns).
        "turns": {
            "assistant": turns,
            "trained": total("turns_trained"),
            "derived": total("turns_derived"),
            "dropped": dropped_turns,
        },
        "turn_tokens": {"assistant": tokens, "dropped": dropped_tokens},
        "untrained_fraction": {
            "turns": round(sum(dropped_turns.values()) / max(turns, 1), 6),
            "tokens": round(sum(dropped_tokens.values()) / max(tokens, 1), 6),
        },
        "trained_tokens": total("trained_tokens"),
        "reasoning_tokens_trained": total("reasoning_tokens_trained"),
        "turns_cut_at_max_tokens": total("turns_cut_at_max_tokens"),
        "context_cut": {"samples": total("context_cut", "samples"), "tokens": total("context_cut", "tokens")},
        "turn_cut": {"samples": total("turn_cut", "samples"), "tokens": total("turn_cut", "tokens")},
    }
