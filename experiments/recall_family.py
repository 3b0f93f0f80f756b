"""A family of associative-recall tasks beyond the sliding window (issue 49): PMNet as shipped,
SWA-only and the memory with oracle routing, over vocabulary, pairs, gap and short convolution.

configs/experiments/recall-family.yaml trains configs/model/pmnet-tiny.yaml as it ships on MQAR's
layout with a gap (data_pipeline/synthetic/mqar.py): `pairs` key/value pairs over `keys` keys and
`keys` values, `gap` filler tokens, then the queries among the last 2 x `pairs` positions, so every
query is more than `gap` tokens after every pair, beyond the attention's reach
(n_layers x (window - 1 + short_conv - 1) = 34 tokens with short_conv 3). The grid moves one factor
at a time around a centre cell (`one_factor_grid`), so its cost grows with the sum of the factors'
values, not their product. Every run reports accuracy, chance (1 / keys), and per memory block the
hit and clean rates of experiments/recall_routes.py.

The oracle family routes every token of every memory block to the leaf numbered by its token id
modulo the leaves (experiments/pmnet_recall.OracleMemory; writes under `write_address: previous`
take the previous token's leaf), for this experiment only: it shows what the tree can hold when
routing is perfect by token, so a cell where the oracle falls short is one where the tree has no room.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data_pipeline import synthetic
from experiments.mqar import MQAR
from experiments.phasor import frozen_at_inference, receptive_field
from experiments.pmnet_recall import OracleMemory
from experiments.runner import EVAL_SEED, Family, Run, eval_task, figure, predictions, save_figure
from model import CausalLM
from model.pmnet import PMNet


@dataclass(frozen=True)
class Cell:
    """One recall task: `keys` keys and as many values (vocabulary 2 x keys + 1 with the filler),
    `pairs` pairs, `gap` filler tokens before the queries, short convolution `conv` (0: none)."""

    keys: int
    pairs: int
    gap: int
    conv: int

    @property
    def name(self) -> str:
        return f"k{self.keys}-p{self.pairs}-g{self.gap}-c{self.conv}"

    @property
    def seq_len(self) -> int:
        """Pairs, gap, then a query region of 2 x pairs positions (a query's answer is the next one)."""
        return 2 * self.pairs + self.gap + 2 * self.pairs

    def overrides(self) -> tuple[str, ...]:
        return (f"data.task.params.vocab_size={2 * self.keys + 1}", f"data.task.params.num_pairs={self.pairs}",
                f"data.task.params.gap={self.gap}", f"data.seq_len={self.seq_len}", f"model.short_conv={self.conv}")


CENTRE = Cell(keys=32, pairs=16, gap=100, conv=3)
MODELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("pmnet", ()),
    # SWA-only with a wider MLP (hidden 384 instead of 256), parameters within 5% of PMNet's
    ("swa", ("model.pmnet.memory_every=0", "model.mlp_ratio=6.0")),
    ("oracle", ()),
)


def one_factor_grid(
    centre: Cell, keys: tuple[int, ...] = (16, 64, 128), pairs: tuple[int, ...] = (8, 32),
    gaps: tuple[int, ...] = (50, 300), convs: tuple[int, ...] = (0,),
) -> tuple[Cell, ...]:
    """The centre, then each factor moved alone to each of its other values (centre first, so an
    interrupted sweep has its reference cell)."""
    cells = [centre]
    cells += [Cell(k, centre.pairs, centre.gap, centre.conv) for k in keys]
    cells += [Cell(centre.keys, p, centre.gap, centre.conv) for p in pairs]
    cells += [Cell(centre.keys, centre.pairs, g, centre.conv) for g in gaps]
    cells += [Cell(centre.keys, centre.pairs, centre.gap, c) for c in convs]
    return tuple(dict.fromkeys(cells))


def families(cells: tuple[Cell, ...]) -> tuple[Family, ...]:
    """Every model at every cell, named `<model>-<cell>`, cell by cell."""
    return tuple(Family(f"{model}-{cell.name}", (*overrides, *cell.overrides())) for cell in cells
                 for model, overrides in MODELS)


