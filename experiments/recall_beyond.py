"""Associative recall beyond the sliding window: the full PMNet (attention and memory) against SWA-only.

configs/experiments/recall-beyond.yaml puts 8 key/value pairs first, then a filler gap longer than
the attention's receptive field, then the queries (MQAR's layout with `gap`). No query's output
depends on any pair through the attention (tests/test_experiments.py checks this with gradients), so
SWA-only can only guess, at chance 1 / (number of values), and PMNet can answer only from its phasor
memory. Beside the accuracy, PMNet's runs report how often a query's read reaches the leaf its pair
wrote (experiments/recall_routes.py) and the per-level use of the tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data_pipeline import synthetic
from experiments.mqar import MQAR
from experiments.phasor import frozen_at_inference, receptive_field
from experiments.runner import Family, Run, bar_plot, eval_task, predictions
from model import CausalLM

PMNET = Family("pmnet")
# A deeper tree (256 leaves instead of 64), so that fewer token types share a query's leaf (writes
# collide less); its narrower MLP (hidden 208) pays for the larger tree: 130,784 parameters.
PMNET_DEPTH4 = Family("pmnet-depth4", ("model.pmnet.depth=4", "model.mlp_ratio=3.25"))
# SWA-only gets a wider MLP (hidden 384 instead of 256): 133,504 parameters against PMNet's 134,880.
SWA = Family("swa", ("model.pmnet.memory_every=0", "model.mlp_ratio=6.0"))


@dataclass
class RecallBeyond(MQAR):
    """MQAR's evaluation (accuracy, routing hit rate) with the reach of the attention, the shortest
    distance from a query to its pair's value in the held-out examples, and for PMNet the accuracy
    with memory updates switched off at inference (the memory then holds nothing of the pairs)."""

    def families_for(self, quick: bool) -> tuple[Family, ...]:
        return self.families

    def comparable_groups(self) -> list[tuple[Family, ...]]:
        return [self.families]

    def evaluate(self, model: CausalLM, run: Run, quick: bool) -> dict[str, Any]:
        scores = super().evaluate(model, run, quick)
        task = eval_task(run, quick)
        examples = [task.example(i) for i in range(16 if quick else self.examples)]
        distance = min(min(np.subtract(e.meta["query_at"], e.meta["value_at"])) for e in examples)
        scores.update(attention_reach=float(receptive_field(run)), min_query_distance=float(distance))
        if run.config.model.pmnet.memory_every:  # the same weights, the memory never written at inference
            frozen = frozen_at_inference(model)
            scores["no_eval_updates/accuracy"] = synthetic.accuracy(examples, predictions(frozen, examples))["token"]
        return scores

    def plot(self, results: dict[str, Any], path: Path) -> None:
        chance = next(iter(results["summary"].values()))["chance"]["mean"]
        keys = [
            "accuracy",
            "no_eval_updates/accuracy",
            "routing_hit/block0",
            "routing_clean/block0",
            "routing_hit/block1",
            "routing_clean/block1",
        ]
        labels = [
            "recall accuracy",
            "no memory writes\nat inference",
            "hit, block 0",
            "clean, block 0",
            "hit, block 1",
            "clean, block 1",
        ]
        bar_plot(results, keys, labels, path, "share of queries (mean, spread over seeds)", [("chance", chance)])


EXPERIMENTS = [
    RecallBeyond(
        name="recall-beyond",
        title="Associative recall beyond the sliding window: PMNet against SWA-only",
        config="recall-beyond.yaml",
        families=(PMNET, PMNET_DEPTH4, SWA),
        quick_overrides=("train.steps=2",),
        paper={"recall with every query beyond the window (issue #33 goal)": {"pmnet": 0.8, "swa": "chance"}},
    ),
]
