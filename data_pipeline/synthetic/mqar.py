"""Multi-query associative recall (MQAR), the task of Zoology, with answers never shown in the input."""

from __future__ import annotations

import numpy as np

from data_pipeline.synthetic.example import IGNORE_INDEX, Example, task_rng


class MultiQueryRecall:
    """Multi-query associative recall (MQAR) in the layout of Zoology (Arora et al. 2023).

    ``[k_1 v_1 ... k_n v_n]`` then a query region of ``seq_len - 2n`` filler tokens in which every key
    appears once, in random order at random distinct places. The answer to a query is its key's value,
    the next token; the input there stays filler, so each answer is scored without being shown, and
    only answers are labelled. Vocabulary: keys ``[0, K)``, values ``[K, 2K)``, filler ``vocab - 1``,
    ``K = (vocab - 1) // 2``; keys are distinct, values drawn with replacement. Zoology spaces queries
    by a power law; here places are uniform (at this length the spacing hardly matters).

    ``gap`` > 0 keeps the first ``gap`` filler tokens after the pairs free of queries, so every query
    is at least ``gap + 1`` positions after the value of every pair (the beyond-the-window recall
    experiment sets it past the sliding window's receptive field).
    """

    task = "mqar"

    def __init__(self, seq_len: int, vocab_size: int = 256, num_pairs: int = 16, seed: int = 0, gap: int = 0) -> None:
        self.keys = (vocab_size - 1) // 2
        if not 1 <= num_pairs <= self.keys:
            raise ValueError(f"num_pairs must be in [1, {self.keys}] for vocab_size {vocab_size}, got {num_pairs}")
        if gap < 0:
            raise ValueError(f"gap must be >= 0, got {gap}")
        if seq_len < 3 * num_pairs + gap + 1:
            raise ValueError(f"seq_len {seq_len} too short for {num_pairs} pairs, a gap of {gap} and their queries")
        self.seq_len, self.vocab_size, self.num_pairs, self.seed, self.gap = seq_len, vocab_size, num_pairs, seed, gap
        self.filler = vocab_size - 1

    @property
    def max_len(self) -> int:
        """Tokens per example."""
        return self.seq_len

    def example(self, i: int) -> Example:
        """Example ``i`` (deterministic in ``(seed, i)``); ``meta["query_at"]`` lists the query places and
        ``meta["value_at"]`` the place of each one's pair value."""
        rng = task_rng(self.seed, self.task, i)
        n = self.num_pairs
        keys = rng.choice(self.keys, size=n, replace=False)
        values = rng.integers(self.keys, 2 * self.keys, size=n)
        tokens = np.full(self.seq_len, self.filler, dtype=np.int64)
        tokens[0 : 2 * n : 2], tokens[1 : 2 * n : 2] = keys, values
        # a query's answer is the next position's label, so the last position cannot hold a query
        places = np.sort(rng.choice(np.arange(2 * n + self.gap, self.seq_len - 1), size=n, replace=False))
        order = rng.permutation(n)
        tokens[places] = keys[order]
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        labels[places] = values[order]
        meta = {"query_at": places.tolist(), "value_at": (2 * order + 1).tolist()}
        return Example(tokens, labels, (int(places[0]) + 1, self.seq_len), meta)
