"""Run in the real-sglang environment by tests/test_rope.py: the rotary embedding SGLang's Llama layer (what serves an
EAGLE-3 drafter) builds from a drafter's config.json, as srt/models/llama.py reads it (rope_parameters, else
rope_theta and rope_scaling) and srt/layers/rotary_embedding's get_rope makes it. Reads {"configs": [drafter dirs],
"positions": [...]} on stdin; prints, per drafter, its cos and sin at those positions as JSON.

On a machine without CUDA, SGLang's RotaryEmbedding takes its apply kernel from vllm._custom_ops, which is not in this
environment: a stand-in module gives it a name to hold. The kernel only applies the rotation; the cos/sin cache this
reads is computed before, by SGLang's own code."""

import json
import sys
import types

import torch

sys.modules.setdefault("vllm", types.ModuleType("vllm"))
sys.modules.setdefault("vllm._custom_ops", types.SimpleNamespace(rotary_embedding=None))

from sglang.srt.layers.rotary_embedding import get_rope  # noqa: E402
from transformers import AutoConfig  # noqa: E402

request = json.load(sys.stdin)
positions = torch.tensor(request["positions"])
out = []
for directory in request["configs"]:
    config = AutoConfig.from_pretrained(directory)
    rope_parameters = getattr(config, "rope_parameters", None)
    if rope_parameters is not None:
        theta, scaling = rope_parameters.get("rope_theta", 10000), dict(rope_parameters)
    else:
        theta, scaling = getattr(config, "rope_theta", 10000), getattr(config, "rope_scaling", None)
    rope = get_rope(
        config.head_dim,
        rotary_dim=config.head_dim,
        max_position=config.max_position_embeddings,
        base=theta,
        rope_scaling=scaling,
        is_neox_style=True,
        dtype=torch.float32,
    )
    cos, sin = rope.cos_sin_cache[positions].float().chunk(2, dim=-1)
    out.append({"type": type(rope).__name__, "cos": cos.tolist(), "sin": sin.tolist()})
print(json.dumps(out))
