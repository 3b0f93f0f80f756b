"""Needle in a haystack of real text: a sentence with a number planted at a seeded depth, asked for at
the end, at any context length."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import BinaryIO

import fsspec
import numpy as np

from data_pipeline.synthetic.example import Example, answer_example, task_rng


def _byte_ids(data: bytes) -> np.ndarray:
    """Byte-level encoding: the bytes themselves."""
    return np.frombuffer(data, dtype=np.uint8)


class NeedleHaystack:
    """Needle in a haystack of real text at a configurable context length (up to 512k and beyond).

    The haystack is a window of ``haystack`` (bytes, a binary file object, or a path/URL read
    through fsspec, e.g. a book
    held out from training), starting at a seeded offset and wrapping around if the text is
    shorter than the context. A needle sentence with a random 6-digit number is inserted at a depth
    (fraction of the context; seeded when ``depth`` is None) on a line boundary when possible, and
    the sequence ends with the question; the answer is the number. ``encode`` maps bytes to token
    ids (default: bytes themselves) so tokenized models can use it.
    """

    task = "needle"
    needle = b"\nThe secret number is %06d.\n"
    question = b"\nWhat is the secret number? The secret number is "

    def __init__(
        self,
        context_len: int,
        haystack: bytes | str | BinaryIO,
        depth: float | None = None,
        seed: int = 0,
        encode: Callable[[bytes], Sequence[int] | np.ndarray] | None = None,
    ) -> None:
        if isinstance(haystack, str):
            with fsspec.open(haystack, "rb") as f:
                haystack = f.read()
        elif hasattr(haystack, "read"):
            haystack = haystack.read()
        if not haystack:
            raise ValueError("the haystack text is empty")
        self.text = haystack
        self.context_len = context_len
        self.depth = depth
        self.seed = seed
        self.encode = encode or _byte_ids
        fixed = len(self._ids(self.needle % 0)) + len(self._ids(self.question)) + len(self._ids(b"000000"))
        if context_len <= fixed:
            raise ValueError(f"context_len {context_len} leaves no room for the haystack")

    @property
    def max_len(self) -> int:
        """Tokens per example."""
        return self.context_len

    def _ids(self, data: bytes) -> np.ndarray:
        return np.asarray(self.encode(data), dtype=np.int64)

    def _hay(self, rng: np.random.Generator, n_tokens: int) -> np.ndarray:
        """``n_tokens`` of haystack tokens from a seeded offset, wrapping around the text."""
        start = int(rng.integers(0, len(self.text)))
        pieces, have, pos = [], 0, start
        while have < n_tokens:
            chunk = self.text[pos : pos + max(4096, n_tokens - have)]
            pos = (pos + len(chunk)) % len(self.text)
            ids = self._ids(chunk)
            pieces.append(ids)
            have += ids.size
        return np.concatenate(pieces)[:n_tokens]

    def example(self, i: int) -> Example:
        """Example ``i``: exactly ``context_len`` tokens, answer = the six digits at the end."""
        rng = task_rng(self.seed, self.task, i)
        number = int(rng.integers(0, 1_000_000))
        depth = float(rng.random()) if self.depth is None else self.depth
        needle = self._ids(self.needle % number)
        question = self._ids(self.question)
        answer = self._ids(b"%06d" % number)
        hay = self._hay(rng, self.context_len - needle.size - question.size - answer.size)
        at = round(depth * hay.size)
        newline = self._ids(b"\n")
        if newline.size == 1:
            breaks = np.flatnonzero(hay[: at + 1] == newline[0])
            at = int(breaks[-1]) + 1 if breaks.size else at
        tokens = np.concatenate([hay[:at], needle, hay[at:], question, answer])
        return answer_example(tokens, tokens.size - answer.size, {"number": number, "depth": depth, "needle_at": at})
