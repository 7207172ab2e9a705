"""Conversations in, samples out (eagle3.data.samples).

Reading: both input forms, tool messages and tool calls, a record's `tools`, blank lines, bad records.
Ids: sample ids (stable for plain chat, changed by tool calls), per-turn sample ids and their conversation.
Tokenising: the stored ids are the chat template's own ids, token for token; the loss mask is exactly what
the target generated (each assistant turn through its end-of-turn token, or only its content), checked
against the template's prefixes over adversarial conversations, and for thinking templates (Qwen3-like,
Kimi-like) that drop earlier reasoning: every assistant turn is trained exactly once.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import re
import threading
from pathlib import Path

import pytest

from eagle3.__main__ import exit_code_for
from eagle3.data import samples as data
from eagle3.data.samples import (
    ChatTemplateError,
    Conversation,
    DataError,
    SampleTokenizer,
    TokenizeStats,
    conversation_id_of,
    encode,
    end_of_turn_tokens,
    normalize_record,
    read_conversations,
    sample_id_of,
    shard_of,
)
from eagle3.data.turns import render

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
CALL = {
    "id": "functions.get_weather:0",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def user(text):
    return {"role": "user", "content": text}


def bot(text, **extras):
    return {"role": "assistant", "content": text, **extras}


def conversation(messages, tools=None, line_no=1) -> Conversation:
    """A conversation as read_conversations gives it (normalised, hashed)."""
    messages, tools = normalize_record({"messages": messages, **({"tools": tools} if tools else {})})
    return Conversation(sample_id_of(messages, tools), tuple(messages), line_no, tuple(tools) if tools else None)


def template_ids(tokenizer, messages, tools=None, **kwargs) -> list[int]:
    # transformers 5: tokenize=True returns a BatchEncoding.
    return list(tokenizer.apply_chat_template(list(messages), tools=tools, tokenize=True, **kwargs)["input_ids"])


def masked_runs(tokenizer, sample) -> list[str]:
    """The trained tokens, decoded, one string per contiguous run."""
    runs, current = [], []
    for token, masked in zip([*sample.input_ids, None], [*sample.loss_mask, 0]):
        if masked:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current, clean_up_tokenization_spaces=False))
            current = []
    return runs


def expected_mask(tokenizer, messages, trained: dict[int, str], tools=None) -> list[int]:
    """The mask derived from the template alone: turn i's text starts right after the ids the template gives
    for messages[:i] with the generation prompt (what the target was served) and is exactly `trained[i]`."""
    ids = template_ids(tokenizer, messages, tools)
    mask = [0] * len(ids)
    for i, text in trained.items():
        start = len(template_ids(tokenizer, messages[:i], tools, add_generation_prompt=True))
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ids[start : start + len(piece)] == piece, f"turn {i}: {text!r} is not what follows its prompt"
        mask[start : start + len(piece)] = [1] * len(piece)
    return mask


def with_template(tokenizer, template, special_tokens=()):
    tokenizer = copy.deepcopy(tokenizer)
    if special_tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    tokenizer.chat_template = template
    return tokenizer


# -- reading ---------------------------------------------------------------------------------------------------


def test_both_forms_give_the_same_conversation_and_id(tmp_path):
    conversations, stats = read_conversations(write_jsonl(tmp_path / "d.jsonl", [SHAREGPT, OPENAI]))
    # The second line is the same conversation in the other form: one sample, one duplicate.
    assert len(conversations) == 1 and stats.duplicates == 1
    assert conversations[0].messages == tuple(OPENAI["messages"])
    assert conversations[0].sample_id == sample_id_of(OPENAI["messages"])


BAD_LINES = [
    OPENAI,
    "{not json",
    {"messages": [{"role": "user", "content": "hi"}]},
    {"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    "",  # a blank line: ignored, as HF datasets does; not a bad record
    {"messages": []},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]},
    {"text": "plain"},
]
BAD_REASONS = {
    2: "invalid JSON",
    3: "no assistant turn",
    4: "turn 0 has unknown role 'wizard'",
    6: "empty conversation",
    7: "turn 1 (assistant) is empty",
    8: 'no "conversations" or "messages" key',
}


def test_bad_records_stop_the_stage_with_their_line_numbers(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", BAD_LINES)
    with pytest.raises(DataError) as info:
        read_conversations(path)
    message = str(info.value)
    assert f"{path}: 6 bad record(s)" in message
    for line, reason in BAD_REASONS.items():
        assert f"line {line}: {reason}" in message
    assert "line 5" not in message
    assert "on_bad_record" in message  # the fix is named


def test_skip_counts_bad_records_instead_of_dropping_them_silently(tmp_path):
    conversations, stats = read_conversations(write_jsonl(tmp_path / "d.jsonl", BAD_LINES), on_bad_record="skip")
    assert len(conversations) == 1
    assert sorted(stats.bad) == sorted(BAD_REASONS)  # line numbers are the file's, the blank line counted
    assert stats.lines == len(BAD_LINES) - 1


def test_blank_lines_are_ignored(tmp_path):
    lines = ["", OPENAI, "   ", "\t", {"messages": [user("q"), bot("a")]}, ""]
    conversations, stats = read_conversations(write_jsonl(tmp_path / "d.jsonl", lines))  # no DataError
    assert [c.line_no for c in conversations] == [2, 5] and stats.bad == {} and stats.lines == 2


def test_max_samples_limits_the_read(tmp_path):
    lines = [{"messages": [user(f"q{i}"), bot(f"a{i}")]} for i in range(10)]
    conversations, _ = read_conversations(write_jsonl(tmp_path / "d.jsonl", lines), max_samples=4)
    assert [c.messages[1]["content"] for c in conversations] == ["a0", "a1", "a2", "a3"]


def test_tool_messages_and_tool_calls_are_kept():
    record = {
        "messages": [
            user("Weather in Paris?"),
            bot(None, tool_calls=[CALL]),
            {"role": "tool", "tool_call_id": CALL["id"], "name": "get_weather", "content": "18C"},
            bot("It is 18C."),
        ],
        "tools": TOOLS,
    }
    messages, tools = normalize_record(record)
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [CALL]}  # null content is fine
    assert messages[2] == record["messages"][2] and tools == TOOLS


@pytest.mark.parametrize(
    "record, reason",
    [
        (
            {"messages": [user("q"), bot(None, tool_calls=[{"function": {"arguments": "{}"}}])]},
            "turn 1 (assistant): each tool call needs",
        ),
        ({"messages": [user("q"), bot("a")], "tools": "get_weather"}, '"tools" must be a list of tool definitions'),
        ({"messages": [user("q"), bot("a")], "tools": ["get_weather"]}, '"tools" must be a list of tool definitions'),
        ({"messages": [user("q"), bot(None)]}, "turn 1 (assistant) has no text content"),
    ],
    ids=["call-without-function-name", "tools-not-a-list", "tools-not-objects", "null-content-no-calls"],
)
def test_bad_tool_records_say_why(tmp_path, record, reason):
    with pytest.raises(ValueError, match="^" + re.escape(reason)):
        normalize_record(record)
    _, stats = read_conversations(write_jsonl(tmp_path / "d.jsonl", [OPENAI, record]), on_bad_record="skip")
    assert list(stats.bad) == [2] and stats.bad[2].startswith(reason)


# -- hostile files: bad bytes, endless lines, things that are not files ----------------------------------------

ANOTHER = {"messages": [user("q"), bot("a")]}


def test_a_line_that_is_not_utf8_is_a_bad_record_with_its_file_and_line(tmp_path):
    """Attack: a byte that is no UTF-8 gave a bare UnicodeDecodeError, with neither file nor line."""
    path = tmp_path / "d.jsonl"
    latin1 = b'{"messages": "caf\xe9"}'  # "cafe" with an accent, saved as Latin-1
    path.write_bytes(b"\n".join([json.dumps(OPENAI).encode(), latin1, json.dumps(ANOTHER).encode()]) + b"\n")
    with pytest.raises(DataError) as info:
        read_conversations(path)
    assert f"{path}: 1 bad record(s)" in str(info.value)
    assert "line 2: not UTF-8 text (byte 0xe9 at byte 18 of the line)" in str(info.value)
    conversations, stats = read_conversations(path, on_bad_record="skip")  # skipped and counted, the rest read
    assert [c.line_no for c in conversations] == [1, 3] and list(stats.bad) == [2]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["FIFO", "device", "directory"])
def test_data_that_is_not_a_regular_file_is_refused_naming_the_path_and_the_field(tmp_path, kind):
    """Attack: data.path=/dev/zero read until the memory ran out; a FIFO would hang the stage for good (/dev/null
    stands in for /dev/zero: the same kind of file, and harmless should the check ever go)."""
    path = {"FIFO": tmp_path / "fifo", "device": "/dev/null", "directory": tmp_path}[kind]
    if kind == "FIFO":
        os.mkfifo(path)
    outcome = []

    def read():  # in a thread: if the FIFO were opened as a file, the open would wait for a writer forever
        try:
            read_conversations(path)
        except DataError as err:
            outcome.append(str(err))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), f"reading {path} blocked"
    article = {"FIFO": "a FIFO", "device": "a device", "directory": "a directory"}[kind]
    assert outcome == [
        f"{path}: is {article}, not a regular file; data.path must name a JSONL file of conversations (one per line)"
    ]


def test_a_line_over_the_cap_is_a_bad_record_and_is_never_held_whole(tmp_path, monkeypatch):
    """Attack: one 400 MB line was read whole (1.67 GB peak). Here the cap is 64 KiB and the line 8 MB: the line is
    a bad record, the reader skips over it in blocks, and its peak memory stays far below the line's size."""
    import tracemalloc

    monkeypatch.setattr(data, "MAX_LINE_BYTES", 64 << 10)
    huge = {"messages": [user("q"), bot("x" * (8 << 20))]}
    path = write_jsonl(tmp_path / "d.jsonl", [OPENAI, huge, ANOTHER])
    with pytest.raises(DataError, match=r"line 2: longer than 65,536 bytes, the most one conversation may take"):
        read_conversations(path)
    tracemalloc.start()
    try:
        conversations, stats = read_conversations(path, on_bad_record="skip")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [c.line_no for c in conversations] == [1, 3] and list(stats.bad) == [2]
    assert peak < (1 << 20), f"peak {peak:,} bytes while skipping an 8 MB line"


