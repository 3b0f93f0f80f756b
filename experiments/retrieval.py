"""VORT's retrieval experiments: Zipf-lag key/value retrieval and entity-label copy."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from experiments.runner import (
    Experiment,
    Family,
    Run,
    bar_plot,
    bucket_accuracy,
    eval_task,
    final_train_loss,
    predictions,
)
from model import CausalLM

KERNEL_FAMILIES = (
    Family("pl", ("model.kind=pl",)),
    Family("exp", ("model.kind=exp",)),
    Family("m5", ("model.kind=m5",)),
    Family("vort", ("model.kind=vort",)),
)
TRANSFORMER = Family("transformer", ("model.kind=transformer",))

QUICK = ("train.steps=2", "data.seq_len=192", "model.max_seq_len=192", "model.vort.soe_horizon=256")
# the dense Zipf-lag task at 128 tokens: 12 queried records per sequence, 16 sequences a step for
# 3,000 steps (576k answered queries; lags up to 92)
SHORT_ZIPF = ("data.seq_len=128", "data.task.params.num_pairs=12", "data.task.params.queries=12",
              "train.global_batch=16", "train.micro_batch=16", "train.steps=3000")
QUICK_DENSE = (*QUICK, "data.seq_len=512", "model.max_seq_len=512")  # room for the dense tasks' 32-33 blocks


class LagRetrieval(Experiment):
    """Exact answer accuracy of held-out examples, bucketed by the lag of the queried record."""

    edges: tuple[float, ...] = ()
    examples: int = 384

    def lag_edges(self, run: Run) -> tuple[float, ...]:
        return self.edges

    def evaluate(self, model: CausalLM, run: Run, quick: bool) -> dict[str, Any]:
        """Every query of every held-out example scored on its own (whole value right), by its lag.

        Two more numbers tell key-value retrieval from a cheaper skill: `in_context`, the share of
        answers that are one of the values written in the sequence (right or not), and
        `in_context_chance`, the accuracy of a guess drawn uniformly from those values. A model
        that has learnt which values occur but not which key each belongs to scores about
        `in_context_chance` with `in_context` near 1, at every lag."""
        task = eval_task(run, quick)
        examples = [task.example(i) for i in range(16 if quick else self.examples)]
        hits, lags, present, guess_chance = [], [], [], []
        for example, guess in zip(examples, predictions(model, examples)):
            body = example.meta["query_at"][0]
            written = {tuple(example.input_ids[p + 2 : p + 2 + task.value_len])
                       for p in np.flatnonzero(example.input_ids[:body] == task.mark)}
            for lag, at in zip(example.meta["lags"], example.meta["query_at"]):
                answer = slice(at + 1, at + 1 + task.value_len)
                hits.append(float(np.array_equal(guess[answer], example.labels[answer])))
                present.append(float(tuple(guess[answer]) in written))
                guess_chance.append(1.0 / len(written))
                lags.append(lag)
        hits_array, lags_array = np.asarray(hits), np.asarray(lags, dtype=np.float64)
        return {
            "accuracy": float(hits_array.mean()),
            "chance": 1.0 / task.keys ** task.value_len,
            "chance_loss": math.log(task.keys),
            "in_context": float(np.mean(present)),
            "in_context_chance": float(np.mean(guess_chance)),
            **bucket_accuracy(hits_array, lags_array, self.lag_edges(run), "lag"),
        }

    def plot(self, results: dict[str, Any], path: Path) -> None:
        keys = sorted(
            {k for m in results["summary"].values() for k in m if k.startswith("lag_") and "_n_" not in k},
            key=_bucket_start,
        )
        first = next(iter(results["summary"].values()))
        levels = [("chance", first["chance"]["mean"])]
        if "in_context_chance" in first:
            levels.append(("a guess among the values in the sequence", first["in_context_chance"]["mean"]))
        labels = [k.removeprefix("lag_") for k in keys]
        bar_plot(results, keys, labels, path, "exact accuracy by lag (mean, spread)", levels)


def _bucket_start(key: str) -> float:
    label = key.removeprefix("lag_")
    return float(label.lstrip(">").split("-")[0])


class ZipfLag(LagRetrieval):
    edges = (0.0, 100.0, 1000.0, math.inf)


class ZipfCheck(ZipfLag):
    """Calibrations of one model at several lengths, widths and budgets: nothing is compared, so
    each family stands alone."""

    def comparable_groups(self) -> list[tuple[Family, ...]]:
        return [(family,) for family in self.families]


@dataclass
class ZipfCurriculum(ZipfLag):
    """Every run in two stages: first `first_stage` (its overrides on `first_config`: a short setting
    the task is learned at), then the experiment's own config from those weights (`init.from`).
    Stage 1 runs are those of any experiment that trains the same family there (zipf-check's
    Transformer), in <out>/runs/<first_config>/<family>-<first_stage.name>."""

    first_config: str = ""
    first_stage: Family = field(default_factory=lambda: Family(""))

    def train(self, family: Family, seed: int, out: Path, quick: bool) -> Run:
        short = Family(f"{family.name}-{self.first_stage.name}", (*family.overrides, *self.first_stage.overrides))
        first = Experiment.train(replace(self, config=self.first_config), short, seed, out, quick)
        return Experiment.train(self, replace(family, overrides=(*family.overrides, f"init.from={first.dir}")),
                                seed, out, quick)

    def evaluate(self, model: CausalLM, run: Run, quick: bool) -> dict[str, Any]:
        """The full-length metrics, and where stage 1 ended (its final training loss): a family
        that did not learn the task short has nothing to carry to the full length."""
        first = Path(run.config.init.from_ or "")
        return {**super().evaluate(model, run, quick), "first_stage_loss_end": final_train_loss(first)}


class EntityCopy(LagRetrieval):
    """Lags are uniform, so the buckets are thirds of the longest lag."""

    def lag_edges(self, run: Run) -> tuple[float, ...]:
        longest = run.config.data.seq_len
        return (0.0, round(longest / 3), round(2 * longest / 3), math.inf)


ZIPF = ZipfLag(
    name="zipf",
    title="Zipf-lag retrieval: exact accuracy by lag",
    config="zipf.yaml",
    families=(*KERNEL_FAMILIES, TRANSFORMER),
    quick_overrides=QUICK,
    paper={"accuracy at lag > 1000": {"pl": 0.794, "exp": 0.523, "m5": 0.618}},
)
ENTITY = EntityCopy(
    name="entity",
    title="Entity-label copy at uniform lags: exact accuracy by lag",
    config="entity.yaml",
    families=(KERNEL_FAMILIES[0], KERNEL_FAMILIES[1], KERNEL_FAMILIES[3]),
    quick_overrides=QUICK,
    paper={"accuracy at long lags": {"pl": 0.827, "exp": 0.584}},
)
EXPERIMENTS = [
    ZIPF,
    replace(ZIPF, name="zipf-10x", title="Zipf-lag retrieval with 10x the steps: exact accuracy by lag",
            config="zipf-10x.yaml"),
    ZipfLag(
        name="zipf-budget",
        title="Zipf-lag retrieval at 256 tokens, 10x the steps: does it learn at all at this size?",
        config="zipf-budget.yaml",
        families=(TRANSFORMER, KERNEL_FAMILIES[3], KERNEL_FAMILIES[1]),
        seeds=1,
        quick_overrides=QUICK,
    ),
    ENTITY,
    replace(ENTITY, name="entity-10x", config="entity-10x.yaml",
            title="Entity-label copy at uniform lags with 10x the steps: exact accuracy by lag"),
    # the rows rerun on what now learns: MQAR's short convolution and lr, and (entity) labels whose
    # tokens never repeat within a sequence; the Transformer is the check that the task is learnable
    replace(ZIPF, name="zipf-conv", config="zipf-conv.yaml", families=(*KERNEL_FAMILIES[:3], TRANSFORMER),
            title="Zipf-lag retrieval with the short convolution: exact accuracy by lag"),  # the paper's three kernels
    replace(ENTITY, name="entity-conv", config="entity-conv.yaml", families=(*ENTITY.families, TRANSFORMER),
            title="Entity-label copy, distinct label tokens, with the short convolution: exact accuracy by lag"),
    # is the task learnable at all here? the Transformer alone, with 4-8x the answered queries
    ZipfCheck(
        name="zipf-check",
        title="Zipf-lag retrieval, 12-32 queries per sequence: can the Transformer with the convolution learn it?",
        config="zipf-dense.yaml",
        families=(
            TRANSFORMER,
            Family("transformer-T128", (*TRANSFORMER.overrides, *SHORT_ZIPF)),
            Family("transformer-T128-d32", (*TRANSFORMER.overrides, *SHORT_ZIPF, "model.d_model=32")),
        ),
        seeds=1,
        quick_overrides=QUICK_DENSE,
    ),
    ZipfCurriculum(
        name="zipf-curriculum",
        title="Zipf-lag retrieval learned at 128 tokens, then trained on at 1,152: exact accuracy by lag",
        config="zipf-curriculum.yaml",
        families=(*KERNEL_FAMILIES[:3], TRANSFORMER),
        first_config="zipf-dense.yaml",
        first_stage=Family("T128", SHORT_ZIPF),
        quick_overrides=QUICK_DENSE,
        paper=ZIPF.paper,
    ),
    replace(ENTITY, name="entity-check", config="entity-dense.yaml", families=(TRANSFORMER,), seeds=1,
            quick_overrides=QUICK_DENSE,
            title="Entity-label copy, 16 queries per sequence: can the Transformer with the convolution learn it?"),
]
