"""Hidden-state store: the target's EAGLE-3 hidden states on disk, crash-safe and resumable.

{workdir}/stores/<key>/, shared by every run with the same capture (eagle3.data.identity; RUN_DIR/hidden_states links
here):
  store.json        written once: format, hidden_size, aux_layers, dtype ("bfloat16" or "float8_e4m3fn")
  key.json          what the key covers
  shard-00000/
    manifest.jsonl  append-only, fsynced; the ONLY record of what exists. A line per commit: {"chunk": name or null,
                    "bytes", "samples": [[id, tokens], ...], "rejected": [[id, reason], ...]}
    chunk-000000.safetensors  whole samples, no padding; metadata {"format", "sample_ids"}:
                      input_ids          int32 [N]
                      loss_mask          uint8 [N]
                      aux_hidden_states  [N, 3H]  aux layers low|mid|high (HF ids)
                      last_hidden_state  [N, H]   the final post-norm state (lm_head's input)
                      offsets            int64 [S+1]: sample s is rows offsets[s]:offsets[s+1]
                    States bf16, or float8_e4m3fn with float32 scales amax / 448 per token and layer
                    (aux_scales [N, 3], last_scale [N, 1])
    .lock           one writer per shard, naming its holder; another waits (on_busy) or gets StoreBusy

A chunk not in the manifest does not exist: the next writer deletes such leftovers and a torn last line. Samples with
non-finite states are rejected and recorded. Readers (HiddenStateStore) mmap, never write, and get float32 from an
fp8 store. A store that is inconsistent or does not match the run raises StoreError naming the file.
Why: docs/decisions/2026-11-29-store-manifest-only-record.md, docs/decisions/2026-12-01-fp8-states.md.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3.disk.fsutil import (
    append_line_durably,
    atomic_write_text,
    commit,
    fsync_dir,
    is_tmp_leftover,
    tmp_path_for,
    try_exclusive_lock,
)
from eagle3.disk.hostid import read_host_id
from eagle3.disk.layout import run_samples_path
from eagle3.jobs.progress import format_bytes

if TYPE_CHECKING:
    from eagle3.config import RunConfig

STORE_FORMAT = "eagle3-hidden-states/1"
STATE_DTYPE = torch.bfloat16  # what the capture backends hand over, and what a bf16 store holds
MAX_OPEN_CHUNKS = 64
# extract.state_dtype -> the dtype the states are stored in (store.json's "dtype" is its torch name)
STORED_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
SCALE_OF = {"aux_hidden_states": "aux_scales", "last_hidden_state": "last_scale"}  # fp8 stores only
SAMPLE_TENSORS = ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state")  # what a reader gets
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448: a layer's largest |value| is stored as this
SCALE_BYTES = 4  # float32
SAFETENSORS_DTYPES = {  # how a chunk's header names each dtype (safe_open's get_dtype)
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.int64: "I64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
}


class StoreError(RuntimeError):
    """A store that is inconsistent or does not match the run; the message names the file."""


class StoreBusy(StoreError):
    """Another process writes the shard (another run on the same shared store, most likely), and the writer was not
    asked to wait for it (ShardWriter's on_busy). A retry may do."""


# While another writer holds a shard's lock, a waiting writer looks again after 1 s, then twice as long each time, up
# to 30 s: a shard's extraction takes minutes to hours, and a flock on a shared filesystem costs a round trip.
LOCK_POLL_FIRST_S = 1.0
LOCK_POLL_MAX_S = 30.0
HOLDER_MAX_BYTES = 4096


@dataclass(frozen=True)
class StoreMeta:
    hidden_size: int
    aux_layers: tuple[int, ...]
    state_dtype: str = "bf16"  # extract.state_dtype's names: "bf16" or "fp8_e4m3"

    def __post_init__(self):
        if self.state_dtype not in STORED_DTYPES:
            raise ValueError(f"state_dtype {self.state_dtype!r}: expected one of {sorted(STORED_DTYPES)}")

    @property
    def stored_dtype(self) -> torch.dtype:
        return STORED_DTYPES[self.state_dtype]

    @property
    def quantized(self) -> bool:
        """fp8: the states are stored with a scale per token and layer (the module docstring)."""
        return self.state_dtype == "fp8_e4m3"

    def to_json(self) -> str:
        return (
            json.dumps(
                {
                    "format": STORE_FORMAT,
                    "hidden_size": self.hidden_size,
                    "aux_layers": list(self.aux_layers),
                    "dtype": _torch_name(self.stored_dtype),
                },
                indent=2,
            )
            + "\n"
        )

    @property
    def bytes_per_token(self) -> int:
        """Payload bytes of one token: aux + last states (with fp8, a float32 scale for each), an int32 id,
        a uint8 mask."""
        states = len(self.aux_layers) + 1
        per_state = self.hidden_size * self.stored_dtype.itemsize + (SCALE_BYTES if self.quantized else 0)
        return states * per_state + 4 + 1

    def chunk_tensors(self, tokens: int, samples: int) -> dict[str, tuple[list[int], torch.dtype]]:
        """name -> (shape, dtype) of every tensor in a chunk of `samples` samples of `tokens` tokens in all; the
        per-token ones first, in the order the digest hashes them."""
        h, k = self.hidden_size, len(self.aux_layers)
        tensors = {
            "input_ids": ([tokens], torch.int32),
            "loss_mask": ([tokens], torch.uint8),
            "aux_hidden_states": ([tokens, k * h], self.stored_dtype),
            "last_hidden_state": ([tokens, h], self.stored_dtype),
        }
        if self.quantized:
            tensors |= {"aux_scales": ([tokens, k], torch.float32), "last_scale": ([tokens, 1], torch.float32)}
        return tensors | {"offsets": ([samples + 1], torch.int64)}

    @property
    def row_tensors(self) -> tuple[str, ...]:
        """The chunk's tensors with one row per token (all but the offsets), in digest order."""
        return tuple(name for name in self.chunk_tensors(0, 0) if name != "offsets")


def _torch_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def quantize_fp8(states: torch.Tensor, layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, layers x H] states -> (float8_e4m3fn [N, layers x H], float32 scales [N, layers]): each token's
    layer scaled so its largest |value| is e4m3fn's largest (448), where the format's 3 mantissa bits sit on
    that row's own range. A row of zeros gets scale 1 (any positive one dequantizes it to zeros, and none
    divides by 0); so does one whose amax / 448 underflows float32."""
    rows = states.float().reshape(len(states), layers, -1)
    scales = rows.abs().amax(dim=-1) / FP8_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    # x / scale is at most 448 up to float rounding; the clamp keeps that last bit from reading as out of range
    payload = (rows / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return payload.reshape(states.shape), scales


def dequantize_fp8(payload: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """quantize_fp8's inverse: float32 [..., layers x H] (payload x scale, exact in float32) from scales
    [..., layers]: one sample's rows, or a padded batch of them."""
    rows = payload.float().reshape(*payload.shape[:-1], scales.shape[-1], -1)
    return (rows * scales.unsqueeze(-1)).reshape(payload.shape)


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
    state_dtypes = {_torch_name(dtype): name for name, dtype in STORED_DTYPES.items()}
    dtype = raw.get("dtype")
    if dtype not in state_dtypes:
        raise StoreError(f"{path}: dtype is {_shown(dtype)}, not one of {sorted(state_dtypes)}; {fix}")
    return StoreMeta(hidden_size, tuple(aux_layers), state_dtypes[dtype])


