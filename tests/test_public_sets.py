"""Public benchmark sets (eagle3.data.public_sets): each set's own record format read from local files the tests write
(made-up records, no copied prompts), rendered as the target is served, and refused with the field and the fix."""

from __future__ import annotations

import json

import pytest

from eagle3.config import ConfigError, InvalidConfig
from eagle3.data.public_sets import (
    SETS,
    PublicSetUnavailable,
    answer_message,
    ask_turn_by_turn,
    hub_records,
    load_public_sets,
    load_set,
    read_local_records,
)
from eagle3.data.samples import DataError, SampleTokenizer


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


# Made-up records in each set's own format (the hub's field names; MT-Bench also in FastChat's).
GSM8K = [
    {"question": "Ann has 3 pears and buys 4 more. How many pears?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "What is 12 + 30?", "answer": "#### 42"},
]
HUMANEVAL = [{"task_id": "Made/0", "prompt": 'def add(a, b):\n    """Return a + b."""\n', "entry_point": "add"}]
MTBENCH = [
    {"prompt_id": 1, "category": "math", "prompt": ["What is 5 + 6?", "And 7 + 8?"], "reference": []},
    {"question_id": 2, "category": "writing", "turns": ["Repeat after me: red blue", "Reverse the words: red blue"]},
]
BFCL = [
    {
        "id": "simple_made_0",
        "question": [[{"role": "user", "content": "How warm is it in Lyon in celsius?"}]],
        "function": [
            {
                "name": "weather.current",
                "description": "Current temperature of a city.",
                "parameters": {
                    "type": "dict",
                    "properties": {
                        "city": {"type": "string", "description": "The city."},
                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                        "hours": {"type": "array", "items": {"type": "float"}},
                    },
                    "required": ["city"],
                },
            }
        ],
    }
]


@pytest.fixture
def tokenizing(tiny_target):
    """The run's SampleTokenizer for the tiny target, with a template that shows what reaches it: the tools, and the
    thinking switch a thinking target's template takes (data.chat_template_kwargs)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    tokenizer.chat_template = (
        "{% if tools %}<|im_start|>tools\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% if thinking %}<think>{% endif %}{% endif %}"
    )
    return SampleTokenizer(tokenizer, 4096, "assistant_turn", ("<|eos|>",), {"thinking": True})


def test_each_sets_records_become_the_chats_the_target_is_served(tmp_path, tokenizing):
    loaded = {
        name: load_set(SETS[name], write_jsonl(tmp_path / f"{name}.jsonl", records), 10, tokenizing)
        for name, records in (("gsm8k", GSM8K), ("humaneval", HUMANEVAL), ("mtbench", MTBENCH), ("bfcl", BFCL))
    }

    assert [c.turns for c in loaded["gsm8k"].chats] == [(({"role": "user", "content": r["question"]},),) for r in GSM8K]
    assert loaded["humaneval"].chats[0].turns == (({"role": "user", "content": HUMANEVAL[0]["prompt"]},),)
    # MT-Bench: the hub's "prompt" and FastChat's "turns", one user message a turn
    assert [len(c.turns) for c in loaded["mtbench"].chats] == [2, 2]
    assert loaded["mtbench"].chats[1].turns[1] == ({"role": "user", "content": "Reverse the words: red blue"},)
    # BFCL: the first turn's messages, its functions as OpenAI tools, BFCL's type names made JSON Schema's
    bfcl = loaded["bfcl"].chats[0]
    assert bfcl.turns == (tuple(BFCL[0]["question"][0]),)
    tool = bfcl.tools[0]
    assert tool["type"] == "function" and tool["function"]["name"] == "weather.current"
    parameters = tool["function"]["parameters"]
    assert parameters["type"] == "object" and parameters["properties"]["hours"]["items"] == {"type": "number"}
    assert parameters["properties"]["unit"]["enum"] == ["celsius", "fahrenheit"] and parameters["required"] == ["city"]

    # Rendered as held-out prompts are: the target's template, data.chat_template_kwargs, the generation prompt.
    for name, one in loaded.items():
        assert one.first_prompts == [tokenizing.prompt_ids(list(c.turns[0]), c.tools) for c in one.chats], name
    text = tokenizing.tokenizer.decode(loaded["bfcl"].first_prompts[0])
    assert '"name": "weather.current"' in text and text.endswith("<|im_start|>assistant\n<think>")


def test_a_set_is_read_as_a_json_array_json_lines_or_with_blank_lines_and_capped(tmp_path, tokenizing):
    array = tmp_path / "gsm8k.json"
    array.write_text(json.dumps(GSM8K))
    lines = tmp_path / "gsm8k-lines.json"  # BFCL's .json files are JSON lines
    lines.write_text("\n" + json.dumps(GSM8K[0]) + "\n\n" + json.dumps(GSM8K[1]) + "\n")
    assert [r for _, r in read_local_records(array)] == [r for _, r in read_local_records(lines)] == GSM8K
    assert [at for at, _ in read_local_records(lines)] == ["line 2", "line 4"]
    assert len(load_set(SETS["gsm8k"], str(array), 1, tokenizing).chats) == 1  # the first N records


@pytest.mark.parametrize(
    "name, record, message",
    [
        ("gsm8k", {"problem": "What is 2 + 2?"}, '"question" is missing'),
        ("gsm8k", {"question": ["What is 2 + 2?"]}, '"question" is not a non-empty string'),
        ("humaneval", {"task_id": "Made/1"}, '"prompt" is missing'),
        ("mtbench", {"prompt": "What is 2 + 2?"}, '"prompt" (or "turns") is missing or not a list'),
        ("bfcl", {"question": [[{"role": "user", "content": "Hi"}]]}, '"function" is missing'),
        ("bfcl", {"question": "Hi", "function": BFCL[0]["function"]}, '"question" is missing or its first turn'),
        ("bfcl", [1, 2], "not a JSON object"),
    ],
)
def test_a_record_not_in_its_sets_format_is_refused_naming_the_file_record_field_and_fix(
    tmp_path, tokenizing, name, record, message
):
    path = write_jsonl(
        tmp_path / "set.jsonl",
        [*{"gsm8k": GSM8K, "humaneval": HUMANEVAL, "mtbench": MTBENCH, "bfcl": BFCL}[name], record],
    )
    with pytest.raises(DataError) as info:
        load_set(SETS[name], path, 10, tokenizing)
    text = str(info.value)
    assert text.startswith(f"evaluate.benchmark_files.{name}: {path}, line ") and message in text
    assert SETS[name].record_format in text and f"remove {name} from evaluate.benchmark_files" in text


def test_an_unreadable_or_empty_file_is_named(tmp_path, tokenizing):
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(GSM8K[0]) + "\n{not json\n")
    with pytest.raises(DataError, match=r"broken.jsonl, line 2: not JSON"):
        load_set(SETS["gsm8k"], str(broken), 10, tokenizing)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match=r"empty.jsonl: holds no records; a GSM8K record is"):
        load_set(SETS["gsm8k"], str(empty), 10, tokenizing)
    with pytest.raises(DataError, match=r"missing.jsonl: no such file"):
        load_set(SETS["gsm8k"], str(tmp_path / "missing.jsonl"), 10, tokenizing)


def test_without_the_hub_the_error_says_how_to_measure_offline(monkeypatch):
    """The box reads the hub; a box without the datasets library is told to install it or to name a local copy, and
    one that cannot reach the hub likewise. (CI has neither the library nor the network: the library's absence is
    made here, and the hub's failure is a stand-in datasets module that raises as an unreachable hub does.)"""
    import sys
    import types

    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(ConfigError) as refused:
        hub_records(SETS["gsm8k"], 10)
    assert refused.value.where == "evaluate.benchmarks" and "evaluate.benchmark_files.gsm8k" in refused.value.fix

    asked = []

    def load_dataset(path, name=None, data_files=None, split=None):
        asked.append((path, name, data_files, split))
        raise ConnectionError("Couldn't reach 'gorilla-llm/Berkeley-Function-Calling-Leaderboard' on the Hub")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    with pytest.raises(
        PublicSetUnavailable,
        match=r"bfcl could not be loaded from the hub \(gorilla-llm/Berkeley-"
        r"Function-Calling-Leaderboard, file BFCL_v3_simple\.json\): "
        r"ConnectionError: .*evaluate\.benchmark_files\.bfcl",
    ):
        hub_records(SETS["bfcl"], 10)
    with pytest.raises(PublicSetUnavailable):
        hub_records(SETS["gsm8k"], 10)
    assert asked == [
        ("gorilla-llm/Berkeley-Function-Calling-Leaderboard", None, "BFCL_v3_simple.json", "train"),
        ("openai/gsm8k", "main", None, "test"),
    ]


def test_a_later_turn_follows_the_targets_own_answer(tmp_path, tokenizing):
    """MT-Bench's second turn is asked after the target's greedy answer to the first, as a client of the server
    would send it back: reasoning apart from the content."""
    loaded = load_set(
        SETS["mtbench"], write_jsonl(tmp_path / "mt.jsonl", [*MTBENCH, {"turns": ["Only one turn"]}]), 10, tokenizing
    )
    tokenizer, eos = tokenizing.tokenizer, tokenizing.tokenizer.convert_tokens_to_ids("<|eos|>")
    asked = []

    def ask(prompts, turn):
        asked.append((turn, prompts))
        return [
            tokenizer.encode(f"<think>step {turn}.{i}</think>Answer {turn}.{i}") + [eos] for i in range(len(prompts))
        ]

    ask_turn_by_turn(loaded, ask, tokenizing, {eos})
    assert [(turn, len(prompts)) for turn, prompts in asked] == [(1, 3), (2, 2)]  # the one-turn record is done
    assert loaded.prompts == asked[0][1] + asked[1][1] and len(loaded.baseline) == 5
    second = [MTBENCH[0]["prompt"][0], MTBENCH[0]["prompt"][1]]
    assert asked[1][1][0] == tokenizing.prompt_ids(
        [
            {"role": "user", "content": second[0]},
            {"role": "assistant", "content": "Answer 1.0", "reasoning_content": "step 1.0"},
            {"role": "user", "content": second[1]},
        ]
    )


def test_an_answer_goes_back_as_a_reasoning_parser_hands_it_over(tiny_tokenizer):
    eos = tiny_tokenizer.convert_tokens_to_ids("<|eos|>")

    def message(text, *end):
        return answer_message(tiny_tokenizer, tiny_tokenizer.encode(text) + list(end), {eos})

    assert message("plain answer", eos) == {"role": "assistant", "content": "plain answer"}
    assert message("<think>\nsome steps\n</think>\n\nthe answer", eos) == {
        "role": "assistant",
        "content": "the answer",
        "reasoning_content": "some steps",
    }
    assert message("reasoning opened by the prompt</think>done") == {
        "role": "assistant",
        "content": "done",
        "reasoning_content": "reasoning opened by the prompt",
    }
    assert message("<think>cut while thinking") == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "cut while thinking",
    }


def test_the_config_names_sets_and_their_files_consistently(tmp_path, tokenizing, make_config):
    for evaluate, field in (
        ({"benchmarks": ["gsm8k"], "benchmark_files": {"bfcl": "/data/bfcl.jsonl"}}, "evaluate.benchmark_files"),
        ({"benchmarks": ["gsm8k", "gsm8k"]}, "evaluate.benchmarks"),
        ({"benchmarks": ["mmlu"]}, "evaluate.benchmarks.0"),
        ({"benchmarks": ["gsm8k"], "benchmark_files": {"gsm8k": "gsm8k.jsonl"}}, "evaluate.benchmark_files.gsm8k"),
    ):
        with pytest.raises(InvalidConfig) as refused:
            make_config(evaluate=evaluate)
        assert refused.value.fields == [field], evaluate
    assert make_config().evaluate.benchmarks == []  # by default nothing is loaded, so nothing is downloaded
    assert load_public_sets(make_config(), tokenizing) == []
    files = {"gsm8k": write_jsonl(tmp_path / "g.jsonl", GSM8K), "mtbench": write_jsonl(tmp_path / "m.jsonl", MTBENCH)}
    cfg = make_config(evaluate={"benchmarks": ["mtbench", "gsm8k"], "benchmark_files": files, "benchmark_prompts": 1})
    assert [(s.spec.name, len(s.chats)) for s in load_public_sets(cfg, tokenizing)] == [("mtbench", 1), ("gsm8k", 1)]


def test_the_registry_is_the_configs_list_of_sets():
    from typing import get_args

    from eagle3.config import EvaluateConfig

    names = get_args(get_args(EvaluateConfig.model_fields["benchmarks"].annotation)[0])
    assert set(names) == set(SETS)


@pytest.mark.timeout(60)
def test_a_local_set_file_that_is_no_regular_file_is_refused_unread(tmp_path):
    """A FIFO named in evaluate.benchmark_files would block the stage forever on a plain read: refused, named."""
    import os

    from eagle3.data.public_sets import read_local_records

    fifo = tmp_path / "gsm8k.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match=rf"^{fifo}: a FIFO, not a regular file; point evaluate.benchmark_files"):
        read_local_records(fifo)
