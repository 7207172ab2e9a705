"""What every capture backend hands back, and the check of the GPUs a shard may use (eagle3.capture says how the
backends are used)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3.config import ConfigError


@dataclass
class CapturedStates:
    aux_hidden_states: torch.Tensor
    last_hidden_state: torch.Tensor | None  # None only for a sample the store already holds


def check_gpu_group(gpu_group: int, gpus_per_group: int, gpus: int) -> None:
    """Refuse a shard whose GPU group (its number on the box x GPUs per shard) the box does not have."""
    if (gpu_group + 1) * gpus_per_group > gpus:
        raise ConfigError(
            "extract.num_shards",
            f"this shard is number {gpu_group} on its box and needs GPUs {gpu_group * gpus_per_group}.."
            f"{(gpu_group + 1) * gpus_per_group - 1}, but the box has {gpus}",
            "lower extract.num_shards (shards per box x GPUs per shard must fit) or add boxes",
        )