def ensure_meta(store_dir: Path, meta: StoreMeta) -> None:
    """Create store.json, or check that the existing one describes the same states."""
    path = Path(store_dir) / "store.json"
    if not path.exists():
        atomic_write_text(path, meta.to_json())  # several shards may race here: same content, atomic replace
    existing = read_meta(store_dir)
    if (existing.hidden_size, existing.aux_layers) != (meta.hidden_size, meta.aux_layers):
        raise StoreError(
            f"{path}: holds hidden_size={existing.hidden_size} aux_layers={list(existing.aux_layers)}, but this "
            f"run asks for hidden_size={meta.hidden_size} aux_layers={list(meta.aux_layers)}; use a new run_name"
        )
    if existing.state_dtype != meta.state_dtype:
        raise StoreError(
            f"{store_dir}: holds {existing.state_dtype} hidden states ({path}), but this run's extract.state_dtype "
            f"is {meta.state_dtype}, and a store never mixes two dtypes. Set extract.state_dtype back to "
            f"{existing.state_dtype} to continue this store, or extract {meta.state_dtype} into a new one (another "
            f"run_name, or delete {store_dir} first)"
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
        return (
            f'"chunk" is {_shown(chunk)}, not the name of a chunk file in its shard directory '
            "(chunk-NNNNNN.safetensors)"
        )
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
            return (
                f'"bytes" is {size}, less than its {tokens} tokens take at hidden_size {meta.hidden_size} with '
                f"{len(meta.aux_layers)} aux layers in {meta.state_dtype} ({tokens * meta.bytes_per_token} bytes)"
            )
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
    return (
        f"{manifest}: {what}. The manifest was edited or damaged, so this shard's chunks cannot be trusted; "
        f"delete the shard directory {manifest.parent} and run extract again (it recomputes that shard only)."
    )


# -- writing ---------------------------------------------------------------------------------


class ShardWriter:
    """Appends whole samples to one shard; buffers them into chunks of about `chunk_bytes`.

    Opening takes an exclusive lock, so two processes can never write the same shard, and then recovers from a crash
    (torn manifest line, unrecorded chunk files, temp files): what it reads is what every writer before it committed.

    on_busy: where another writer holds the lock, called as on_busy(who holds it, seconds waited so far) before each
    look again (LOCK_POLL_FIRST_S doubling to LOCK_POLL_MAX_S) until the lock is free; None: StoreBusy at once. A lock
    this very process holds is StoreBusy either way (a writer not released would be waited for forever). `writer`:
    who this writer is, for the others' on_busy (a run's name).
    """

    def __init__(
        self,
        store_dir: Path,
        shard: int,
        meta: StoreMeta,
        chunk_bytes: int = 256 << 20,
        on_busy: Callable[[str, float], None] | None = None,
        writer: str = "",
    ):
        self.dir = shard_dir(store_dir, shard)
        self.dir.mkdir(parents=True, exist_ok=True)
        ensure_meta(store_dir, meta)
        self.meta = meta
        self.chunk_tokens = max(1, chunk_bytes // meta.bytes_per_token)
        self._lock = self._take_lock(on_busy, writer)
        self.manifest = self.dir / "manifest.jsonl"
        records = self._recover()
        self.done_ids = {sid for r in records for sid, _ in r.get("samples", ())}
        self.rejected = {sid: reason for r in records for sid, reason in r["rejected"]}
        self.num_chunks = sum(1 for r in records if r["chunk"])
        self._pending: list[tuple[str, dict[str, torch.Tensor]]] = []  # (id, its row tensors as they are stored)
        self._pending_rejects: list[tuple[str, str]] = []
        self._pending_tokens = 0
        self.bytes_written = 0

    def _take_lock(self, on_busy: Callable[[str, float], None] | None, writer: str):
        path, started, delay = self.dir / ".lock", time.monotonic(), LOCK_POLL_FIRST_S
        while (lock := try_exclusive_lock(path)) is None:
            holder = read_holder(path)
            if on_busy is None:
                raise StoreBusy(
                    f"{self.dir}: another process is writing this shard ({describe_holder(holder)}): "
                    "another run sharing this store, or a stray extract. A retry waits for it, or stop it"
                )
            if holder.get("pid") == os.getpid() and holder.get("host_id") == read_host_id():
                raise StoreBusy(
                    f"{self.dir}: this process (pid {os.getpid()}) holds the shard's lock already, in a "
                    "writer it has not released: waiting for it would never end"
                )
            on_busy(describe_holder(holder), time.monotonic() - started)
            time.sleep(delay)
            delay = min(2 * delay, LOCK_POLL_MAX_S)
        record = {
            "host": socket.gethostname(),
            "host_id": read_host_id(),
            "pid": os.getpid(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "writer": writer,
        }
        lock.seek(0)
        lock.truncate()
        lock.write(json.dumps(record) + "\n")
        lock.flush()
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
            rejected += not self._add(
                sample.sample_id, sample.input_ids, sample.loss_mask, state.aux_hidden_states, state.last_hidden_state
            )
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
        if not (all_finite(aux) and all_finite(last)):  # before quantising, which would carry inf/NaN into a scale
            self._pending_rejects.append((sample_id, "non-finite hidden state"))
            return False
        rows = {
            "input_ids": torch.as_tensor(input_ids, dtype=torch.int32),
            "loss_mask": torch.as_tensor(loss_mask, dtype=torch.uint8),
            "aux_hidden_states": aux,
            "last_hidden_state": last,
        }
        if self.meta.quantized:  # here, on the writer thread: the forward pass does not wait for it
            rows["aux_hidden_states"], rows["aux_scales"] = quantize_fp8(aux, len(self.meta.aux_layers))
            rows["last_hidden_state"], rows["last_scale"] = quantize_fp8(last, 1)
        self._pending.append((sample_id, rows))
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
        ids, rows = zip(*self._pending)
        lengths = [len(r["input_ids"]) for r in rows]
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(lengths).cumsum(0)
        tensors = {name: torch.cat([r[name] for r in rows]) for name in self.meta.row_tensors}
        tensors["offsets"] = offsets
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


def read_holder(lock_path: Path) -> dict:
    """What the writer holding a shard's lock recorded of itself in the lock file ({} when nothing readable yet: the
    writer has just taken the lock)."""
    try:
        with open(lock_path, "rb") as f:
            record = json.loads(f.read(HOLDER_MAX_BYTES))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def describe_holder(holder: dict) -> str:
    """A lock holder's record as a waiter names it: pid, host, writer, since when."""
    if not holder:
        return "a writer that has recorded nothing of itself yet (it has just taken the lock)"
    parts = [f"pid {_shown(holder.get('pid'))} on host {_shown(holder.get('host'))}"]
    if holder.get("writer"):
        parts.append(_shown(holder["writer"]))
    if holder.get("since"):
        parts.append(f"since {_shown(holder['since'])}")
    return ", ".join(parts)


# -- reading ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleLocation:
    shard: int
    chunk: str
    row: int  # index of the sample within its chunk
    start: int  # token rows start:end within the chunk
    end: int


class HiddenStateStore:
    """Read-only view of a store: random access by sample id, iteration by shard. Files are mmapped.

    `only`: see just these samples (one run's, of a store shared by many: `open_run_store`)."""

    def __init__(self, store_dir: str | Path, only: set[str] | None = None):
        self.dir = Path(store_dir)
        self.only = only
        self.meta = read_meta(self.dir)
        self.locations: dict[str, SampleLocation] = {}
        self.chunks: dict[int, list[dict]] = {}
        self.rejected: dict[str, str] = {}
        self._handles: dict[tuple[int, str], object] = {}
        self._records: dict[tuple[int, str], dict] = {}
        seen: set[str] = set()
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
                    if sid in seen:
                        raise StoreError(f"{sdir}: sample {sid} is stored twice ({record['chunk']})")
                    seen.add(sid)
                    if only is None or sid in only:
                        self.locations[sid] = SampleLocation(shard, record["chunk"], row, start, start + n)
                    start += n
        if only is not None:
            self.rejected = {sid: reason for sid, reason in self.rejected.items() if sid in only}
            missing = only.difference(self.locations, self.rejected)
            if missing:
                raise StoreError(
                    f"{self.dir}: {len(missing)} of the run's samples are not in the store (e.g. "
                    f"{min(missing)}); run extract again, it adds what is missing"
                )

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

    def stored(self, sample_id: str) -> dict[str, torch.Tensor]:
        """One sample's row tensors exactly as stored (an fp8 store's payload and scales): what the digest hashes."""
        loc = self.locations[sample_id]
        f = self._open(loc.shard, loc.chunk)
        return {name: f.get_slice(name)[loc.start : loc.end] for name in self.meta.row_tensors}

    def batch(self, sample_ids: list[str], device) -> dict[str, torch.Tensor]:
        """The samples as one right-padded float batch on `device`: input_ids and loss_mask (int64; padding's mask is
        0), lengths, and the states in float32 (aux_hidden_states [B, T, 3H], last_hidden_state [B, T, H]), whatever
        the store holds.

        The states travel to the device as stored (bf16, or an fp8 store's payload and scales) and become float32
        there. On the host that conversion would take 125 ms (bf16) or 485 ms (fp8) per 4096-token sample at Kimi
        width on 2 cores (bench/state_conversion.py), inside the training loop, and the copy to the GPU would carry
        4 bytes per value instead of 2 or 1. Both conversions are exact: the batch is the same bits on any device."""
        rows = [self.stored(sid) for sid in sample_ids]
        lengths = [len(row["input_ids"]) for row in rows]
        longest = max(lengths)

        def padded(name: str) -> torch.Tensor:
            first = rows[0][name]
            out = torch.zeros(len(rows), longest, *first.shape[1:], dtype=first.dtype)
            for i, (row, length) in enumerate(zip(rows, lengths)):
                out[i, :length] = row[name]
            return out.to(device)

        batch = {
            "input_ids": padded("input_ids").long(),
            "loss_mask": padded("loss_mask").long(),
            "lengths": torch.tensor(lengths).to(device),
        }
        for name, scales in SCALE_OF.items():
            batch[name] = dequantize_fp8(padded(name), padded(scales)) if self.meta.quantized else padded(name).float()
        return batch

    def __getitem__(self, sample_id: str) -> Mapping[str, torch.Tensor]:
        """One sample's SAMPLE_TENSORS. From a bf16 store, views of the mmapped chunk: the bytes are read when
        first touched; from an fp8 store, its states dequantized to float32 when asked for (DequantizedSample)."""
        loc = self.locations[sample_id]
        f = self._open(loc.shard, loc.chunk)
        if self.meta.quantized:
            return DequantizedSample(lambda name: f.get_slice(name)[loc.start : loc.end])
        return {name: f.get_slice(name)[loc.start : loc.end] for name in SAMPLE_TENSORS}

    def iter_shard(self, shard: int) -> Iterator[tuple[str, Mapping[str, torch.Tensor]]]:
        """Samples of one shard in storage order, as views of the mmapped chunks (read when touched,
        e.g. when a batch is collated; an fp8 store's dequantized then). The kernel reads the next chunk ahead
        meanwhile."""
        records = self.chunks.get(shard, [])
        for i, record in enumerate(records):
            if i + 1 < len(records):
                _read_ahead(shard_dir(self.dir, shard) / records[i + 1]["chunk"])
            f = self._open(shard, record["chunk"])
            tensors = {name: f.get_tensor(name) for name in self.meta.chunk_tensors(0, 0)}
            offsets = tensors["offsets"].tolist()
            for row, (sid, _) in enumerate(record["samples"]):
                if self.only is not None and sid not in self.only:
                    continue
                a, b = offsets[row], offsets[row + 1]
                if self.meta.quantized:
                    yield sid, DequantizedSample(lambda name, t=tensors, a=a, b=b: t[name][a:b])
                else:
                    yield sid, {name: tensors[name][a:b] for name in SAMPLE_TENSORS}


def open_run_store(cfg: RunConfig) -> HiddenStateStore:
    """The run's samples of its store. The store is shared by runs (RUN_DIR/hidden_states is a link into
    {workdir}/stores/, made by `eagle3 init`) and holds every run's samples, so the run's own are those its extract
    shards listed."""
    if not cfg.store_dir.is_symlink():
        raise StoreError(f"{cfg.store_dir}: not the link to the run's shared store; `python -m eagle3 init` makes it")
    ids: set[str] = set()
    for shard in range(cfg.extract.num_shards):
        path = run_samples_path(cfg.run_dir, shard)
        try:
            ids.update(path.read_text().split())
        except FileNotFoundError:
            raise StoreError(
                f"{path}: missing, so extract shard {shard} of this run has not finished; run it "
                f"(python -m eagle3 extract --config {cfg.config_path} --shard {shard})"
            ) from None
    return HiddenStateStore(cfg.store_dir, only=ids)


class DequantizedSample(Mapping):
    """One sample of an fp8 store, read as a bf16 store's is: input_ids and loss_mask as stored, each state
    dequantized to float32 (payload x scale, exact: a bf16 result would round a second time) when asked for.
    Computed on each access, not kept: a reader of ids alone (vocab counting) never pays for the states, and
    a batch being collated does not hold a second float32 copy of itself."""

    def __init__(self, read: Callable[[str], torch.Tensor]):
        self._read = read  # name -> the sample's rows of that stored tensor

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in SCALE_OF:
            return dequantize_fp8(self._read(name), self._read(SCALE_OF[name]))
        if name in SAMPLE_TENSORS:
            return self._read(name)
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return iter(SAMPLE_TENSORS)

    def __len__(self) -> int:
        return len(SAMPLE_TENSORS)


def _header_problem(handle, record: dict, meta: StoreMeta) -> str | None:
    """How a chunk's tensors disagree with its manifest record and the store's shapes, or None."""
    lengths = [length for _, length in record["samples"]]
    n, h, k = sum(lengths), meta.hidden_size, len(meta.aux_layers)
    expected = meta.chunk_tensors(n, len(lengths))
    names = set(handle.keys())
    if names != set(expected):
        return f"holds tensors {sorted(names)}, expected {sorted(expected)} (a {meta.state_dtype} store's)"
    for name, (shape, dtype) in expected.items():
        tensor, dtype = handle.get_slice(name), SAFETENSORS_DTYPES[dtype]
        if list(tensor.get_shape()) != shape or tensor.get_dtype() != dtype:
            return (
                f"{name} is {tensor.get_dtype()} {list(tensor.get_shape())}, but the manifest's {len(lengths)} "
                f"samples of {n} tokens at hidden_size {h} with {k} aux layers make it {dtype} {shape}"
            )
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
    meta = store.meta
    names = set(meta.chunk_tensors(0, 0))
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
                    found = set(f.keys())
                    if found != names:
                        problems.append(
                            f"{path}: tensors {sorted(found)}, expected {sorted(names)} (a {meta.state_dtype} store's)"
                        )
                        continue
                    t = {name: f.get_tensor(name) for name in names}
                    metadata = f.metadata() or {}
            except Exception as err:  # noqa: BLE001 - any unreadable chunk is a finding, not a crash
                problems.append(f"{path}: unreadable ({err})")
                continue
            problems += _check_chunk(path, record, t, metadata, meta)
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
        "hidden_size": meta.hidden_size,
        "aux_layers": list(meta.aux_layers),
        "state_dtype": meta.state_dtype,
    }


def _check_chunk(path, record, t, metadata, meta: StoreMeta) -> list[str]:
    problems = []
    n = len(t["input_ids"])
    lengths = [length for _, length in record["samples"]]
    expected = meta.chunk_tensors(n, len(lengths))
    for name, (_, dtype) in expected.items():
        if t[name].dtype != dtype:
            problems.append(f"{path}: {name} is {t[name].dtype}, expected {dtype}")
    if any(list(t[name].shape) != shape for name, (shape, _) in expected.items() if name != "offsets"):
        scales = ", one scale per token and layer" if meta.quantized else ""
        problems.append(
            f"{path}: shapes do not agree with {n} tokens, hidden_size {meta.hidden_size}, "
            f"{len(meta.aux_layers)} aux layers{scales}"
        )
    offsets = t["offsets"].tolist()
    if offsets[0] != 0 or offsets[-1] != n or [b - a for a, b in zip(offsets, offsets[1:])] != lengths:
        problems.append(f"{path}: offsets {offsets[:4]}... disagree with the manifest's sample lengths")
    if json.loads(metadata.get("sample_ids", "[]")) != [sid for sid, _ in record["samples"]]:
        problems.append(f"{path}: sample ids in the file differ from the manifest")
    for name, scale_name in SCALE_OF.items():
        state = t[name]
        if state.dtype == torch.float8_e4m3fn:  # e4m3fn has NaN encodings but no inf (isfinite has no fp8 kernel)
            if torch.isnan(state).any():
                problems.append(f"{path}: {name} has NaN")
        elif not torch.isfinite(state).all():
            problems.append(f"{path}: {name} has NaN or inf")
        if meta.quantized:
            scales = t[scale_name]
            bad = ~(torch.isfinite(scales) & (scales > 0))
            if bad.any():
                token, layer = (int(i) for i in bad.nonzero()[0])
                problems.append(
                    f"{path}: {scale_name} has {int(bad.sum())} scale(s) not finite and > 0 (first: token "
                    f"{token}, layer {layer}: {float(scales[token, layer])}); a scale dequantizes its "
                    f"layer's {meta.hidden_size} values"
                )
    return problems


# numpy has no bf16 or fp8 dtype: their bits are hashed as integers of the same width
RAW_BITS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}


def digest(store_dir: str | Path) -> str:
    """sha256 over all samples in sample-id order, as stored (an fp8 store's payload bits and scales): equal
    digests mean equal content, however chunked."""
    store = HiddenStateStore(store_dir)
    h = hashlib.sha256()
    for sample_id in sorted(store.sample_ids):
        sample = store.stored(sample_id)
        h.update(sample_id.encode())
        for name in store.meta.row_tensors:
            tensor = sample[name].contiguous()
            if tensor.dtype in RAW_BITS:
                tensor = tensor.view(RAW_BITS[tensor.dtype])
            h.update(tensor.numpy().tobytes())
    return h.hexdigest()
