"""Training checkpoints: plain dicts on disk, saved whole or not at all, listed, loaded, the best one picked.

    RUN_DIR/train/checkpoints/step-NNNNNN/
      state.pt    {"model", "optimizer", "scheduler", "rng", "step", "best"}: torch.save, read back with
                  weights_only=True (tensors and plain containers only)
      meta.json   step, total_steps, world_size, the validation figures, the drafter's config

A checkpoint is written to a temporary directory, fsynced and renamed (eagle3.disk.fsutil.atomic_dir): a directory named
step-* is complete. Resuming is the fresh start's code path with these values loaded (eagle3.stages.train).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from eagle3.disk.fsutil import atomic_dir

STATE, META = "state.pt", "meta.json"
# The meta figure the best checkpoint is picked by: the offline acceptance length at evaluate.draft_lengths[0]
# (eagle3.stages.train.Trainer.validate).
BEST_BY = "val_offline_accept_length"


def checkpoint_dirs(root: Path) -> list[Path]:
    """The complete checkpoints under `root`, oldest step first."""
    return sorted(p for p in Path(root).glob("step-*") if p.is_dir())


def save_checkpoint(root: Path, state: dict, meta: dict, keep_last: int, best_step: int | None) -> Path:
    """Write step-<state["step"]>, then drop all but the newest `keep_last` and the best."""
    final = Path(root) / f"step-{state['step']:06d}"
    with atomic_dir(final) as tmp:
        torch.save(state, tmp / STATE)
        (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")
    keep = {p.name for p in checkpoint_dirs(root)[-keep_last:]}
    if best_step is not None:
        keep.add(f"step-{best_step:06d}")
    for path in checkpoint_dirs(root):
        if path.name not in keep:
            shutil.rmtree(path)
    return final


def load_checkpoint(path: Path) -> dict:
    return torch.load(Path(path) / STATE, weights_only=True, map_location="cpu")


def read_meta(path: Path) -> dict:
    return json.loads((Path(path) / META).read_text())


def best_checkpoint(root: Path) -> tuple[Path, dict]:
    """(directory, meta) of the kept checkpoint with the highest BEST_BY (the later step on a tie)."""
    candidates = [(p, read_meta(p)) for p in checkpoint_dirs(root)]
    if not candidates:
        raise FileNotFoundError(f"{root}: no checkpoint; run the train stage first")
    return max(candidates, key=lambda c: (c[1][BEST_BY], c[1]["step"]))