def test_a_value_echoed_in_a_reason_is_shortened(tmp_path):
    """Attack: a 3000-character role came back whole in the error (and in every log that shows it)."""
    record = {"messages": [{"role": "r" * 3000, "content": "hi"}, bot("yo")]}
    _, stats = read_conversations(write_jsonl(tmp_path / "d.jsonl", [record]), on_bad_record="skip")
    reason = stats.bad[1]
    assert reason.startswith(f"turn 0 has unknown role {'r' * data.SHOWN_CHARS!r}... (3000 chars) (known: ")
    assert len(reason) < 250


def test_json_nested_too_deeply_is_a_bad_record(tmp_path):
    """Attack: 100,000 opening brackets end json's recursion: a traceback instead of the line's number."""
    _, stats = read_conversations(write_jsonl(tmp_path / "d.jsonl", [OPENAI, "[" * 100_000]), on_bad_record="skip")
    assert stats.bad == {2: "invalid JSON (nested too deeply)"}


# -- ids -------------------------------------------------------------------------------------------------------


def old_sample_id(messages) -> str:
    """How ids were computed before tool calls existed: runs key on them, so plain chat must keep them."""
    rows = [
        [m["role"], m["content"], *([m["reasoning_content"]] if "reasoning_content" in m else [])] for m in messages
    ]
    text = json.dumps(rows, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def test_plain_conversations_keep_their_ids_and_tool_calls_change_them():
    thinking = [user("¿Cuánto es 2 + 3? 你好"), bot("5.", reasoning_content="Sumar.")]
    for messages in (OPENAI["messages"], thinking):
        # sort_keys=True orders dict keys only: plain rows are lists, so the text (and the id) is unchanged.
        assert sample_id_of(messages) == old_sample_id(messages)
    base = [user("Weather?"), bot("", tool_calls=[CALL])]
    tool = {"role": "tool", "content": "18C"}
    assert sample_id_of(base) != old_sample_id(base)  # the calls are part of the content
    assert sample_id_of(base) != sample_id_of(base, TOOLS)
    assert sample_id_of([*base, tool]) != sample_id_of([*base, {**tool, "tool_call_id": CALL["id"]}])
    assert sample_id_of(base) == sample_id_of([dict(m) for m in base])


def test_sample_id_is_stable_and_content_sensitive():
    changed = [dict(m) for m in OPENAI["messages"]]
    changed[2]["content"] = "2 + 3 = 6."
    assert sample_id_of(OPENAI["messages"]) == sample_id_of(list(OPENAI["messages"]))
    assert sample_id_of(OPENAI["messages"]) != sample_id_of(changed)
    assert len(sample_id_of(changed)) == 16 and 0 <= shard_of(sample_id_of(changed), 8) < 8
    # A turn's own sample "<id>.<turn>" belongs to its conversation and is sharded with it.
    assert conversation_id_of("abc.3") == "abc" and conversation_id_of("abc") == "abc"
    assert all(shard_of(f"{sample_id_of(changed)}.4", n) == shard_of(sample_id_of(changed), n) for n in (1, 3, 8))


# -- tokenising: the tiny target's template ---------------------------------------------------------------------


def test_end_of_turn_tokens_are_the_eos_and_the_models_stop_tokens(tiny_tokenizer, tiny_target):
    # tokenizer eos <|eos|>; generation_config.json's eos_token_id is <|im_end|>, what the chat model stops on.
    assert set(end_of_turn_tokens(tiny_tokenizer, tiny_target)) == {tiny_tokenizer.eos_token, "<|im_end|>"}
    assert end_of_turn_tokens(tiny_tokenizer) == (tiny_tokenizer.eos_token,)


CASES = {
    "two-turns-with-system": (OPENAI["messages"], None),
    "one-char-letter": ([user("q"), bot("a")], None),
    "one-char-digit": ([user("q"), bot("1")], None),
    "role-name-user": ([user("who?"), bot("user")], None),
    "role-name-assistant": ([user("who?"), bot("assistant")], None),
    "special-token-pieces": ([user("<|im_start"), bot("<|im_start"), user("x"), bot("_start|>")], None),
    "end-token-pieces": ([user("q"), bot("im"), user("<|im"), bot("<|im"), user("q"), bot("d")], None),
    # A special token's text as content is that token (as when served); <|im_start|> is not an end of turn.
    # Not included: content "<|im_end|>" is the end-of-turn token itself (test_content_that_is_the_end_token).
    "special-token-start": ([user("x"), bot("<|im_start|>")], None),
    "answer-seen-earlier": ([{"role": "system", "content": "a"}, user("a"), bot("a")], None),
    "empty-system": ([{"role": "system", "content": ""}, user("hi"), bot("yo")], None),
    "emoji": ([user("👍"), bot("👍🏽 done 👩‍👩‍👧")], None),
    "cjk": ([user("你好"), bot("你好，世界。")], None),
    "combining-marks": ([user("e\u0301"), bot("e\u0301 n\u0303 a\u0308\u0301")], None),
    "whitespace-only-users": ([user(" "), bot("x"), user("\n\n"), bot("y"), user("\t"), bot("z")], None),
    "spaces-and-newlines": (
        [
            user("q"),
            bot(" a"),
            user("q"),
            bot("a "),
            user("q"),
            bot("\na"),
            user("q"),
            bot("a\n"),
            user("q"),
            bot("  a  \n\n"),
        ],
        None,
    ),
    "assistant-speaks-first": ([bot("Hello."), user("hi"), bot("Hello.")], None),  # nothing prompted turn 0
    "tool-result-equals-answer": (
        [
            user("6*7?"),
            bot("", tool_calls=[CALL]),
            {"role": "tool", "tool_call_id": CALL["id"], "content": "42"},
            bot("42"),
        ],
        TOOLS,
    ),
}


POLICY_CASES = [
    pytest.param(policy, end, *case, id=f"{name}-{policy}")
    for policy, end in [("assistant_turn", "<|im_end|>"), ("content", "")]
    for name, case in CASES.items()
]


@pytest.mark.parametrize("policy, end, messages, tools", POLICY_CASES)
def test_ids_are_the_templates_and_the_mask_is_what_the_target_generated(
    tiny_tokenizer, tiny_target, messages, tools, policy, end
):
    tokenizer = tiny_tokenizer
    conv = conversation(messages, tools)
    [sample] = SampleTokenizer(tokenizer, 4096, policy, end_of_turn_tokens(tokenizer, tiny_target)).samples(conv)
    assert sample.sample_id == conv.sample_id and not sample.truncated
    assert sample.input_ids == template_ids(tokenizer, messages, tools)
    assert tokenizer.decode(sample.input_ids) == tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    # Each prompted assistant turn: its content, then <|im_end|> under assistant_turn; never the "\n" after it,
    # never another role's text (positions checked, so an equal user/tool text cannot stand in).
    trained = {i: m["content"] + end for i, m in enumerate(messages) if m["role"] == "assistant" and i > 0}
    trained = {i: text for i, text in trained.items() if text}  # a tool-call-only turn has no content to mask
    assert masked_runs(tokenizer, sample) == list(trained.values())
    assert sample.loss_mask == expected_mask(tokenizer, messages, trained, tools)


def test_content_that_is_the_end_token(tiny_tokenizer, tiny_target):
    # The content tokenises as <|im_end|> itself: the target stops there, so that one token is the turn.
    messages = [user("say it"), bot("<|im_end|>")]
    end = end_of_turn_tokens(tiny_tokenizer, tiny_target)
    [sample] = SampleTokenizer(tiny_tokenizer, 4096, "assistant_turn", end).samples(conversation(messages))
    assert sample.input_ids == template_ids(tiny_tokenizer, messages)
    assert masked_runs(tiny_tokenizer, sample) == ["<|im_end|>"]
    assert sample.loss_mask == expected_mask(tiny_tokenizer, messages, {1: "<|im_end|>"})


def runs_of(mask: list[int]) -> list[tuple[int, int]]:
    """The [start, end) token ranges of a mask's contiguous trained runs."""
    runs, start = [], None
    for k, masked in enumerate([*mask, 0]):
        if masked and start is None:
            start = k
        elif not masked and start is not None:
            runs.append((start, k))
            start = None
    return runs


def test_max_length_keeps_every_turn_and_cuts_the_context_from_the_left(tiny_tokenizer):
    """Issue 37: a turn past data.max_length lost its training (the sample kept its first max_length tokens).
    The whole conversation keeps its start and the turns that end within max_length; each later turn gets a
    sample of its own, the turn whole and its context cut from the left after the BOS token (here the system
    prompt is more than a quarter of these windows: only BOS stays); a turn longer than the window keeps its start
    after half a window of context. Every cut is counted; no turn is dropped."""
    conv = Conversation("0" * 16, tuple(OPENAI["messages"]), 1)
    [full] = SampleTokenizer(tiny_tokenizer, 4096).samples(conv)
    (a2, b2), (a4, b4) = runs_of(full.loss_mask)  # turn 2's trained tokens, then turn 4's
    length = len(full.input_ids)
    assert b4 == length and b2 < a4

    limit = b2 + 2  # turn 2 fits, turn 4 does not
    stats = TokenizeStats()
    whole, last = SampleTokenizer(tiny_tokenizer, limit).iter([conv], stats)
    assert (whole.sample_id, whole.truncated) == (conv.sample_id, True)
    assert whole.input_ids == full.input_ids[:limit] and runs_of(whole.loss_mask) == [(a2, b2)]
    assert (last.sample_id, last.truncated) == (f"{conv.sample_id}.4", True)
    bos = full.input_ids[:1]
    assert bos == [tiny_tokenizer.bos_token_id]
    assert last.input_ids == bos + full.input_ids[-(limit - 1) :]
    assert runs_of(last.loss_mask) == [(a4 - (length - limit), limit)]
    assert (stats.trained_turns, stats.turns_dropped, stats.skipped) == (2, {}, {})
    assert (stats.context_cut_samples, stats.context_cut_tokens, stats.turn_cut_samples) == (1, length - limit, 0)

    limit = 5  # shorter than either turn: each keeps its start, after limit // 2 tokens of context
    stats = TokenizeStats()
    first, second = SampleTokenizer(tiny_tokenizer, limit).iter([conv], stats)
    assert [s.sample_id for s in (first, second)] == [f"{conv.sample_id}.2", f"{conv.sample_id}.4"]
    assert first.input_ids == bos + full.input_ids[a2 - 2 : a2 + 2] and runs_of(first.loss_mask) == [(3, 5)]
    assert second.input_ids == bos + full.input_ids[a4 - 2 : a4 + 2] and runs_of(second.loss_mask) == [(3, 5)]
    assert (stats.trained_turns, stats.turns_dropped) == (2, {})
    assert (stats.turn_cut_samples, stats.turn_cut_tokens) == (2, (b2 - a2 - 2) + (b4 - a4 - 2))


def test_a_cut_context_keeps_the_system_prompt_and_the_tools_ahead_of_its_window(tiny_tokenizer):
    """Issue 42: a late turn of a long agentic conversation, cut to data.max_length, kept only its last tokens, so
    BOS, the system prompt and the tool definitions (what every answer in it was generated under) were gone and the
    target's states were not the ones it serves. Its sample now starts with them (the template's rendering of the
    leading system messages and tools, as whole tokens), then the window ending at the turn's end."""
    pairs = [(f"Question number {i}: what follows {i}?", f"The number after {i} is {i + 1}.") for i in range(6)]
    messages = [{"role": "system", "content": "Be brief."}]
    for question, answer in pairs:
        messages += [user(question), bot(answer)]
    conv = Conversation("1" * 16, tuple(messages), 1)
    [full] = SampleTokenizer(tiny_tokenizer, 4096).samples(conv)
    head = encode(tiny_tokenizer, render(tiny_tokenizer, messages[:1]))
    assert full.input_ids[: len(head)] == head and head[0] == tiny_tokenizer.bos_token_id
    limit = 4 * len(head)
    assert len(full.input_ids) > limit + len(head)  # the last turn's window starts well after the system prompt

    stats = TokenizeStats()
    *_, last = SampleTokenizer(tiny_tokenizer, limit).iter([conv], stats)
    assert last.sample_id == f"{conv.sample_id}.{len(messages) - 1}" and len(last.input_ids) == limit
    assert last.input_ids == head + full.input_ids[-(limit - len(head)) :]
    assert not any(last.loss_mask[: len(head)]) and last.loss_mask[-1] == full.loss_mask[-1]
    assert stats.context_cut_samples >= 1 and stats.turns_dropped == {}


def test_a_template_that_rewrites_content(tiny_tokenizer):
    tokenizer = with_template(
        tiny_tokenizer,
        "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{{ m.content | upper }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    )
    messages = [user("hi"), bot("yo")]
    conv = conversation(messages, line_no=3)
    with pytest.raises(
        ValueError,
        match=r"turn 1 \(assistant\): the chat template does not render its content "
        "verbatim",
    ):
        SampleTokenizer(tokenizer, 100, "content").samples(conv)
    stats = TokenizeStats()
    assert list(SampleTokenizer(tokenizer, 100, "content").iter([conv], stats)) == []
    assert stats.skipped[f"{conv.sample_id}.1"].startswith("line 3: turn 1")
    assert stats.turns_dropped == {"not_verbatim": 1} and stats.assistant_turns == 1
    # assistant_turn trains what the template rendered as generated, whatever it did to the content.
    [sample] = SampleTokenizer(tokenizer, 100, "assistant_turn", ("<|im_end|>",)).samples(conv)
    assert sample.input_ids == template_ids(tokenizer, messages) and masked_runs(tokenizer, sample) == ["YO<|im_end|>"]


def test_reasoning_content_is_read_and_trained_when_the_template_renders_it(tiny_tokenizer, tmp_path):
    record = {"messages": [user("What is 2 + 3?"), bot("5.", reasoning_content="Add two and three.")]}
    plain = {"messages": [record["messages"][0], bot("5.")]}
    thinking, without = read_conversations(write_jsonl(tmp_path / "r.jsonl", [record, plain]))[0]
    assert thinking.messages[1]["reasoning_content"] == "Add two and three."
    assert thinking.sample_id != without.sample_id  # the reasoning is part of the content

    tokenizer = with_template(
        tiny_tokenizer,
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if "
        "m.get('reasoning_content') %}<think>{{ m['reasoning_content'] }}</think>{% endif %}"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    )
    [sample] = SampleTokenizer(tokenizer, 4096, "content").samples(thinking)
    assert masked_runs(tokenizer, sample) == ["Add two and three.", "5."]
    [sample] = SampleTokenizer(tokenizer, 4096, "assistant_turn", ("<|im_end|>",)).samples(thinking)
    assert masked_runs(tokenizer, sample) == ["<think>Add two and three.</think>5.<|im_end|>"]
    # A template that never writes reasoning, and whose generation prompt leaves no place for it: the turn is not
    # trained without its reasoning (as "5.<|im_end|>"), under either mask; it is dropped and counted.
    for policy in ("content", "assistant_turn"):
        with pytest.raises(
            ValueError,
            match=r"turn 1 \(assistant\): the chat template never renders its "
            "reasoning_content, and leaves no place after the generation prompt",
        ):
            SampleTokenizer(tiny_tokenizer, 4096, policy).samples(thinking)
    stats = TokenizeStats()
    assert list(SampleTokenizer(tiny_tokenizer, 4096).iter([thinking], stats)) == []
    assert stats.turns_dropped == {"reasoning_not_rendered": 1} and stats.reasoning_not_rendered == 1


# -- thinking templates that drop earlier reasoning --------------------------------------------------------------

# Qwen3's rule: reasoning shown only for assistant turns after the last user message.
QWEN_LIKE = (
    "{{ bos_token }}{% set ns = namespace(last_query=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and loop.index0 > ns.last_query and m.reasoning_content %}"
    "<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_qwen_like_template_trains_each_turn_once_where_it_was_generated(tiny_tokenizer, tiny_target):
    tokenizer = with_template(tiny_tokenizer, QWEN_LIKE)
    messages = [
        {"role": "system", "content": "Think."},
        user("2 + 3?"),
        bot("5.", reasoning_content="Add them."),
        user("Times 2?"),
        bot("10.", reasoning_content="Double 5."),
    ]
    conv = conversation(messages)
    assert "Add them." not in tokenizer.apply_chat_template(messages, tokenize=False)  # the template drops it
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    turn1, turn2 = "<think>\nAdd them.\n</think>\n\n5.<|im_end|>", "<think>\nDouble 5.\n</think>\n\n10.<|im_end|>"

    whole, own = SampleTokenizer(tokenizer, 4096, "assistant_turn", end_of_turn_tokens(tokenizer, tiny_target)).samples(
        conv
    )
    assert whole.sample_id == conv.sample_id and whole.input_ids == template_ids(tokenizer, messages)
    assert masked_runs(tokenizer, whole) == [turn2]  # turn 1 is context here: not what the target generated
    assert whole.loss_mask == expected_mask(tokenizer, messages, {4: turn2})
    # Turn 1 in the rendering it was served and generated in: the conversation through it.
    assert own.sample_id == f"{conv.sample_id}.{first}" and conversation_id_of(own.sample_id) == conv.sample_id
    assert own.input_ids == template_ids(tokenizer, messages[: first + 1])
    assert masked_runs(tokenizer, own) == [turn1]
    assert own.loss_mask == expected_mask(tokenizer, messages[: first + 1], {first: turn1})

    whole, own = SampleTokenizer(tokenizer, 4096, "content").samples(conv)
    assert masked_runs(tokenizer, whole) == ["Double 5.", "10."] and masked_runs(tokenizer, own) == ["Add them.", "5."]


KIMI_SPECIALS = [
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|tool_calls_section_begin|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|tool_calls_section_end|>",
]
# Kimi's format. Reasoning is blanked ("<think></think>") for assistant turns before the last user message and
# kept for the turns of the current query (its tool-call chain). Blanking it for every assistant turn but the
# last one would make a turn's prompt differ from its rendering once a later assistant turn exists, which no
# prefix-based mask can place (the conversation is skipped, reported in stats.skipped).
KIMI_LIKE = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor %}{% if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>"
    "{% endif %}{% for m in messages %}{% if m.role == 'tool' %}"
    "<|im_system|>tool<|im_middle|>## Return of {{ m.tool_call_id }}\n{{ m.content }}<|im_end|>"
    "{% elif m.role == 'assistant' %}<|im_assistant|>assistant<|im_middle|>{% if loop.index0 > ns.last %}"
    "<think>{{ m.reasoning_content or '' }}</think>{% else %}<think></think>{% endif %}{{ m.content }}"
    "{% if m.tool_calls %}<|tool_calls_section_begin|>{% for c in m.tool_calls %}<|tool_call_begin|>{{ c.id }}"
    "<|tool_call_argument_begin|>{{ c.function.arguments }}<|tool_call_end|>{% endfor %}<|tool_calls_section_end|>"
    "{% endif %}<|im_end|>{% else %}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)
KIMI_CONVERSATION = [
    user("Hi."),
    bot("Hello!", reasoning_content="Greet back."),
    user("Weather in Paris?"),
    bot(None, reasoning_content="Need the tool.", tool_calls=[CALL]),
    {"role": "tool", "tool_call_id": CALL["id"], "name": "get_weather", "content": "18C, sunny"},
    bot("It is 18C.", reasoning_content="The tool says 18C."),
]


def test_kimi_like_template_trains_tool_calls_never_tool_results(tiny_tokenizer, tiny_target):
    tokenizer = with_template(tiny_tokenizer, KIMI_LIKE, KIMI_SPECIALS)
    conv = conversation(KIMI_CONVERSATION, TOOLS)
    messages = list(conv.messages)
    call = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
    )
    trained = {
        3: f"<think>Need the tool.</think>{call}<|im_end|>",
        5: "<think>The tool says 18C.</think>It is 18C.<|im_end|>",
    }

    whole, own = SampleTokenizer(tokenizer, 4096, "assistant_turn", end_of_turn_tokens(tokenizer, tiny_target)).samples(
        conv
    )
    assert whole.sample_id == conv.sample_id and whole.input_ids == template_ids(tokenizer, messages, TOOLS)
    assert masked_runs(tokenizer, whole) == list(trained.values())
    assert whole.loss_mask == expected_mask(tokenizer, messages, trained, TOOLS)
    call_ids = set(tokenizer.convert_tokens_to_ids(KIMI_SPECIALS[4:]))
    assert all(m for t, m in zip(whole.input_ids, whole.loss_mask) if t in call_ids)  # the calls are drafted
    assert not any(
        "18C, sunny" in run or "Return of" in run or "tool_declare" in run for run in masked_runs(tokenizer, whole)
    )
    # Turn 1's reasoning is blanked in the whole rendering: it gets its own sample, as with Qwen3.
    assert own.sample_id == f"{conv.sample_id}.1" and own.input_ids == template_ids(tokenizer, messages[:2], TOOLS)
    assert masked_runs(tokenizer, own) == ["<think>Greet back.</think>Hello!<|im_end|>"]


def test_iter_counts_turn_samples_and_skips_nothing(tiny_tokenizer, tiny_target):
    tokenizer = with_template(tiny_tokenizer, KIMI_LIKE, KIMI_SPECIALS)
    thinking, plain = conversation(KIMI_CONVERSATION, TOOLS), conversation([user("q"), bot("a")])
    stats = TokenizeStats()
    samples = list(
        SampleTokenizer(tokenizer, 4096, "assistant_turn", end_of_turn_tokens(tokenizer, tiny_target)).iter(
            [thinking, plain], stats
        )
    )
    assert [s.sample_id for s in samples] == [thinking.sample_id, f"{thinking.sample_id}.1", plain.sample_id]
    assert (stats.conversations, stats.samples, stats.turn_samples, stats.skipped) == (2, 3, 1, {})


def test_content_policy_masks_the_content_not_a_later_copy_of_it(tiny_tokenizer):
    tokenizer = with_template(tiny_tokenizer, KIMI_LIKE, KIMI_SPECIALS)
    messages = [user("Weather in Paris?"), bot("Paris", reasoning_content="think", tool_calls=[CALL])]
    [sample] = SampleTokenizer(tokenizer, 4096, "content").samples(conversation(messages))
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    at = len(tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True) + "<think>")
    count = [
        len(tokenizer(text[:c], add_special_tokens=False)["input_ids"])
        for c in (at, at + len("think"), at + len("think</think>"), at + len("think</think>Paris"))
    ]
    expected = [0] * len(sample.input_ids)
    for a, b in (count[:2], count[2:]):  # the reasoning right after <think>, the content right after </think>
        expected[a:b] = [1] * (b - a)
    assert sample.loss_mask == expected


# Kimi-K2.5's own rule: reasoning is blanked for every message up to and including the last assistant turn
# without tool calls (the "final answer"), kept after it. So a final answer is never rendered with its
# reasoning, and a tool chain is rendered again, blanked, once its answer follows.
KIMI_K25_LIKE = KIMI_LIKE.replace(
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}",
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'assistant' and not m.tool_calls %}",
)
# What a user passes as data.generation_chat_template: the same template with the blanking branch emptied.
KIMI_K25_AS_GENERATED = KIMI_LIKE.replace("{% if m.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}", "")


