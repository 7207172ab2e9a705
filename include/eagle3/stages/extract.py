"""The extract stage: conversations -> the target's EAGLE-3 hidden states in the store.

    python -m eagle3 extract --config RUN_DIR/config.json [--shard I --num-shards N --gpu-group K]

Writes the shard's samples into the shared store (eagle3.data.store), then RUN_DIR/extract/shard-NNNNN.samples (the
run's sample ids in it; written last, so it exists only for a finished shard) and shard-NNNNN.stats.json. Resumable
and idempotent: samples already in the shard's manifest are skipped, and batches are planned over the whole shard
and stored whole, so a resumed run stores the same digest as an uninterrupted one. A writer thread stores batch N
while the target computes N+1 (extract.writer_queue_depth).

A shard whose assistant turns cannot be trained as generated beyond data.max_untrained_fraction is refused and left
unfinished. Where another writer holds the shard's lock, extract waits before loading the target, logging the holder
every extract.progress_interval_s and beating progress so the stall watch does not kill it (BusyShardWait); then it
computes only what the store lacks. The wait is bounded by box.stage_timeout_h.
Why: docs/decisions/2026-11-29-batch-aligned-chunks.md, docs/decisions/2026-12-04-refuse-shards-losing-turns.md.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from eagle3 import capture
from eagle3.capture.staging import discard_staging
from eagle3.data.identity import attach_store
from eagle3.data.samples import (
    SampleTokenizer,
    TokenizedSample,
    TokenizeStats,
    conversation_id_of,
    prompted_turns,
    read_conversations,
    shard_of,
    untrained_refusal,
)
from eagle3.data.store import ShardWriter, StoreMeta
from eagle3.disk.fsutil import atomic_write_text
from eagle3.disk.layout import run_samples_path, run_stats_path
from eagle3.jobs.progress import ProgressLog, beat, human_duration
from eagle3.jobs.supervisor import FIRST_PROGRESS_VAR

if TYPE_CHECKING:
    from eagle3.config import RunConfig

log = logging.getLogger(__name__)

PLANNING_WINDOW = 1024  # samples sorted by length together; bounds memory and keeps the order stable


def plan_batches(samples: Iterable[TokenizedSample], batch_tokens: int) -> Iterator[list[TokenizedSample]]:
    """Group samples into forward batches of at most `batch_tokens` padded tokens.

    Within each window of PLANNING_WINDOW samples, longest first, so that padding stays small. A sample
    longer than the budget gets a batch of its own. Deterministic for a given input order.
    """
    window: list[TokenizedSample] = []
    for sample in samples:
        window.append(sample)
        if len(window) == PLANNING_WINDOW:
            yield from _pack(window, batch_tokens)
            window = []
    yield from _pack(window, batch_tokens)


def _pack(window: list[TokenizedSample], batch_tokens: int) -> Iterator[list[TokenizedSample]]:
    batch: list[TokenizedSample] = []
    for sample in sorted(window, key=lambda s: (-len(s.input_ids), s.sample_id)):
        longest = len(batch[0].input_ids) if batch else len(sample.input_ids)
        if batch and (len(batch) + 1) * longest > batch_tokens:
            yield batch
            batch = []
        batch.append(sample)
    if batch:
        yield batch


class BusyShardWait:
    """ShardWriter's on_busy for a stage: while another writer holds the shard's lock, a log line naming it every
    `interval_s` and a progress beat at each look, so the job's stall watch sees a stage that waits, not one that hung.
    took_lock() then gives the stage the first-progress allowance again (the job's FIRST_PROGRESS_VAR): loading the
    target comes next, as at a stage's start, and the beats of the wait would otherwise leave it the shorter limit
    between two beats."""

    def __init__(self, label: str, interval_s: float, logger: logging.Logger):
        self.label, self.interval_s, self.log = label, interval_s, logger
        self.waited_s: float | None = None  # None: the lock was free
        self.logged_at: float | None = None

    def __call__(self, holder: str, waited_s: float) -> None:
        self.waited_s = waited_s
        line = (
            f"{self.label}: waiting for the shard, which another writer holds ({holder}); waited "
            f"{human_duration(waited_s)}"
        )
        now = time.monotonic()
        if self.logged_at is None or now - self.logged_at >= self.interval_s:
            self.logged_at = now
            self.log.info("%s. The samples it stores are not computed again here", line)
        beat(line)

    def took_lock(self) -> None:
        if self.waited_s is None:
            return
        line = f"{self.label}: the shard is free after waiting about {human_duration(self.waited_s)}"
        self.log.info("%s; reading what the other writer stored", line)
        try:
            allowance = float(os.environ[FIRST_PROGRESS_VAR])
        except (KeyError, ValueError):
            allowance = None  # not a job's stage, or no stall limit: nothing watches the silence
        beat(line, allowance_s=allowance)


class BackgroundWriter:
    """Feeds a ShardWriter from a bounded queue on its own thread; re-raises its errors in the caller."""

    _STOP = object()

    def __init__(self, writer: ShardWriter, depth: int):
        self.writer = writer
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.rejected = 0
        self.thread = threading.Thread(target=self._run, name="store-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        # No torch.set_num_threads(1) here, though the writer's ops need no thread team: it is not a
        # per-thread setting. It sets a process-wide count that every thread whose first parallel op comes
        # later adopts, so a backend that starts its model after this thread (sglang) ran single-threaded.
        while (item := self.queue.get()) is not self._STOP:
            if self.error is None:
                try:
                    self.rejected += self.writer.add_batch(*item)
                except BaseException as err:  # noqa: BLE001 - handed to the main thread
                    self.error = err
            self.queue.task_done()
        self.queue.task_done()

    def drain(self) -> None:
        """Wait until every batch handed over so far is in the writer (benchmarks time the writer with it)."""
        self.queue.join()
        self._raise_if_failed()

    def put(self, samples, states) -> None:
        self._raise_if_failed()
        self.queue.put((samples, states))

    def close(self) -> None:
        self.queue.put(self._STOP)
        self.thread.join()
        self._raise_if_failed()
        self.writer.flush()

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error


def run_extract(cfg: RunConfig, shard: int = 0, num_shards: int | None = None, gpu_group: int = 0) -> dict:
    """Extract one shard on GPU group `gpu_group` of the box (capture.open_backend). `cfg` is a RunConfig with
    the target facts resolved. Returns the stats."""
    started = time.monotonic()
    num_shards = num_shards or cfg.extract.num_shards
    if not 0 <= shard < num_shards:
        raise ValueError(f"--shard {shard} is out of range for {num_shards} shard(s) (valid 0..{num_shards - 1})")
    conversations, read_stats = read_conversations(
        cfg.conversations_path, cfg.data.on_bad_record, cfg.data.max_samples, cfg.conversations_missing_hint
    )
    mine = [c for c in conversations if shard_of(c.sample_id, num_shards) == shard]
    mine_ids = {c.sample_id for c in mine}

    store = attach_store(cfg)  # shared by every run of the same capture: only what it lacks is computed
    meta = StoreMeta(cfg.target.hidden_size, tuple(cfg.resolved_aux_layers()), cfg.extract.state_dtype)
    waiting = BusyShardWait(f"extract shard {shard}", cfg.extract.progress_interval_s, log)
    writer = ShardWriter(
        cfg.store_dir,
        shard,
        meta,
        chunk_bytes=cfg.extract.chunk_mib << 20,
        on_busy=waiting,
        writer=f"run {cfg.run_name}",
    )
    waiting.took_lock()
    done_before = sum(conversation_id_of(sid) in mine_ids for sid in [*writer.done_ids, *writer.rejected])
    stored_conversations = {conversation_id_of(sid) for sid in writer.done_ids} & mine_ids
    log.info(
        "extract shard %d/%d: %d conversations in this shard, %d samples already in store %s, aux layers %s",
        shard,
        num_shards,
        len(mine),
        done_before,
        store.name,
        list(meta.aux_layers),
    )
    tokenizing = SampleTokenizer.for_run(cfg)
    stats_of_pass = TokenizeStats()
    shard_turns = sum(len(prompted_turns(c)) for c in mine)

    def refuse_untrained(stats: TokenizeStats, total_turns: int | None = shard_turns) -> None:
        """Stop as soon as more of the shard's assistant turns cannot be trained as generated than
        data.max_untrained_fraction allows (on turns while tokenising; on turns and tokens at the end)."""
        refusal = untrained_refusal(
            stats,
            cfg.data.max_untrained_fraction,
            tokenizing.template_where,
            total_turns,
            f"extract shard {shard}/{num_shards}: ",
        )
        if refusal is not None:
            raise refusal

    run_sample_ids: set[str] = set()  # this run's samples in the shard, stored now or before (by any run)

    def pending_batches(stats: TokenizeStats, seen: set[str] | None = None) -> Iterator[list[TokenizedSample]]:
        """The shard's planned batches that hold a sample not stored yet (tokenised as they are read)."""
        for batch in plan_batches(tokenizing.iter(mine, stats, refuse_untrained), cfg.extract.batch_tokens):
            if seen is not None:
                seen.update(s.sample_id for s in batch)
            if not all(writer.is_done(s.sample_id) for s in batch):
                yield batch

    # Samples are counted as conversations are tokenised (a thinking model's multi-turn conversation gives
    # one per turn): until then each conversation not yet tokenised counts as one.
    progress = ProgressLog(f"extract shard {shard}", len(mine), done_before, cfg.extract.progress_interval_s, log)
    batches = pending_batches(stats_of_pass, run_sample_ids)
    first = next(batches, None)
    backend = capture.open_backend(cfg, shard, gpu_group, writer.is_done) if first is not None else None  # done: none
    background = BackgroundWriter(writer, cfg.extract.writer_queue_depth)
    truncated = tokens = 0
    loop_started = time.monotonic()
    completed = False
    try:
        if backend is not None:
            # Its progress total counts conversations not stored yet: the sample count is known only once all
            # are tokenised (a thinking model's conversation can give several).
            backend.prepare(pending_batches(TokenizeStats()), len(mine) - len(stored_conversations))
            loop_started = time.monotonic()  # tokens/s below is the capture pass's (sglang: the aux pass)
        for batch in itertools.chain([first] if first is not None else [], batches):
            progress.total = stats_of_pass.samples + len(mine) - stats_of_pass.conversations
            todo = [s for s in batch if not writer.is_done(s.sample_id)]
            if len(todo) != len(batch):  # batches are stored whole; this means the data changed since
                log.info("recomputing a partly stored batch of %d samples as planned", len(batch))
            states = backend.capture(batch)
            keep = [(s, st) for s, st in zip(batch, states) if not writer.is_done(s.sample_id)]
            background.put([s for s, _ in keep], [st for _, st in keep])
            backend.release_stored()  # what it kept for batches the writer has committed by now
            batch_tokens = sum(len(s.input_ids) for s in todo)
            tokens += batch_tokens
            truncated += sum(s.truncated for s in todo)
            progress.update(len(todo), batch_tokens, _state_bytes(meta, batch_tokens))
        progress.total = stats_of_pass.samples  # every conversation is tokenised now: the exact count
        refuse_untrained(stats_of_pass, None)  # the exact fractions, turns and tokens; the shard stays unfinished
        completed = True
    finally:
        background.close()  # also after an error: batches already computed are complete, keep them
        loop_seconds = time.monotonic() - loop_started  # capture + writing, without start-up and model load
        if completed:  # every sample is in the store now; discarded under the shard lock
            discard_staging(cfg.run_dir, shard)
            # The run's part of the shared store; written last, so that it exists means the shard is done.
            atomic_write_text(
                run_samples_path(cfg.run_dir, shard),
                "".join(f"{sid}\n" for sid in sorted(run_sample_ids) if writer.is_done(sid)),
            )
        writer.release()
        if backend is not None:
            backend.close()
    progress.emit()
    turns = stats_of_pass.as_dict()
    if turns["turns_dropped"]:
        log.warning(
            "extract shard %d: %d of %d assistant turns not trained as generated (%s; within "
            "data.max_untrained_fraction %g); first: %s",
            shard,
            sum(turns["turns_dropped"].values()),
            turns["assistant_turns"],
            ", ".join(f"{k}: {n}" for k, n in turns["turns_dropped"].items()),
            cfg.data.max_untrained_fraction,
            next(iter(stats_of_pass.skipped.values()), ""),
        )
    if stats_of_pass.context_cut_samples or stats_of_pass.turn_cut_samples:
        log.warning(
            "extract shard %d: data.max_length (%d) cut the context of %d sample(s) from the left (%d tokens) "
            "and the end of %d turn(s) longer than it (%d trained tokens lost); raise data.max_length to keep "
            "them",
            shard,
            cfg.data.max_length,
            stats_of_pass.context_cut_samples,
            stats_of_pass.context_cut_tokens,
            stats_of_pass.turn_cut_samples,
            stats_of_pass.turn_cut_tokens,
        )

    seconds = time.monotonic() - started
    stats = {
        "shard": shard,
        "num_shards": num_shards,
        "conversations_in_shard": len(mine),
        "samples_in_shard": stats_of_pass.samples,
        "turn_samples": stats_of_pass.turn_samples,  # thinking models' earlier turns, each a sample of its own
        "reasoning_not_rendered": stats_of_pass.reasoning_not_rendered,  # turns dropped: no place for their reasoning
        # Assistant turns trained and dropped (per reason), their tokens, cuts by max_tokens and max_length.
        **turns,
        "store": store.name,  # {workdir}/stores/<this>, shared by every run with the same capture key
        "samples_stored_before": done_before,  # reused: in the store already (this run's earlier try, or another run)
        "samples_extracted": progress.done_here,
        "samples_stored": sum(sid in writer.done_ids for sid in run_sample_ids),  # the run's, now
        "store_samples": len(writer.done_ids),  # every run's, in this shard
        "tokens": tokens,
        "bytes": writer.bytes_written,
        "rejected_nonfinite": len(writer.rejected),
        "skipped": sum(stats_of_pass.turns_dropped.values()),  # assistant turns not trained (turns_dropped)
        "skipped_reasons": dict(list(stats_of_pass.skipped.items())[:20]),
        "truncated": truncated,
        "bad_records": len(read_stats.bad),
        "bad_record_lines": list(read_stats.bad)[:50],
        "duplicates": read_stats.duplicates,
        "seconds": round(seconds, 3),
        "loop_seconds": round(loop_seconds, 3),
        "tokens_per_s": round(tokens / loop_seconds, 1) if loop_seconds else None,
        # how the states were captured (sglang: plugin or lists, and why it fell back); nothing captured: None
        **(backend.stats() if backend is not None else {"capture_path": None}),
    }
    atomic_write_text(run_stats_path(cfg.run_dir, shard), json.dumps(stats, indent=2) + "\n")
    return stats


def _state_bytes(meta: StoreMeta, tokens: int) -> int:
    return tokens * meta.bytes_per_token
