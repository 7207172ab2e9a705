"""Measure acceptance length with real speculative decoding, offline, on the HF target.

    python -m eagle3 evaluate --config RUN_DIR/config.json

For each draft length k in evaluate.draft_lengths, on held-out prompts (the validation split of the
data, by sample-id hash, first user turn): greedy chain drafting of k tokens with the EXPORTED drafter
(RUN_DIR/drafter, loaded as SGLang would: the export plus the target's embedding), verification by the
target, accept the longest agreeing prefix plus the target's own next token. Writes {run dir}/evaluate/:
  report.json   per k: mean acceptance length (tokens committed per verify step: SGLang's scheduler metric
                avg_spec_accept_length, which benchmark reports too), the same for the first cycle of each
                answer (drafted right after prefill) and for the later ones, completion tokens per verify
                step (meta_info's spec_accept_length, labelled), the acceptance rate of each draft
                position; beside it the teacher-forced simulated figure from training; and whether every
                speculative output equalled plain greedy decoding token for token (it must: verification
                makes speculation lossless)
  acceptance.png  acceptance rate per draft position, one line per k

The prompts are the lineage's pinned evaluation set (eagle3.promote: chosen by its first evaluation, the same for
every run since), and the lineage's current drafter is measured on them too; this run's is promoted if better.

The drafter runs at the last position with the training-time-test pattern: step 0 over the context
(target features at t, token t+1), then each further draft step feeds its own output hidden state and
the token it just drafted, RoPE position advanced by one. No KV cache: each cycle recomputes, which is
simple and fast enough for evaluation-sized targets; SGLang's serving path is what runs at scale.
"""

from __future__ import annotations

import json
import logging
import time

import torch

from eagle3.fsutil import atomic_write_text
from eagle3.progress import ProgressLog

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


def speculative_greedy(target, drafter, draft_to_target, prompt: list[int], k: int, max_new: int, eos: set[int]):
    """Greedy decoding with k-token chain drafts. Returns (new tokens, accepted count per cycle)."""
    seq = list(prompt)
    logits, aux = target.logits_and_aux(seq)
    token = int(logits[-1].argmax())
    accepted = []
    while len(seq) - len(prompt) < max_new and token not in eos:
        drafts = draft_chain(drafter, draft_to_target, aux[: len(seq)], seq[1:] + [token], k)
        candidate = seq + [token] + drafts
        logits, aux = target.logits_and_aux(candidate)
        predictions = logits[len(seq) :].argmax(-1).tolist()  # the target's token after each candidate token
        a = 0
        while a < k and drafts[a] == predictions[a]:
            a += 1
            if drafts[a - 1] in eos:  # an accepted end of turn is committed, as SGLang does, and ends the answer
                break
        seq += [token] + drafts[:a]
        accepted.append(a)
        if a and drafts[a - 1] in eos:
            return seq[len(prompt) : len(prompt) + max_new], accepted
        token = predictions[a]
    if token in eos and len(seq) - len(prompt) < max_new:
        seq.append(token)
    return seq[len(prompt) : len(prompt) + max_new], accepted


