"""A tiny DeepSeek-V3-architecture target the project builds itself: no download of any kind.

`python -m eagle3 make-tiny-target DIR` writes, into DIR:
  config.json, model.safetensors    DeepseekV3ForCausalLM (MLA attention + MoE, like Kimi-K2.5), small
  tokenizer.json, tokenizer_config.json   a byte-level BPE trained with `tokenizers`, with a chat template
  prompts.jsonl                     conversations (ShareGPT form) for the pipeline to consume
  build_report.json                 the training loss curve, and the exact-match rate of the target's greedy answers
                                    on prompts its training never saw (the demo refuses a target under MIN_EXACT_MATCH)
  tiny_target.json                  the arguments it was built with (the cache key)

The target learns a task whose answers depend on the prompt: a sequence the question fixes where it starts, steps
and stops (count up or down by 1-3, list letters forwards or backwards, say a word n times: "Count by twos from 12
to 40."), 8-20 items long, so that a drafter must read the prompt, as it must with a real model, and most answers
leave room for 7 drafts. One question in UNSEEN_SHARE (by its hash) is never trained on: the target's exact-match
rate on those is its figure of generalisation, and a drafter's held-out answers cannot have been learnt by heart by
the target either. Its loss is on the assistant turns only. Same arguments and seed give the same files; a DIR already
built with the same arguments is reused.

It is small but shaped so that serving engines load it as they load DeepSeek-V3 and Kimi-K2.5: MLA with the real
latent width (kv_lora_rank 512 + a 64-wide rope head: vLLM's CPU MLA kernel runs only that 576-wide cache, and its
non-MLA fallback rotates a DeepSeek q wrongly on CPU), and the router fields both engines read without a fallback
(topk_method "noaux_tc", scoring_func "sigmoid", moe_layer_freq 1, as in DeepSeek-V3's and Kimi-K2.5's own
config.json). Transformers computes the same either way (sigmoid + correction bias); without them vLLM creates no
gate.e_score_correction_bias and fails to load the weights, and SGLang reads them with no default.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3.disk.fsutil import atomic_dir

log = logging.getLogger(__name__)

BUILD_VERSION = 3  # bump when the generator or training changes what gets built
BUILD_REPORT = "build_report.json"
MIN_EXACT_MATCH = 0.9  # the share of unseen prompts the demo's target must answer exactly
EXACT_MATCH_PROMPTS = 200
# The CPU threads the build trains with, whatever the machine or OMP_NUM_THREADS say: a matmul's sums depend on how
# its work is split, so the weights (and every figure the demo prints) would otherwise differ between a test run that
# built the target single-threaded and a `make demo` on the same machine.
BUILD_THREADS = 2
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = (
    "red blue green yellow black white apple banana cherry grape lemon mango river mountain forest ocean "
    "desert cloud stone paper pencil window garden bridge castle rocket planet silver golden quiet happy"
).split()
SYSTEM_PROMPT = "You are a careful assistant. Answer exactly."
# What SGLang's and vLLM's DeepSeek-V3 code read from config.json with no fallback that transformers' config does
# not write (the values DeepSeek-V3 and Kimi-K2.5 ship).
SERVED_ROUTER = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1}
SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt"}


@dataclass(frozen=True)
class TinyTargetSpec:
    hidden_size: int = 256
    num_layers: int = 8
    moe: bool = True  # False: every layer dense (the shallow, wide I/O-benchmark target)
    vocab_size: int = 1024
    train_steps: int = 900
    num_prompts: int = 6000
    seed: int = 0
    build_version: int = BUILD_VERSION


# -- the synthetic task ----------------------------------------------------------------------

LETTERS = "abcdefghijklmnopqrstuvwxyz"
BY = {1: "", 2: " by twos", 3: " by threes"}
UNSEEN_SHARE = 10  # 1 in 10 questions (by their hash) is never trained on: the ones exact_match asks


def _task(rng: random.Random) -> tuple[str, str]:
    """A question and its answer: a sequence whose start, step and end the question says."""
    kind = rng.randrange(4)
    if kind <= 1:  # count, by 1 (kind 0) or by 2 or 3 (kind 1), up or down, within 0-99 (one token a number)
        step = 1 if kind == 0 else rng.choice((2, 3))
        n = rng.randint(8, 20 if step < 3 else 16)
        low = rng.randrange(100 - step * n)
        high = low + step * (n - 1)
        if rng.random() < 0.5:
            return f"Count{BY[step]} from {low} to {high}.", " ".join(map(str, range(low, high + 1, step))) + "."
        return f"Count down{BY[step]} from {high} to {low}.", " ".join(map(str, range(high, low - 1, -step))) + "."
    if kind == 2:
        n = rng.randint(8, 20)
        low = rng.randrange(len(LETTERS) - n + 1)
        letters = LETTERS[low : low + n]
        if rng.random() < 0.5:
            return f"List the letters from {letters[0]} to {letters[-1]}.", " ".join(letters) + "."
        return f"List the letters backwards from {letters[-1]} to {letters[0]}.", " ".join(reversed(letters)) + "."
    word, n = rng.choice(WORDS), rng.randint(4, 12)
    return f"Say {word} {n} times.", " ".join([word] * n) + "."


def unseen(question: str) -> bool:
    """Whether the target's training leaves this question out (exact_match asks these)."""
    return int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "little") % UNSEEN_SHARE == 0


