"""Hidden-state store: the target's EAGLE-3 hidden states on disk, crash-safe and resumable.

On-disk contract (one store per run, {run dir}/hidden_states/):

  store.json                      written once: format, hidden_size, aux_layers, dtype
  shard-00000/
    manifest.jsonl                append-only journal, fsynced line by line; the ONLY record of what exists.
                                  One line per commit: a chunk and the samples rejected since the last one
                                    {"chunk": "chunk-000000.safetensors" | null, "bytes": 123,
                                     "samples": [["<id>", 812], ...], "rejected": [["<id>", "non-finite hidden state"]]}
    chunk-000000.safetensors      whole samples, no padding:
                                    input_ids          int32 [N]
                                    loss_mask          uint8 [N]
                                    aux_hidden_states  bf16  [N, 3H]   (aux layers low|mid|high, HF ids)
                                    last_hidden_state  bf16  [N, H]    (final post-norm state, lm_head input)
                                    offsets            int64 [S+1]     sample s is rows offsets[s]:offsets[s+1]
                                  metadata: {"format": ..., "sample_ids": JSON list}

A chunk is written to a temporary name, fsynced, renamed, and only then recorded in the manifest (fsynced).
A chunk not in the manifest does not exist: opening a shard for writing deletes such leftovers and a
torn last manifest line. Samples whose states are not finite are rejected, recorded, and counted, so a
resumed run neither loses them silently nor computes them again. Readers mmap (safetensors) and never
modify anything.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3.fsutil import append_line_durably, atomic_write_text, commit, fsync_dir, is_tmp_leftover, tmp_path_for
from eagle3.progress import format_bytes

STORE_FORMAT = "eagle3-hidden-states/1"
STATE_DTYPE = torch.bfloat16
MAX_OPEN_CHUNKS = 64
TENSOR_NAMES = ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state", "offsets")


class StoreError(RuntimeError):
    """A store that is inconsistent or does not match the run; the message names the file."""


@dataclass(frozen=True)
class StoreMeta:
    hidden_size: int
    aux_layers: tuple[int, ...]

    def to_json(self) -> str:
        return json.dumps(
            {"format": STORE_FORMAT, "hidden_size": self.hidden_size, "aux_layers": list(self.aux_layers),
             "dtype": "bfloat16"},
            indent=2,
        ) + "\n"

    @property
    def bytes_per_token(self) -> int:
        """Payload bytes of one token: aux + last states in bf16, an int32 id, a uint8 mask."""
        return (len(self.aux_layers) + 1) * self.hidden_size * 2 + 4 + 1


def all_finite(tensor: torch.Tensor) -> bool:
    """True if no element is NaN or inf. Fast path: a finite fp32 sum proves it (NaN and inf propagate
    through a sum), in one pass without a bool tensor; only a non-finite sum (NaN/inf, or a rare
    overflow) pays for the exact check."""
    return bool(torch.isfinite(tensor.sum(dtype=torch.float32))) or bool(torch.isfinite(tensor).all())


def is_disk_full(err: BaseException) -> bool:
    """ENOSPC, whether as an OSError or inside safetensors' own error (it reports Rust's StorageFull)."""
    return (isinstance(err, OSError) and err.errno == errno.ENOSPC) or "No space left on device" in str(err)


def shard_dir(store_dir: Path, shard: int) -> Path:
    return Path(store_dir) / f"shard-{shard:05d}"


def chunk_name(index: int) -> str:
    return f"chunk-{index:06d}.safetensors"


def is_count(value: object) -> bool:
    """A non-negative integer as JSON gives it; True and False are ints to Python but not counts here."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shown(value: object, limit: int = 60) -> str:
    """A value for an error message: its repr, cut short (a hostile file may hold a megabyte in one field)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_meta(store_dir: Path) -> StoreMeta:
    path = Path(store_dir) / "store.json"
    fix = f"delete the store directory {store_dir} and run extract again"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StoreError(f"{path}: missing; {store_dir} is not a hidden-state store (nothing extracted yet?)") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise StoreError(f"{path}: not JSON, so the store's shapes are unknown; {fix}") from None
    if not isinstance(raw, dict) or raw.get("format") != STORE_FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else raw
        raise StoreError(f"{path}: format {_shown(found)}, expected {STORE_FORMAT!r}")
    hidden_size, aux_layers = raw.get("hidden_size"), raw.get("aux_layers")
    if not is_count(hidden_size) or hidden_size == 0:
        raise StoreError(f"{path}: hidden_size is {_shown(hidden_size)}, not a positive integer; {fix}")
    if not isinstance(aux_layers, list) or not aux_layers or not all(is_count(layer) for layer in aux_layers):
        raise StoreError(f"{path}: aux_layers is {_shown(aux_layers)}, not a list of layer numbers; {fix}")
    return StoreMeta(hidden_size, tuple(aux_layers))


def ensure_meta(store_dir: Path, meta: StoreMeta) -> None:
    """Create store.json, or check that the existing one describes the same states."""
    path = Path(store_dir) / "store.json"
    if not path.exists():
        atomic_write_text(path, meta.to_json())  # several shards may race here: same content, atomic replace
    existing = read_meta(store_dir)
    if existing != meta:
        raise StoreError(
            f"{path}: holds hidden_size={existing.hidden_size} aux_layers={list(existing.aux_layers)}, but this "
            f"run asks for hidden_size={meta.hidden_size} aux_layers={list(meta.aux_layers)}; use a new run_name"
        )


CHUNK_NAME = re.compile(r"chunk-\d{6,}\.safetensors")  # what chunk_name() gives: no path, no "..", no "/"
RECORD_FIELDS = ("chunk", "bytes", "samples", "rejected")
SHARD_NAME = re.compile(r"shard-\d{5,}")  # what shard_dir() gives


def read_manifest(path: Path, meta: StoreMeta | None = None) -> tuple[list[dict], int]:
    """Parse and check a manifest. Returns (records, byte length of the intact part).

    A torn last line (no newline yet: a crash mid-append) is not part of the manifest and is ignored. Every
    other line must be a record the writer could have written (see record_problem; with `meta`, its chunk
    must also be large enough for its tokens): the manifest decides which files are read and how they are
    sliced, so one that was edited or damaged is refused rather than followed out of the store or trusted
    for lengths it cannot back.
    """
    path = Path(path)
    if not path.exists():
        return [], 0
    data = path.read_bytes()
    intact = data[: data.rfind(b"\n") + 1]
    records, chunks = [], set()
    for n, line in enumerate(intact.split(b"\n")[:-1], start=1):
        try:
            record = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise StoreError(_damaged(path, f"line {n} is not JSON")) from None
        problem = record_problem(record, meta) or _escape_problem(path.parent, record["chunk"], chunks)
        if problem:
            raise StoreError(_damaged(path, f"line {n}: {problem}"))
        chunks.add(record["chunk"])
        records.append(record)
    return records, len(intact)


def record_problem(record: object, meta: StoreMeta | None = None) -> str | None:
    """Why a manifest line is not a record ShardWriter.flush writes, or None. Checked: the fields and their
    types, a chunk name that is a plain file name of the shard directory, and non-negative byte and token
    counts (with `meta`: at least the bytes the samples' states take at the store's hidden size)."""
    if not isinstance(record, dict):
        return f"{_shown(record)} is not a JSON object"
    missing = [name for name in RECORD_FIELDS if name not in record]
    if missing:
        return f'the field "{missing[0]}" is missing'
    chunk, size, samples, rejected = (record[name] for name in RECORD_FIELDS)
    if chunk is not None and not (isinstance(chunk, str) and CHUNK_NAME.fullmatch(chunk)):
        return (f'"chunk" is {_shown(chunk)}, not the name of a chunk file in its shard directory '
                "(chunk-NNNNNN.safetensors)")
    if not is_count(size):
        return f'"bytes" is {_shown(size)}, not a non-negative integer'
    for name, pairs, second in (("samples", samples, "token count"), ("rejected", rejected, "reason")):
        if not isinstance(pairs, list):
            return f'"{name}" is {_shown(pairs)}, not a list'
        for i, pair in enumerate(pairs):
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
                return f'"{name}"[{i}] is {_shown(pair)}, not ["<sample id>", <{second}>]'
            if name == "samples" and not is_count(pair[1]):
                return f'"samples"[{i}] ({pair[0]}) has length {_shown(pair[1])}, not a non-negative integer'
            if name == "rejected" and not isinstance(pair[1], str):
                return f'"rejected"[{i}] ({pair[0]}) has reason {_shown(pair[1])}, not a string'
    if chunk is None and samples:
        return '"samples" lists samples but "chunk" is null: a sample is stored only in a chunk'
    if meta is not None and chunk is not None:
        tokens = sum(length for _, length in samples)
        if tokens * meta.bytes_per_token > size:
            return (f'"bytes" is {size}, less than its {tokens} tokens take at hidden_size {meta.hidden_size} with '
                    f"{len(meta.aux_layers)} aux layers ({tokens * meta.bytes_per_token} bytes)")
    return None


def _escape_problem(directory: Path, chunk: str | None, seen: set[str]) -> str | None:
    """A well-formed chunk name that is still not a chunk of this shard: one listed twice (its rows would be
    read for two records), or a symlink whose target lies outside the shard directory."""
    if chunk is None:
        return None
    if chunk in seen:
        return f'"chunk" {chunk} is recorded twice'
    path = directory / chunk
    if path.is_symlink() and Path(os.path.realpath(path)).parent != Path(os.path.realpath(directory)):
        return f'"chunk" {chunk} is a symlink to {os.path.realpath(path)}, outside its shard directory'
    return None


def _damaged(manifest: Path, what: str) -> str:
    return (f"{manifest}: {what}. The manifest was edited or damaged, so this shard's chunks cannot be trusted; "
            f"delete the shard directory {manifest.parent} and run extract again (it recomputes that shard only).")


# -- writing ---------------------------------------------------------------------------------


class ShardWriter:
    """Appends whole samples to one shard; buffers them into chunks of about `chunk_bytes`.

    Opening recovers from a crash (torn manifest line, unrecorded chunk files, temp files) and takes an
    exclusive lock, so two processes can never write the same shard.
    """

    def __init__(self, store_dir: Path, shard: int, meta: StoreMeta, chunk_bytes: int = 256 << 20):
        self.dir = shard_dir(store_dir, shard)
        self.dir.mkdir(parents=True, exist_ok=True)
        ensure_meta(store_dir, meta)
        self.meta = meta
        self.chunk_tokens = max(1, chunk_bytes // meta.bytes_per_token)
        self._lock = self._take_lock()
        self.manifest = self.dir / "manifest.jsonl"
        records = self._recover()
        self.done_ids = {sid for r in records for sid, _ in r.get("samples", ())}
        self.rejected = {sid: reason for r in records for sid, reason in r["rejected"]}
        self.num_chunks = sum(1 for r in records if r["chunk"])
        self._pending: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._pending_rejects: list[tuple[str, str]] = []
        self._pending_tokens = 0
        self.bytes_written = 0

    def _take_lock(self):
        lock = open(self.dir / ".lock", "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise StoreError(f"{self.dir}: another process is writing this shard; wait for it or stop it") from None
        return lock

    def _recover(self) -> list[dict]:
        records, intact = read_manifest(self.manifest, self.meta)
        if self.manifest.exists() and self.manifest.stat().st_size != intact:
            with open(self.manifest, "r+b") as f:  # drop the torn line a crash left mid-append
                f.truncate(intact)
                os.fsync(f.fileno())
        recorded = {r["chunk"] for r in records if r["chunk"]}
        for path in self.dir.iterdir():
            unrecorded_chunk = path.name.startswith("chunk-") and path.name not in recorded
            if unrecorded_chunk or is_tmp_leftover(path):
                path.unlink()
        fsync_dir(self.dir)
        return records

    def is_done(self, sample_id: str) -> bool:
        return sample_id in self.done_ids or sample_id in self.rejected

    def add_batch(self, samples, states) -> int:
        """Queue one capture batch; returns how many samples were rejected as non-finite.

        Chunks are cut only between batches, so after a crash a batch is either wholly recorded or
        wholly recomputed, with the same batch composition and so bit-identical states.
        """
        rejected = 0
        for sample, state in zip(samples, states, strict=True):
            rejected += not self._add(sample.sample_id, sample.input_ids, sample.loss_mask,
                                      state.aux_hidden_states, state.last_hidden_state)
        if self._pending_tokens >= self.chunk_tokens:
            self.flush()
        return rejected

    def _add(self, sample_id, input_ids, loss_mask, aux_hidden_states, last_hidden_state) -> bool:
        if self.is_done(sample_id):
            raise StoreError(f"{self.dir}: sample {sample_id} is already stored")
        aux = aux_hidden_states.to(STATE_DTYPE)
        last = last_hidden_state.to(STATE_DTYPE)
        n, h = len(input_ids), self.meta.hidden_size
        if aux.shape != (n, len(self.meta.aux_layers) * h) or last.shape != (n, h) or len(loss_mask) != n:
            raise StoreError(
                f"sample {sample_id}: shapes ids={n} mask={len(loss_mask)} aux={tuple(aux.shape)} "
                f"last={tuple(last.shape)} do not match hidden_size={h} with {len(self.meta.aux_layers)} aux layers"
            )
        if not (all_finite(aux) and all_finite(last)):
            self._pending_rejects.append((sample_id, "non-finite hidden state"))
            return False
        ids = torch.as_tensor(input_ids, dtype=torch.int32)
        mask = torch.as_tensor(loss_mask, dtype=torch.uint8)
        self._pending.append((sample_id, ids, mask, aux, last))
        self._pending_tokens += n
        return True

    def flush(self) -> None:
        """Commit what is pending: chunk to a temp file, fsync, rename, then ONE manifest line that
        records the chunk and the rejected samples together (a crash keeps both or neither)."""
        if not self._pending and not self._pending_rejects:
            return
        record: dict = {"chunk": None, "bytes": 0, "samples": [], "rejected": [list(r) for r in self._pending_rejects]}
        if self._pending:
            record.update(self._write_chunk())
        try:
            append_line_durably(self.manifest, json.dumps(record))
        except OSError as err:  # the renamed chunk is unrecorded: the next writer removes it on open
            if is_disk_full(err):
                raise StoreError(self._disk_full(len(json.dumps(record)))) from None
            raise
        self.done_ids.update(sid for sid, _ in record["samples"])
        self.rejected.update(dict(self._pending_rejects))
        self._pending.clear()
        self._pending_rejects.clear()
        self._pending_tokens = 0

    def _write_chunk(self) -> dict:
        ids, ids_t, mask_t, aux_t, last_t = zip(*self._pending)
        lengths = [len(t) for t in ids_t]
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(lengths).cumsum(0)
        tensors = {
            "input_ids": torch.cat(ids_t),
            "loss_mask": torch.cat(mask_t),
            "aux_hidden_states": torch.cat(aux_t),
            "last_hidden_state": torch.cat(last_t),
            "offsets": offsets,
        }
        name = chunk_name(self.num_chunks)
        final = self.dir / name
        tmp = tmp_path_for(final)
        try:
            save_file(tensors, str(tmp), metadata={"format": STORE_FORMAT, "sample_ids": json.dumps(ids)})
            commit(tmp, final)
        except Exception as err:
            tmp.unlink(missing_ok=True)  # never leave half a chunk behind, and give the space back
            if is_disk_full(err):
                raise StoreError(self._disk_full(sum(t.numel() * t.element_size() for t in tensors.values()))) from None
            raise
        size = final.stat().st_size
        self.num_chunks += 1
        self.bytes_written += size
        return {"chunk": name, "bytes": size, "samples": [list(p) for p in zip(ids, lengths)]}

    def _disk_full(self, needed_bytes: int) -> str:
        usage = shutil.disk_usage(self.dir)
        return (
            f"{self.dir}: no space left on the device writing {format_bytes(needed_bytes)} "
            f"({format_bytes(usage.free)} free of {format_bytes(usage.total)}). Nothing partial was kept; "
            f"{len(self.done_ids)} samples of this shard are stored. Free space (or pick a workdir with room; "
            "the disk_space sensor estimates the need), then run the stage again: it resumes after them."
        )

    def release(self) -> None:
        """Give up the shard lock (pending samples are not written: call flush first to keep them)."""
        self._lock.close()

    def close(self) -> None:
        self.flush()
        self.release()


# -- reading ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleLocation:
    shard: int
    chunk: str
    row: int  # index of the sample within its chunk
    start: int  # token rows start:end within the chunk
    end: int


class HiddenStateStore:
    """Read-only view of a store: random access by sample id, iteration by shard. Files are mmapped."""

    def __init__(self, store_dir: str | Path):
        self.dir = Path(store_dir)
        self.meta = read_meta(self.dir)
        self.locations: dict[str, SampleLocation] = {}
        self.chunks: dict[int, list[dict]] = {}
        self.rejected: dict[str, str] = {}
        self._handles: dict[tuple[int, str], object] = {}
        self._records: dict[tuple[int, str], dict] = {}
        for sdir in sorted(self.dir.glob("shard-*")):
            if not (SHARD_NAME.fullmatch(sdir.name) and sdir.is_dir()):
                continue  # not a shard: nothing the writer makes is named so (a backup someone made, say)
            shard = int(sdir.name.split("-")[1])
            records, _ = read_manifest(sdir / "manifest.jsonl", self.meta)
            self.chunks[shard] = [r for r in records if r["chunk"]]
            self._records.update({(shard, r["chunk"]): r for r in self.chunks[shard]})
            self.rejected.update({sid: reason for r in records for sid, reason in r["rejected"]})
            for record in self.chunks[shard]:
                start = 0
                for row, (sid, n) in enumerate(record["samples"]):
                    if sid in self.locations:
                        raise StoreError(f"{sdir}: sample {sid} is stored twice ({record['chunk']})")
                    self.locations[sid] = SampleLocation(shard, record["chunk"], row, start, start + n)
                    start += n

    def __len__(self) -> int:
        return len(self.locations)

    @property
    def sample_ids(self) -> list[str]:
        return list(self.locations)

    @property
    def num_tokens(self) -> int:
        return sum(loc.end - loc.start for loc in self.locations.values())

    def _open(self, shard: int, chunk: str):
        """An mmapped handle on a chunk; the most recently used MAX_OPEN_CHUNKS stay open."""
        key = (shard, chunk)
        handle = self._handles.pop(key, None)
        if handle is None:
            handle = self._open_checked(shard_dir(self.dir, shard) / chunk, self._records[key])
            if len(self._handles) >= MAX_OPEN_CHUNKS:
                self._handles.pop(next(iter(self._handles)))
        self._handles[key] = handle  # re-inserted: dict order is recency order
        return handle

    def _open_checked(self, path: Path, record: dict):
        """Open a chunk, checking first what its header can tell cheaply: its size is the manifest's, and its
        tensors have the shapes and dtypes the manifest's sample lengths and the store's hidden size imply,
        with offsets that slice it as the manifest does. Otherwise a sample would be read short, shifted or
        reinterpreted, and a digest or a training run built on it silently. (safetensors itself refuses a
        header whose offsets lie about the file.) verify() checks the contents too."""
        fix = f"delete the shard directory {path.parent} and run extract again (it recomputes that shard only)"
        try:
            size = path.stat().st_size
            handle = safe_open(str(path), framework="pt")
        except FileNotFoundError:
            raise StoreError(f"{path}: in the manifest but missing; {fix}") from None
        except Exception as err:  # noqa: BLE001 - safetensors reports a bad header as its own error type
            raise StoreError(f"{path}: not a readable chunk ({err}); {fix}") from None
        if size != record["bytes"]:
            raise StoreError(f"{path}: {size} bytes, but the manifest records {record['bytes']}; {fix}")
        problem = _header_problem(handle, record, self.meta)
        if problem:
            raise StoreError(f"{path}: {problem}; {fix}")
        return handle

    def close(self) -> None:
        """Drop the open handles (their mmaps go with them)."""
        self._handles.clear()

    def __getitem__(self, sample_id: str) -> dict[str, torch.Tensor]:
        """One sample's tensors as views of the mmapped chunk: the bytes are read when first touched."""
        loc = self.locations[sample_id]
        f = self._open(loc.shard, loc.chunk)
        return {name: f.get_slice(name)[loc.start : loc.end] for name in TENSOR_NAMES[:4]}

    def iter_shard(self, shard: int) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        """Samples of one shard in storage order, as views of the mmapped chunks (read when touched,
        e.g. when a batch is collated). The kernel reads the next chunk ahead meanwhile."""
        records = self.chunks.get(shard, [])
        for i, record in enumerate(records):
            if i + 1 < len(records):
                _read_ahead(shard_dir(self.dir, shard) / records[i + 1]["chunk"])
            f = self._open(shard, record["chunk"])
            tensors = {name: f.get_tensor(name) for name in TENSOR_NAMES}
            offsets = tensors["offsets"].tolist()
            for row, (sid, _) in enumerate(record["samples"]):
                a, b = offsets[row], offsets[row + 1]
                yield sid, {name: tensors[name][a:b] for name in TENSOR_NAMES[:4]}


