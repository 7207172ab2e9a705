"""What decides a target's hidden states (or its regenerated answers), as a digest: the key of the store
runs share them in.

Scheduled reruns of a lineage see the same conversations again and again; their states are computed once
and kept in `{workdir}/stores/{key}/`, a store every run with the same capture uses. The key covers
everything that changes a stored byte:

- the target itself: config.json, and its weight files (a sampled digest, below), the tokenizer files and
  the chat template;
- how conversations become token ids and masks: data.max_length, data.loss_mask, data.chat_template_kwargs,
  data.generation_chat_template (the file's bytes), and eagle3.data.samples.TOKENIZING_VERSION (the code's own way: a
  sample id that now gives other ids or another mask must not find the old sample stored);
- how states are taken and stored: extract.backend (SGLang's kernels and transformers' differ in the last
  bits), target.dtype, the resolved aux layers, extract.state_dtype, and extract.num_shards (a sample's shard is
  its id mod num_shards, so another shard count is another layout). Not SGLang's tp size or attention backend:
  they move the last bits too, and a store keyed on them would be rebuilt for a change of box.

Left out on purpose: data.path (a store is content-addressed by sample id, so new data only adds samples),
batch sizes, devices and everything after extract.

Regenerated answers are shared the same way, in `{workdir}/generated/{key}/` (generation_fields: the target,
the server that answers, sampling, max_tokens, reasoning, template options), keyed inside by the source
conversation's id.

Weights are digested by sampling, not read whole: Kimi-K2.5's are about 1 TB, a full sha256 half an hour.
Each weight file contributes its name, size, safetensors header (every tensor's name, dtype, shape and offsets)
and 16 blocks of 64 KiB spread evenly over its data; a file under 64 MiB is read whole. A new checkpoint of
the same architecture (identical headers) changes practically every weight, so it changes the sampled
blocks too; a change to a few weights elsewhere would not be seen (say so with a new model directory).

Never imports torch: `init` computes the key for the config it writes.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from eagle3.config import ConfigError, RunConfig
from eagle3.data.samples import TOKENIZING_VERSION, template_file_bytes
from eagle3.disk.fsutil import atomic_symlink, atomic_write_text
from eagle3.disk.layout import GENERATED, GENERATED_PARTS, KEY_RECORD, STORES

KEY_FORMAT = 1  # bump when the store's layout or the key's fields change: a new key, never a mixed store
KEY_CHARS = 16  # hex digits of the sha256 in the directory name

# Files that define how text becomes ids (HF fast/slow, sentencepiece, tiktoken as Kimi-K2.5 ships it), and the
# chat template when it is a file of its own.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "tiktoken.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
)
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")
WHOLE_FILE_LIMIT = 64 << 20
SAMPLED_BLOCKS = 16
BLOCK_BYTES = 64 << 10


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def weights_digest(path: Path) -> str:
    """A weight file's size, safetensors header and sampled data (the whole file if small)."""
    size = path.stat().st_size
    if size <= WHOLE_FILE_LIMIT:
        return file_digest(path)
    h = hashlib.sha256(f"{size}".encode())
    with open(path, "rb") as f:
        data_start = 0
        if path.suffix == ".safetensors":
            header_len = int.from_bytes(f.read(8), "little")
            h.update(f.read(min(header_len, size - 8)))
            data_start = 8 + header_len
        span = max(0, size - data_start - BLOCK_BYTES)
        for i in range(SAMPLED_BLOCKS):
            f.seek(data_start + span * i // (SAMPLED_BLOCKS - 1))
            h.update(f.read(BLOCK_BYTES))
    return h.hexdigest()


def target_identity(model_path: str | Path, tokenizer_dir: str | Path) -> dict[str, str]:
    """{file name: digest} of the target's config, weights (sampled), weight index, tokenizer and template. Not
    cached: the point is to see a target that changed; sampled, it takes tens of milliseconds at any size."""
    model_path, tokenizer_dir = Path(model_path), Path(tokenizer_dir)
    # (a directory without weights has a key too: init may check a config before the weights are copied)
    weight_files = sorted(f for pattern in WEIGHT_FILES for f in model_path.glob(pattern))
    identity = {"config.json": file_digest(model_path / "config.json")}
    identity.update({f.name: file_digest(f) for f in sorted(model_path.glob("*.index.json"))})
    identity.update({f.name: weights_digest(f) for f in weight_files})
    for name in (*TOKENIZER_FILES, *TEMPLATE_FILES):
        if (tokenizer_dir / name).is_file():
            identity[f"tokenizer/{name}"] = file_digest(tokenizer_dir / name)
    return identity


def capture_fields(cfg: RunConfig) -> dict:
    """Every field that decides the stored bytes (see the module docstring); `cfg` has its target facts."""
    template = cfg.data.generation_chat_template
    if template and not os.path.lexists(template):
        raise ConfigError(
            "data.generation_chat_template",
            f"{template} does not exist on the box",
            "copy the template there or leave the field empty",
        )
    # Read as the stages read it (a small regular file, no link, nothing in /proc): a naive read of
    # /proc/self/pagemap would never end, and init would hang before any stage refused the file.
    template_digest = hashlib.sha256(template_file_bytes(template)).hexdigest() if template else None
    return {
        "format": KEY_FORMAT,
        "samples_of": TOKENIZING_VERSION,
        "target": target_identity(cfg.target.model_path, cfg.tokenizer_dir),
        "target_dtype": cfg.target.dtype,
        "max_length": cfg.data.max_length,
        "loss_mask": cfg.data.loss_mask,
        "chat_template_kwargs": cfg.data.chat_template_kwargs,
        "generation_chat_template": template_digest,
        "backend": cfg.extract.backend,
        "aux_layers": cfg.resolved_aux_layers(),
        "state_dtype": cfg.extract.state_dtype,
        "num_shards": cfg.extract.num_shards,
    }


def capture_key(fields: dict) -> str:
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:KEY_CHARS]


