"""Acceptance evaluation: real speculative decoding with the exported drafter on the tiny target."""

from __future__ import annotations

import json

import pytest

from eagle3.stages.evaluate import run_evaluate
from eagle3.stages.export import run_export


@pytest.mark.slow
def test_speculation_is_lossless_and_reports_acceptance(trained_config, make_config):
    train_config = trained_config
    run_export(train_config)
    cfg = make_config(
        run_name="train",
        evaluate={"num_prompts": 8, "max_new_tokens": 24, "draft_lengths": [1, 3]},
        **{k: train_config.model_dump()[k] for k in ("train", "vocab", "extract")},
    )
    report = run_evaluate(cfg)

    assert report["prompts"] == 8
    for k, result in report["speculative"].items():
        assert result["identical_to_greedy"] == "8/8"  # verification makes speculation exact
        assert 1.0 <= result["accept_length"] <= result["sglang_accept_length"] <= 1 + int(k)
        assert len(result["accept_rate_per_position"]) == int(k)
        assert all(0.0 <= r <= 1.0 for r in result["accept_rate_per_position"])
    # The trained drafter gets real acceptances: more than one token per target forward on average.
    assert report["speculative"]["3"]["accept_length"] > 1.2
    out = cfg.run_dir / "evaluate"
    assert json.loads((out / "report.json").read_text()) == report
    assert (out / "acceptance.png").stat().st_size > 10_000


@pytest.mark.slow
def test_public_sets_are_measured_at_the_published_configurations_beside_the_held_out_figure(
    trained_config, make_config, tmp_path
):
    """evaluate.benchmarks, each set's records from a local file in the set's own format (made up): every set is
    measured with the drafter at k=3 (3 steps / topk 1 / 4 draft tokens) and k=7 (7 / 1 / 8) whatever the held-out
    draft lengths, losslessly, in report.json's public_sets next to speculative. The figures are those of the
    prompts rendered as the target is served, decoded by the same speculative loop: recomputed here apart."""
    from transformers import AutoConfig

    from eagle3.capture.hf import HfCapture
    from eagle3.data.samples import SampleTokenizer
    from eagle3.stages.evaluate.decoding import speculative_greedy
    from eagle3.stages.export import load_exported_drafter
    from tests.test_public_sets import BFCL, GSM8K, HUMANEVAL, MTBENCH, write_jsonl

    run_export(trained_config)
    sets = {"mtbench": MTBENCH, "gsm8k": GSM8K, "humaneval": HUMANEVAL, "bfcl": BFCL}
    files = {name: write_jsonl(tmp_path / f"{name}.jsonl", records) for name, records in sets.items()}
    cfg = make_config(
        run_name="train",
        evaluate={
            "num_prompts": 4,
            "max_new_tokens": 16,
            "draft_lengths": [3],
            "promote": False,
            "benchmarks": list(sets),
            "benchmark_files": files,
            "benchmark_max_new_tokens": 8,
        },
        **{k: trained_config.model_dump()[k] for k in ("train", "vocab", "extract")},
    )
    report = run_evaluate(cfg)

    assert list(report["speculative"]) == ["3"] and report["prompts"] == 4  # the held-out figure, as before
    public = report["public_sets"]
    assert list(public) == list(sets)
    assert [(p["records"], p["prompts"]) for p in public.values()] == [(2, 4), (2, 2), (1, 1), (1, 1)]
    for name, one in public.items():
        assert one["source"] == f"file {files[name]}" and one["max_new_tokens"] == 8
        assert 0 <= one["answers_cut_at_max_new_tokens"] <= one["prompts"]
        assert list(one["speculative"]) == ["3", "7"], name  # k=7 too: a start of its own here
        for k, figures in one["speculative"].items():
            assert figures["configuration"] == {"num_steps": int(k), "eagle_topk": 1, "num_draft_tokens": int(k) + 1}
            assert figures["identical_to_greedy"] == f"{one['prompts']}/{one['prompts']}", (name, k)
            low, high = figures["accept_length_interval95"]
            assert 1.0 <= low <= figures["accept_length"] <= high <= 1 + int(k)
            assert figures["accept_length"] <= figures["ceiling_accept_length"]
    assert sum(one["answers_cut_at_max_new_tokens"] for one in public.values()) > 0  # 8 tokens cut some answers
    assert public["gsm8k"]["published_k3"] == {"TorchSpec Kimi-K2.5 EAGLE-3": 3.20, "AQ-MedAI Kimi-K2 EAGLE-3": 3.27}
    assert public["bfcl"]["published_k3"] == {}
    assert json.loads((cfg.run_dir / "evaluate" / "report.json").read_text()) == report

    tokenizing = SampleTokenizer.for_run(cfg)
    target, (drafter, d2t) = HfCapture(cfg), load_exported_drafter(cfg.run_dir / "drafter", cfg.target.model_path)
    eos = {AutoConfig.from_pretrained(cfg.target.model_path).eos_token_id}
    for k in (3, 7):
        cycles = [
            a
            for record in GSM8K
            for a in speculative_greedy(
                target,
                drafter,
                d2t,
                tokenizing.prompt_ids([{"role": "user", "content": record["question"]}]),
                k,
                8,
                eos,
            )[1]
        ]
        measured = public["gsm8k"]["speculative"][str(k)]
        assert (measured["cycles"], measured["sglang_accept_length"]) == (len(cycles), 1 + sum(cycles) / len(cycles))