def _header_problem(handle, record: dict, meta: StoreMeta) -> str | None:
    """How a chunk's tensors disagree with its manifest record and the store's shapes, or None."""
    lengths = [length for _, length in record["samples"]]
    n, h, k = sum(lengths), meta.hidden_size, len(meta.aux_layers)
    expected = {
        "input_ids": ([n], "I32"), "loss_mask": ([n], "U8"), "aux_hidden_states": ([n, k * h], "BF16"),
        "last_hidden_state": ([n, h], "BF16"), "offsets": ([len(lengths) + 1], "I64"),
    }
    names = set(handle.keys())
    if names != set(TENSOR_NAMES):
        return f"holds tensors {sorted(names)}, expected {sorted(TENSOR_NAMES)}"
    for name, (shape, dtype) in expected.items():
        tensor = handle.get_slice(name)
        if list(tensor.get_shape()) != shape or tensor.get_dtype() != dtype:
            return (f"{name} is {tensor.get_dtype()} {list(tensor.get_shape())}, but the manifest's {len(lengths)} "
                    f"samples of {n} tokens at hidden_size {h} with {k} aux layers make it {dtype} {shape}")
    offsets = handle.get_tensor("offsets").tolist()
    if [b - a for a, b in zip(offsets, offsets[1:])] != lengths or offsets[0] != 0:
        return "its offsets disagree with the manifest's sample lengths"
    return None


