"""Scoring a model's argmax predictions against the labelled answers of synthetic examples."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from data_pipeline.synthetic.example import IGNORE_INDEX, Example


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
