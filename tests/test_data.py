"""Conversations in, loss masks out: both input forms, the chat template, and bad records."""

from __future__ import annotations

import copy
import json

import pytest

from eagle3.data import (
    Conversation,
    DataError,
    read_conversations,
    sample_id_of,
    shard_of,
    tokenize_conversation,
)

SHAREGPT = {
    "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "What is 2 + 3?"},
        {"from": "gpt", "value": "2 + 3 = 5."},
        {"from": "human", "value": "Reverse the words: red blue"},
        {"from": "gpt", "value": "Reversed: blue red."},
    ]
}
OPENAI = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "2 + 3 = 5."},
        {"role": "user", "content": "Reverse the words: red blue"},
        {"role": "assistant", "content": "Reversed: blue red."},
    ]
}


def write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_both_forms_give_the_same_conversation_and_id(tmp_path):
    conversations, stats = read_conversations(write_jsonl(tmp_path / "d.jsonl", [SHAREGPT, OPENAI]))
    # The second line is the same conversation in the other form: one sample, one duplicate.
    assert len(conversations) == 1 and stats.duplicates == 1
    assert conversations[0].messages == tuple(OPENAI["messages"])
    assert conversations[0].sample_id == sample_id_of(OPENAI["messages"])


def test_sample_id_is_stable_and_content_sensitive():
    changed = [dict(m) for m in OPENAI["messages"]]
    changed[2]["content"] = "2 + 3 = 6."
    assert sample_id_of(OPENAI["messages"]) == sample_id_of(list(OPENAI["messages"]))
    assert sample_id_of(OPENAI["messages"]) != sample_id_of(changed)
    assert len(sample_id_of(changed)) == 16 and 0 <= shard_of(sample_id_of(changed), 8) < 8


BAD_LINES = [
    OPENAI,
    "{not json",
    {"messages": [{"role": "user", "content": "hi"}]},
    {"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    "",
    {"messages": []},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]},
    {"text": "plain"},
]


def test_bad_records_stop_the_stage_with_their_line_numbers(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", BAD_LINES)
    with pytest.raises(DataError) as info:
        read_conversations(path)
    message = str(info.value)
    assert f"{path}: 7 bad record(s)" in message
    for line, reason in [(2, "invalid JSON"), (3, "no assistant turn"), (4, "turn 0 has unknown role 'wizard'"),
                         (5, "empty line"), (6, "empty conversation"), (7, "turn 1 (assistant) is empty"),
                         (8, 'no "conversations" or "messages" key')]:
        assert f"line {line}: {reason}" in message
    assert "on_bad_record" in message  # the fix is named


def test_skip_counts_bad_records_instead_of_dropping_them_silently(tmp_path):
    conversations, stats = read_conversations(write_jsonl(tmp_path / "d.jsonl", BAD_LINES), on_bad_record="skip")
    assert len(conversations) == 1
    assert sorted(stats.bad) == [2, 3, 4, 5, 6, 7, 8]


def test_max_samples_limits_the_read(tmp_path):
    lines = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
             for i in range(10)]
    conversations, _ = read_conversations(write_jsonl(tmp_path / "d.jsonl", lines), max_samples=4)
    assert [c.messages[1]["content"] for c in conversations] == ["a0", "a1", "a2", "a3"]


def test_loss_mask_covers_exactly_the_assistant_contents(tiny_tokenizer):
    conversation = Conversation(sample_id_of(OPENAI["messages"]), tuple(OPENAI["messages"]), 1)
    sample = tokenize_conversation(tiny_tokenizer, conversation, max_length=4096)
    # The ids are the chat template's rendering, token for token.
    rendered = tiny_tokenizer.apply_chat_template(list(OPENAI["messages"]), tokenize=False)
    assert tiny_tokenizer.decode(sample.input_ids) == rendered
    # Masked runs, decoded, are the assistant turns, in order, and nothing else.
    runs, current = [], []
    for token, masked in zip(sample.input_ids, sample.loss_mask):
        if masked:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    assert [tiny_tokenizer.decode(run) for run in runs] == ["2 + 3 = 5.", "Reversed: blue red."]
    assert not sample.truncated


def test_truncation_keeps_the_prefix_and_says_so(tiny_tokenizer):
    conversation = Conversation("0" * 16, tuple(OPENAI["messages"]), 1)
    full = tokenize_conversation(tiny_tokenizer, conversation, max_length=4096)
    cut = tokenize_conversation(tiny_tokenizer, conversation, max_length=20)
    assert cut.truncated and cut.input_ids == full.input_ids[:20] and cut.loss_mask == full.loss_mask[:20]


def test_a_template_that_rewrites_content_is_reported(tiny_tokenizer):
    class RewritingTokenizer:
        def apply_chat_template(self, messages, tokenize):
            return "".join(m["content"].upper() for m in messages)

    messages = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"})
    conversation = Conversation("0" * 16, messages, 3)
    with pytest.raises(ValueError, match="does not appear verbatim in the rendered chat template"):
        tokenize_conversation(RewritingTokenizer(), conversation, max_length=100)


def test_reasoning_content_is_read_and_trained_on_when_the_template_renders_it(tiny_tokenizer, tmp_path):
    """A thinking model's answers (generate keeps SGLang's reasoning_content): the loss mask covers the reasoning
    and the answer, in the order a Kimi-style template renders them."""
    record = {"messages": [{"role": "user", "content": "What is 2 + 3?"},
                           {"role": "assistant", "content": "5.", "reasoning_content": "Add two and three."}]}
    plain = {"messages": [record["messages"][0], {"role": "assistant", "content": "5."}]}
    conversations, _ = read_conversations(write_jsonl(tmp_path / "r.jsonl", [record, plain]))
    thinking, without = conversations
    assert thinking.messages[1]["reasoning_content"] == "Add two and three."
    assert thinking.sample_id != without.sample_id  # the reasoning is part of the content

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m.get('reasoning_content') %}<think>{{ m['reasoning_content'] }}</think>{% endif %}"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    )
    sample = tokenize_conversation(tokenizer, thinking, max_length=4096)
    masked = [token for token, m in zip(sample.input_ids, sample.loss_mask) if m]
    assert tokenizer.decode(masked) == "Add two and three.5."
    # A template that drops the reasoning cannot be trained on as asked: said, not silently half-masked.
    with pytest.raises(ValueError, match="its reasoning_content does not appear verbatim"):
        tokenize_conversation(tiny_tokenizer, thinking, max_length=4096)
