"""Synthetic long-context tasks, deterministic by ``(seed, example index)``.

Every task has ``example(i) -> Example``: ``input_ids`` (int64), ``labels`` aligned with the
``PackedStream`` convention (``labels[t]`` is the target for the prediction made at position ``t``,
i.e. ``input_ids[t + 1]``) but equal to ``IGNORE_INDEX`` everywhere except where the next token is
part of the answer, and ``answer = (start, end)``, the half-open span of answer tokens in
``input_ids``. The trainer can train on ``(input_ids, labels)``; an evaluator runs the model, takes
the argmax predictions and calls ``accuracy``.

Token-level tasks (``ZipfRetrieval``, ``EntityLabelCopy``) take a content vocabulary size and split
it into keys, values, noise and two marker ids (``MultiQueryRecall``: keys, values and a filler,
its answers never shown in ``input_ids``, so ``answer`` spans its query region); byte-level tasks (``CopyPaste``,
``NeedleHaystack``) emit bytes (values 0..255) and use ASCII control bytes as markers, so they
run unchanged on byte-level models.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import fsspec
import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from data_pipeline.order import seeded_rng

# The label the loss skips is the model interface's contract; data producers follow it (model/ never
# imports data_pipeline/, so the dependency points one way).
from model.interface import IGNORE_INDEX

_TASK_TAGS = {"zipf": 11, "entity": 12, "copy": 13, "needle": 14, "mqar": 15}
_COPY_START, _COPY_QUERY = 0x02, 0x03
_PRINTABLE = np.arange(32, 127)
_LETTERS = _PRINTABLE[np.char.isalpha(_PRINTABLE.astype(np.uint8).view("S1").astype(str))]
_NON_LETTERS = np.setdiff1d(_PRINTABLE, _LETTERS)


@dataclass(frozen=True)
class Example:
    """One synthetic example (see module docstring for the label convention)."""

    input_ids: np.ndarray
    labels: np.ndarray
    answer: tuple[int, int]
    meta: dict[str, Any] = field(default_factory=dict)


def _rng(seed: int, task: str, index: int) -> np.random.Generator:
    return seeded_rng(seed, _TASK_TAGS[task], index)


def _example(tokens: np.ndarray, answer_start: int, meta: dict[str, Any]) -> Example:
    """Wrap a sequence whose answer runs from ``answer_start`` to the end."""
    ids = tokens.astype(np.int64)
    labels = np.full(ids.size, IGNORE_INDEX, dtype=np.int64)
    labels[answer_start - 1 : ids.size - 1] = ids[answer_start:]
    return Example(ids, labels, (answer_start, ids.size), meta)


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
        rng = _rng(self.seed, self.task, i)
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


class MultiQueryRecall:
    """Multi-query associative recall (MQAR) in the layout of Zoology (Arora et al. 2023).

    ``[k_1 v_1 ... k_n v_n]`` then a query region of ``seq_len - 2n`` filler tokens in which every key
    appears once, in random order at random distinct places. The answer to a query is its key's value,
    the next token; the input there stays filler, so each answer is scored without being shown, and
    only answers are labelled. Vocabulary: keys ``[0, K)``, values ``[K, 2K)``, filler ``vocab - 1``,
    ``K = (vocab - 1) // 2``; keys are distinct, values drawn with replacement. Zoology spaces queries
    by a power law; here places are uniform (at this length the spacing hardly matters).
    """

    task = "mqar"

    def __init__(self, seq_len: int, vocab_size: int = 256, num_pairs: int = 16, seed: int = 0) -> None:
        self.keys = (vocab_size - 1) // 2
        if not 1 <= num_pairs <= self.keys:
            raise ValueError(f"num_pairs must be in [1, {self.keys}] for vocab_size {vocab_size}, got {num_pairs}")
        if seq_len < 3 * num_pairs + 1:
            raise ValueError(f"seq_len {seq_len} too short for {num_pairs} pairs and their queries")
        self.seq_len, self.vocab_size, self.num_pairs, self.seed = seq_len, vocab_size, num_pairs, seed
        self.filler = vocab_size - 1

    @property
    def max_len(self) -> int:
        """Tokens per example."""
        return self.seq_len

    def example(self, i: int) -> Example:
        """Example ``i`` (deterministic in ``(seed, i)``); ``meta["query_at"]`` lists the query places."""
        rng = _rng(self.seed, self.task, i)
        n = self.num_pairs
        keys = rng.choice(self.keys, size=n, replace=False)
        values = rng.integers(self.keys, 2 * self.keys, size=n)
        tokens = np.full(self.seq_len, self.filler, dtype=np.int64)
        tokens[0 : 2 * n : 2], tokens[1 : 2 * n : 2] = keys, values
        # a query's answer is the next position's label, so the last position cannot hold a query
        places = np.sort(rng.choice(np.arange(2 * n, self.seq_len - 1), size=n, replace=False))
        order = rng.permutation(n)
        tokens[places] = keys[order]
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        labels[places] = values[order]
        return Example(tokens, labels, (int(places[0]) + 1, self.seq_len), {"query_at": places.tolist()})


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
        rng = _rng(self.seed, self.task, i)
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
        return _example(tokens, 1 + lookback, {"copy_len": n, "lookback": lookback})


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
        rng = _rng(self.seed, self.task, i)
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
        return _example(tokens, tokens.size - answer.size, {"number": number, "depth": depth, "needle_at": at})


class TaskStream(IterableDataset):
    """A synthetic task as an ``IterableDataset`` for training: rank ``r`` of ``world_size`` gets
    examples ``start + r + k * world_size`` (resume by passing the number of examples consumed
    globally as ``start``), each right-padded to ``pad_to`` tokens when given (inputs with
    ``pad_id``, labels with ``IGNORE_INDEX``) so the default collate can stack them.

    Yields ``{"input_ids", "labels", "index"}``. Generation is cheap, so use it with
    ``num_workers=0``; more data-loader workers would repeat examples and are refused.
    """

    def __init__(
        self,
        task: Any,
        rank: int = 0,
        world_size: int = 1,
        start: int = 0,
        num_examples: int | None = None,
        pad_to: int | None = None,
        pad_id: int = 0,
    ) -> None:
        super().__init__()
        self.task = task
        self.rank = rank
        self.world_size = world_size
        self.start = start
        self.num_examples = num_examples
        self.pad_to = pad_to
        self.pad_id = pad_id

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        if info is not None and info.num_workers > 1:
            raise RuntimeError("TaskStream would repeat examples across data-loader workers; use num_workers=0")
        for i in itertools.count(self.start + self.rank, self.world_size):
            if self.num_examples is not None and i >= self.num_examples:
                return
            e = self.task.example(i)
            ids, labels = torch.from_numpy(e.input_ids), torch.from_numpy(e.labels)
            if self.pad_to is not None:
                if ids.numel() > self.pad_to:
                    raise ValueError(f"example {i} has {ids.numel()} tokens, more than pad_to={self.pad_to}")
                extra = self.pad_to - ids.numel()
                ids = torch.nn.functional.pad(ids, (0, extra), value=self.pad_id)
                labels = torch.nn.functional.pad(labels, (0, extra), value=IGNORE_INDEX)
            yield {"input_ids": ids, "labels": labels, "index": i}


# ----------------------------------------------------------------------------- the registry

Task = ZipfRetrieval | EntityLabelCopy | MultiQueryRecall | CopyPaste | NeedleHaystack

MIN_TASK_LEN = 128
"""Shortest example length at which every task fits with its default parameters: room for the needle
sentence and question, and for 8 key/value records of the token-level tasks. Shorter examples are a
task's own business: its constructor refuses a length its parameters do not fit in."""