def shared_store_dir(workdir: str | Path, key: str) -> Path:
    return Path(workdir) / STORES / key


def attach_store(cfg: RunConfig) -> Path:
    """Point the run's store (`RUN_DIR/hidden_states`) at the shared store of its capture key; returns the key's
    directory. Idempotent. Refuses a run whose link names another key: its target or a capture field changed
    since the run started, and one store must never hold two captures."""
    fields = capture_fields(cfg)
    return link_shared(
        cfg.store_dir,
        shared_store_dir(cfg.workdir, capture_key(fields)),
        fields,
        "hidden states were captured into store",
        "target or capture settings",
    )


def generation_fields(cfg: RunConfig) -> dict:
    """What decides a regenerated answer besides its conversation: the target, the server that answers and how
    it is asked. Sampling is part of it (a cached answer drawn at temperature 0.7 stands for one), the seed not."""
    gen = cfg.generate
    return {
        "format": KEY_FORMAT,
        "samples_of": TOKENIZING_VERSION,
        "target": target_identity(cfg.target.model_path, cfg.tokenizer_dir),
        "backend": gen.backend,
        # an endpoint the stage does not start serves whatever model it serves: its address and name stand for it
        "endpoint": None if gen.backend == "hf" or gen.launch_server else gen.endpoint,
        "model": gen.model,
        "server": cfg.server.model_dump(mode="json") if gen.backend == "server" and gen.launch_server else None,
        "target_dtype": cfg.target.dtype if gen.backend == "hf" else None,
        "temperature": gen.temperature,
        "top_p": gen.top_p,
        "top_k": gen.top_k,
        "max_tokens": gen.max_tokens,
        "reasoning": gen.reasoning,
        "chat_template_kwargs": cfg.data.chat_template_kwargs,
    }


def attach_generated(cfg: RunConfig) -> Path:
    """Point the run's `generate/parts` at the answers cache of its generation key ({workdir}/generated/<key>):
    a conversation answered by an earlier run with the same key is not asked again."""
    fields = generation_fields(cfg)
    key = capture_key(fields)
    return link_shared(
        cfg.run_dir / GENERATED_PARTS,
        Path(cfg.workdir) / GENERATED / key,
        fields,
        "answers were generated into cache",
        "target or generation settings",
    )


def link_shared(link: Path, shared: Path, fields: dict, made_into: str, what_changed: str) -> Path:
    """`link` -> `shared` (relative), made atomically, with `shared/key.json` listing `fields`."""
    shared.mkdir(parents=True, exist_ok=True)
    if not (shared / KEY_RECORD).exists():  # what the key covers, for a person choosing what to delete
        atomic_write_text(shared / KEY_RECORD, json.dumps(fields, indent=2, sort_keys=True) + "\n")
    if link.is_symlink():
        linked = Path(link.readlink()).name
        if linked != shared.name:
            raise ConfigError(
                link,
                f"this run's {made_into} {linked}, but its {what_changed} now give {shared.name} (see "
                f"{shared / 'key.json'} and {shared.with_name(linked) / 'key.json'} for what differs): a new target "
                "checkpoint or setting is a new run",
                "pick a new run_name",
            )
        return shared
    link.parent.mkdir(parents=True, exist_ok=True)
    atomic_symlink(link, Path(os.path.relpath(shared, link.parent)))  # relative: the work directory may move whole
    return shared
