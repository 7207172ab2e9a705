"""Acceptance evaluation: real speculative decoding with the exported drafter on the tiny target."""

from __future__ import annotations

import json

from eagle3.evaluate import run_evaluate
from eagle3.export import run_export
from eagle3.train import run_train


def test_speculation_is_lossless_and_reports_acceptance(train_config, make_config):
    run_train(train_config)
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
