"""Assistant turns placed after the prompt they were served (eagle3.data.turns), for templates whose rendering of a turn
differs from what the server renders for it live: a generation prompt that opens a block the rendered turn shows
closed (DeepSeek-V3.1 thinking), one indented otherwise than the rendered turn (a serving engine's DeepSeek tool
template), a generation prompt that matches nothing (refused, not guessed). Turns cut at generate.max_tokens: no
end-of-turn token trained. The templates are look-alikes written here, not the published ones."""

from __future__ import annotations

import pytest

from eagle3.data.samples import SampleTokenizer, TokenizeStats
from eagle3.data.turns import markup_pattern
from eagle3.stages.generate import Regeneration, Reply
from tests.test_data import (
    CALL,
    KIMI_AGENT_CONVERSATION,
    KIMI_AGENT_GENERATED,
    KIMI_K25_LIKE,
    KIMI_SPECIALS,
    TOOLS,
    assert_served_then_generated,
    bot,
    conversation,
    masked_runs,
    template_ids,
    user,
    with_template,
)

DS_SPECIALS = [
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜end▁of▁sentence｜>",
    "<think>",
    "</think>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
]
DS_END = ("<｜end▁of▁sentence｜>",)
DS_CALL = (
    '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
)
# DeepSeek-V3.1's rules: a turn after a user message opens with <｜Assistant｜></think> and never shows reasoning;
# a turn after a tool's result has no opening, and nothing is served for it after the result. In thinking mode
# the generation prompt ends <think>: the target writes its reasoning, then </think>.
DS_THINKING_LIKE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{{ m.content }}"
    "{% elif m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% elif m.role == 'assistant' %}{% if loop.previtem is defined and loop.previtem.role == 'user' %}"
    "<｜Assistant｜></think>{% endif %}{{ m.content }}{% if m.tool_calls %}<｜tool▁calls▁begin｜>"
    "{% for c in m.tool_calls %}<｜tool▁call▁begin｜>{{ c.function.name }}<｜tool▁sep｜>{{ c.function.arguments }}"
    "<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜>{% endif %}<｜end▁of▁sentence｜>"
    "{% elif m.role == 'tool' %}<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt and messages[-1].role == 'user' %}<｜Assistant｜>"
    "{% if thinking %}<think>{% else %}</think>{% endif %}{% endif %}"
)
# A tool template laid out with indented jinja: the spaces before an expression survive, so the generation prompt
# comes out indented by 4 where the rendered turn is by 6 (and its tool calls by 8).
INDENTED_TOOL_LIKE = """{{ bos_token }}
{%- for m in messages %}
  {%- if m.role == 'user' %}
    {{- '<｜User｜>' + m.content }}
  {%- elif m.role == 'assistant' %}
    {%- if loop.previtem is defined and loop.previtem.role == 'user' %}
      {{ '<｜Assistant｜></think>' }}
    {%- endif %}
    {%- if m.tool_calls %}
        {{ m.content + '<｜tool▁calls▁begin｜>' }}
      {%- for c in m.tool_calls %}
        {{- '<｜tool▁call▁begin｜>' + c.function.name + '<｜tool▁sep｜>' + c.function.arguments }}
        {{- '<｜tool▁call▁end｜>' }}
      {%- endfor %}
      {{- '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' }}
    {%- else %}
      {{- m.content + '<｜end▁of▁sentence｜>' }}
    {%- endif %}
  {%- elif m.role == 'tool' %}
    {{- '<｜tool▁output▁begin｜>' + m.content + '<｜tool▁output▁end｜>' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt and messages[-1].role == 'user' %}
    {{ '<｜Assistant｜></think>' }}
{%- endif %}"""
TOOL_RESULT = {"role": "tool", "tool_call_id": CALL["id"], "content": "18C"}


def tokenize_all(tokenizer, conv, **kwargs):
    stats = TokenizeStats()
    samples = list(SampleTokenizer(tokenizer, 4096, "assistant_turn", DS_END, **kwargs).iter([conv], stats))
    return samples, stats