def synthetic_conversation(rng: random.Random, trained_only: bool = False) -> list[dict]:
    """One or two question-and-answer turns, a system prompt in 30% of them; `trained_only`: no unseen question."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 0.3 else []
    for _ in range(1 if rng.random() < 0.85 else 2):
        question, answer = _task(rng)
        while trained_only and unseen(question):
            question, answer = _task(rng)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages


# -- building --------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        chat_template=CHAT_TEMPLATE,
    )


def model_config(spec: TinyTargetSpec, tokenizer):
    from transformers import DeepseekV3Config

    h = spec.hidden_size
    heads = max(2, h // 64)
    return DeepseekV3Config(
        vocab_size=len(tokenizer),
        hidden_size=h,
        intermediate_size=2 * h,
        moe_intermediate_size=h // 2,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        first_k_dense_replace=1 if spec.moe else spec.num_layers,
        n_group=1,
        topk_group=1,
        q_lora_rank=h // 4,
        kv_lora_rank=512,  # DeepSeek-V3's and Kimi-K2.5's latent width: see the module docstring
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        **SERVED_ROUTER,
    )


def render(tokenizer, messages: list[dict]):
    """The conversation through CHAT_TEMPLATE, tokenized, and which tokens are the assistant's (its turns and their
    end of turn): ([ids], [bool])."""
    text, spans = tokenizer.bos_token, []
    for m in messages:
        text += f"<|im_start|>{m['role']}\n"
        start = len(text)
        text += m["content"] + "<|im_end|>"
        if m["role"] == "assistant":
            spans.append((start, len(text)))
        text += "\n"
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    answer = [any(a <= begin < b for a, b in spans) for begin, _ in encoded["offset_mapping"]]
    return encoded["input_ids"], answer


def train_briefly(model, tokenizer, rng: random.Random, steps: int, batch_size: int = 32) -> list[float]:
    """Next-token training on fresh synthetic conversations, none with an unseen question, the loss on the
    assistant's tokens only (the prompts are random: predicting them teaches nothing); returns the loss curve."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-3, total_steps=max(steps, 1), pct_start=0.05)
    losses = []
    started = time.monotonic()
    model.train()
    for step in range(steps):
        conversations = [synthetic_conversation(rng, trained_only=True) for _ in range(batch_size)]
        rows = [render(tokenizer, c) for c in conversations]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids, _ in rows])
        labels = torch.tensor(
            [[t if a else -100 for t, a in zip(*row)] + [-100] * (width - len(row[0])) for row in rows]
        )
        mask = torch.tensor([[1] * len(ids_) + [0] * (width - len(ids_)) for ids_, _ in rows])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            elapsed = time.monotonic() - started
            log.info("tiny target: step %d/%d loss %.3f (%.0fs)", step + 1, steps, loss.item(), elapsed)
    model.eval()
    return losses


