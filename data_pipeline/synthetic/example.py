"""What every synthetic task returns (`Example`) and the per-task, per-index seeding that makes
examples deterministic; the generators in the sibling modules build on it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from data_pipeline.order import seeded_rng

# The label the loss skips is the model interface's contract; data producers follow it (model/ never
# imports data_pipeline/, so the dependency points one way).
from model.interface import IGNORE_INDEX

_TASK_TAGS = {"zipf": 11, "entity": 12, "copy": 13, "needle": 14, "mqar": 15}


@dataclass(frozen=True)
class Example:
    """One synthetic example (data_pipeline.synthetic's docstring gives the label convention)."""

    input_ids: np.ndarray
    labels: np.ndarray
    answer: tuple[int, int]
    meta: dict[str, Any] = field(default_factory=dict)


def task_rng(seed: int, task: str, index: int) -> np.random.Generator:
    """The generator of example `index` of `task`: each task draws from its own stream, so two tasks
    with one seed never share examples."""
    return seeded_rng(seed, _TASK_TAGS[task], index)


def answer_example(tokens: np.ndarray, answer_start: int, meta: dict[str, Any]) -> Example:
    """Wrap a sequence whose answer runs from ``answer_start`` to the end."""
    ids = tokens.astype(np.int64)
    labels = np.full(ids.size, IGNORE_INDEX, dtype=np.int64)
    labels[answer_start - 1 : ids.size - 1] = ids[answer_start:]
    return Example(ids, labels, (answer_start, ids.size), meta)
