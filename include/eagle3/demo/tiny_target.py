"""A tiny DeepSeek-V3-architecture target the project builds itself: no download of any kind.

`python -m eagle3 make-tiny-target DIR` writes, into DIR:
  config.json, model.safetensors    DeepseekV3ForCausalLM (MLA attention + MoE, like Kimi-K2.5), small
  tokenizer.json, tokenizer_config.json   a byte-level BPE trained with `tokenizers`, with a chat template
  prompts.jsonl                     held-out conversations (ShareGPT form) for the pipeline to consume
  tiny_target.json                  the arguments it was built with (the cache key)

The target is trained briefly on a synthetic conversational task with deterministic answers
(arithmetic, sorting, counting, reversing, repeating), so its next-token distributions are peaked and a
drafter has something real to learn. Same arguments and seed give the same files; a DIR already built
with the same arguments is reused.

It is small but shaped so that serving engines load it as they load DeepSeek-V3 and Kimi-K2.5: MLA with the real
latent width (kv_lora_rank 512 + a 64-wide rope head: vLLM's CPU MLA kernel runs only that 576-wide cache, and its
non-MLA fallback rotates a DeepSeek q wrongly on CPU), and the router fields both engines read without a fallback
(topk_method "noaux_tc", scoring_func "sigmoid", moe_layer_freq 1, as in DeepSeek-V3's and Kimi-K2.5's own
config.json). Transformers computes the same either way (sigmoid + correction bias); without them vLLM creates no
gate.e_score_correction_bias and fails to load the weights, and SGLang reads them with no default.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3.disk.fsutil import atomic_dir

log = logging.getLogger(__name__)

BUILD_VERSION = 2  # bump when the generator or training changes what gets built
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
    train_steps: int = 150
    num_prompts: int = 6000  # the demo holds out 30%: about 950 evaluation prompts, an interval of +-0.05 at k=3
    seed: int = 0
    build_version: int = BUILD_VERSION


# -- the synthetic task ----------------------------------------------------------------------


def _task(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randrange(100), rng.randrange(100)
        return f"What is {a} + {b}?", f"{a} + {b} = {a + b}."
    if kind == 1:
        xs = [rng.randrange(50) for _ in range(rng.randint(3, 7))]
        return f"Sort these numbers: {' '.join(map(str, xs))}", f"Sorted: {' '.join(map(str, sorted(xs)))}."
    if kind == 2:
        word = rng.choice(WORDS)
        letter = rng.choice(sorted(set(word)))
        n = word.count(letter)
        return (
            f"How many times does the letter {letter} appear in {word}?",
            f"The letter {letter} appears {n} time{'s' if n != 1 else ''} in {word}.",
        )
    words = [rng.choice(WORDS) for _ in range(rng.randint(2, 6))]
    if kind == 3:
        return f"Reverse the words: {' '.join(words)}", f"Reversed: {' '.join(reversed(words))}."
    return f"Repeat after me: {' '.join(words)}", f"{' '.join(words)}"


def synthetic_conversation(rng: random.Random) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 0.3 else []
    for _ in range(1 if rng.random() < 0.7 else 2):
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


def train_briefly(model, tokenizer, rng: random.Random, steps: int, batch_size: int = 32) -> list[float]:
    """Plain next-token training on fresh synthetic conversations; returns the loss curve."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=max(steps, 1), pct_start=0.1)
    losses = []
    started = time.monotonic()
    model.train()
    for step in range(steps):
        texts = [tokenizer.apply_chat_template(synthetic_conversation(rng), tokenize=False) for _ in range(batch_size)]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 25 == 0 or step == steps - 1:
            elapsed = time.monotonic() - started
            log.info("tiny target: step %d/%d loss %.3f (%.0fs)", step + 1, steps, loss.item(), elapsed)
    model.eval()
    return losses


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
    finally:
        torch.set_num_threads(threads)

    with atomic_dir(directory) as building:
        model.save_pretrained(building)
        tokenizer.save_pretrained(building)
        prompt_rng = random.Random(spec.seed + 1_000_003)  # a stream the training never saw
        with open(building / "prompts.jsonl", "w") as f:
            for _ in range(spec.num_prompts):
                conversation = synthetic_conversation(prompt_rng)
                turns = [{"from": SHAREGPT_ROLES[m["role"]], "value": m["content"]} for m in conversation]
                f.write(json.dumps({"conversations": turns}) + "\n")
        (building / "train_losses.json").write_text(json.dumps(losses))
        (building / "tiny_target.json").write_text(json.dumps(asdict(spec)))
    return directory