def route_by_token(model: PMNet) -> PMNet:
    """Turn every memory of `model` into an OracleMemory whose leaves are the input ids modulo the
    leaves, set by a hook on the embedding before each forward (in place; returns the model)."""
    memories = model.memories()
    leaves = memories[0].branching ** memories[0].depth

    def set_leaves(_module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        for memory in memories:
            memory.leaves = args[0] % leaves

    for memory in memories:
        memory.__class__ = OracleMemory
    model.embed.register_forward_pre_hook(set_leaves)
    return model


@contextlib.contextmanager
def oracle_training() -> Iterator[None]:
    """While open, the trainer builds PMNets with oracle routing (route_by_token)."""
    import pretrain.trainer as trainer

    build = trainer.build_model
    trainer.build_model = lambda config: route_by_token(build(config))
    try:
        yield
    finally:
        trainer.build_model = build


def is_oracle(family: Family) -> bool:
    return family.name.startswith("oracle-")


@dataclass
class RecallFamily(MQAR):
    """MQAR's evaluation (accuracy, per-block hit and clean rates) per (model, cell), with the
    attention's reach, the shortest query-to-value distance, the tree's leaves and the task's token
    types, and for PMNet the accuracy with the memory's writes switched off at inference."""

    cells: tuple[Cell, ...] = ()
    far_gaps: tuple[int, ...] = (1000,)

    def far_accuracy(self, model: CausalLM, run: Run, quick: bool) -> dict[str, float]:
        """`accuracy@gap<g>`: the trained model on its own task with the gap widened to g (held-out
        examples): recall from as far back as `far_gaps` without training at that length."""
        params = run.config.data.task.params
        scores = {}
        for gap in self.far_gaps:
            cell = Cell(int(params["vocab_size"]) // 2, int(params["num_pairs"]), gap, run.config.model.short_conv)
            task = synthetic.make_task("mqar", cell.seq_len, vocab_size=2 * cell.keys + 1, num_pairs=cell.pairs,
                                       gap=gap, seed=EVAL_SEED)
            examples = [task.example(i) for i in range(4 if quick else 128)]
            scores[f"accuracy@gap{gap}"] = synthetic.accuracy(examples, predictions(model, examples))["token"]
        return scores

    def families_for(self, quick: bool) -> tuple[Family, ...]:
        return self.families[: len(MODELS)] if quick else self.families

    def comparable_groups(self) -> list[tuple[Family, ...]]:
        n = len(MODELS)
        return [self.families[i : i + n] for i in range(0, len(self.families), n)]

    def train(self, family: Family, seed: int, out: Path, quick: bool) -> Run:
        with oracle_training() if is_oracle(family) else contextlib.nullcontext():
            return super().train(family, seed, out, quick)

    def evaluate(self, model: CausalLM, run: Run, quick: bool) -> dict[str, Any]:
        pm = run.config.model.pmnet
        if is_oracle(run.family):
            route_by_token(model)
        scores = super().evaluate(model, run, quick)
        task = eval_task(run, quick)
        examples = [task.example(i) for i in range(16 if quick else self.examples)]
        distance = min(min(np.subtract(e.meta["query_at"], e.meta["value_at"])) for e in examples)
        scores.update(attention_reach=float(receptive_field(run)), min_query_distance=float(distance),
                      leaves=float(pm.branching**pm.depth), token_types=float(task.vocab_size))
        scores.update(self.far_accuracy(model, run, quick))
        if pm.memory_every and not is_oracle(run.family):
            frozen = frozen_at_inference(model)
            scores["no_eval_updates/accuracy"] = synthetic.accuracy(examples, predictions(frozen, examples))["token"]
        return scores

    def plot(self, results: dict[str, Any], path: Path) -> None:
        summary = results["summary"]
        cells = list(dict.fromkeys(name.split("-", 1)[1] for name in summary))
        fig, axes = figure(1, 1, (max(7.0, 1.1 * len(cells) + 2), 4.2))
        ax = axes[0, 0]
        width = 0.8 / len(MODELS)
        for i, (model, _) in enumerate(MODELS):
            stats = [summary.get(f"{model}-{cell}", {}).get("accuracy", {}) for cell in cells]
            xs = np.arange(len(cells)) + (i - (len(MODELS) - 1) / 2) * width
            ax.bar(xs, [s.get("mean", np.nan) for s in stats], width, yerr=[s.get("std", 0.0) for s in stats],
                   capsize=2, label=model)
        ax.axhline(0.8, color="black", linestyle="--", linewidth=0.8, label="goal 0.8")
        ax.set_xticks(np.arange(len(cells)), cells, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("recall beyond the window (mean, spread over seeds)")
        ax.set_ylim(0, 1.02)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
        save_figure(fig, results, path)


GRID = one_factor_grid(CENTRE)
EXPERIMENTS = [
    RecallFamily(
        name="recall-family",
        title="A family of recall tasks beyond the sliding window: PMNet as shipped, SWA-only, oracle routing",
        config="recall-family.yaml",
        families=families(GRID),
        cells=GRID,
        quick_overrides=("train.steps=2", "data.task.params.gap=40", "data.seq_len=104"),
        paper={"recall beyond the window on cells with room (issue 49 goal)": {"pmnet": 0.8, "swa": "chance"}},
    ),
]