CALL_SECTION = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
)
# Multi-turn thinking with a tool chain, as Kimi-K2.5 serves it: a greeting, a tool call, the answer after the tool's
# result, a follow-up question with a second tool chain, its answer.
KIMI_AGENT_CONVERSATION = [
    {"role": "system", "content": "You are Kimi."},
    user("Hi."),
    bot("Hello!", reasoning_content="Greet back."),
    user("Weather in Paris?"),
    bot("", reasoning_content="Need the tool.", tool_calls=[CALL]),
    {"role": "tool", "tool_call_id": CALL["id"], "name": "get_weather", "content": "18C, sunny"},
    bot("It is 18C.", reasoning_content="The tool says 18C."),
    user("And tomorrow?"),
    bot("Let me check.", reasoning_content="Ask again.", tool_calls=[CALL]),
    {"role": "tool", "tool_call_id": CALL["id"], "name": "get_weather", "content": "rain"},
    bot("Rain tomorrow.", reasoning_content="The tool says rain."),
]
# What the target generated for each assistant turn: its reasoning in the template's <think> block, its content,
# its tool calls in the template's markup, its end-of-turn token.
KIMI_AGENT_GENERATED = {
    2: "<think>Greet back.</think>Hello!<|im_end|>",
    4: f"<think>Need the tool.</think>{CALL_SECTION}<|im_end|>",
    6: "<think>The tool says 18C.</think>It is 18C.<|im_end|>",
    8: f"<think>Ask again.</think>Let me check.{CALL_SECTION}<|im_end|>",
    10: "<think>The tool says rain.</think>Rain tomorrow.<|im_end|>",
}