class RowByRow:
    """A target's logits_and_aux_rows from its logits_and_aux, one sequence at a time (the test doubles here)."""

    def logits_and_aux_rows(self, seqs: list[list[int]]) -> list:
        return [self.logits_and_aux(seq) for seq in seqs]


class ScriptedTarget(RowByRow):
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


def test_verify_steps_with_fewer_than_k_answer_tokens_left_are_counted_as_capped():
    """A 10-token answer at k=7: prefill commits 1, the first step 8 (7 drafts and a bonus) with 9 left, the second
    the last 1 with 1 left: capped. At k=3 the steps start with 9, 5 and 1 left: one capped."""
    from eagle3.stages.evaluate.figures import capped_by_answer_end

    assert capped_by_answer_end(10, [7, 0], 7) == 1
    assert capped_by_answer_end(10, [3, 3, 0], 3) == 1
    assert capped_by_answer_end(10, [0] * 9, 3) == 2  # one token a step: 9, 8, ..., 2, 1 left, the last two capped


def test_a_drafted_end_of_turn_that_the_target_agrees_with_is_accepted(monkeypatch):
    """SGLang commits a correctly drafted end-of-turn token like any other: the drafter that learned to end
    answers gets the credit, and the output still equals plain greedy decoding."""
    import eagle3.stages.evaluate.decoding as decoding

    prompt = [1, 2]
    target = ScriptedTarget(len(prompt))
    monkeypatch.setattr(decoding, "draft_chains", lambda drafter, d2t, auxes, nexts, k: [[6, 7, 9][:k]] * len(nexts))
    tokens, accepted = decoding.speculative_greedy(target, None, None, prompt, 3, 48, {9})
    assert tokens == decoding.plain_greedy(target, prompt, 48, {9}) == [5, 6, 7, 9]
    assert accepted == [3]  # 6, 7 and the end of turn: one verify step after prefill's first token


@pytest.mark.parametrize(
    ("proposal", "max_new", "passes"),
    [
        ([5, 6, 7, 9], 48, 1),  # right: one pass confirms it
        ([5, 6, 7, 9], 2, 1),  # right up to max_new
        ([5, 8, 7, 9], 48, 4),  # wrong at 1: decoded on from there (3 tokens, a pass each)
        ([5, 6], 48, 3),  # right but stops short: decoded on
        ([], 48, 4),  # nothing proposed: plain decoding
    ],
)
def test_the_greedy_baseline_is_confirmed_from_a_proposal_or_decoded_where_it_is_wrong(proposal, max_new, passes):
    """HfMeasurer's greedy baseline: whatever is proposed, the answer is plain greedy decoding's; a right proposal
    costs one forward pass."""
    from eagle3.stages.evaluate import decoding

    prompt, target = [1, 2], ScriptedTarget(2)
    calls = []
    counted = type(
        "Counted", (RowByRow,), {"logits_and_aux": lambda self, seq: calls.append(seq) or target.logits_and_aux(seq)}
    )

    (answer,) = decoding.confirmed_greedy_rows(counted(), [prompt], [proposal], max_new, {9})

    assert answer == decoding.plain_greedy(target, prompt, max_new, {9}) == [5, 6, 7, 9][:max_new]
    assert len(calls) == passes


