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

One module per kind of task (``recall``: zipf and entity, ``mqar``, ``copy_paste``, ``needle``) on
``example`` (``Example`` and the seeding); ``registry`` names them (``TASKS``, ``make_task``),
``batches`` turns examples into training and evaluation batches, ``scoring`` holds ``accuracy``.
Every public name is re-exported here, so callers import from ``data_pipeline.synthetic``.
"""

from data_pipeline.synthetic.batches import TaskBatches, TaskStream, collate
from data_pipeline.synthetic.copy_paste import CopyPaste
from data_pipeline.synthetic.example import IGNORE_INDEX, Example
from data_pipeline.synthetic.mqar import MultiQueryRecall
from data_pipeline.synthetic.needle import NeedleHaystack
from data_pipeline.synthetic.recall import PLACEMENT_TRIES, EntityLabelCopy, ZipfRetrieval
from data_pipeline.synthetic.registry import MIN_TASK_LEN, TASKS, Task, TaskSpec, make_task
from data_pipeline.synthetic.scoring import accuracy

__all__ = [
    "IGNORE_INDEX",
    "MIN_TASK_LEN",
    "PLACEMENT_TRIES",
    "TASKS",
    "CopyPaste",
    "EntityLabelCopy",
    "Example",
    "MultiQueryRecall",
    "NeedleHaystack",
    "Task",
    "TaskBatches",
    "TaskSpec",
    "TaskStream",
    "ZipfRetrieval",
    "accuracy",
    "collate",
    "make_task",
]