def assert_served_then_generated(tokenizer, samples, conv, generated: dict[int, str], tools=TOOLS, **template_kwargs):
    """Each sample is one turn: the ids the template serves for it (the conversation before it with the generation
    prompt), then exactly the generated text's ids, those and only those trained."""
    messages = list(conv.messages)
    assert sorted(s.sample_id for s in samples) == sorted(f"{conv.sample_id}.{i}" for i in generated)
    for sample in samples:
        i = int(sample.sample_id.split(".")[1])
        served = template_ids(tokenizer, messages[:i], tools, add_generation_prompt=True, **template_kwargs)
        answer = tokenizer(generated[i], add_special_tokens=False)["input_ids"]
        assert sample.input_ids == served + answer, f"turn {i}"
        assert sample.loss_mask == [0] * len(served) + [1] * len(answer), f"turn {i}"


def test_kimi_k25_trains_every_turn_with_its_reasoning_without_a_generation_template(tiny_tokenizer, tiny_target):
    """Issue 37: with Kimi-K2.5's blanking template and no data.generation_chat_template, every tool-calling
    conversation was skipped ("another prefix") and each final answer trained as <think></think>answer: a run
    trained on none of the reasoning, with one warning line, and exited 0. Now every assistant turn is trained with
    its own reasoning and tool calls, after exactly the prompt the template serves for it; nothing is dropped."""
    tokenizer = with_template(tiny_tokenizer, KIMI_K25_LIKE, KIMI_SPECIALS)
    conv = conversation(KIMI_AGENT_CONVERSATION, TOOLS)
    assert "Greet back." not in tokenizer.apply_chat_template(list(conv.messages[:3]), tokenize=False)  # it blanks
    stats = TokenizeStats()
    samples = list(
        SampleTokenizer(tokenizer, 4096, "assistant_turn", end_of_turn_tokens(tokenizer, tiny_target)).iter(
            [conv], stats
        )
    )
    assert_served_then_generated(tokenizer, samples, conv, KIMI_AGENT_GENERATED)
    # The answer's prompt is what K2.5 serves: its own tool chain with its reasoning, earlier turns blanked.
    answer = next(s for s in samples if s.sample_id.endswith(".10"))
    assert "<think>Ask again.</think>" in tokenizer.decode(answer.input_ids)
    assert "Greet back." not in tokenizer.decode(answer.input_ids)
    reasoning = sum(
        len(tokenizer(m["reasoning_content"], add_special_tokens=False)["input_ids"])
        for m in conv.messages
        if m.get("reasoning_content")
    )
    assert (stats.assistant_turns, stats.trained_turns, stats.turns_dropped, stats.skipped) == (5, 5, {}, {})
    assert stats.reasoning_tokens == reasoning > 0 and stats.derived_turns == 3  # the final answers
    assert stats.trained_tokens == sum(map(sum, (s.loss_mask for s in samples)))

    # data.loss_mask "content": the reasoning and the content of each turn, placed the same way.
    content = {
        s.sample_id: masked_runs(tokenizer, s) for s in SampleTokenizer(tokenizer, 4096, "content").samples(conv)
    }
    assert content == {
        f"{conv.sample_id}.{i}": [m["reasoning_content"], *([m["content"]] if m["content"] else [])]
        for i, m in enumerate(conv.messages)
        if m["role"] == "assistant"
    }