def multi_turn(first: str, *later: str) -> dict:
    messages = [{"role": "user", "content": first}, {"role": "assistant", "content": f"About {first}"}]
    for text in later:
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": f"About {text}"}]
    return {"messages": messages}


def questions(part: str, count: int, start: int = 0) -> list[str]:
    """`count` questions whose split key (val_fraction 0.5) falls in `part`."""
    from eagle3.stages.split import part_of_key, prompt_key

    found, n = [], start
    while len(found) < count:
        n += 1
        if part_of_key(prompt_key(q := f"What is {n} + {n + 1}?"), 0.5) == part:
            found.append(q)
    return found


@pytest.mark.slow
def test_held_out_prompts_mix_first_and_later_turns_deterministically(make_config, tmp_path):
    """evaluate's prompts end at the first user turn or, up to half of them, at a later one (the conversation
    before it as context, the generation prompt after it), from evaluation-part conversations only, in an order the
    file's order does not change. A later turn that asks what opens a training conversation is not taken: that
    question's answer was trained."""
    from eagle3.data.samples import SampleTokenizer, read_conversations
    from eagle3.stages.evaluate.prompts import held_out
    from eagle3.stages.split import EVALUATION, TRAINING, run_split
    from tests.test_split import write_jsonl

    opening, asked_later, trained = (
        questions("evaluation", 6),
        questions("evaluation", 12, 1000),
        questions("training", 3, 2000),
    )
    rows = [multi_turn(q, asked_later[2 * i], asked_later[2 * i + 1]) for i, q in enumerate(opening)]
    rows += [multi_turn(q) for q in trained]
    rows.append(multi_turn(questions("evaluation", 1, 3000)[0], trained[0].upper()))  # asked later, trained first
    data = tmp_path / "turns.jsonl"
    write_jsonl(data, rows)
    cfg = make_config(data={"path": str(data), "max_samples": None}, train={"val_fraction": 0.5})
    tokenizing = SampleTokenizer.for_run(cfg)
    conversations = {c.sample_id: c for c in read_conversations(data)[0]}
    split = run_split(cfg)

    held = held_out(cfg, tokenizing, limit=8)
    assert [h.kind for h in held] == ["first"] * 4 + ["later"] * 4
    for h in held:
        messages = conversations[h.conversation_id].messages
        assert split.part_of_conversation(h.conversation_id) == EVALUATION
        assert messages[h.turn]["role"] == "assistant" and messages[h.turn - 1]["role"] == "user"
        assert h.prompt == tokenizing.prompt_ids(messages[: h.turn])
        assert (h.turn == 1) == (h.kind == "first")
    assert all(h.turn == 3 for h in held if h.kind == "later")  # second user turns before any third

    everything = held_out(cfg, tokenizing, limit=100)  # more than there are: the later turns fill in
    assert [h.kind for h in everything].count("first") == 7 and [h.kind for h in everything].count("later") == 12
    asker = next(c.sample_id for c in conversations.values() if c.messages[-2]["content"] == trained[0].upper())
    taken = {(h.conversation_id, h.turn) for h in everything}
    assert (asker, 1) in taken and (asker, 3) not in taken
    assert (
        split.part_of_conversation(
            next(c for c in conversations.values() if c.messages[0]["content"] == trained[0]).sample_id
        )
        == TRAINING
    )

    write_jsonl(data, rows[::-1])  # the file's order does not choose the prompts
    again = held_out(cfg, SampleTokenizer.for_run(cfg), limit=8)
    assert [(h.conversation_id, h.turn, h.prompt) for h in again] == [
        (h.conversation_id, h.turn, h.prompt) for h in held
    ]


class MarkovTarget(RowByRow):
    """A target that samples: its next-token distribution depends on the last token only (a fixed random table over
    a vocabulary of 8; token 7 ends the answer), so that plain sampling and speculative sampling can be drawn
    thousands of times in seconds."""

    VOCAB, EOS = 8, 7

    def __init__(self):
        import torch

        generator = torch.Generator().manual_seed(7)
        self.table = torch.randn(self.VOCAB, self.VOCAB, generator=generator) * 1.5
        self.table[:, self.EOS] -= 1.5  # answers run a few tokens

    def logits_and_aux(self, seq):
        import torch

        return self.table[torch.as_tensor(seq) % self.VOCAB], torch.zeros(len(seq), 3)


