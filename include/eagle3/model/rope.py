"""The drafter's rotary position embedding, and the target's RoPE scaling it carries.

The drafter is served as a Llama layer (SGLang's and vLLM's LlamaForCausalLMEagle3), whose rotary embedding takes
rope_theta and rope_scaling from the drafter's config.json. A long-context target scales its RoPE (Kimi-K2: YaRN,
factor 32 over 4096 positions, served to 131,072; Kimi-K2.5 by YaRN too): a drafter trained without that scaling,
and served with it or without it, sees other rotations than the target's context positions mean. So the drafter
carries the target's scaling by default (drafter.rope_scaling "target"): trained with the same frequencies the
engines will compute from the exported config.json, and exported with it. Supported are the scalings computed here
exactly as both engines' Llama path computes them (sglang 0.5.23 srt/layers/rotary_embedding, vllm 0.32
model_executor/layers/rotary_embedding; tests/test_rope.py runs both engines' own code on an exported config):
  default   inv_freq = theta^(-2i/d)
  linear    positions / factor
  yarn      YaRN: low frequencies interpolated by `factor`, high ones kept, a linear ramp between the dimensions
            that rotate beta_fast and beta_slow times over original_max_position_embeddings (rounded outward), and
            cos/sin scaled by mscale: 0.1 ln(factor) + 1, or with mscale and mscale_all_dim given (DeepSeek's and
            Kimi's configs) the ratio of the two such terms (1.0 for Kimi-K2's)
Anything else (llama3, longrope, dynamic, deepseek_yarn ...) is refused at init, naming drafter.rope_scaling: set it
to "none" to train and serve the drafter without scaling, knowingly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# The keys of a scaling the engines read for the supported types (others are dropped from the export).
YARN_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attn_factor",
    "truncate",
)


def exported_scaling(scaling: dict | None) -> dict | None:
    """The scaling as the drafter's config.json states it (legacy `rope_scaling`, which both engines read, through
    transformers 5's rope_parameters as well)."""
    if scaling is None:
        return None
    keys = YARN_KEYS if scaling["type"] == "yarn" else ("factor",)
    return {"type": scaling["type"], **{k: scaling[k] for k in keys if k in scaling}}


@dataclass(frozen=True)
class Rotary:
    """The drafter's RoPE: theta, and the scaling (None, or {"type", parameters}) it carries."""

    theta: float
    scaling: dict | None = None

    def frequencies(self, dim: int) -> tuple[torch.Tensor, float]:
        """(inv_freq [dim/2], the magnitude cos and sin are scaled by)."""
        base = self.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        kind = (self.scaling or {}).get("type", "default")
        if kind == "default":
            return 1.0 / base, 1.0
        factor = float(self.scaling["factor"])
        if kind == "linear":
            return 1.0 / (factor * base), 1.0
        return self._yarn(base, dim, factor)

    def _yarn(self, base: torch.Tensor, dim: int, factor: float) -> tuple[torch.Tensor, float]:
        s = self.scaling
        original = s["original_max_position_embeddings"]

        def rotations_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low, high = rotations_dim(s.get("beta_fast", 32)), rotations_dim(s.get("beta_slow", 1))
        if s.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # 1: a high frequency, kept (extrapolated); 0: a low one, interpolated
        inv_freq = (1.0 / (factor * base)) * (1 - keep) + (1.0 / base) * keep

        def magnitude(m: float = 1.0) -> float:
            return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

        if s.get("mscale") is not None and s.get("mscale_all_dim") is not None:
            scale = magnitude(s["mscale"]) / magnitude(s["mscale_all_dim"])
        else:
            scale = magnitude()
        return inv_freq, scale * float(s.get("attn_factor", 1.0))

    def cos_sin(self, positions: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [*positions.shape, dim] in the rotate-half layout (neox style, as the Llama models use)."""
        inv_freq, scale = self.frequencies(dim)
        angles = positions.float()[..., None] * inv_freq.to(positions.device)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos() * scale, angles.sin() * scale


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotary: Rotary):
    """Rotate q, k: [B, heads, T, d] at positions [B, T]."""
    cos, sin = rotary.cos_sin(positions, q.shape[-1])
    cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, d]
    rotated = [(x.float() * cos + rotate_half(x.float()) * sin).to(x.dtype) for x in (q, k)]
    return rotated[0], rotated[1]