def test_kimi_k25_turns_with_a_generation_template_are_trained_the_same(tiny_tokenizer, tiny_target):
    """data.generation_chat_template stays the explicit override: the target's template for the prompts, the given
    one for the turns. Here it gives what the derivation gives."""
    tokenizer = with_template(tiny_tokenizer, KIMI_K25_LIKE, KIMI_SPECIALS)
    end = end_of_turn_tokens(tokenizer, tiny_target)
    conv = conversation(KIMI_AGENT_CONVERSATION, TOOLS)
    as_generated = SampleTokenizer(tokenizer, 4096, "assistant_turn", end, generation_template=KIMI_K25_AS_GENERATED)
    samples = as_generated.samples(conv)
    assert samples[-1].sample_id == conv.sample_id  # the last turn's sample carries the conversation's id
    last = len(conv.messages) - 1
    renamed = [
        dataclasses.replace(s, sample_id=f"{conv.sample_id}.{last}") if s.sample_id == conv.sample_id else s
        for s in samples
    ]
    assert_served_then_generated(tokenizer, renamed, conv, KIMI_AGENT_GENERATED)
    single = conversation([user("What is 2 + 3?"), bot("5.", reasoning_content="Add them.")])
    [content] = SampleTokenizer(tokenizer, 4096, "content", end, generation_template=KIMI_K25_AS_GENERATED).samples(
        single
    )
    assert masked_runs(tokenizer, content) == ["Add them.", "5."]


