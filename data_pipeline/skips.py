"""Global sample numbers a training stream never reads: `data.skip_samples` set by hand, and the ranges a
loss-spike rollback adds (pretrain/resilience/spike.py).

Every loader numbers its samples globally (docs/data.md) and keeps as its resumable state the number
of the next sample to read. With skipped ranges that number still counts in the full numbering: the
samples of a range are neither read nor renumbered, so a range means the same samples at any world
size, and a state saved with its ranges resumes exactly. The position is kept normalised (never inside
a range), so two loaders that reach the same place by different routes (a rollback that adds a range,
a resume with the range in its config) hold the same state.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class SkipRanges:
    """Sorted, disjoint, merged half-open ranges [first, end) of global sample numbers."""

    def __init__(self, ranges: Iterable[Sequence[int]] = ()) -> None:
        self._ranges: list[tuple[int, int]] = []
        for first, end in ranges:
            self.add(first, end)

    def add(self, first: int, end: int) -> None:
        """Skip samples first .. end - 1 as well (merged with the ranges already held)."""
        if not 0 <= first < end:
            raise ValueError(f"a skipped range needs 0 <= first < end, got [{first}, {end})")
        merged: list[tuple[int, int]] = []
        for lo, hi in sorted([*self._ranges, (int(first), int(end))]):
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        self._ranges = merged

    def nth(self, position: int, n: int) -> int:
        """The global number of the `n`-th (from 0) sample at or after `position` that is not skipped;
        `nth(position, 0)` is `position` normalised (moved past a range it falls in)."""
        for lo, hi in self._ranges:
            if hi <= position:
                continue
            if position < lo:
                if position + n < lo:
                    return position + n
                n -= lo - position
            position = hi
        return position + n

    def to_list(self) -> list[list[int]]:
        """The ranges as JSON-able [first, end] pairs (the loaders' state)."""
        return [[lo, hi] for lo, hi in self._ranges]
