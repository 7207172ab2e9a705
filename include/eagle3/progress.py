"""Progress lines for long stages, at a fixed interval, in the task log (stdout/stderr via logging).

One line a person reads at a glance: done/total, rate, bytes, ETA. Rates count only the work of this
process, so a resumed run shows its real speed, and the ETA covers what is left.
"""

from __future__ import annotations

import logging
import time


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

    def __init__(self, label: str, total: int, already_done: int, interval_s: float, logger: logging.Logger,
                 unit: str = "samples", track_bytes: bool = True, track_failures: bool = False):
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

    def emit(self) -> None:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        tried = self.done_here + self.failed
        left = self.total - self.done - self.failed
        eta = human_duration(left * elapsed / tried) if tried else "?"
        pct = 100.0 * self.done / self.total if self.total else 100.0
        failed = f"{self.failed} failed, " if self.track_failures else ""
        written = f"{self.bytes / 2**30:.2f} GiB written, " if self.track_bytes else ""
        self.log.info(
            "%s: %d/%d %s (%.1f%%), %s%.0f tokens/s, %selapsed %s, ETA %s",
            self.label, self.done, self.total, self.unit, pct, failed, self.tokens / elapsed, written,
            human_duration(elapsed), eta,
        )