# -- hostile chat templates: each goes in as the file a run names, and must be refused with that file named --------

# The tiny target's own template, which every stage renders with unless a test swaps it out.
PLAIN_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ESCAPE = "{{ ''.__class__.__mro__[1].__subclasses__() }}"  # the classic way out of jinja to Python's classes
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"  # 10^10 steps


def generation_template_config(make_config, tmp_path, template: str):
    path = tmp_path / "generation.jinja"
    path.write_text(template)
    return make_config(data={"generation_chat_template": str(path)}), path


@pytest.mark.parametrize(
    "template, error",
    [
        (ESCAPE, "SecurityError: access to attribute '__class__' of 'str' object is unsafe"),
        ("{% for m in messages %}{{ m.content }", "TemplateSyntaxError at line 1 of the template: unexpected '}'"),
        ("{{ messages | nosuchfilter }}", "No filter named 'nosuchfilter'"),
        ("{{ undefined_thing.field.deeper }}", "UndefinedError: 'undefined_thing' is undefined"),
        ("{% for i in range(10**9) %}{% endfor %}", "OverflowError: Range too big"),
        ("{% macro down(n) %}{{ down(n + 1) }}{% endmacro %}{{ down(0) }}", "RecursionError"),
    ],
    ids=["escape", "syntax", "filter", "undefined", "range", "recursion"],
)
def test_a_generation_template_the_sandbox_refuses_is_a_config_error(make_config, tmp_path, template, error):
    """Attack: data.generation_chat_template reaching for Python's internals, or broken (a syntax error, an
    unknown filter or name, a range past the sandbox's limit, a macro recursing forever). Refused when the
    stage loads its tokenizer, naming the field, the file and jinja's error in one line, as exit 2."""
    cfg, path = generation_template_config(make_config, tmp_path, template)
    with pytest.raises(ChatTemplateError) as info:
        SampleTokenizer.for_run(cfg)
    refused = info.value
    assert refused.where == f"data.generation_chat_template {path}" and error in refused.fact
    assert "\n" not in str(refused) and "data.generation_chat_template" in refused.fix
    assert exit_code_for(info.value) == 2


