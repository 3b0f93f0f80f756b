"""Byte-level copy: a segment of printable bytes, filler, then a query marker after which the segment
is repeated; the lookback is how far the copy reaches."""

from __future__ import annotations

import numpy as np

from data_pipeline.synthetic.example import Example, answer_example, task_rng

_COPY_START, _COPY_QUERY = 0x02, 0x03
_PRINTABLE = np.arange(32, 127)
_LETTERS = _PRINTABLE[np.char.isalpha(_PRINTABLE.astype(np.uint8).view("S1").astype(str))]
_NON_LETTERS = np.setdiff1d(_PRINTABLE, _LETTERS)


class CopyPaste:
    """Byte-level copy-paste: ``[STX, segment, filler, ETX, segment]``.

    ``segment`` (printable ASCII, length uniform in ``[1, max_copy]``) must be reproduced after a
    look-back (distance from the segment's first byte to its copy's first byte, uniform in
    ``[len + 2, max_lookback]``). Filler is printable ASCII too, so only the markers delimit.
    ``distinct``: the segment's bytes are distinct ASCII letters and the filler never holds a
    letter, so each byte of the copy is found once in the look-back and fixes the byte after it.
    ``lookbacks``: "uniform", or "log_uniform" (uniform in log look-back: as many look-backs in
    [4, 16) as in [64, 256), so a model meets copies its attention window reaches as often as copies
    only a memory reaches, a curriculum mixed into every batch).
    """

    task = "copy"

    def __init__(
        self, max_copy: int = 1024, max_lookback: int = 2048, seed: int = 0, distinct: bool = False,
        lookbacks: str = "uniform",
    ) -> None:
        if max_lookback < max_copy + 2:
            raise ValueError("max_lookback must be at least max_copy + 2")
        if lookbacks not in ("uniform", "log_uniform"):
            raise ValueError(f"lookbacks: expected 'uniform' or 'log_uniform', got {lookbacks!r}")
        self.lookbacks = lookbacks
        if distinct and max_copy > _LETTERS.size:
            raise ValueError(f"distinct: max_copy={max_copy} exceeds the {_LETTERS.size} ASCII letters")
        self.distinct = distinct
        self.max_copy = max_copy
        self.max_lookback = max_lookback
        self.seed = seed

    @property
    def max_len(self) -> int:
        """Tokens in the longest example."""
        return self.max_lookback + self.max_copy + 1

    @property
    def alphabet(self) -> int:
        """Symbols a segment byte is drawn from (a uniform guess is right once in this many)."""
        return _LETTERS.size if self.distinct else _PRINTABLE.size

    def example(self, i: int) -> Example:
        """Example ``i`` (deterministic in ``(seed, i)``); variable length, at most ``max_lookback + max_copy + 1``."""
        rng = task_rng(self.seed, self.task, i)
        n = int(rng.integers(1, self.max_copy + 1))
        if self.lookbacks == "uniform":
            lookback = int(rng.integers(n + 2, self.max_lookback + 1))
        else:
            lookback = int(np.exp(rng.uniform(np.log(n + 2), np.log(self.max_lookback + 1))))
        if self.distinct:
            segment = rng.choice(_LETTERS, size=n, replace=False)
            filler = rng.choice(_NON_LETTERS, size=lookback - n - 1)
        else:
            segment = rng.choice(_PRINTABLE, size=n)
            filler = rng.choice(_PRINTABLE, size=lookback - n - 1)
        tokens = np.concatenate([[_COPY_START], segment, filler, [_COPY_QUERY], segment])
        return answer_example(tokens, 1 + lookback, {"copy_len": n, "lookback": lookback})