def plain_greedy(target, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    seq = list(prompt)
    while len(seq) - len(prompt) < max_new:
        token = int(target.logits_and_aux(seq)[0][-1].argmax())
        seq.append(token)
        if token in eos:
            break
    return seq[len(prompt) :]


def held_out(cfg, tokenizing, limit: int | None = None) -> list[tuple[str, list[int]]]:
    """(conversation id, prompt) for the first user turns (chat template applied, generation prompt added) of the
    validation split: prompts training never saw. `tokenizing` is the run's eagle3.data.SampleTokenizer."""
    from eagle3.data import read_conversations
    from eagle3.train import is_validation

    # The conversations training split by sample id (the regenerated ones, with generate on).
    conversations, _ = read_conversations(cfg.conversations_path, "skip", None, cfg.conversations_missing_hint)
    prompts = []
    for conversation in conversations:
        if not is_validation(conversation.sample_id, cfg.train.val_fraction):
            continue
        first_answer = next(i for i, m in enumerate(conversation.messages) if m["role"] == "assistant")
        if first_answer == 0:  # nothing prompts it
            continue
        prompts.append((conversation.sample_id,
                        tokenizing.prompt_ids(conversation.messages[:first_answer], conversation.tools)))
        if len(prompts) == (limit or cfg.evaluate.num_prompts):
            break
    return prompts


def held_out_prompts(cfg, tokenizing, limit: int | None = None) -> list[list[int]]:
    return [prompt for _, prompt in held_out(cfg, tokenizing, limit)]


def target_greedy_accuracy(cfg, lm_head: torch.Tensor, max_tokens: int = 100_000) -> float | None:
    """Of the held-out samples' trained tokens (the first `max_tokens`), the share the target itself predicts
    greedily: what explains an acceptance length. Drafts are accepted only where they equal the target's own
    next token, so data the target would not have written (generate off) caps what a drafter learns from it;
    with generate on it is near 1. `lm_head`: the target's [vocab, hidden] output weights, on the CPU."""
    from eagle3.store import open_run_store
    from eagle3.train import is_validation

    store = open_run_store(cfg)
    lm_head = lm_head.float()
    hits = total = 0
    for sample_id in sorted(s for s in store.sample_ids if is_validation(s, cfg.train.val_fraction)):
        if total >= max_tokens:
            break
        sample = store[sample_id]
        answered = sample["loss_mask"][1:].bool()  # token t+1 is trained: the target predicted it at t
        predicted = (sample["last_hidden_state"][:-1][answered].float() @ lm_head.T).argmax(-1)
        hits += int((predicted == sample["input_ids"][1:][answered].long()).sum())
        total += int(answered.sum())
    return hits / total if total else None


def acceptance_figures(cycles: list[int], first_cycles: list[int], new_tokens: int, k: int) -> dict:
    """Acceptance of one draft length from the drafts accepted in each verify step (cycle). The headline is
    SGLang's scheduler metric, avg_spec_accept_length: tokens committed per verify step, the accepted drafts
    plus the target's own bonus token. The first cycle of an answer (drafted right after prefill, from the
    prompt's last token, a position SpecForge's mask never trains) is shown apart, and so are the later ones:
    on short answers the first cycle is a large share of all."""
    def per_step(accepted: int, steps: int) -> float:
        return 1 + accepted / max(steps, 1)

    reached = [sum(a >= j for a in cycles) for j in range(k + 1)]
    later = (sum(cycles) - sum(first_cycles), len(cycles) - len(first_cycles))
    return {
        "mean_accept_length": per_step(sum(cycles), len(cycles)),
        "first_cycle_accept_length": per_step(sum(first_cycles), len(first_cycles)),
        "later_cycles_accept_length": per_step(*later),
        # meta_info's spec_accept_length: completion tokens (prefill's first one too) / verify steps
        "completion_tokens_per_verify_step": new_tokens / max(len(cycles), 1),
        "accept_rate_per_position": [reached[j + 1] / max(reached[j], 1) for j in range(k)],
        "cycles": len(cycles),
    }


def run_evaluate(cfg, hold_promotion: bool = False) -> dict:
    from transformers import AutoConfig

    from eagle3.capture.hf import HfCapture
    from eagle3.data import SampleTokenizer
    from eagle3.export import DRAFTER_DIR, load_exported_drafter
    from eagle3.promote import Lineage

    started = time.monotonic()
    out = cfg.run_dir / "evaluate"
    out.mkdir(parents=True, exist_ok=True)
    eos = AutoConfig.from_pretrained(cfg.target.model_path, trust_remote_code=cfg.target.trust_remote_code).eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    target = HfCapture(cfg)
    drafter, draft_to_target = load_exported_drafter(cfg.run_dir / DRAFTER_DIR, cfg.target.model_path)
    candidates = held_out(cfg, SampleTokenizer.for_run(cfg))
    if not candidates:
        raise ValueError("no held-out prompts: raise train.val_fraction or evaluate on more data")
    # Every run of the lineage measures the prompts its first evaluation pinned, so that figures compare.
    lineage = Lineage(cfg)
    pinned = lineage.pin_eval_set(*map(list, zip(*candidates)), cfg.run_name)
    prompts = pinned["prompts"]
    log.info("evaluate: %d prompts of lineage %s's evaluation set (pinned by run %s)", len(prompts), lineage.key,
             pinned["pinned_by"])
    max_new = cfg.evaluate.max_new_tokens

    def progress(what: str) -> ProgressLog:
        return ProgressLog(f"evaluate: {what}", len(prompts), 0, cfg.evaluate.progress_interval_s, log,
                           unit="prompts", track_bytes=False)

    with torch.no_grad():
        baseline, counting = [], progress("greedy baseline")
        for prompt in prompts:
            baseline.append(plain_greedy(target, prompt, max_new, eos))
            counting.update(1, len(baseline[-1]))
        counting.emit()
        results = measure(cfg, target, drafter, draft_to_target, prompts, baseline, eos, progress)
        promotion = compare_and_promote(cfg, lineage, pinned, results, lambda drafter_dir: measure(
            cfg, target, *load_exported_drafter(drafter_dir, cfg.target.model_path), prompts, baseline, eos, progress,
            "current drafter, "), hold=hold_promotion)
    export = json.loads((cfg.run_dir / DRAFTER_DIR / "export.json").read_text())
    report = {
        "prompts": len(prompts),
        "max_new_tokens": max_new,
        "generated_tokens": sum(len(b) for b in baseline),
        "speculative": results,
        "simulated_accept_length_teacher_forced": export["val_accept_length"],
        "target_greedy_accuracy_held_out": target_greedy_accuracy(cfg, target.lm_head.weight.detach().cpu()),
        "val_acc_per_position": export["val_acc"],
        "hidden_states": extraction_summary(cfg),
        "promotion": promotion,
        "seconds": round(time.monotonic() - started, 1),
    }
    atomic_write_text(out / "report.json", json.dumps(report, indent=2) + "\n")
    plot_acceptance(report, out / "acceptance.png")
    return report


def measure(cfg, target, drafter, draft_to_target, prompts, baseline, eos, progress, label: str = "") -> dict:
    """Acceptance figures per k of one drafter on `prompts` (`baseline`: the target's plain greedy answers)."""
    results = {}
    for k in cfg.evaluate.draft_lengths:
        cycles, first_cycles, identical, new_tokens = [], [], 0, 0
        counting = progress(f"{label}k={k} speculative")
        for prompt, expected in zip(prompts, baseline):
            tokens, accepted = speculative_greedy(target, drafter, draft_to_target, prompt, k,
                                                  cfg.evaluate.max_new_tokens, eos)
            identical += tokens == expected
            new_tokens += len(tokens)
            cycles += accepted
            first_cycles += accepted[:1]
            counting.update(1, len(tokens))
        counting.emit()
        results[str(k)] = acceptance_figures(cycles, first_cycles, new_tokens, k)
        results[str(k)]["identical_to_greedy"] = f"{identical}/{len(prompts)}"
        log.info("evaluate: %sk=%d: mean acceptance length %.3f over %d cycles (first cycle %.3f); %d/%d outputs "
                 "equal greedy", label, k, results[str(k)]["mean_accept_length"], len(cycles),
                 results[str(k)]["first_cycle_accept_length"], identical, len(prompts))
    return results


def compare_and_promote(cfg, lineage, pinned: dict, results: dict, measure_drafter, hold: bool = False) -> dict:
    """Measure the lineage's current drafter (`measure_drafter(its dir)`) on the same prompts, and promote this
    run's if it is better by evaluate.promote_margin (eagle3.promote). `hold`: decide, but leave the switch to
    `lineage promote`, which the DAG runs once a person approved (the deployment's approve_promotion)."""
    from eagle3.export import DRAFTER_DIR
    from eagle3.promote import decide, hold_for_approval, inputs_digest, weights_digest
    from eagle3.train import started_from

    k = cfg.evaluate.draft_lengths[0]
    figures = {key: value["mean_accept_length"] for key, value in results.items()}
    outcome = {"lineage": lineage.key, "lineage_dir": str(lineage.dir), "eval_set_prompts": len(pinned["prompts"]),
               "eval_set_pinned_by": pinned["pinned_by"], "accept_length": figures, "current_before": None}
    if not cfg.evaluate.promote:
        return {**outcome, "promoted": False, "reason": "evaluate.promote is off"}
    ours = weights_digest(cfg.run_dir / DRAFTER_DIR)
    current = lineage.current()
    theirs = None
    if current is not None:
        record = current.record
        outcome["current_before"] = {"version": current.name, "run": record["run"]}
        if record["weights_sha256"] == ours:  # a retried evaluate, or a rerun whose inputs had not changed
            lineage.also_made_from(current, inputs_digest(cfg))  # the next run with these inputs skips training
            return {**outcome, "promoted": False, "current": str(lineage.dir / "current"),
                    "reason": f"this drafter is the current one already ({current.name}, the same weights)"}
        theirs = measure_drafter(current.path)
        outcome["current_before"]["accept_length"] = {key: v["mean_accept_length"] for key, v in theirs.items()}
    promote, reason = decide(results, theirs, k, cfg.evaluate.promote_margin)
    log.info("evaluate: %s %s", "promoting this run's drafter:" if promote else "not promoted:", reason)
    if not promote:
        return {**outcome, "promoted": False, "reason": reason, "current": str(lineage.dir / "current")}
    record = {"run": cfg.run_name, "run_dir": str(cfg.run_dir), "weights_sha256": ours, "accept_length": figures,
              "inputs_digest": inputs_digest(cfg),  # a later run with the same inputs skips training
              "started_from": started_from(cfg),  # train.init_from current: the version it was warm-started from
              "promoted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "reason": reason,
              "previous": outcome["current_before"], "eval_set_prompts": len(pinned["prompts"])}
    if hold:
        hold_for_approval(cfg, record, expected_current=current.name if current else None)
        return {**outcome, "promoted": False, "pending_approval": True, "reason": reason,
                "current": str(lineage.dir / "current")}
    version = lineage.promote(cfg.run_dir / DRAFTER_DIR, cfg.run_name, record, cfg.evaluate.keep_versions,
                              expected_current=current.name if current else None)
    if version is None:
        return {**outcome, "promoted": False, "reason": "another run promoted a drafter while this one was measured; "
                "evaluate again to compare with it"}
    return {**outcome, "promoted": True, "reason": reason, "current": str(lineage.dir / "current"),
            "version": version.name}


def extraction_summary(cfg) -> dict:
    """What extract did for this run: how many samples it computed, how many it found in the shared store."""
    from eagle3.runlayout import run_stats_path

    shards = [json.loads(path.read_text()) for shard in range(cfg.extract.num_shards)
              if (path := run_stats_path(cfg.run_dir, shard)).exists()]
    return {
        "store": str(cfg.store_dir.resolve()),
        "samples": sum(s["samples_stored"] for s in shards),
        "extracted": sum(s["samples_extracted"] for s in shards),
        "reused": sum(s["samples_stored_before"] for s in shards),
    }


def plot_acceptance(report: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for k, result in report["speculative"].items():
        rates = result["accept_rate_per_position"]
        ax.plot(range(1, len(rates) + 1), rates, marker="o",
                label=f"k={k}: accept length {result['mean_accept_length']:.2f}")
    ax.set(xlabel="draft position", ylabel="acceptance rate (given the earlier ones)", ylim=(0, 1.05),
           title=f"speculative decoding on {report['prompts']} held-out prompts "
                 f"(teacher-forced simulated: {report['simulated_accept_length_teacher_forced']:.2f})")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
