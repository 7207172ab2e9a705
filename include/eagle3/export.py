"""Export the best checkpoint as a drafter SGLang loads with --speculative-algorithm EAGLE3.

    python -m eagle3 export --config RUN_DIR/config.json

Writes {run dir}/drafter/ (temp dir, fsync, rename):
  config.json         LlamaForCausalLMEagle3: one layer, vocab_size = the target's, draft_vocab_size, the
                      drafter's shape, eagle_config.eagle_aux_hidden_state_layer_ids in the ids SGLang
                      expects for the TARGET's family (eagle3.layer_ids), use_aux_hidden_state
  model.safetensors   exactly EXPORT_KEYS + d2t (int64 offsets) + t2d (bool). No embed_tokens: SGLang
                      takes the target's. SGLang ignores unknown keys silently, so tests pin this set.
  export.json         which checkpoint, its validation figures
Serve it:
  python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 \\
      --speculative-draft-model-path RUN_DIR/drafter --speculative-num-steps 3 \\
      --speculative-eagle-topk 1 --speculative-num-draft-tokens 4
(EAGLE, not EAGLE3, loads it too and silently gives accept length 1.)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from eagle3.fsutil import atomic_dir
from eagle3.layer_ids import sglang_layer_ids
from eagle3.model import DraftConfig
from eagle3.train import checkpoint_dirs, load_checkpoint

log = logging.getLogger(__name__)

DRAFTER_DIR = "drafter"
EXPORT_KEYS = (
    "fc.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
    "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight",
    "norm.weight", "lm_head.weight",
)


def best_checkpoint(run_dir: Path) -> tuple[Path, dict]:
    """The kept checkpoint with the highest simulated acceptance length on the validation split."""
    root = run_dir / "train" / "checkpoints"
    candidates = [(p, json.loads((p / "meta.json").read_text())) for p in checkpoint_dirs(root)]
    if not candidates:
        raise FileNotFoundError(f"{run_dir}/train/checkpoints: no checkpoint; run the train stage first")
    return max(candidates, key=lambda c: (c[1]["val_accept_length"], c[1]["step"]))


def sglang_config(draft: DraftConfig, target_architecture: str, dtype: str) -> dict:
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
        "max_position_embeddings": draft.max_position_embeddings,
        "vocab_size": draft.target_vocab_size,
        "draft_vocab_size": draft.draft_vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": sglang_layer_ids(list(draft.aux_layer_ids), target_architecture),
            "use_aux_hidden_state": True,
        },
    }


def run_export(cfg) -> dict:
    from eagle3.vocab import MAPPING_DIR

    out = cfg.run_dir / DRAFTER_DIR
    checkpoint, meta = best_checkpoint(cfg.run_dir)
    draft = DraftConfig(**{**meta["draft_config"], "aux_layer_ids": tuple(meta["draft_config"]["aux_layer_ids"])})
    architecture = json.loads((Path(cfg.target.model_path) / "config.json").read_text())["architectures"][0]
    state = load_checkpoint(checkpoint)["model"]
    if set(state) != set(EXPORT_KEYS):
        differing = sorted(set(state) ^ set(EXPORT_KEYS))
        raise RuntimeError(f"{checkpoint}: weights {differing} differ from the export set")
    dtype = getattr(torch, cfg.export.dtype)
    tensors = {key: state[key].to(dtype).contiguous() for key in EXPORT_KEYS}
    mapping = cfg.run_dir / MAPPING_DIR
    tensors["d2t"] = torch.from_numpy(np.load(mapping / "d2t.npy", allow_pickle=False))
    tensors["t2d"] = torch.from_numpy(np.load(mapping / "t2d.npy", allow_pickle=False))
    report = {"checkpoint": str(checkpoint), "step": meta["step"], "val_acc": meta["val_acc"],
              "val_accept_length": meta["val_accept_length"], "dtype": cfg.export.dtype}

    if out.exists() and json.loads((out / "export.json").read_text()) == report:
        log.info("export: %s already holds step %d", out, meta["step"])
        return report
    with atomic_dir(out) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = sglang_config(draft, architecture, cfg.export.dtype)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "export.json").write_text(json.dumps(report, indent=2) + "\n")
    log.info("export: step %d (simulated accept length %.3f) -> %s", meta["step"], meta["val_accept_length"], out)
    return report


def load_exported_drafter(drafter_dir: str | Path, target_model_path: str | Path):
    """The drafter as SGLang would see it: from the export alone, plus the target's embedding.

    Returns (Eagle3Draft in fp32, draft-to-target id map)."""
    from safetensors.torch import load_file

    from eagle3.layer_ids import hf_layer_ids_from_sglang
    from eagle3.model import EMBED_KEYS, Eagle3Draft, load_target_tensor

    drafter_dir = Path(drafter_dir)
    config = json.loads((drafter_dir / "config.json").read_text())
    architecture = json.loads((Path(target_model_path) / "config.json").read_text())["architectures"][0]
    draft = DraftConfig(
        hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"], num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"], rms_norm_eps=config["rms_norm_eps"], rope_theta=config["rope_theta"],
        max_position_embeddings=config["max_position_embeddings"], target_vocab_size=config["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"],
        aux_layer_ids=tuple(hf_layer_ids_from_sglang(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
                                                     architecture)),
    )
    model = Eagle3Draft(draft)
    weights = load_file(str(drafter_dir / "model.safetensors"))
    d2t = weights.pop("d2t")
    weights.pop("t2d")
    weights["embed_tokens.weight"] = load_target_tensor(target_model_path, EMBED_KEYS)
    model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=True)
    return model.eval(), d2t + torch.arange(len(d2t))
