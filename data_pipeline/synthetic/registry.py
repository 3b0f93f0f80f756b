"""The tasks by name (`TASKS`, `make_task`): how each is sized to an example length, for the run
config's `data.task` and the evaluators."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from data_pipeline.synthetic.copy_paste import CopyPaste
from data_pipeline.synthetic.mqar import MultiQueryRecall
from data_pipeline.synthetic.needle import NeedleHaystack
from data_pipeline.synthetic.recall import EntityLabelCopy, ZipfRetrieval

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
