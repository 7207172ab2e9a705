"""Run in the vLLM environment by tests/test_rope.py: the rotary embedding vLLM's Llama layer (what serves an EAGLE-3
drafter) builds from a drafter's config.json, read by vLLM's own config loader and made by its get_rope as
model_executor/models/llama.py calls it. Reads {"configs": [drafter dirs], "positions": [...]} on stdin; prints, per
drafter, its cos and sin at those positions as JSON."""

import json
import sys

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.transformers_utils.config import get_config

request = json.load(sys.stdin)
positions = torch.tensor(request["positions"])
out = []
for directory in request["configs"]:
    config = get_config(directory, trust_remote_code=False)
    with set_current_vllm_config(VllmConfig()):  # vLLM's custom ops are made inside a config's scope
        rope = get_rope(
            config.head_dim,
            max_position=config.max_position_embeddings,
            is_neox_style=True,
            rope_parameters=getattr(config, "rope_parameters", None),
            dtype=torch.float32,
        )
    cos, sin = rope.cos_sin_cache[positions].float().chunk(2, dim=-1)
    out.append({"type": type(rope).__name__, "cos": cos.tolist(), "sin": sin.tolist()})
print(json.dumps(out))