def _read_ahead(path: Path) -> None:
    """Ask the kernel to start reading a chunk. Only advice: a chunk that cannot be opened is reported when
    it is opened for reading, with its fix."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)


# -- checking --------------------------------------------------------------------------------


def verify(store_dir: str | Path) -> dict:
    """Check every chunk against the manifest and the contract; return stats or raise StoreError."""
    store = HiddenStateStore(store_dir)
    h, k = store.meta.hidden_size, len(store.meta.aux_layers)
    problems: list[str] = []
    tokens = loss_tokens = payload_bytes = 0
    for shard, records in store.chunks.items():
        for record in records:
            path = shard_dir(store.dir, shard) / record["chunk"]
            if not path.exists():
                problems.append(f"{path}: in the manifest but missing")
                continue
            payload_bytes += path.stat().st_size
            if path.stat().st_size != record["bytes"]:
                problems.append(f"{path}: {path.stat().st_size} bytes, manifest says {record['bytes']}")
            try:
                with safe_open(str(path), framework="pt") as f:
                    names = set(f.keys())
                    if names != set(TENSOR_NAMES):
                        problems.append(f"{path}: tensors {sorted(names)}, expected {sorted(TENSOR_NAMES)}")
                        continue
                    t = {name: f.get_tensor(name) for name in TENSOR_NAMES}
                    metadata = f.metadata() or {}
            except Exception as err:  # noqa: BLE001 - any unreadable chunk is a finding, not a crash
                problems.append(f"{path}: unreadable ({err})")
                continue
            problems += _check_chunk(path, record, t, metadata, h, k)
            tokens += len(t["input_ids"])
            loss_tokens += int(t["loss_mask"].sum())
    if problems:
        raise StoreError(f"{store.dir}: {len(problems)} problem(s):\n  " + "\n  ".join(problems))
    return {
        "samples": len(store),
        "tokens": tokens,
        "loss_tokens": loss_tokens,
        "rejected": len(store.rejected),
        "chunks": sum(len(r) for r in store.chunks.values()),
        "shards": len(store.chunks),
        "bytes": payload_bytes,
        "bytes_per_token": payload_bytes / tokens if tokens else None,
        "hidden_size": h,
        "aux_layers": list(store.meta.aux_layers),
    }


def _check_chunk(path, record, t, metadata, h, k) -> list[str]:
    problems = []
    n = len(t["input_ids"])
    lengths = [length for _, length in record["samples"]]
    expected_dtypes = {
        "input_ids": torch.int32, "loss_mask": torch.uint8, "aux_hidden_states": STATE_DTYPE,
        "last_hidden_state": STATE_DTYPE, "offsets": torch.int64,
    }
    for name, dtype in expected_dtypes.items():
        if t[name].dtype != dtype:
            problems.append(f"{path}: {name} is {t[name].dtype}, expected {dtype}")
    if t["aux_hidden_states"].shape != (n, k * h) or t["last_hidden_state"].shape != (n, h) or len(t["loss_mask"]) != n:
        problems.append(f"{path}: shapes do not agree with {n} tokens, hidden_size {h}, {k} aux layers")
    offsets = t["offsets"].tolist()
    if offsets[0] != 0 or offsets[-1] != n or [b - a for a, b in zip(offsets, offsets[1:])] != lengths:
        problems.append(f"{path}: offsets {offsets[:4]}... disagree with the manifest's sample lengths")
    if json.loads(metadata.get("sample_ids", "[]")) != [sid for sid, _ in record["samples"]]:
        problems.append(f"{path}: sample ids in the file differ from the manifest")
    for name in ("aux_hidden_states", "last_hidden_state"):
        if not torch.isfinite(t[name]).all():
            problems.append(f"{path}: {name} has NaN or inf")
    return problems


def digest(store_dir: str | Path) -> str:
    """sha256 over all samples in sample-id order: equal digests mean equal content, however chunked."""
    store = HiddenStateStore(store_dir)
    h = hashlib.sha256()
    for sample_id in sorted(store.sample_ids):
        sample = store[sample_id]
        h.update(sample_id.encode())
        for name in TENSOR_NAMES[:4]:
            tensor = sample[name].contiguous()
            if tensor.dtype == STATE_DTYPE:
                tensor = tensor.view(torch.int16)  # numpy has no bf16; the raw bits are what matter
            h.update(tensor.numpy().tobytes())
    return h.hexdigest()
