"""Token-level key/value recall: records planted in noise, then a query for one key, at Zipf-distributed
lags (`ZipfRetrieval`) or uniform ones with multi-token labels (`EntityLabelCopy`)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from data_pipeline.synthetic.example import IGNORE_INDEX, Example, task_rng

PLACEMENT_TRIES = 10_000  # lags drawn for one record before the layout is declared impossible


class _KeyValueRecall(ABC):
    """Shared generator: key/value records planted in noise, then a query for one key.

    Layout: noise with ``num_pairs`` records ``[MARK, key, value...]``; the sequence ends with
    ``queries`` query blocks ``[QUERY, key, value...]``, the j-th asking for the j-th key, whose
    record starts ``lags[j]`` tokens before that query's QUERY token. With one query (the default)
    the last block is the whole answer; with several, every query block's value is labelled (a
    denser training signal) and ``meta`` lists each query's position and lag. A later query's lag
    is drawn from the task's distribution conditioned on fitting before the query blocks.
    Vocabulary: keys ``[0, K)``, values ``[K, 2K)``, noise ``[2K, vocab-2)``, MARK ``vocab-2``,
    QUERY ``vocab-1``, with ``K = (vocab - 2) // 4``. Values are drawn with replacement unless
    ``distinct_values``: then no value token occurs twice among a sequence's records, so within a
    sequence each value token determines the one after it (a multi-token value can be copied
    token by token by an induction lookup, as it cannot when labels share symbols).
    """

    task = ""

    def __init__(
        self, seq_len: int, vocab_size: int, num_pairs: int, value_len: int, seed: int, queries: int = 1,
        distinct_values: bool = False,
    ) -> None:
        self.keys = (vocab_size - 2) // 4
        if self.keys < num_pairs:
            raise ValueError(f"vocab_size {vocab_size} has {self.keys} keys, fewer than num_pairs={num_pairs}")
        if distinct_values and self.keys < num_pairs * value_len:
            raise ValueError(f"distinct_values: vocab_size {vocab_size} has {self.keys} value tokens, fewer than "
                             f"the {num_pairs} x {value_len} = {num_pairs * value_len} a sequence's records need")
        if not 1 <= queries <= num_pairs:
            raise ValueError(f"queries must be in [1, num_pairs={num_pairs}], got {queries}")
        record = 2 + value_len
        if seq_len < (num_pairs + queries + 1) * record:
            raise ValueError(
                f"seq_len {seq_len} too short for {num_pairs} records and {queries} queries of {record} tokens"
            )
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.num_pairs = num_pairs
        self.value_len = value_len
        self.queries = queries
        self.distinct_values = distinct_values
        self.seed = seed
        self.mark = vocab_size - 2
        self.query = vocab_size - 1

    @property
    def max_len(self) -> int:
        """Tokens per example."""
        return self.seq_len

    @property
    def max_lag(self) -> int:
        """Largest lag (query position minus queried record position) that fits."""
        return self.seq_len - self.queries * (2 + self.value_len)

    def _no_room(self, i: int, what: str) -> ValueError:
        return ValueError(f"task {self.task!r} example {i}: {what}; seq_len {self.seq_len} is too short for "
                          f"{self.num_pairs} records and {self.queries} queries at these lags")

    @abstractmethod
    def _lag(self, rng: np.random.Generator, low: int) -> int:
        """Distance from a queried record's first token to its query token, at least ``low``."""

    def example(self, i: int) -> Example:
        """Example ``i`` (deterministic in ``(seed, i)``)."""
        rng = task_rng(self.seed, self.task, i)
        record = 2 + self.value_len
        body_len = self.seq_len - self.queries * record
        tokens = rng.integers(2 * self.keys, self.vocab_size - 2, size=self.seq_len)
        keys = rng.choice(self.keys, size=self.num_pairs, replace=False)
        shape = (self.num_pairs, self.value_len)
        if self.distinct_values:
            values = self.keys + rng.choice(self.keys, size=shape, replace=False)
        else:
            values = rng.integers(self.keys, 2 * self.keys, size=shape)
        taken = np.zeros(body_len, dtype=bool)
        starts, lags, query_at = [], [], []
        for j in range(self.queries):
            at = body_len + j * record
            for _ in range(PLACEMENT_TRIES):  # a free place for the record: lags near the query blocks collide most
                lag = self._lag(rng, low=at - body_len + record)
                if not taken[at - lag : at - lag + record].any():
                    break
            else:
                raise self._no_room(i, f"queried record {j + 1} found no free place in {PLACEMENT_TRIES} lags")
            taken[at - lag : at - lag + record] = True
            starts.append(at - lag)
            lags.append(lag)
            query_at.append(at)
        free = [s * record for s in range(body_len // record) if not taken[s * record : (s + 1) * record].any()]
        if len(free) < self.num_pairs - self.queries:
            raise self._no_room(i, f"{len(free)} free places for {self.num_pairs - self.queries} unqueried records")
        starts += (rng.choice(free, size=self.num_pairs - self.queries, replace=False)).tolist()
        for pos, key, value in zip(starts, keys, values):
            tokens[pos : pos + record] = [self.mark, key, *value]
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        for j, at in enumerate(query_at):
            tokens[at : at + record] = [self.query, keys[j], *values[j]]
            labels[at + 1 : at + 1 + self.value_len] = values[j]
        meta = {"lag": lags[-1], "key": int(keys[self.queries - 1]), "lags": lags, "query_at": query_at}
        return Example(tokens.astype(np.int64), labels, (query_at[-1] + 2, self.seq_len), meta)


class ZipfRetrieval(_KeyValueRecall):
    """Retrieval at Zipf-distributed lags: most queries are recent, a heavy tail reaches far back.

    The lag (tokens from the queried record to the query) is ``min_lag - 1 + Zipf(alpha)``,
    resampled until it fits in the sequence. Answer: the key's single value token.
    """

    task = "zipf"

    def __init__(
        self,
        seq_len: int,
        vocab_size: int = 256,
        num_pairs: int = 8,
        alpha: float = 1.2,
        min_lag: int = 4,
        seed: int = 0,
        queries: int = 1,
    ) -> None:
        super().__init__(seq_len, vocab_size, num_pairs, 1, seed, queries)
        self.alpha = alpha
        self.min_lag = max(min_lag, 3)

    def _lag(self, rng: np.random.Generator, low: int) -> int:
        while True:
            lag = self.min_lag - 1 + int(rng.zipf(self.alpha))
            if low <= lag <= self.max_lag:
                return lag


class EntityLabelCopy(_KeyValueRecall):
    """Entity -> multi-token label copy with lags uniform in ``[min_lag, max_lag]``.

    ``distinct_labels``: no label token repeats within a sequence (``distinct_values`` above)."""

    task = "entity"

    def __init__(
        self,
        seq_len: int,
        vocab_size: int = 256,
        num_entities: int = 8,
        label_len: int = 4,
        min_lag: int | None = None,
        seed: int = 0,
        queries: int = 1,
        distinct_labels: bool = False,
    ) -> None:
        super().__init__(seq_len, vocab_size, num_entities, label_len, seed, queries, distinct_labels)
        self.min_lag = min_lag if min_lag is not None else 2 + label_len

    def _lag(self, rng: np.random.Generator, low: int) -> int:
        return int(rng.integers(max(self.min_lag, low), self.max_lag + 1))
