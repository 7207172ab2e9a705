"""States a first capture pass computed, kept on disk until the second pass stores them with the rest.

The sglang backend captures in two passes with one engine at a time (see eagle3/capture/sglang.py): the
final-state pass stages every sample's last_hidden_state [T, H] here, one part per batch, then the aux
pass joins them with the aux states it captures and hands whole samples to the store. Staging is a
quarter of the store's size (H of the 4H state columns), at its largest when the first pass ends; the
aux pass deletes each part once the store holds its batch, so staging and store together never need
more than the finished store (at a fraction f of the aux pass: 0.25 (1 - f) + f <= 1). extract deletes
whatever is left once the shard is complete.

  {run dir}/capture-staging/shard-00000/
    part-000000.safetensors    last_hidden_state bf16 [N, H], the batch's samples one after another;
                               metadata: {"sample_ids": JSON list, "lengths": JSON list (tokens each)}

Every part is written to a temporary name, fsynced and renamed, so a part that exists is complete: the
rename is the commit, and no manifest is needed (parts are independent and never rewritten). Opening
deletes temporary leftovers of a crash.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3.data.store import STATE_DTYPE
from eagle3.disk.fsutil import commit, fsync_dir, is_tmp_leftover, tmp_path_for


def staging_dir(run_dir: Path, shard: int) -> Path:
    return Path(run_dir) / "capture-staging" / f"shard-{shard:05d}"


class StagedStates:
    """One shard's staged final states: add a batch, look one up by sample."""

    def __init__(self, directory: Path, hidden_size: int):
        self.dir = Path(directory)
        self.hidden_size = hidden_size
        self.dir.mkdir(parents=True, exist_ok=True)
        for path in self.dir.iterdir():
            if is_tmp_leftover(path):
                path.unlink()
        self._where: dict[str, tuple[Path, int, int]] = {}  # sample id -> (part, first row, end row)
        self._parts: dict[Path, list[str]] = {}  # part -> its sample ids, oldest part first
        self.next_part = 0  # parts are numbered in the order they were staged; no name is taken twice
        for part in sorted(self.dir.glob("part-*.safetensors")):
            with safe_open(str(part), framework="pt") as f:
                meta = f.metadata()
            self._index(part, json.loads(meta["sample_ids"]), json.loads(meta["lengths"]))
            self.next_part = int(part.name.split("-")[1].split(".")[0]) + 1
        self._open: tuple[Path, object] | None = None  # the part read last: the aux pass reads them in order

    def _index(self, part: Path, sample_ids: list[str], lengths: list[int]) -> None:
        self._parts[part] = list(sample_ids)
        start = 0
        for sample_id, n in zip(sample_ids, lengths, strict=True):
            self._where[sample_id] = (part, start, start + n)
            start += n

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self._where

    def __len__(self) -> int:
        return len(self._where)

    def add(self, samples, states: list[torch.Tensor]) -> None:
        """Stage one batch as one part: samples in order, state i is [len(samples[i].input_ids), H]."""
        for sample, state in zip(samples, states, strict=True):
            if state.shape != (len(sample.input_ids), self.hidden_size):
                raise ValueError(
                    f"sample {sample.sample_id}: staged state {tuple(state.shape)} does not match "
                    f"{len(sample.input_ids)} tokens x hidden_size {self.hidden_size}"
                )
        ids = [s.sample_id for s in samples]
        lengths = [len(s.input_ids) for s in samples]
        final = self.dir / f"part-{self.next_part:06d}.safetensors"
        tmp = tmp_path_for(final)
        try:
            save_file(
                {"last_hidden_state": torch.cat([s.to(STATE_DTYPE) for s in states])},
                str(tmp),
                metadata={"sample_ids": json.dumps(ids), "lengths": json.dumps(lengths)},
            )
            commit(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self.next_part += 1
        self._index(final, ids, lengths)

    def get(self, sample) -> torch.Tensor:
        """The staged [T, H] state of `sample`, copied out of the file (bf16)."""
        try:
            part, start, end = self._where[sample.sample_id]
        except KeyError:
            raise RuntimeError(
                f"{self.dir}: no staged final state for sample {sample.sample_id}; the final-state "
                "pass must run over every sample before the aux pass"
            ) from None
        if end - start != len(sample.input_ids):
            raise RuntimeError(
                f"{self.dir}: staged state of sample {sample.sample_id} has {end - start} rows for a "
                f"{len(sample.input_ids)}-token sample; delete {self.dir} and run extract again"
            )
        if self._open is None or self._open[0] != part:
            self._open = (part, safe_open(str(part), framework="pt"))
        return self._open[1].get_slice("last_hidden_state")[start:end].clone()

    def discard_stored(self, is_stored) -> int:
        """Delete the oldest parts whose every sample `is_stored` (the store has committed it), up to the
        first part that still has one to store: the aux pass stores batches in the order they were
        staged. Returns how many parts went."""
        gone = 0
        for part, sample_ids in list(self._parts.items()):
            if not all(is_stored(sample_id) for sample_id in sample_ids):
                break
            if self._open is not None and self._open[0] == part:
                self._open = None
            part.unlink()
            del self._parts[part]
            for sample_id in sample_ids:
                self._where.pop(sample_id, None)
            gone += 1
        return gone


def discard_staging(run_dir: Path, shard: int) -> None:
    """Delete a shard's staged states (once the store holds them all); nothing to do without any."""
    directory = staging_dir(run_dir, shard)
    if directory.exists():
        shutil.rmtree(directory)
        fsync_dir(directory.parent)