def hostile_template_path(tmp_path: Path, kind: str) -> tuple[str, str]:
    """(the path data.generation_chat_template names, the refusal expected after "<path>: ") for a hostile kind."""
    good = tmp_path / "good.jinja"
    good.write_text(PLAIN_TEMPLATE)
    if kind == "link":
        (tmp_path / "link.jinja").symlink_to(good)
        return str(tmp_path / "link.jinja"), "a symbolic link, not a regular file"
    if kind == "fifo":
        os.mkfifo(tmp_path / "fifo.jinja")
        return str(tmp_path / "fifo.jinja"), "a FIFO, not a regular file"
    if kind == "proc":
        return "/proc/self/status", "a file in /proc, the kernel's view"
    if kind == "link into proc":  # the path as written is no /proc path; a directory on the way is a link there
        (tmp_path / "me").symlink_to("/proc/self")
        return str(tmp_path / "me" / "status"), "a file in /proc, the kernel's view"
    assert kind == "oversize"
    big = tmp_path / "big.jinja"
    big.write_text(PLAIN_TEMPLATE + "{#" + "x" * data.MAX_TEMPLATE_BYTES + "#}")  # (a comment: it renders)
    return str(big), f"{big.stat().st_size} bytes, more than the {data.MAX_TEMPLATE_BYTES} read here"