def likeliest_chains(target: MarkovTarget):
    """A stand-in for decoding.draft_chains: from each context's last token, the target's likeliest chain."""

    def draft_chains(drafter, d2t, auxes, nexts, k):
        chains = [[next_ids[-1]] for next_ids in nexts]
        for chain in chains:
            for _ in range(k):
                chain.append(int(target.table[chain[-1]].argmax()))
        return [chain[1:] for chain in chains]

    return draft_chains


def sample_both_ways(monkeypatch, sampling, answers: int = 600):
    """`answers` answers to one prompt from plain sampling and from speculative sampling, each seeded apart, the
    drafter proposing the target's likeliest chain from the last token; and the drafts accepted per verify step."""
    import torch

    import eagle3.stages.evaluate.decoding as decoding

    target, prompt = MarkovTarget(), [3, 4]

    monkeypatch.setattr(decoding, "draft_chains", likeliest_chains(target))
    plain, drawn, cycles = [], [], []
    for i in range(answers):
        plain.append(
            decoding.plain_decode(
                target,
                prompt,
                12,
                {MarkovTarget.EOS},
                decoding.SamplingRule(sampling, torch.Generator().manual_seed(2 * i)),
            )
        )
        tokens, accepted = decoding.speculative_decode(
            target,
            None,
            None,
            prompt,
            3,
            12,
            {MarkovTarget.EOS},
            decoding.SamplingRule(sampling, torch.Generator().manual_seed(2 * i + 1)),
        )
        drawn.append(tokens)
        cycles += accepted
    return plain, drawn, cycles


def test_prompts_decoded_together_get_the_answers_each_gets_alone(monkeypatch):
    """evaluate's hf path decodes DECODE_ROWS prompts together: prompts of other lengths, answers that end at
    other steps, sampled with a generator each, are what decoding each prompt alone gives, draws included."""
    import torch

    import eagle3.stages.evaluate.decoding as decoding
    from eagle3.engines import Sampling

    target = MarkovTarget()

    monkeypatch.setattr(decoding, "draft_chains", likeliest_chains(target))
    prompts = [[3, 4], [1], [5, 6, 2, 0], [3, 4], [2, 2, 2]] * 4

    def rule(index):
        return decoding.SamplingRule(Sampling(1.0, 0.95, None), torch.Generator().manual_seed(index))

    rules = [rule(i) for i in range(len(prompts))]
    together = decoding.speculative_decode_rows(target, None, None, prompts, 3, 12, {MarkovTarget.EOS}, rules)
    alone = [
        decoding.speculative_decode(target, None, None, prompt, 3, 12, {MarkovTarget.EOS}, rule(i))
        for i, prompt in enumerate(prompts)
    ]
    assert together == alone
    assert len({len(tokens) for tokens, _ in alone}) > 2  # answers of several lengths: rows leave the batch apart


@pytest.mark.slow
def test_speculative_sampling_draws_the_answers_plain_sampling_draws(monkeypatch):
    """At a temperature, a chain of drafts verified by the speculative sampling rule (accept a draft with the target's
    probability of it, resample a rejected one from the rest) gives answers distributed as plain sampling's: the
    permutation test evaluate reports finds no difference over 600 answers, while the same test tells plain
    sampling from greedy verification and from another temperature, and from a rule that resamples a rejected draft
    from the whole distribution (the common bug: its token comes back too often)."""
    import torch

    import eagle3.stages.evaluate.decoding as decoding
    from eagle3.engines import Sampling
    from eagle3.model.acceptance import same_distribution_p

    served = Sampling(1.0, 0.95, None)
    plain, drawn, cycles = sample_both_ways(monkeypatch, served)
    assert 0.2 < sum(cycles) / len(cycles) / 3 < 0.8  # drafts both accepted and rejected: every branch drawn
    assert same_distribution_p(plain, drawn) > 0.05

    # The test can fail: greedy verification at a temperature, and sampling at another temperature, are told apart.
    greedy = [decoding.speculative_greedy(MarkovTarget(), None, None, [3, 4], 3, 12, {MarkovTarget.EOS})[0]] * 600
    assert same_distribution_p(plain, greedy) < 0.001
    colder, _, _ = sample_both_ways(monkeypatch, Sampling(0.6, 0.95, None))
    assert same_distribution_p(plain, colder) < 0.001
    # ... and so is a rejected draft resampled from the whole distribution instead of the rest of it.
    monkeypatch.setattr(torch.Tensor, "clone", lambda self: _NoWrites(self))
    _, lossy, _ = sample_both_ways(monkeypatch, served)
    assert same_distribution_p(plain, lossy) < 0.001


