"""The tiny target: a real DeepSeek-V3 model with MLA and MoE, deterministic for a seed, cached, trained on the
assistant's tokens only, and answering prompts it never saw."""

from __future__ import annotations

import json
import os
import random
import string
import subprocess
import sys

import pytest

from eagle3.demo.tiny_target import (
    BUILD_REPORT,
    MIN_EXACT_MATCH,
    TinyTargetSpec,
    _task,
    build,
    exact_match,
    synthetic_conversation,
    unseen,
)

SMALL = TinyTargetSpec(hidden_size=64, num_layers=5, train_steps=3, num_prompts=20)


@pytest.mark.slow
def test_same_seed_same_files_and_a_second_build_is_reused(tmp_path):
    """The second build runs as `make demo` would build it on a machine with other CPU threads than this test's
    (tests/conftest.py sets one): the files are the same all the same."""
    a = build(tmp_path / "a", SMALL)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "eagle3",
            "make-tiny-target",
            str(tmp_path / "b"),
            "--hidden-size",
            "64",
            "--num-layers",
            "5",
            "--train-steps",
            "3",
            "--num-prompts",
            "20",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "3"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    b = tmp_path / "b"
    for name in ("model.safetensors", "tokenizer.json", "prompts.jsonl", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    build(a, SMALL)
    assert (a / "model.safetensors").stat().st_mtime_ns == stamp
    other = build(tmp_path / "c", TinyTargetSpec(**{**SMALL.__dict__, "seed": 1}))
    assert (other / "model.safetensors").read_bytes() != (a / "model.safetensors").read_bytes()


def test_the_loss_is_on_the_assistants_tokens_of_the_chat_template_rendering():
    from eagle3.demo.tiny_target import CHAT_TEMPLATE, SYSTEM_PROMPT, render, train_tokenizer

    rng = random.Random(0)
    tokenizer = train_tokenizer([json.dumps(synthetic_conversation(rng)) for _ in range(200)] + [CHAT_TEMPLATE], 400)
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Count from 3 to 9."},
        {"role": "assistant", "content": "3 4 5 6 7 8 9."},
        {"role": "user", "content": "Say apple 3 times."},
        {"role": "assistant", "content": "apple apple apple."},
    ]
    ids, answer = render(tokenizer, messages)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    trained = tokenizer.decode([t for t, a in zip(ids, answer) if a])
    assert trained == "3 4 5 6 7 8 9.<|im_end|>apple apple apple.<|im_end|>"


def test_every_answer_follows_from_its_question():
    """The task's answers are functions of the prompt (what the target must learn, and a drafter must read)."""
    rng = random.Random(1)
    for question, answer in (_task(rng) for _ in range(300)):
        for asked, said in zip(question.rstrip(".").split(", then "), answer.rstrip(".").split(", then ")):
            words = asked.lower().split()
            if words[0] == "say":
                assert said == " ".join([words[1]] * int(words[2]))
            elif words[0] == "count":
                step = {"twos": 2, "threes": 3}.get(words[words.index("by") + 1], 1) if "by" in words else 1
                start, end = int(words[-3]), int(words[-1])
                numbers = list(range(start, end + (1 if end > start else -1), step if end > start else -step))
                assert said == " ".join(map(str, numbers)) and numbers[-1] == end
            else:
                first, last = words[-3], words[-1]
                assert (
                    said.replace(" ", "")
                    in (string.ascii_lowercase, string.ascii_lowercase[::-1])["backwards" in words]
                    and said[0] == first
                    and said[-1] == last
                )


def test_the_unseen_questions_are_never_trained_on():
    rng = random.Random(2)
    conversations = [synthetic_conversation(rng, trained_only=True) for _ in range(2000)]
    asked = [m["content"] for conversation in conversations for m in conversation if m["role"] == "user"]
    assert asked and not [question for question in asked if unseen(question)]
    everything = [_task(rng)[0] for _ in range(2000)]
    assert 0.05 < sum(map(unseen, everything)) / len(everything) < 0.15  # 1 in UNSEEN_SHARE (10)


@pytest.mark.slow
def test_the_default_target_is_deepseek_v3_shaped_and_answers_prompts_it_never_saw(tiny_target):
    """The demo refuses a target under MIN_EXACT_MATCH on unseen prompts (scripts/demo.py); the figure the build
    recorded is checked here on fresh prompts, not taken from the record."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((tiny_target / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["num_hidden_layers"] == 8 and config["hidden_size"] == 256
    assert config["kv_lora_rank"] > 0 and config["n_routed_experts"] > 1  # MLA + MoE, like Kimi-K2.5

    report = json.loads((tiny_target / BUILD_REPORT).read_text())
    assert report["held_out_exact_match"] >= MIN_EXACT_MATCH
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    # Unseen questions of another stream than the build's.
    assert exact_match(model, tokenizer, random.Random(7), prompts=50) >= MIN_EXACT_MATCH
