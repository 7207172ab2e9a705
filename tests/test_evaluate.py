"""Acceptance evaluation: real speculative decoding with the exported drafter on the tiny target."""

from __future__ import annotations

import json

from eagle3.evaluate import run_evaluate
from eagle3.export import run_export


def test_speculation_is_lossless_and_reports_acceptance(trained_config, make_config):
    train_config = trained_config
    run_export(train_config)
    cfg = make_config(run_name="train", evaluate={"num_prompts": 8, "max_new_tokens": 24, "draft_lengths": [1, 3]},
                      **{k: train_config.model_dump()[k] for k in ("train", "vocab", "extract")})
    report = run_evaluate(cfg)

    assert report["prompts"] == 8
    for k, result in report["speculative"].items():
        assert result["identical_to_greedy"] == "8/8"  # verification makes speculation exact
        assert 1.0 <= result["mean_accept_length"] <= 1 + int(k)
        assert len(result["accept_rate_per_position"]) == int(k)
        assert all(0.0 <= r <= 1.0 for r in result["accept_rate_per_position"])
    # The trained drafter gets real acceptances: more than one token per target forward on average.
    assert report["speculative"]["3"]["mean_accept_length"] > 1.2
    out = cfg.run_dir / "evaluate"
    assert json.loads((out / "report.json").read_text()) == report
    assert (out / "acceptance.png").stat().st_size > 10_000


class ScriptedTarget:
    """A target whose greedy continuation of anything is SCRIPT, then EOS (logits from the sequence length)."""

    SCRIPT, EOS, VOCAB = [5, 6, 7], 9, 10

    def __init__(self, prompt_len: int):
        self.prompt_len = prompt_len

    def logits_and_aux(self, seq):
        import torch

        nexts = [*self.SCRIPT, self.EOS]
        logits = torch.zeros(len(seq), self.VOCAB)
        for t in range(len(seq)):
            logits[t, nexts[min(max(t + 1 - self.prompt_len, 0), len(nexts) - 1)]] = 1.0
        return logits, torch.zeros(len(seq), 3)


def test_a_drafted_end_of_turn_that_the_target_agrees_with_is_accepted(monkeypatch):
    """SGLang commits a correctly drafted end-of-turn token like any other: the drafter that learned to end
    answers gets the credit, and the output still equals plain greedy decoding."""
    import eagle3.evaluate as evaluate

    prompt = [1, 2]
    target = ScriptedTarget(len(prompt))
    monkeypatch.setattr(evaluate, "draft_chain", lambda drafter, d2t, aux, next_ids, k: [6, 7, 9][:k])
    tokens, accepted = evaluate.speculative_greedy(target, None, None, prompt, 3, 48, {9})
    assert tokens == evaluate.plain_greedy(target, prompt, 48, {9}) == [5, 6, 7, 9]
    assert accepted == [3]  # 6, 7 and the end of turn: one verify step after prefill's first token


def test_acceptance_figures_use_sglangs_definition():
    # Three answers: cycles accepting (2, 0), (3,), (1, 1, 0) drafts of k=3, 14 new tokens in all.
    figures = evaluate_figures([2, 3, 1, 0, 1, 0], [2, 3, 1], 14)
    assert figures["mean_accept_length"] == 1 + 7 / 6  # committed tokens per verify step, bonus included
    assert figures["first_cycle_accept_length"] == 1 + 6 / 3
    assert figures["later_cycles_accept_length"] == 1 + 1 / 3
    assert figures["completion_tokens_per_verify_step"] == 14 / 6  # meta_info's spec_accept_length
    assert figures["accept_rate_per_position"] == [4 / 6, 2 / 4, 1 / 2]


def evaluate_figures(cycles, first_cycles, new_tokens):
    from eagle3.evaluate import acceptance_figures

    return acceptance_figures(cycles, first_cycles, new_tokens, k=3)
