"""Examples into training input: `TaskStream` (one rank's share as an IterableDataset, padded),
`TaskBatches` (the trainer's micro-batches, resumable) and `collate` (right-padded evaluation batches)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from data_pipeline.skips import SkipRanges
from data_pipeline.synthetic.example import IGNORE_INDEX, Example
from data_pipeline.synthetic.registry import Task


class TaskStream(IterableDataset):
    """A synthetic task as an ``IterableDataset`` for training: rank ``r`` of ``world_size`` gets
    examples ``start + r + k * world_size`` (resume by passing the number of examples consumed
    globally as ``start``), numbered past the ranges of ``skips`` when given, each right-padded to
    ``pad_to`` tokens when given (inputs with ``pad_id``, labels with ``IGNORE_INDEX``) so the default
    collate can stack them.

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
        skips: SkipRanges | None = None,
    ) -> None:
        super().__init__()
        self.task = task
        self.skips = skips or SkipRanges()
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
        for k in itertools.count():
            i = self.skips.nth(self.start, self.rank + k * self.world_size)
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


class TaskBatches:
    """Micro-batches of a synthetic task for the trainer, with the loader interface it uses.

    Each example is padded to ``seq_len``; ``state_dict`` holds the global number of the next example
    to read and the skipped ranges (``skip_samples``, data_pipeline/skips.py), so that a resumed run
    continues with the next unseen example.
    """

    def __init__(
        self, task: Task, seq_len: int, batch_size: int, rank: int = 0, world_size: int = 1,
        skip_samples: Sequence[Sequence[int]] = (),
    ) -> None:
        self.task, self.seq_len, self.batch_size = task, seq_len, batch_size
        self.rank, self.world_size = rank, world_size
        self.skips = SkipRanges(skip_samples)
        self.consumed = self.skips.nth(0, 0)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            stream = TaskStream(self.task, self.rank, self.world_size, start=self.consumed, pad_to=self.seq_len,
                                skips=self.skips)
            rows = list(itertools.islice(iter(stream), self.batch_size))
            self.consumed = self.skips.nth(self.consumed, self.batch_size * self.world_size)
            yield {key: torch.stack([row[key] for row in rows]) for key in ("input_ids", "labels")}

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.consumed, "skip": self.skips.to_list()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for first, end in state.get("skip", []):
            self.skips.add(first, end)
        self.consumed = self.skips.nth(int(state["consumed"]), 0)

    def position(self) -> int:
        """Global number of the next example to read."""
        return self.consumed

    def skip(self, first: int, end: int) -> None:
        """Never read examples ``first .. end - 1``."""
        self.skips.add(first, end)
        self.consumed = self.skips.nth(self.consumed, 0)

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