def test_deepseek_thinking_turns_are_trained_after_the_think_the_server_opened(tiny_tokenizer):
    """Issue 37: DeepSeek-V3.1 in thinking mode serves <｜Assistant｜><think> and renders the turn
    <｜Assistant｜></think>answer: no turn had the served prompt as its prefix, every conversation was skipped as
    "another prefix", extract stored nothing and exited 0. Each turn is now the served prompt, then the reasoning,
    </think> and the rest of the turn as rendered."""
    tokenizer = with_template(tiny_tokenizer, DS_THINKING_LIKE, DS_SPECIALS)
    conv = conversation(
        [
            user("Hi"),
            bot("Hello!", reasoning_content="Greet."),
            user("Weather?"),
            bot("", tool_calls=[CALL]),
            TOOL_RESULT,
            bot("It is 18C."),
            user("Thanks."),
            bot("You are welcome.", reasoning_content="Be polite."),
        ],
        TOOLS,
    )
    samples, stats = tokenize_all(tokenizer, conv, template_kwargs={"thinking": True})
    own = [s for s in samples if "." in s.sample_id]
    assert_served_then_generated(
        tokenizer,
        own,
        conv,
        {
            1: "Greet.</think>Hello!<｜end▁of▁sentence｜>",
            3: f"</think>{DS_CALL}<｜end▁of▁sentence｜>",  # no reasoning: the target closes the block at once
            7: "Be polite.</think>You are welcome.<｜end▁of▁sentence｜>",
        },
        thinking=True,
    )
    # The answer after the tool's result: nothing is served after it, the whole rendering shows it as generated.
    [whole] = [s for s in samples if s.sample_id == conv.sample_id]
    assert masked_runs(tokenizer, whole) == ["It is 18C.<｜end▁of▁sentence｜>"]
    assert whole.input_ids == template_ids(tokenizer, list(conv.messages), TOOLS, thinking=True)
    assert (stats.trained_turns, stats.derived_turns, stats.turns_dropped) == (4, 3, {})
    assert stats.reasoning_tokens == len(tokenizer("Greet.")["input_ids"]) + len(tokenizer("Be polite.")["input_ids"])


def test_an_indented_generation_prompt_is_laid_over_the_turn_ignoring_its_layout(tiny_tokenizer):
    """Issue 37: a serving engine's DeepSeek tool template indents its generation prompt by 4 spaces where the
    rendered turn has 6: every conversation was skipped. The served prompt is matched over the turn's opening
    piece by piece; the template's indentation is layout, not generated text."""
    tokenizer = with_template(tiny_tokenizer, INDENTED_TOOL_LIKE, DS_SPECIALS)
    conv = conversation(
        [user("Hi"), bot("Hello!"), user("Weather?"), bot("", tool_calls=[CALL]), TOOL_RESULT, bot("It is 18C.")], TOOLS
    )
    served = tokenizer.apply_chat_template([user("Hi")], tokenize=False, add_generation_prompt=True)
    assert served.endswith("Hi    <｜Assistant｜></think>")
    assert "Hi      <｜Assistant｜></think>Hello!" in tokenizer.apply_chat_template(list(conv.messages), tokenize=False)
    samples, stats = tokenize_all(tokenizer, conv)
    assert_served_then_generated(
        tokenizer,
        [s for s in samples if "." in s.sample_id],
        conv,
        {
            1: "Hello!<｜end▁of▁sentence｜>",
            3: f"{DS_CALL}<｜end▁of▁sentence｜>",
        },
    )
    assert (stats.trained_turns, stats.turns_dropped) == (3, {})


def test_kimi_k25_whose_generation_prompt_opens_the_think_block(tiny_tokenizer, tiny_target):
    """Kimi-K2.5 in thinking mode serves <|im_assistant|>assistant<|im_middle|><think> (public renderers of it say
    so), its rendered turns start <think></think> when blanked: the generated text begins inside the block."""
    from eagle3.data.samples import end_of_turn_tokens

    opening = "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>"
    template = KIMI_K25_LIKE.replace(opening, opening + "<think>")
    assert template != KIMI_K25_LIKE
    tokenizer = with_template(tiny_tokenizer, template, [*KIMI_SPECIALS, "<think>", "</think>"])
    conv = conversation(KIMI_AGENT_CONVERSATION, TOOLS)
    stats = TokenizeStats()
    samples = list(
        SampleTokenizer(tokenizer, 4096, "assistant_turn", end_of_turn_tokens(tokenizer, tiny_target)).iter(
            [conv], stats
        )
    )
    assert_served_then_generated(
        tokenizer, samples, conv, {i: text.removeprefix("<think>") for i, text in KIMI_AGENT_GENERATED.items()}
    )
    assert (stats.trained_turns, stats.turns_dropped) == (5, {})


