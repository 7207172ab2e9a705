"""Benchmark: can training read the store as fast as the disk gives the bytes?

    python bench/store_read.py [STORE_DIR]     (default: the store bench/extract_throughput.py wrote)

Baseline: a plain sequential read of the same chunk files (8 MiB reads). Measured, cold and warm cache:
  shard iteration   HiddenStateStore.iter_shard, every tensor materialised     (goal >= 0.90 of baseline)
  random access     store[sample_id] for every sample, in shuffled order
Cold = each file evicted from the page cache first (posix_fadvise DONTNEED, no root needed); warm = read
once before timing. Prints figures; asserts nothing.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_STORE = REPO / "bench-work" / "runs" / "bench-extract" / "hidden_states"
BLOCK = 8 << 20


def chunk_files(store_dir: Path) -> list[Path]:
    return sorted(store_dir.glob("shard-*/chunk-*.safetensors"))


def evict(files: list[Path]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequential_read(files: list[Path]) -> int:
    buffer = bytearray(BLOCK)
    total = 0
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return total


def shard_iteration(store_dir: Path) -> int:
    from eagle3.store import HiddenStateStore

    store = HiddenStateStore(store_dir)
    total = 0
    for shard in store.chunks:
        for _, sample in store.iter_shard(shard):
            total += sum(t.numel() * t.element_size() for t in sample.values())
    return total


def random_access(store_dir: Path) -> int:
    from eagle3.store import HiddenStateStore

    store = HiddenStateStore(store_dir)
    ids = store.sample_ids
    random.Random(0).shuffle(ids)
    total = 0
    for sample_id in ids:
        total += sum(t.numel() * t.element_size() for t in store[sample_id].values())
    return total


def timed(fn, arg) -> tuple[int, float]:
    started = time.monotonic()
    nbytes = fn(arg)
    return nbytes, time.monotonic() - started


def main() -> None:
    store_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_STORE
    files = chunk_files(store_dir)
    if not files:
        sys.exit(f"{store_dir}: no chunks; run bench/extract_throughput.py first or pass a store directory")
    file_bytes = sum(p.stat().st_size for p in files)
    figures = {"store": str(store_dir), "chunk_files": len(files), "file_MiB": round(file_bytes / 2**20, 1)}
    for cache in ("cold", "warm"):
        rates = {}
        for name, fn, arg in (("sequential", sequential_read, files), ("shard_iteration", shard_iteration, store_dir),
                              ("random_access", random_access, store_dir)):
            if cache == "cold":
                evict(files)
            else:
                sequential_read(files)
            nbytes, seconds = timed(fn, arg)
            rates[name] = nbytes / seconds
            figures[f"{cache}_{name}_MB_per_s"] = round(rates[name] / 1e6, 1)
        figures[f"{cache}_shard_iteration_ratio"] = round(rates["shard_iteration"] / rates["sequential"], 3)
        figures[f"{cache}_random_access_ratio"] = round(rates["random_access"] / rates["sequential"], 3)
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
