"""Progress lines for long stages, at a fixed interval, in the task log (stdout/stderr via logging), and the
progress heartbeat the job supervisor watches.

One line a person reads at a glance: done/total, rate, bytes, ETA. Rates count only the work of this
process, so a resumed run shows its real speed, and the ETA covers what is left.

The heartbeat (beat): a stage that runs as a job (eagle3.jobs.job) finds EAGLE3_PROGRESS_FILE in its environment and
writes {"at", "line", "allowance_s"} there whenever its work moves on (at most five times a second). A supervisor that
sees no beat for too long kills the stage as hung: an NCCL hang, a deadlocked scheduler or a stuck filesystem keeps the
process alive, and only the work it stopped doing tells. `allowance_s` is a stage's way to announce a long silence
(loading a 1T model) before it starts one.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from eagle3.disk.fsutil import tmp_path_for

PROGRESS_FILE_VAR = "EAGLE3_PROGRESS_FILE"
BEAT_MIN_INTERVAL_S = 0.2  # a rename a beat: cheap, and the newest line is the one a stall message names
_last_beat = {"at": 0.0, "allowance_s": None}


def beat(line: str, allowance_s: float | None = None) -> None:
    """Tell the job supervisor that the work moved on (`line` says how far); no-op outside a job. `allowance_s`:
    the silence to allow until the next beat, when longer than the supervisor's usual limit."""
    path = os.environ.get(PROGRESS_FILE_VAR)
    now = time.time()
    if not path or (now - _last_beat["at"] < BEAT_MIN_INTERVAL_S and allowance_s == _last_beat["allowance_s"]):
        return
    _last_beat.update(at=now, allowance_s=allowance_s)
    tmp = tmp_path_for(Path(path))
    try:  # a heartbeat, not data: renamed into place, no fsync (eagle3.disk.fsutil's commit would add three)
        with open(tmp, "w") as f:
            json.dump({"at": now, "line": line[:500], "allowance_s": allowance_s}, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a full disk must not fail the stage; the supervisor's limit applies as without beats


def format_bytes(n: float) -> str:
    """Binary units: 4.61 TiB, 812.00 MiB, 17 B."""
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
    step = 0
    while abs(n) >= 1024 and step < len(units) - 1:
        n /= 1024
        step += 1
    return f"{n:.0f} B" if step == 0 else f"{n:.2f} {units[step]}"


def format_count(n: int) -> str:
    """87.8M, 1.2K, 512."""
    for divisor, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= divisor:
            return f"{n / divisor:.3g}{suffix}"
    return str(n)


def human_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class ProgressLog:
    """Counts work done and logs one line every `interval_s`: `{label}: done/total {unit} (%), [N failed, ]
    tokens/s, [GiB written, ]elapsed, ETA`. Failures (track_failures) count towards the ETA as work done."""

    def __init__(
        self,
        label: str,
        total: int,
        already_done: int,
        interval_s: float,
        logger: logging.Logger,
        unit: str = "samples",
        track_bytes: bool = True,
        track_failures: bool = False,
    ):
        self.label, self.total, self.done, self.interval_s, self.log = label, total, already_done, interval_s, logger
        self.unit, self.track_bytes, self.track_failures = unit, track_bytes, track_failures
        self.started = self.last = time.monotonic()
        self.done_here = self.failed = self.tokens = self.bytes = 0

    def update(self, samples: int, tokens: int, nbytes: int = 0, failed: int = 0) -> None:
        self.done += samples
        self.done_here += samples
        self.failed += failed
        self.tokens += tokens
        self.bytes += nbytes
        now = time.monotonic()
        if now - self.last >= self.interval_s:
            self.last = now
            self.emit()
        elif samples or tokens or failed:
            beat(f"{self.label}: {self.done}/{self.total} {self.unit}")

    def emit(self) -> None:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        tried = self.done_here + self.failed
        left = self.total - self.done - self.failed
        eta = human_duration(left * elapsed / tried) if tried else "?"
        pct = 100.0 * self.done / self.total if self.total else 100.0
        failed = f"{self.failed} failed, " if self.track_failures else ""
        written = f"{self.bytes / 2**30:.2f} GiB written, " if self.track_bytes else ""
        line = (
            f"{self.label}: {self.done}/{self.total} {self.unit} ({pct:.1f}%), {failed}"
            f"{self.tokens / elapsed:.0f} tokens/s, {written}elapsed {human_duration(elapsed)}, ETA {eta}"
        )
        self.log.info("%s", line)
        beat(line)