# The tiny target's ChatML, except that an assistant turn is rendered under the role name "bot": the generation
# prompt (<|im_start|>assistant) cannot be laid over it.
RENAMING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ 'bot' if m.role == 'assistant' else m.role }}\n"
    "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_generation_prompt_that_matches_nothing_is_not_guessed(tiny_tokenizer):
    """Only markup may be left over (a block the generation prompt opened): a served role name that the turn does
    not show means the turn cannot be placed, and it is dropped with that reason, never trained at a guess."""
    tokenizer = with_template(tiny_tokenizer, RENAMING_TEMPLATE)
    conv = conversation([user("q"), bot("a"), user("q2"), bot("b")])
    stats = TokenizeStats()
    assert list(SampleTokenizer(tokenizer, 4096).iter([conv], stats)) == []
    assert (stats.assistant_turns, stats.trained_turns, stats.turns_dropped) == (2, 0, {"not_placed": 2})
    assert (
        "another opening than the generation prompt it is served with ('<|im_start|>assistant' where the turn "
        "shows '<|im_start|>bot" in stats.skipped[f"{conv.sample_id}.1"]
    )
    with pytest.raises(
        ValueError,
        match=r"turn 1 \(assistant\): the chat template renders this turn with another "
        "opening",
    ):
        SampleTokenizer(tokenizer, 4096).samples(conv)


def test_markup_pieces_keep_special_tokens_whole(tiny_tokenizer):
    tokenizer = with_template(tiny_tokenizer, DS_THINKING_LIKE, DS_SPECIALS)
    pieces = [m.group() for m in markup_pattern(tokenizer).finditer("<｜Assistant｜>  <think>ab c</think>")]
    assert pieces == ["<｜Assistant｜>", "<think>", "ab", "c", "</think>"]


# -- turns cut at generate.max_tokens ---------------------------------------------------------------------------


def test_a_turn_cut_at_max_tokens_trains_no_end_of_turn(tiny_tokenizer, tiny_target):
    """The target never wrote the end-of-turn token of an answer cut at generate.max_tokens (nor the template's
    closing text after it): training it there would teach the drafter to end turns the target does not end."""
    from eagle3.data.samples import end_of_turn_tokens

    end = end_of_turn_tokens(tiny_tokenizer, tiny_target)
    cut = conversation([user("Count to 100."), bot("1 2 3 4", finish_reason="length"), user("Stop."), bot("OK.")])
    plain = conversation([user("Count to 100."), bot("1 2 3 4"), user("Stop."), bot("OK.")])
    assert cut.messages[1]["finish_reason"] == "length" and cut.sample_id != plain.sample_id  # the mark is content
    stats = TokenizeStats()
    [sample] = SampleTokenizer(tiny_tokenizer, 4096, "assistant_turn", end).iter([cut], stats)
    assert masked_runs(tiny_tokenizer, sample) == ["1 2 3 4", "OK.<|im_end|>"]
    assert sample.input_ids == template_ids(tiny_tokenizer, list(cut.messages))  # the ids: as served, unchanged
    assert (stats.cut_at_max_tokens, stats.trained_turns, stats.turns_dropped) == (1, 2, {})
    [uncut] = SampleTokenizer(tiny_tokenizer, 4096, "assistant_turn", end).samples(plain)
    assert masked_runs(tiny_tokenizer, uncut) == ["1 2 3 4<|im_end|>", "OK.<|im_end|>"]

    # A derived turn (Kimi-K2.5's final answer) cut the same way: its reasoning and content, no <|im_end|>.
    kimi = with_template(tiny_tokenizer, KIMI_K25_LIKE, KIMI_SPECIALS)
    answer = conversation([user("Count."), bot("1 2 3", reasoning_content="Start at one.", finish_reason="length")])
    [sample] = SampleTokenizer(kimi, 4096, "assistant_turn", end).samples(answer)
    assert masked_runs(kimi, sample) == ["<think>Start at one.</think>1 2 3"]


def test_generate_marks_the_turn_cut_at_max_tokens_and_never_sends_the_mark(tiny_tokenizer):
    walk = Regeneration(conversation([user("Count to 100."), bot("old"), user("Stop."), bot("old")]))
    assert walk.next_request() == [user("Count to 100.")]
    walk.answer(Reply("1 2 3 4", None, 8, "length"))
    history = walk.next_request()
    assert history[1] == {"role": "assistant", "content": "1 2 3 4"}  # servers know no finish_reason field
    walk.answer(Reply("OK.", None, 2, "stop"))
    result = walk.result()
    assert [m.get("finish_reason") for m in result["messages"]] == [None, "length", None, None]
    assert result["truncated"] is True