def exact_match(model, tokenizer, rng: random.Random, prompts: int = EXACT_MATCH_PROMPTS) -> float:
    """The share of `prompts` questions the target never trained on (unseen) that it answers exactly, greedily."""
    import torch

    tasks = []
    while len(tasks) < prompts:
        question, answer = _task(rng)
        if unseen(question):
            tasks.append((question, answer))
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    right = 0
    for i in range(0, len(tasks), 50):
        batch = tasks[i : i + 50]
        prompts_text = [
            tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q, _ in batch
        ]
        rows = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts_text]
        width = max(map(len, rows))  # left-padded: every prompt ends where generation starts
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=96,
                do_sample=False,
                eos_token_id=end,
                pad_token_id=tokenizer.pad_token_id,
            )
        for (_, answer), row in zip(batch, out[:, width:].tolist()):
            right += tokenizer.decode(row[: row.index(end)] if end in row else row) == answer
    return right / len(tasks)


def write_prompts(path: Path, spec: TinyTargetSpec) -> None:
    """The pipeline's conversations, in ShareGPT form: a stream of their own, from the task's whole distribution (the
    target trained on most of their questions, as a real model's own data overlaps what it is asked)."""
    rng = random.Random(spec.seed + 1_000_003)
    with open(path, "w") as f:
        for _ in range(spec.num_prompts):
            turns = [{"from": SHAREGPT_ROLES[m["role"]], "value": m["content"]} for m in synthetic_conversation(rng)]
            f.write(json.dumps({"conversations": turns}) + "\n")


def build(directory: Path, spec: TinyTargetSpec) -> Path:
    """Build the tiny target into `directory` (atomically), or reuse it if built with the same spec. The reuse check
    reads one file and comes before torch and transformers are imported: `make test` and `make demo` ask for the
    target every time, and those imports cost about 6 CPU-seconds (10-40 s of wall time on a cold page cache)."""
    directory = Path(directory).resolve()
    stamp = directory / "tiny_target.json"
    if stamp.exists():
        if json.loads(stamp.read_text()) == asdict(spec):
            log.info("tiny target: %s already built with these arguments; reusing it", directory)
            return directory
        log.info("tiny target: %s was built with other arguments; rebuilding", directory)
    elif directory.exists() and any(directory.iterdir()):
        raise FileExistsError(f"{directory} exists and is not a tiny target; pick an empty or new directory")

    import torch
    from transformers import DeepseekV3ForCausalLM

    rng = random.Random(spec.seed)
    torch.manual_seed(spec.seed)
    corpus = [
        json.dumps(synthetic_conversation(rng)) for _ in range(4000)
    ]  # JSON text covers every character the chat template and the tasks produce
    tokenizer = train_tokenizer(corpus + [CHAT_TEMPLATE], spec.vocab_size)
    model = DeepseekV3ForCausalLM(model_config(spec, tokenizer))
    threads = torch.get_num_threads()
    torch.set_num_threads(BUILD_THREADS)
    try:
        losses = train_briefly(model, tokenizer, rng, spec.train_steps)
        matched = exact_match(model, tokenizer, random.Random(spec.seed + 2_000_003))
    finally:
        torch.set_num_threads(threads)
    log.info("tiny target: exact match on %d unseen prompts %.1f%%", EXACT_MATCH_PROMPTS, 100 * matched)

    with atomic_dir(directory) as building:
        model.save_pretrained(building)
        tokenizer.save_pretrained(building)
        write_prompts(building / "prompts.jsonl", spec)
        report = {"held_out_exact_match": matched, "held_out_prompts": EXACT_MATCH_PROMPTS, "train_losses": losses}
        (building / BUILD_REPORT).write_text(json.dumps(report))
        (building / "tiny_target.json").write_text(json.dumps(asdict(spec)))
    return directory