class _NoWrites(__import__("torch").Tensor):
    """A copy whose item writes are dropped: the rule's `rest[draft] = 0` then leaves the rejected draft in."""

    def __new__(cls, tensor):
        return tensor.detach().contiguous().as_subclass(cls)

    def __setitem__(self, index, value):
        pass


def test_sampling_probabilities_follow_temperature_top_k_and_top_p():
    """What the target samples from, as the engines apply it: temperature, then top_k, then the smallest set of
    likeliest tokens whose probabilities reach top_p."""
    import torch

    from eagle3.engines import Sampling
    from eagle3.stages.evaluate.decoding import sampling_probs

    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    assert torch.allclose(sampling_probs(logits, Sampling(1.0)), torch.tensor([0.5, 0.25, 0.15, 0.1]))
    assert torch.allclose(sampling_probs(logits, Sampling(1.0, top_k=2)), torch.tensor([2 / 3, 1 / 3, 0, 0]))
    assert torch.allclose(sampling_probs(logits, Sampling(1.0, top_p=0.7)), torch.tensor([2 / 3, 1 / 3, 0, 0]))
    assert torch.allclose(sampling_probs(logits, Sampling(1.0, top_p=0.75)), torch.tensor([2 / 3, 1 / 3, 0, 0]))
    assert torch.allclose(sampling_probs(logits, Sampling(1.0, top_p=0.76)), torch.tensor([0.5, 0.25, 0.15, 0]) / 0.9)
    cold = sampling_probs(logits, Sampling(0.5))
    assert torch.allclose(cold, torch.tensor([0.25, 0.0625, 0.0225, 0.01]) / 0.345)


@pytest.mark.slow
def test_evaluate_at_the_serving_temperature_reports_sampled_figures(trained_config, make_config):
    """evaluate.sampling "serving": the target's sampling (here set on generate, as init fills it from the target's
    generation_config.json) draws the baseline and the speculative answers; the report says how they were drawn,
    checks them against plain sampling in distribution instead of token for token, and a rerun draws the same
    answers (seeded per prompt)."""
    run_export(trained_config)
    sections = {k: trained_config.model_dump()[k] for k in ("train", "vocab", "extract")}
    cfg = make_config(
        run_name="train",
        # hot enough that the tiny target, which answers 98% of unseen prompts exactly, samples other answers
        generate={"temperature": 2.0, "top_p": 0.95, "top_k": 20},
        evaluate={
            "num_prompts": 8,
            "max_new_tokens": 24,
            "draft_lengths": [3],
            "promote": False,
            "sampling": "serving",
        },
        **sections,
    )
    report = run_evaluate(cfg)

    assert report["sampling"] == {"temperature": 2.0, "top_p": 0.95, "top_k": 20}
    figures = report["speculative"]["3"]
    assert figures["identical_to_greedy"] is None and 0 < figures["same_distribution_as_plain_p"] <= 1
    assert 1.0 <= figures["accept_length"] <= figures["ceiling_accept_length"]
    assert run_evaluate(cfg)["speculative"] == report["speculative"]  # the same draws again
    greedy = run_evaluate(
        make_config(
            run_name="train",
            evaluate={"num_prompts": 8, "max_new_tokens": 24, "draft_lengths": [3], "promote": False},
            **sections,
        )
    )
    assert greedy["sampling"] == {"temperature": 0.0, "top_p": 1.0, "top_k": None}
    assert greedy["speculative"]["3"]["identical_to_greedy"] == "8/8"
    assert greedy["speculative"]["3"]["cycles"] != figures["cycles"]  # other answers: sampled, not greedy
