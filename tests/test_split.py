"""The split by first user prompt: no first prompt on two sides, three disjoint parts, the lineage's pinned set kept
out of training and validation, and the cached keys rebuilt when the conversations change."""

from __future__ import annotations

import json
from collections import Counter, defaultdict

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


def shared_first_prompts(groups: int = 24) -> tuple[list[dict], list[list[int]]]:
    """Conversations in groups that open with one question each, spelled and followed differently (case, spacing,
    a system prompt, later turns): (conversations, line indices of each group)."""
    rows, members = [], []
    for g in range(groups):
        question = f"Sort these numbers: {g} {3 * g + 1} {7 - g}"
        variants = [
            conversation(question, f"Sorted, group {g}."),
            conversation(question.upper() + "  ", f"Sorted again, group {g}.", "And reversed?"),
            conversation(question.replace(" ", "  "), f"One more, group {g}.", system="Be brief."),
        ]
        members.append(list(range(len(rows), len(rows) + len(variants))))
        rows += variants
    return rows, members


def write_jsonl(path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_conversations_that_share_a_first_prompt_take_one_part(make_config, tmp_path):
    rows, members = shared_first_prompts()
    data = tmp_path / "shared.jsonl"
    write_jsonl(data, rows)
    cfg = make_config(data={"path": str(data), "max_samples": None}, train={"val_fraction": 0.5})
    conversations, _ = read_conversations(data)
    split = run_split(cfg)
    parts = [{split.part_of_conversation(conversations[i].sample_id) for i in group} for group in members]
    assert all(len(p) == 1 for p in parts), parts
    assert {p.pop() for p in parts} == {TRAINING, VALIDATION, EVALUATION}  # (else the test proves little)
    # Keyed on the conversation id, as before, the groups straddle the sides.
    assert any(len({int(conversations[i].sample_id, 16) % 10_000 < 5_000 for i in group}) > 1 for group in members)
    # A per-turn sample "<conversation id>.<turn>" takes its conversation's part.
    some = conversations[members[0][1]].sample_id
    assert split.part(f"{some}.3") == split.part(some) == split.part_of_conversation(some)
    with pytest.raises(SplitError, match=f"{'0' * 16} is in the run's samples but not in {data}"):
        split.part("0" * 16)


@pytest.mark.slow
def test_on_the_tiny_targets_prompts_no_first_prompt_is_on_two_sides(make_config, tiny_target):
    """The demo's data (the tiny target's 6000 prompts, 5387 distinct conversations), at the demo's val_fraction."""
    cfg = make_config(data={"max_samples": None}, train={"val_fraction": 0.3})
    conversations, _ = read_conversations(tiny_target / "prompts.jsonl")
    split = run_split(cfg)
    sides, old_sides, opened = defaultdict(set), defaultdict(set), Counter()
    for c in conversations:
        first = normalise_prompt(next(m["content"] for m in c.messages if m["role"] == "user"))
        sides[first].add(split.part_of_conversation(c.sample_id))
        old_sides[first].add(int(c.sample_id, 16) % 10_000 < 0.05 * 10_000)  # the control: a key per conversation
        opened[first] += 1
    shared = [first for first, n in opened.items() if n > 1]
    assert len(conversations) == 5387 and len(shared) == 238  # the tiny target's prompts, as built
    assert sum(len(parts) > 1 for parts in old_sides.values()) == 30
    assert not [first for first, parts in sides.items() if len(parts) > 1]
    assert {part for parts in sides.values() for part in parts} == {TRAINING, VALIDATION, EVALUATION}


def test_the_keys_are_cached_in_the_run_directory_until_the_conversations_change(make_config, tmp_path, monkeypatch):
    rows, _ = shared_first_prompts(4)
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
    rows, members = shared_first_prompts()
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
            "split_keys": [before.keys[conversations[validating[0]].sample_id], prompt_key(question.upper())],
            "prompts": [[1, 2]],
        },
    )
    after = run_split(cfg)
    for i in validating + trained:
        assert after.part_of_conversation(conversations[i].sample_id) == EVALUATION
    assert after.pinned_out([conversations[i].sample_id for i in validating + trained]) == 6