@dataclass(frozen=True)
class TaskSpec:
    """How to build one task at a given example length.

    ``build(length, vocab_size, haystack, encode, seed, params)`` sizes the task to ``length`` tokens
    (the task's own defaults otherwise; ``params`` overrides them by constructor name).
    """

    build: Callable[[int, int, bytes | None, Callable[[bytes], Any] | None, int, dict[str, Any]], Task]
    needs_haystack: bool = False


def _copy(length: int, _vocab: int, _hay: bytes | None, _enc: Any, seed: int, params: dict[str, Any]) -> CopyPaste:
    max_copy = int(params.pop("max_copy", max(1, length // 8)))
    max_lookback = int(params.pop("max_lookback", length - max_copy - 1))
    return CopyPaste(max_copy=max_copy, max_lookback=max_lookback, seed=seed, **params)


def _needle(length: int, _vocab: int, hay: bytes | None, enc: Any, seed: int, params: dict[str, Any]) -> NeedleHaystack:
    if not hay:
        raise ValueError("the needle task needs a haystack text")
    return NeedleHaystack(length, hay, encode=enc, seed=seed, **params)


TASKS: dict[str, TaskSpec] = {
    "copy": TaskSpec(_copy),
    "entity": TaskSpec(lambda n, vocab, _h, _e, seed, p: EntityLabelCopy(n, vocab_size=vocab, seed=seed, **p)),
    "mqar": TaskSpec(lambda n, vocab, _h, _e, seed, p: MultiQueryRecall(n, vocab_size=vocab, seed=seed, **p)),
    "needle": TaskSpec(_needle, needs_haystack=True),
    "zipf": TaskSpec(lambda n, vocab, _h, _e, seed, p: ZipfRetrieval(n, vocab_size=vocab, seed=seed, **p)),
}


def make_task(
    name: str,
    length: int,
    vocab_size: int = 256,
    haystack: bytes | None = None,
    encode: Callable[[bytes], Any] | None = None,
    seed: int = 0,
    **params: Any,
) -> Task:
    """The task ``name`` with examples of (at most) ``length`` tokens; ValueError names what is wrong."""
    if name not in TASKS:
        raise ValueError(f"unknown synthetic task {name!r}; known: {', '.join(sorted(TASKS))}")
    try:
        return TASKS[name].build(length, vocab_size, haystack, encode, seed, dict(params))
    except TypeError as err:
        raise ValueError(f"task {name!r}: bad parameters {sorted(params)}: {err}") from err
    except ValueError as err:
        raise ValueError(f"task {name!r} at {length} tokens: {err}") from err


class TaskBatches:
    """Micro-batches of a synthetic task for the trainer, with the loader interface it uses.

    Each example is padded to ``seq_len``; ``state_dict`` counts the examples consumed by all ranks
    so that a resumed run continues with the next unseen example.
    """

    def __init__(self, task: Task, seq_len: int, batch_size: int, rank: int = 0, world_size: int = 1) -> None:
        self.task, self.seq_len, self.batch_size = task, seq_len, batch_size
        self.rank, self.world_size = rank, world_size
        self.consumed = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            stream = TaskStream(self.task, self.rank, self.world_size, start=self.consumed, pad_to=self.seq_len)
            rows = list(itertools.islice(iter(stream), self.batch_size))
            self.consumed += self.batch_size * self.world_size
            yield {key: torch.stack([row[key] for row in rows]) for key in ("input_ids", "labels")}

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consumed = int(state["consumed"])

    def stats(self) -> dict[str, int]:
        return {"examples": self.consumed}


def collate(examples: Sequence[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad examples into a batch: ``input_ids`` (pad_id), ``labels`` (IGNORE_INDEX), ``lengths``."""
    n = max(e.input_ids.size for e in examples)
    ids = torch.full((len(examples), n), pad_id, dtype=torch.int64)
    labels = torch.full((len(examples), n), IGNORE_INDEX, dtype=torch.int64)
    for row, e in enumerate(examples):
        ids[row, : e.input_ids.size] = torch.from_numpy(e.input_ids)
        labels[row, : e.labels.size] = torch.from_numpy(e.labels)
    return {"input_ids": ids, "labels": labels, "lengths": torch.tensor([e.input_ids.size for e in examples])}


def accuracy(examples: Sequence[Example], predictions: Sequence[Any]) -> dict[str, float]:
    """Score argmax predictions: ``predictions[k][t]`` is the model's guess for ``input_ids[t + 1]``
    of example ``k`` (logits' argmax over a batch works; extra padded positions are ignored).

    Returns ``exact`` (fraction of examples whose whole answer is right) and ``token`` (fraction of
    answer tokens right).
    """
    if len(examples) != len(predictions):
        raise ValueError(f"{len(examples)} examples but {len(predictions)} predictions")
    exact = right = total = 0
    for e, pred in zip(examples, predictions):
        p = np.asarray(pred.cpu() if isinstance(pred, torch.Tensor) else pred).reshape(-1)
        scored = np.flatnonzero(e.labels != IGNORE_INDEX)
        if p.size < e.labels.size:
            raise ValueError(f"prediction of length {p.size} for an example of length {e.labels.size}")
        hits = p[scored] == e.labels[scored]
        right += int(hits.sum())
        total += scored.size
        exact += int(hits.all())
    return {"exact": exact / max(1, len(examples)), "token": right / max(1, total)}
