"""Files inside a run directory that more than one stage reads. Light: no torch, so `lineage check` is quick."""

from __future__ import annotations

from pathlib import Path


def run_samples_path(run_dir: Path, shard: int) -> Path:
    """The sample ids one run's extract shard stored (or found stored), one per line: the run's part of a
    shared store. Written when the shard is complete, so its presence means done."""
    return Path(run_dir) / "extract" / f"shard-{shard:05d}.samples"


def run_stats_path(run_dir: Path, shard: int) -> Path:
    return Path(run_dir) / "extract" / f"shard-{shard:05d}.stats.json"
