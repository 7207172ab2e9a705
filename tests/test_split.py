"""The split keyed on every user turn: a user turn held out for evaluation is asked by no training conversation,
wherever it stands in a conversation; three disjoint parts; the lineage's pinned set kept out of training and
validation; the cached keys rebuilt when the conversations change."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

import eagle3.stages.split as split_module
from eagle3.data.samples import read_conversations
from eagle3.disk.layout import SPLIT_KEYS
from eagle3.records.lineage import Lineage
from eagle3.stages.split import (
    EVALUATION,
    TRAINING,
    VALIDATION,
    SplitError,
    normalise_prompt,
    part_of_key,
    prompt_key,
    run_split,
)


def test_normalisation_merges_spellings_of_one_question_and_nothing_more():
    same = [
        "What is 2 + 2?",
        "what is 2 + 2?",
        "  What  is\t2 +\n2? ",
        "ＷＨＡＴ ｉｓ ２ ＋ ２？",  # full width
        "What\u00a0is 2 + 2?",
    ]
    assert {normalise_prompt(text) for text in same} == {"what is 2 + 2?"}
    assert normalise_prompt("Cafe\u0301") == normalise_prompt("Café") == "café"  # combining accent: NFC's case too
    assert normalise_prompt("Straße") == normalise_prompt("STRASSE")  # casefold, not lower
    different = ["What is 2 + 2?", "What is 2 + 3?", "What is 2 + 2", "What is 2+2?"]
    assert len({prompt_key(text) for text in different}) == 4  # digits, punctuation and spacing inside stay


def conversation(first: str, answer: str, *later: str, system: str | None = None) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    messages += [{"role": "user", "content": first}, {"role": "assistant", "content": answer}]
    for i, text in enumerate(later):
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": f"answer {i}"}]
    return {"messages": messages}


def shared_questions(groups: int = 24) -> tuple[list[dict], list[list[int]]]:
    """Conversations in groups that ask one question each, spelled and followed differently (case, spacing, a system
    prompt, later turns), and once as a later turn after another question: (conversations, line indices of each
    group)."""
    rows, members = [], []
    for g in range(groups):
        question = f"Sort these numbers: {g} {3 * g + 1} {7 - g}"
        variants = [
            conversation(question, f"Sorted, group {g}."),
            conversation(question.upper() + "  ", f"Sorted again, group {g}.", "And reversed?"),
            conversation(question.replace(" ", "  "), f"One more, group {g}.", system="Be brief."),
            conversation(f"Hello from group {g}.", "Hello.", question),  # asked again, as a later turn
        ]
        members.append(list(range(len(rows), len(rows) + len(variants))))
        rows += variants
    return rows, members


def write_jsonl(path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_a_question_held_out_for_evaluation_is_asked_by_no_conversation_that_trains(make_config, tmp_path):
    rows, members = shared_questions()
    data = tmp_path / "shared.jsonl"
    write_jsonl(data, rows)
    cfg = make_config(data={"path": str(data), "max_samples": None}, train={"val_fraction": 0.5})
    conversations, _ = read_conversations(data)
    split = run_split(cfg)
    held_out = [g for g in members if part_of_key(prompt_key(rows[g[0]]["messages"][0]["content"]), 0.5) == EVALUATION]
    assert held_out and len(held_out) < len(members)  # (else the test proves little)
    for group in held_out:
        assert {split.part_of_conversation(conversations[i].sample_id) for i in group} == {EVALUATION}
    assert {split.part_of_conversation(c.sample_id) for c in conversations} == {TRAINING, VALIDATION, EVALUATION}
    # Keyed on the first user prompt only, a held-out question asked as a later turn was trained.
    opened_by = [part_of_key(prompt_key(conversations[g[3]].messages[0]["content"]), 0.5) for g in held_out]
    assert TRAINING in opened_by
    # A per-turn sample "<conversation id>.<turn>" takes its conversation's part.
    some = conversations[members[0][1]].sample_id
    assert split.part(f"{some}.3") == split.part(some) == split.part_of_conversation(some)
    with pytest.raises(SplitError, match=f"{'0' * 16} is in the run's samples but not in {data}"):
        split.part("0" * 16)


@pytest.mark.slow
def test_on_the_tiny_targets_prompts_no_evaluated_turn_is_trained(make_config, tiny_target):
    """The demo's data (the tiny target's prompts), at the demo's val_fraction: the user turn a prompt evaluate
    measures ends at is asked by no conversation that trains or validates, and every turn whose own bucket is
    evaluation is held out wherever it is asked."""
    from eagle3.data.samples import SampleTokenizer
    from eagle3.stages.evaluate.prompts import held_out

    cfg = make_config(data={"max_samples": None}, train={"val_fraction": 0.3}, evaluate={"num_prompts": 10_000})
    conversations, _ = read_conversations(tiny_target / "prompts.jsonl")
    split = run_split(cfg)
    parts_asking = defaultdict(set)
    for c in conversations:
        for m in c.messages:
            if m["role"] == "user":
                parts_asking[prompt_key(m["content"])].add(split.part_of_conversation(c.sample_id))
    assert {part for parts in parts_asking.values() for part in parts} == {TRAINING, VALIDATION, EVALUATION}
    for key, parts in parts_asking.items():
        if part_of_key(key, 0.3) == EVALUATION:
            assert parts == {EVALUATION}
    tokenizing = SampleTokenizer.for_run(cfg)
    measured = held_out(cfg, tokenizing)
    assert len(measured) > 500
    assert not [h for h in measured if parts_asking[h.keys[-1]] - {EVALUATION}]  # (earlier turns: context only)


def test_the_keys_are_cached_in_the_run_directory_until_the_conversations_change(make_config, tmp_path, monkeypatch):
    rows, _ = shared_questions(4)
    data = tmp_path / "data.jsonl"
    write_jsonl(data, rows)
    cfg = make_config(data={"path": str(data), "max_samples": None})
    keys = run_split(cfg).keys
    cached = json.loads((cfg.run_dir / SPLIT_KEYS).read_text())
    assert cached["keys"] == keys and cached["rule"] == split_module.SPLIT_RULE
    assert not [p for p in (cfg.run_dir / SPLIT_KEYS).parent.iterdir() if p.name.startswith(".")]

    import eagle3.data.samples

    def must_not_read(*args, **kwargs):
        raise AssertionError("the conversations were read again though the cached keys hold")

    monkeypatch.setattr(eagle3.data.samples, "read_conversations", must_not_read)
    assert run_split(cfg).keys == keys
    monkeypatch.undo()
    write_jsonl(data, rows + [conversation("A new question?", "A new answer.")])
    grown = run_split(cfg).keys
    assert len(grown) == len(keys) + 1 and keys.items() <= grown.items()
    data.unlink()  # (data.path moved away after extract: the recorded keys still place the run's samples)
    assert run_split(cfg).keys == grown


def pin_by_hand(cfg, record: dict) -> None:
    lineage = Lineage(cfg)
    (lineage.dir / "eval_set.json").write_text(json.dumps({**record, "pinned_by": "earlier", "pinned_at": "then"}))


def test_the_pinned_sets_keys_keep_their_conversations_out_of_training_and_validation(make_config, tmp_path):
    rows, members = shared_questions()
    data = tmp_path / "shared.jsonl"
    write_jsonl(data, rows)
    cfg = make_config(data={"path": str(data), "max_samples": None}, train={"val_fraction": 0.5})
    conversations, _ = read_conversations(data)
    before = run_split(cfg)
    trained = next(g for g in members if before.part_of_conversation(conversations[g[0]].sample_id) == TRAINING)
    validating = next(g for g in members if before.part_of_conversation(conversations[g[0]].sample_id) == VALIDATION)
    # Pinned: a conversation of the validating group (its key), and a later turn that asks the trained group's
    # question (the key of the user message it ends at).
    question = conversations[trained[0]].messages[0]["content"]
    pin_by_hand(
        cfg,
        {
            "format": 2,
            "conversation_ids": [conversations[validating[0]].sample_id],
            "split_keys": [*before.keys[conversations[validating[0]].sample_id], prompt_key(question.upper())],
            "prompts": [[1, 2]],
        },
    )
    after = run_split(cfg)
    for i in validating + trained:
        assert after.part_of_conversation(conversations[i].sample_id) == EVALUATION
    assert after.pinned_out([conversations[i].sample_id for i in validating + trained]) == 8
