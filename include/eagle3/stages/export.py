"""Export the best checkpoint as a drafter SGLang and vLLM load with their EAGLE-3 speculative decoding.

    python -m eagle3 export --config RUN_DIR/config.json

Writes {run dir}/drafter/ whole (temp dir, fsync, rename), or keeps it where its export.json already matches:
  config.json        LlamaForCausalLMEagle3 (one layer, the drafter's shape and RoPE, the target's vocab_size,
                     draft_vocab_size), each engine's aux layer ids where and as it reads them (eagle3.model.layer_ids)
  model.safetensors  exactly EXPORT_KEYS (fc_norm.<i> too with fc_norm) + d2t (int64) + t2d (bool); no embed_tokens
  export.json        the checkpoint, its validation figures, and per engine the ids it reads and whether it is served
A target of no known family, or no engine served: LayerIdError, nothing written; one engine not served: a warning.
Serve it:
  python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 \\
      --speculative-draft-model-path RUN_DIR/drafter --speculative-num-steps 3 \\
      --speculative-eagle-topk 1 --speculative-num-draft-tokens 4
  python -m vllm.entrypoints.openai.api_server --model TARGET \\
      --speculative-config '{"method": "eagle3", "model": "RUN_DIR/drafter", "num_speculative_tokens": 3}'
(SGLang's EAGLE, not EAGLE3, loads it too and silently gives accept length 1.)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from eagle3.disk.fsutil import atomic_dir
from eagle3.disk.layout import (
    CHECKPOINTS,
    DRAFTER_CONFIG,
    DRAFTER_DIR,
    EXPORT_RECORD,
    MAPPING_D2T,
    MAPPING_T2D,
    WEIGHTS,
)
from eagle3.model.drafter import EMBED_KEYS, DraftConfig, Eagle3Draft, load_target_tensor
from eagle3.model.layer_ids import LayerIdError, engines_served, family, hf_layers_read
from eagle3.model.rope import exported_scaling
from eagle3.records.checkpoint import best_checkpoint, load_checkpoint
from eagle3.target import read_architecture, target_rope

if TYPE_CHECKING:
    from eagle3.config import RunConfig

log = logging.getLogger(__name__)

EXPORT_KEYS = (
    "fc.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight",
    "norm.weight",
    "lm_head.weight",
)


def export_names(draft: DraftConfig) -> dict[str, str]:
    """{the trained weight's name: its name in the export}: SpecForge's names, which SGLang and vLLM load, plus
    EAGLE-3.1's per-aux norms under the engines' fc_norm.<i> (fc.norms.<i> in training)."""
    names = {key: key for key in EXPORT_KEYS}
    if draft.fc_norm:
        names.update({f"fc.norms.{i}.weight": f"fc_norm.{i}.weight" for i in range(len(draft.aux_layer_ids))})
    return names


def drafter_config(draft: DraftConfig, target_architecture: str, dtype: str) -> dict:
    """The exported config.json: SGLang's LlamaForCausalLMEagle3, with each engine's aux layer ids where it reads
    them. Refused when no engine can be told the trained layers."""
    hf_ids = list(draft.aux_layer_ids)
    served = engines_served(hf_ids, target_architecture)
    if all(isinstance(ids, str) for ids in served.values()):
        raise LayerIdError(f"no serving engine can be told the layers this drafter was trained on: {served}")
    vllm_ids = served["vllm"] if not isinstance(served["vllm"], str) else [i + 1 for i in hf_ids]
    sglang_ids = served["sglang"] if not isinstance(served["sglang"], str) else vllm_ids
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": draft.hidden_size,
        "intermediate_size": draft.intermediate_size,
        "num_attention_heads": draft.num_attention_heads,
        "num_key_value_heads": draft.num_key_value_heads,
        "head_dim": draft.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": draft.rms_norm_eps,
        "rope_theta": draft.rope_theta,
        **({"rope_scaling": exported_scaling(draft.rope_scaling)} if draft.rope_scaling else {}),
        "max_position_embeddings": draft.max_position_embeddings,
        "vocab_size": draft.target_vocab_size,
        "draft_vocab_size": draft.draft_vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        # EAGLE-3.1's normalisations, read by sglang 0.5.23 and vllm 0.32 (llama_eagle3.py), written only when on
        **({"fc_norm": True} if draft.fc_norm else {}),
        **({"norm_output": True} if draft.norm_output else {}),
        "eagle_aux_hidden_state_layer_ids": vllm_ids,  # vLLM reads this one first
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": sglang_ids,  # the only one SGLang reads
            "use_aux_hidden_state": True,
        },
    }


# Where each engine looks for the aux layer ids in a drafter's config.json, first found wins (sglang 0.5.23
# model_runner_components/spec_aux_hidden_state.py; vllm 0.32 v1/worker/gpu_model_runner.py
# _get_eagle3_aux_layers_from_config). tests/sglang_real/ and tests/vllm_real/ run those functions on an
# exported config.
READ_FROM = {
    "sglang": ("eagle_config.eagle_aux_hidden_state_layer_ids",),
    "vllm": ("eagle_aux_hidden_state_layer_ids", "eagle_config.eagle_aux_hidden_state_layer_ids"),
}


def ids_read_by(config: dict, engine: str) -> tuple[str, list[int]] | None:
    """(the key, the ids) `engine` reads from a drafter's config.json, or None where it finds none."""
    for key in READ_FROM[engine]:
        value = config
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value:
            return key, list(value)
    return None


def engines_of(config: dict, target_architecture: str, hf_ids: list[int]) -> dict:
    """Per engine, from the written config.json read as that engine reads it: the key, the ids and the HF layers they
    mean to it, and whether those are the trained ones (only then is the engine served)."""
    engines = {}
    for engine in READ_FROM:
        found = ids_read_by(config, engine)
        if found is None:
            engines[engine] = {"served": False, "why": "no aux layer ids where it reads them"}
            continue
        key, ids = found
        layers = hf_layers_read(ids, target_architecture, engine)
        engines[engine] = {"served": layers == hf_ids, "reads": key, "ids": ids, "hf_layers": layers}
        if layers != hf_ids:
            engines[engine]["why"] = f"it would capture HF layers {layers}, not the trained {hf_ids}"
    return engines


def run_export(cfg: RunConfig) -> dict:
    out = cfg.run_dir / DRAFTER_DIR
    checkpoint, meta = best_checkpoint(cfg.run_dir / CHECKPOINTS)
    draft = DraftConfig(**{**meta["draft_config"], "aux_layer_ids": tuple(meta["draft_config"]["aux_layer_ids"])})
    architecture = read_architecture(cfg.target.model_path)
    state = load_checkpoint(checkpoint)["model"]
    names = export_names(draft)
    if set(state) != set(names):
        differing = sorted(set(state) ^ set(names))
        raise RuntimeError(f"{checkpoint}: weights {differing} differ from the export set")
    dtype = getattr(torch, cfg.export.dtype)
    tensors = {exported: state[trained].to(dtype).contiguous() for trained, exported in names.items()}
    tensors["d2t"] = torch.from_numpy(np.load(cfg.run_dir / MAPPING_D2T, allow_pickle=False))
    tensors["t2d"] = torch.from_numpy(np.load(cfg.run_dir / MAPPING_T2D, allow_pickle=False))
    family(architecture)  # refuse a target whose engines' layer-id rules were never read, before writing anything
    config = drafter_config(draft, architecture, cfg.export.dtype)
    engines = engines_of(config, architecture, list(draft.aux_layer_ids))
    report = {
        "checkpoint": str(checkpoint),
        "step": meta["step"],
        "val_acc": meta["val_acc"],
        # the offline acceptance length per k (decoding replayed on the validation split)
        "val_offline": meta["val_offline"],
        "dtype": cfg.export.dtype,
        "engines": engines,
    }

    if out.exists() and json.loads((out / EXPORT_RECORD).read_text()) == report:
        log.info("export: %s already holds step %d", out, meta["step"])
        return report
    with atomic_dir(out) as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / DRAFTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        (tmp / EXPORT_RECORD).write_text(json.dumps(report, indent=2) + "\n")
    offline = ", ".join(f"k={k} {figures['accept_length']:.3f}" for k, figures in (report["val_offline"] or {}).items())
    log.info("export: step %d (offline acceptance length %s) -> %s", meta["step"], offline or "not recorded", out)
    for engine, reading in engines.items():
        if reading["served"]:
            log.info(
                "export: %s reads aux layer ids %s from %s: HF layers %s, as trained",
                engine,
                reading["ids"],
                reading["reads"],
                reading["hf_layers"],
            )
        else:
            log.warning("export: not for %s: %s", engine, reading["why"])
    return report


def aux_layers_of(drafter_dir: Path, config: dict, architecture: str) -> list[int]:
    """The HF layers an exported drafter was trained on, as the first engine its export.json serves reads them from
    its config.json."""
    engines = json.loads((drafter_dir / EXPORT_RECORD).read_text())["engines"]
    engine = next(name for name, reading in engines.items() if reading["served"])
    found = ids_read_by(config, engine)
    if found is None:
        raise LayerIdError(f"{drafter_dir}/config.json: no aux layer ids where {engine} reads them; export it again")
    return hf_layers_read(found[1], architecture, engine)


def load_exported_drafter(drafter_dir: str | Path, target_model_path: str | Path):
    """The drafter as SGLang would see it: from the export alone, plus the target's embedding.

    Returns (Eagle3Draft in fp32, draft-to-target id map)."""
    drafter_dir = Path(drafter_dir)
    config = json.loads((drafter_dir / DRAFTER_CONFIG).read_text())
    architecture = read_architecture(target_model_path)
    draft = DraftConfig(
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        rms_norm_eps=config["rms_norm_eps"],
        rope_theta=config["rope_theta"],
        max_position_embeddings=config["max_position_embeddings"],
        target_vocab_size=config["vocab_size"],
        rope_scaling=target_rope(config)[1],  # as the engines read it from this config.json
        draft_vocab_size=config["draft_vocab_size"],
        aux_layer_ids=tuple(aux_layers_of(drafter_dir, config, architecture)),
        fc_norm=bool(config.get("fc_norm", False)),
        norm_output=bool(config.get("norm_output", False)),
    )
    model = Eagle3Draft(draft)
    exported = load_file(str(drafter_dir / WEIGHTS))
    d2t = exported.pop("d2t")
    exported.pop("t2d")
    weights = {trained: exported.pop(name) for trained, name in export_names(draft).items() if name in exported}
    weights.update(exported)  # (anything left over fails load_state_dict below, by name)
    weights["embed_tokens.weight"] = load_target_tensor(target_model_path, EMBED_KEYS)
    model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=True)
    return model.eval(), d2t + torch.arange(len(d2t))