# timeout (signal method): a FIFO opened to read blocks until a writer comes; this stops it, should it be opened
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["link", "fifo", "proc", "link into proc", "oversize"])
def test_a_generation_template_that_is_no_plain_small_file_is_refused_unread(make_config, tmp_path, kind):
    """Attack: data.generation_chat_template naming a link (to any file the box user can read), a FIFO (a read
    waits for a writer forever), a file in /proc (/proc/self/pagemap is a "regular file" that never ends), also
    through a link in a directory on the way, or a file far larger than any template. Refused before it is read,
    naming the field, the file and the fix, as exit 2."""
    path, refusal = hostile_template_path(tmp_path, kind)
    cfg = make_config(data={"generation_chat_template": path})
    with pytest.raises(DataError) as info:
        SampleTokenizer.for_run(cfg)
    message = str(info.value)
    assert message.startswith(f"data.generation_chat_template: {path}: {refusal}"), message
    assert message.endswith(
        "point data.generation_chat_template at the jinja chat template file itself: a regular "
        "file on the box (not a link, nothing in /proc or /sys) of at most 1 MiB"
    )
    assert exit_code_for(info.value) == 2


def test_a_generation_template_file_reads_as_text_did(tmp_path):
    """The ordinary case: a template's text as a file read as text gives it (UTF-8, universal newlines), and a
    missing file named with the field and the fix."""
    path = tmp_path / "crlf.jinja"
    path.write_bytes("{{ '\u00e9' }}\r\n{% if x %}\ry{% endif %}\n".encode())
    assert data.read_template_file(str(path)) == path.read_text(encoding="utf-8")
    with pytest.raises(
        DataError,
        match=r"^data.generation_chat_template: cannot read .*/absent.jinja \(No such "
        r"file or directory\); point data.generation_chat_template at",
    ):
        data.read_template_file(str(tmp_path / "absent.jinja"))


def no_probe_left_running() -> bool:
    """A probe stopped by its timer leaves nothing behind; one left in a thread would spin on for hours and slow
    every later test of this process."""
    return not [thread for thread in threading.enumerate() if thread.name == "chat-template-probe"]


# method="thread": pytest-timeout's default holds SIGALRM for the whole test, and the probe's timer needs it (a
# stage's main thread always has it free).
@pytest.mark.slow
@pytest.mark.timeout(300, method="thread")
def test_a_generation_template_that_loops_is_stopped_and_refused(make_config, tmp_path, monkeypatch):
    """Attack: data.generation_chat_template with two nested loops of 10^5 steps, each within the sandbox's
    range limit and together hours of work. The load-time probe is stopped at its time limit (0.3 s here)."""
    monkeypatch.setattr(data, "PROBE_TIME_LIMIT_S", 0.3)
    cfg, path = generation_template_config(make_config, tmp_path, PLAIN_TEMPLATE + NESTED_LOOPS)
    with pytest.raises(
        ChatTemplateError,
        match=rf"^data.generation_chat_template {re.escape(str(path))}: took "
        r"longer than 0.3 s to render a two-message conversation",
    ):
        SampleTokenizer.for_run(cfg)
    assert no_probe_left_running()


@pytest.mark.slow
@pytest.mark.timeout(300, method="thread")  # (as above)
def test_a_target_chat_template_that_escapes_or_loops_is_refused(make_config, tmp_path, tiny_target, monkeypatch):
    """Attack: the tokenizer directory's own chat_template.jinja replaced by one that reaches for Python's
    internals, then by one that loops. The message names that file and the field that points there."""
    monkeypatch.setattr(data, "PROBE_TIME_LIMIT_S", 0.3)
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tokenizer_dir / name).write_bytes((tiny_target / name).read_bytes())
    template = tokenizer_dir / "chat_template.jinja"
    cfg = make_config(target={"tokenizer_path": str(tokenizer_dir)})
    where = f"{template}, the chat template of target.tokenizer_path"
    for hostile, refusal in (
        (ESCAPE, "fails in jinja's sandbox on a two-message conversation (SecurityError"),
        (NESTED_LOOPS, "took longer than 0.3 s to render a two-message conversation"),
    ):
        template.write_text(hostile)
        with pytest.raises(ChatTemplateError) as info:
            SampleTokenizer.for_run(cfg)
        assert (info.value.where, info.value.fact[: len(refusal)]) == (where, refusal), str(info.value)
        assert "target.tokenizer_path" in info.value.fix
    assert no_probe_left_running()


def test_a_template_that_fails_only_on_some_conversation_stops_the_stage(tiny_tokenizer):
    """Attack: a template that passes the probe and reaches for Python's internals only when a message says so.
    That conversation stops the stage naming the template and the data line; it is not skipped as one bad
    conversation. A template's own raise_exception() is its verdict on a conversation: skipped with its reason."""
    trap = "{% if messages[-1].content == 'open sesame' %}" + ESCAPE + "{% endif %}"
    tokenizing = SampleTokenizer(with_template(tiny_tokenizer, PLAIN_TEMPLATE + trap), 4096)
    tokenizing.check_templates()  # the probe conversation does not spring it
    innocent, trapped = conversation([user("hi"), bot("yo")]), conversation([user("open sesame"), bot("no")], line_no=9)
    with pytest.raises(
        ChatTemplateError,
        match=r"^the tokenizer's chat template: fails in jinja's sandbox rendering "
        r"the conversation on line 9 of the data \(SecurityError",
    ):
        list(tokenizing.iter([innocent, trapped]))

    refusing = (
        PLAIN_TEMPLATE + "{% if messages[0].role == 'system' %}{{ raise_exception('No system role.') }}{% endif %}"
    )
    stats = TokenizeStats()
    system = conversation([{"role": "system", "content": "Be brief."}, user("hi"), bot("yo")], line_no=4)
    refuser = SampleTokenizer(with_template(tiny_tokenizer, refusing), 4096)
    assert list(refuser.iter([system], stats)) == []
    assert stats.skipped == {system.sample_id: "line 4: the chat template refuses this conversation: No system role."}
    with pytest.raises(
        DataError,
        match=r"refuses this conversation: No system role\. \(the one whose last message "
        r"begins 'hi'\); fix or drop that conversation in the data",
    ):
        refuser.prompt_ids(list(system.messages[:2]))  # what generate serves: there it is a data error (exit 2)
