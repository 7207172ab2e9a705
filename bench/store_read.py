"""Benchmark: can training read the store as fast as the disk gives the bytes?

    python bench/store_read.py                 a synthetic store with real-sized samples (see below)
    python bench/store_read.py STORE_DIR       any store, e.g. the one bench/extract_throughput.py wrote

Per-sample costs (Python objects, views) are fixed, so the ratio depends on sample size: the synthetic
store has hidden size 2048 and 1024-3072-token samples (the seed's real run averaged 2,353 tokens per
sample), about 700 MiB, written with the real ShardWriter.

Baseline: a plain sequential read of the same chunk files (8 MiB reads). Measured, cold and warm cache,
each the median of REPEATS runs, every byte really read into memory:
  shard iteration   HiddenStateStore.iter_shard, each tensor copied out of the mmap  (goal >= 0.90)
  random access     store[sample_id] for every sample, shuffled, likewise
Cold = each file evicted from the page cache first (posix_fadvise DONTNEED, no root needed); warm = read
once before timing. Prints figures; asserts nothing.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from eagle3.data.store import HiddenStateStore  # imported before any timing: it brings in torch

REPO = Path(__file__).resolve().parents[1]
SYNTHETIC_STORE = REPO / "bench-work" / "synthetic-store"
BLOCK = 8 << 20
REPEATS = 5  # each figure is the median of this many runs


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
    """iter_shard yields mmap views; copying them out (as collating a batch does) reads the bytes."""
    store = HiddenStateStore(store_dir)
    total = sum(
        t.clone().nbytes for shard in store.chunks for _, sample in store.iter_shard(shard) for t in sample.values()
    )
    store.close()  # unmap, so that the next measurement's eviction really empties the cache
    return total


def random_access(store_dir: Path) -> int:
    """store[id] gives mmap views; copying them out is what reads the bytes."""
    store = HiddenStateStore(store_dir)
    ids = store.sample_ids
    random.Random(0).shuffle(ids)
    total = sum(t.clone().nbytes for sample_id in ids for t in store[sample_id].values())
    store.close()
    return total


def timed(fn, arg) -> tuple[int, float]:
    started = time.monotonic()
    nbytes = fn(arg)
    return nbytes, time.monotonic() - started


def synthetic_store(store_dir: Path, hidden_size: int = 2048, samples: int = 20) -> Path:
    from eagle3.capture import CapturedStates
    from eagle3.data.samples import TokenizedSample
    from eagle3.data.store import ShardWriter, StoreMeta

    if (store_dir / "shard-00000" / "manifest.jsonl").exists():
        return store_dir
    rng = random.Random(0)
    writer = ShardWriter(store_dir, 0, StoreMeta(hidden_size, (1, 2, 3)), chunk_bytes=256 << 20)
    for i in range(samples):
        n = rng.randint(1024, 3072)
        sample = TokenizedSample(f"{i:016x}", [rng.randrange(1000) for _ in range(n)], [1] * n, False)
        states = CapturedStates(torch.randn(n, 3 * hidden_size), torch.randn(n, hidden_size))
        writer.add_batch([sample], [states])
    writer.close()
    return store_dir


def main() -> None:
    store_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else synthetic_store(SYNTHETIC_STORE)
    files = chunk_files(store_dir)
    if not files:
        sys.exit(f"{store_dir}: no chunks; is it a store directory (RUN_DIR/hidden_states)?")
    file_bytes = sum(p.stat().st_size for p in files)
    figures = {"store": str(store_dir), "chunk_files": len(files), "file_MiB": round(file_bytes / 2**20, 1)}
    for cache in ("cold", "warm"):
        rates = {}
        for name, fn, arg in (
            ("sequential", sequential_read, files),
            ("shard_iteration", shard_iteration, store_dir),
            ("random_access", random_access, store_dir),
        ):
            runs = []
            for _ in range(REPEATS):
                if cache == "cold":
                    evict(files)
                else:
                    sequential_read(files)
                nbytes, seconds = timed(fn, arg)
                runs.append(nbytes / seconds)
            rates[name] = statistics.median(runs)
            figures[f"{cache}_{name}_MB_per_s"] = round(rates[name] / 1e6, 1)
        figures[f"{cache}_shard_iteration_ratio"] = round(rates["shard_iteration"] / rates["sequential"], 3)
        figures[f"{cache}_random_access_ratio"] = round(rates["random_access"] / rates["sequential"], 3)
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
