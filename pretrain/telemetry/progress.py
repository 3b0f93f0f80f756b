"""Time in progress reports: elapsed time and an estimate of the time left, for the trainer's step
lines and for commands that work through a known number of items (`python -m pretrain.plan`'s probes)."""

from __future__ import annotations

import sys
import time


def duration(seconds: float) -> str:
    """`seconds` as M:SS, or H:MM:SS from an hour on."""
    total = max(round(seconds), 0)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Pace:
    """Elapsed time since `started` (time.time()) and the time left for `total` items at the mean
    pace of the items done since this object was made (`first` of them were done before it: a
    resumed run), so that start-up does not count in the pace once an item is done."""

    def __init__(self, total: int, first: int = 0, started: float | None = None) -> None:
        self.total, self.first = total, first
        self.started = time.time() if started is None else started
        self.counting_from = time.time()

    def elapsed(self) -> float:
        return time.time() - self.started

    def left(self, done: int) -> float | None:
        """Seconds left once `done` items of `total` are done; None before the first is."""
        if done <= self.first:
            return None
        per_item = (time.time() - self.counting_from) / (done - self.first)
        return per_item * (self.total - done)

    def rewind(self, since: int, to: int) -> None:
        """The item count went back from `since` to `to` (a loss-spike rollback): the items made in between
        still count in the pace, and `to` is again `total - to` items from the end."""
        self.first -= since - to

    def report(self, done: int) -> str:
        """`elapsed M:SS, left ~M:SS` (the estimate once one item is done)."""
        left = self.left(done)
        return f"elapsed {duration(self.elapsed())}, left ~{duration(left) if left is not None else '?'}"


def announce(pace: Pace, done: int, what: str) -> None:
    """One progress line on stderr: `[done/total elapsed ..., left ~...] what`."""
    print(f"[{done}/{pace.total} {pace.report(done)}] {what}", file=sys.stderr, flush=True)
