"""The tiny target: a real DeepSeek-V3 model with MLA and MoE, deterministic for a seed, cached, and
trained enough that its next-token distributions on the synthetic task are peaked."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys

import pytest
import torch

from eagle3.data.samples import SampleTokenizer, read_conversations
from eagle3.demo.tiny_target import TinyTargetSpec, _task, build

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


@pytest.mark.slow
def test_the_default_target_is_deepseek_v3_shaped_and_has_learned_the_task(tiny_target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((tiny_target / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["num_hidden_layers"] == 8 and config["hidden_size"] == 256
    assert config["kv_lora_rank"] > 0 and config["n_routed_experts"] > 1  # MLA + MoE, like Kimi-K2.5

    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()

    def answer(question: str) -> str:
        messages = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=24, do_sample=False)
        return tokenizer.decode(out[0, ids.shape[1] :])

    # The answer formats are learned: every answer is one of the tasks' and ends its turn. Which format a prompt gets
    # depends on the CPU's float arithmetic, as the target mostly memorises (issue 53): on some CPUs every addition
    # is answered "Sorted: 0 8 21 47." So the prompt is asserted to steer the format, not to pick the right one.
    formats = [
        r"\d+ \+ \d+ = \d+\.",
        r"Sorted:( \d+)+\.",
        r"The letter \w appears \d+ times? in \w+\.",
        r"Reversed:( \w+)+\.",
    ]
    rng = random.Random(0)
    questions = [question for question, _ in (_task(rng) for _ in range(20)) if not question.startswith("Repeat")]
    answered = [
        next((i for i, f in enumerate(formats) if re.fullmatch(f + r"<\|im_end\|>", answer(q))), None)
        for q in questions
    ]
    assert None not in answered, [answer(q) for q, i in zip(questions, answered) if i is None]
    assert len(set(answered)) >= 3  # 3 of the 4 tasks' formats on the CPU that answers additions so

    # Peaked next-token distributions on held-out assistant tokens (untrained: ~1/vocab = 0.001).
    conversations, _ = read_conversations(tiny_target / "prompts.jsonl", max_samples=30)
    top1 = []
    for conversation in conversations:
        [sample] = SampleTokenizer(tokenizer, 4096).samples(conversation)
        with torch.no_grad():
            probs = model(torch.tensor([sample.input_ids])).logits[0, :-1].softmax(-1)
        top1.append(probs.max(-1).values[torch.tensor(sample.loss_mask[1:]).bool()])
    assert torch.cat(top1).mean() > 0.4  # measured 0.50
